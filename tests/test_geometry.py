"""Issue 26, diagnostics: each norm's angle to 1 on calibration inputs, before and after the fold
(passes/geometry.py), through both frontends and `lnfold report --calibrate/--angles/--plot`."""
from __future__ import annotations

import json

import numpy as np
import pytest

import lnfold
from lnfold.onnx_rewrite import cli
from lnfold.passes.geometry import angle_stats
from tests.geometry_models import PostLN, ids, onnx_model


@pytest.fixture(scope="module")
def models():
    return {0.0: onnx_model(0.0), 4.0: onnx_model(4.0)}


def _by_verdict(g):
    return {n.verdict: n for n in g.norms}


def test_angle_stats_known_vectors():
    d = 8
    ones = np.ones((3, d))
    orth = np.tile([1.0, -1.0], (3, d // 2))  # zero-mean rows
    assert angle_stats([ones]).mean_deg == pytest.approx(0.0, abs=1e-6)
    assert angle_stats([-ones]).mean_deg == pytest.approx(180.0, abs=1e-6)
    s = angle_stats([orth])
    assert s.mean_deg == pytest.approx(90.0) and s.mean_over_rms == pytest.approx(0.0)
    # cos θ = μ / rms: a row [1, 0, ..., 0] has μ/rms = (1/d) / (1/√d) = 1/√d
    e = np.zeros((1, d))
    e[0, 0] = 1
    assert angle_stats([e]).mean_over_rms == pytest.approx(1 / np.sqrt(d))


def test_planted_mean_moves_the_angle_onnx(models):
    feeds = {"ids": ids(8).numpy()}
    plain = _by_verdict(lnfold.analyze_onnx(models[0.0], calibration=feeds).geometry)
    planted = _by_verdict(lnfold.analyze_onnx(models[4.0], calibration=feeds).geometry)
    assert abs(plain["keep"].before.mean_deg - 90) < 10
    assert abs(planted["keep"].before.mean_deg - 90) > 30, planted["keep"].before  # the planted mean shows
    assert planted["keep"].before.mean_over_rms > 0.5
    # the embedding norm: a large mean before (emb + 3), 90° after the fold by construction
    fold = planted["fold"]
    assert abs(fold.before.mean_deg - 90) > 30
    assert fold.after.mean_deg == pytest.approx(90.0, abs=1e-3) and fold.after.mean_over_rms < 1e-5
    assert planted["keep"].after is None  # kept norms have no "after"


def test_planted_mean_moves_the_angle_torch():
    x = ids(8)
    plain = _by_verdict(lnfold.analyze_module(PostLN(0.0), (x[:2],), calibration=(x,)).geometry)
    planted = _by_verdict(lnfold.analyze_module(PostLN(4.0), (x[:2],), calibration=(x,)).geometry)
    assert abs(plain["keep"].before.mean_deg - 90) < 10
    assert abs(planted["keep"].before.mean_deg - 90) > 30
    assert planted["fold"].after.mean_deg == pytest.approx(90.0, abs=1e-3)


def test_without_calibration_the_report_says_the_inputs_were_made_up(models, capsys):
    r = lnfold.analyze_onnx(models[0.0], angles=True)
    assert r.geometry.synthetic and "made up" in r.table()
    assert lnfold.analyze_onnx(models[0.0]).geometry is None  # nothing measured unless asked


def test_cli_report_calibrate_json_and_plot(models, tmp_path, capsys):
    src = tmp_path / "m.onnx"
    src.write_bytes(models[4.0].SerializeToString())
    np.savez(tmp_path / "calib.npz", ids=ids(4).numpy())
    png = tmp_path / "angles.png"
    assert cli.main(["report", str(src), "--calibrate", str(tmp_path / "calib.npz"), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    g = out["geometry"]
    assert not g["synthetic"] and len(g["norms"]) == 2 and g["rows"] == 4 * 16
    assert png.stat().st_size > 1000
    assert cli.main(["report", str(src), "--plot", str(tmp_path / "x.txt")]) == 2  # a bad suffix: one line
    assert "--plot writes" in capsys.readouterr().err
