"""The package as a user installs it: one namespace, no torch on the ONNX path, a report that says
what was edited, and timing statements a measurement supports."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lnfold
from lnfold.onnx_rewrite.timing import describe_ratio, ratio

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_the_onnx_path_without_torch():
    code = ("import sys, lnfold; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'lnfold.fx_rewrite' not in sys.modules; print(lnfold.fold_onnx.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fold_model"


def test_public_names_resolve():
    for name in lnfold.__all__:
        assert getattr(lnfold, name) is not None, name
    assert issubclass(lnfold.NothingToFold, lnfold.LnfoldError)
    assert lnfold.fold_module.__module__ == "lnfold.fx_rewrite.api"  # the lazy torch names
    with pytest.raises(AttributeError):
        lnfold.no_such_name  # noqa: B018


@pytest.mark.slow
def test_wheel_holds_only_the_lnfold_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("lnfold-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lnfold"}
    for must in ("lnfold/py.typed", "lnfold/passes/plan.py", "lnfold/onnx_rewrite/cli.py", "lnfold/fx_rewrite/api.py"):
        assert must in names
    assert not any(n.startswith(("lnfold/tests", "lnfold/benchmarks", "tests/", "benchmarks/")) for n in names)
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    plain = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert plain and not any("torch" in ln or "transformers" in ln for ln in plain), plain


def test_report_says_what_was_edited():
    from lnfold import zoo

    from .conftest import export_quiet

    module, args = zoo.gpt2(vocab=1000)  # big enough that the exporter keeps lm_head's Transpose
    model = export_quiet(module, args, ["input_ids"], opset=18)
    report = lnfold.fold_onnx(model).report
    table = report.table()
    assert report.folded == 5 and len(report.streams) == 1
    stream = report.streams[0]
    assert sorted(stream.norms) == sorted(n.name for n in report.norms)
    # GPT-2's sources: token and position tables, two output projections (weight + bias) per block
    assert len(stream.centered) == 2 + 2 * 2 * 2, stream.centered
    assert any("wte" in c or "lm_head" in c for c in stream.centered)
    # the tied embedding / lm_head table is cloned: the lm_head keeps reading the original
    assert len(stream.cloned) == 1 and "keeps the original" in stream.cloned[0]
    betas = [n.beta for n in report.norms]
    assert sum(b.startswith("into the bias of") for b in betas) == 4  # ln_1, ln_2 of each block
    assert betas[-1].startswith("kept as an Add")  # ln_f: the lm_head has no bias
    for needle in ("centered (10)", "cloned (1)", "β into the bias of", "stream 1"):
        assert needle in table, needle
    js = json.loads(report.to_json())
    assert js["streams"][0]["centered"] == stream.centered


def test_fold_json_and_help(tmp_path, zoo_onnx):
    import onnx

    _, _, model = zoo_onnx("gpt2")
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    run = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(src), "-o", str(tmp_path / "o.onnx"), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)  # nothing but the JSON object on stdout
    assert got["report"]["folded"] == 5 and got["verified"] and got["max_rel_err"] < 1e-4
    helptext = subprocess.run([sys.executable, "-m", "lnfold", "fold", "--help"], capture_output=True, text=True).stdout
    assert "crms" in helptext and "CRMSNorm" in helptext


def test_ratio_claims_only_what_the_spread_supports():
    import random

    rng = random.Random(1)
    # a 95% interval: about 1 seed in 20 claims a difference between identical distributions
    # (measured: 8 of 200 seeds at 200 samples); this one does not
    same = {"a": {"samples": [1 + rng.gauss(0, 0.2) for _ in range(200)]},
            "b": {"samples": [1 + rng.gauss(0, 0.2) for _ in range(200)]}}
    r = ratio(same, "a", "b")
    assert r["within_noise"] and "within noise" in describe_ratio(r)
    apart = {"a": {"samples": [0.8 + rng.gauss(0, 0.01) for _ in range(50)]},
             "b": {"samples": [1.0 + rng.gauss(0, 0.01) for _ in range(50)]}}
    r = ratio(apart, "a", "b")
    assert not r["within_noise"] and r["hi"] < 1 and "less time" in describe_ratio(r)
