"""Issue 26, the approximate swap (mode "rms-approx", passes/approx.py): never without a budget,
never over it on the calibration data, budget 0 swaps nothing, a planted mean makes a norm
unswappable, and the written model says it is not exactly equivalent; both frontends."""
from __future__ import annotations

import itertools
import random

import numpy as np
import onnx
import pytest

import lnfold
from lnfold.onnx_rewrite import cli
from lnfold.passes import LnfoldError
from lnfold.passes.approx import METADATA_KEY, choose, relative_error
from tests.geometry_models import PostLN, ids, onnx_model

FEEDS = {"ids": ids(8).numpy()}


def _run(model, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_choose_never_exceeds_the_budget_and_reports_the_measured_total():
    rng = random.Random(0)
    for trial in range(50):
        names = [f"n{k}" for k in range(6)]
        cost = {n: rng.choice([0.0, 1e-4, 1e-3, 1e-2, 0.5]) * rng.random() for n in names}
        pair = {frozenset(p): rng.random() * 3e-3 for p in itertools.combinations(names, 2)}

        def error(s):  # not additive: pairs interact
            return sum(cost[n] for n in s) + sum(pair[frozenset(p)] for p in itertools.combinations(sorted(s), 2))

        budget = rng.choice([0.0, 1e-3, 5e-3, 2e-2])
        sel = choose(names, error, budget)
        assert sel.total <= budget and sel.total == pytest.approx(error(sel.names))
        assert (not sel.swapped) if budget == 0 else True


def test_no_budget_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(LnfoldError, match="needs an error budget"):
        lnfold.fold_onnx(onnx_model(), mode="rms-approx", calibration=FEEDS)
    with pytest.raises(LnfoldError, match="needs calibration"):
        lnfold.fold_onnx(onnx_model(), mode="rms-approx", budget=0.1)
    with pytest.raises(LnfoldError, match="budget must be"):
        lnfold.fold_onnx(onnx_model(), mode="rms-approx", calibration=FEEDS, budget=-1)
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    src.write_bytes(onnx_model().SerializeToString())
    np.savez(tmp_path / "c.npz", **FEEDS)
    assert cli.main(["fold", str(src), "-o", str(dst), "--mode", "rms-approx", "--calibrate", str(tmp_path / "c.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget" in err and not dst.exists()


def test_budget_zero_swaps_nothing_beyond_the_exact_fold():
    res = lnfold.fold_onnx(onnx_model(), mode="rms-approx", calibration=FEEDS, budget=0)
    assert res.report.approximated == 0 and res.report.folded == 1 and res.report.kept == 1
    assert METADATA_KEY not in {p.key for p in res.model.metadata_props}
    assert relative_error(_run(onnx_model(), FEEDS), _run(res.model, FEEDS)) < 1e-5  # exact


def test_swap_within_budget_is_marked_approximate_and_measured_honestly(tmp_path):
    budget = 0.2
    res = lnfold.fold_onnx(onnx_model(), mode="rms-approx", calibration=FEEDS, budget=budget)
    sel = res.report.approx
    assert res.report.approximated == 1 and res.report.folded == 1  # the two kinds kept apart
    assert {n.verdict for n in res.report.norms} == {"fold", "approx"}
    assert 0 < sel.total <= budget and sel.heldout is not None
    # the selection's figure is what the written model does on the calibration half
    calib = {"ids": FEEDS["ids"][:4]}
    assert relative_error(_run(onnx_model(), calib), _run(res.model, calib)) == pytest.approx(sel.total, rel=1e-6)
    meta = {p.key: p.value for p in res.model.metadata_props}
    assert "NOT exactly equivalent" in meta[METADATA_KEY]
    assert "APPROXIMATE" in res.report.table() and res.report.to_dict()["approximate"]["exact"] is False


def test_planted_mean_makes_the_norm_unswappable():
    res = lnfold.fold_onnx(onnx_model(4.0), mode="rms-approx", calibration=FEEDS, budget=0.2)
    assert res.report.approximated == 0
    (refused,) = res.report.approx.refused
    assert refused.alone > 0.2 and "budget" in refused.reason


def test_torch_frontend_budget_and_planted_mean():
    x = ids(8)
    res = lnfold.fold_module(PostLN(0.0), (x[:2],), mode="rms-approx", calibration=(x,), budget=0.2)
    assert res.report.approximated == 1 and 0 < res.report.approx.total <= 0.2
    import torch

    with torch.no_grad():  # the measured total is the module's own error on the calibration half
        err = relative_error([PostLN(0.0)(x[:4]).double().numpy()], [res.module(x[:4]).double().numpy()])
    assert err == pytest.approx(res.report.approx.total, rel=1e-6)
    planted = lnfold.fold_module(PostLN(4.0), (x[:2],), mode="rms-approx", calibration=(x,), budget=0.2)
    assert planted.report.approximated == 0
    with pytest.raises(LnfoldError, match="needs an error budget"):
        lnfold.fold_module(PostLN(0.0), (x[:2],), mode="rms-approx", calibration=(x,))


def test_swap_for_training_keeps_parameters_and_names():
    import torch

    from lnfold.fx_rewrite.approx_train import RMSNormWithBias, swap_for_training

    m = PostLN(0.0)
    keys, ln1 = list(m.state_dict()), m.ln1
    x = ids(2)
    before = m(x).detach()
    assert swap_for_training(m, ["ln1"]) == ["ln1"]
    assert isinstance(m.ln1, RMSNormWithBias) and m.ln1.weight is ln1.weight and m.ln1.bias is ln1.bias
    assert list(m.state_dict()) == keys  # checkpoints and optimizers see the same parameters
    after = m(x)
    assert 0 < relative_error([before.double().numpy()], [after.detach().double().numpy()]) < 0.2  # not exact
    after.sum().backward()
    assert ln1.weight.grad is not None
    with pytest.raises(LnfoldError, match="not an nn.LayerNorm"):
        swap_for_training(m, ["fc"])
    assert isinstance(m.fc, torch.nn.Linear)
