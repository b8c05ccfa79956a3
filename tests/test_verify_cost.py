"""What verification costs (issue 24): each model read once, each onnxruntime session built once,
a float64 run in onnxruntime even where a few ops have no double kernel there (Conv, Erf), at
the smallest sizes that judge the fold — and still a wrong fold refused, and a missing float64
run explained. Counting is instrumentation of onnx.load and onnxruntime.InferenceSession: the
sessions and runs are real."""
from __future__ import annotations

import collections

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lnfold import zoo
from lnfold.onnx_rewrite import fold_model
from lnfold.onnx_rewrite import exact, sessions, verify
from lnfold.passes import VerificationError
from tests import onnx_graphs as G
from tests.conftest import export_quiet, missing_one_centering


@pytest.fixture(scope="module")
def vit_files(tmp_path_factory, zoo_onnx):
    """A ViT (conv stem, Erf GELU: no double kernels in onnxruntime) saved as files, as the CLI
    verifies: the original and its fold. (The zoo's, as the run's other files export it.)"""
    d = tmp_path_factory.mktemp("vit")
    _, _, model = zoo_onnx("vit")
    onnx.save(model, d / "vit.onnx")
    onnx.save(fold_model(model, verify=False).model, d / "vit.folded.onnx")
    return d / "vit.onnx", d / "vit.folded.onnx"


def _count(monkeypatch):
    """Counters of onnx.load calls (by path) and InferenceSession constructions (by what they were
    given: a path, or serialized bytes)."""
    loads, sessions = collections.Counter(), []
    real_load = onnx.load

    def counting_load(f, *a, **kw):
        loads[str(f)] += 1
        return real_load(f, *a, **kw)

    class CountingSession(ort.InferenceSession):
        def __init__(self, src, *a, **kw):
            sessions.append(src if isinstance(src, str) else "bytes")
            super().__init__(src, *a, **kw)

    monkeypatch.setattr(onnx, "load", counting_load)
    monkeypatch.setattr(ort, "InferenceSession", CountingSession)
    return loads, sessions


def test_each_model_is_read_once_and_each_session_built_once(vit_files, monkeypatch):
    original, folded = vit_files
    loads, sessions = _count(monkeypatch)
    verdict = verify.check(original, folded)
    assert verdict.ok and verdict.criterion == "float64", verdict
    assert loads[str(original)] <= 1 and loads[str(folded)] <= 1, loads
    # onnxruntime loads both files itself; the float64 copy's runs are the other sessions
    assert sessions.count(str(original)) == 1 and sessions.count(str(folded)) == 1, sessions
    ref_runs = sum(ref for ref, _ in verify.Float64Run(onnx.load(str(original))).segments.runs)
    assert ref_runs >= 2  # the conv stem and each block's Erf
    monkeypatch.undo()


def test_float64_runs_in_onnxruntime_beside_ops_without_double_kernels(vit_files):
    original, _ = vit_files
    model = onnx.load(str(original))
    from lnfold.onnx_rewrite import inputs as synth

    _, feeds = next(synth.candidates(model))
    assert feeds["pixel_values"].shape[0] == 1  # one image: dozens of rows already
    exact, how = verify.exact_run(model, feeds)
    assert exact is not None and how.startswith("onnxruntime, with Conv, Erf in onnx's reference evaluator"), how
    # the same outputs as the whole copy in the reference evaluator (what ran it before)
    copy, weights = verify.float64_copy(model)
    whole = sessions.reference(copy).run(None, {"pixel_values": feeds["pixel_values"].astype("f8"), **weights})
    assert abs(exact[0] - whole[0]).max() <= 1e-12 * abs(whole[0]).max()


def _refuses_a_dropped_centering(model, monkeypatch) -> None:
    from lnfold.onnx_rewrite import api

    assert fold_model(model).criterion == "float64"
    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan))
    with pytest.raises(VerificationError, match="away from a float64 run"):
        fold_model(model)


def test_a_planted_bug_is_refused_through_segments(vit_files, monkeypatch):
    """A dropped centering, through the float64 run in onnxruntime + reference evaluator segments."""
    _refuses_a_dropped_centering(onnx.load(str(vit_files[0])), monkeypatch)


@pytest.mark.parametrize("name", ["vit", "gpt2"])
def test_a_planted_bug_is_still_refused(name, monkeypatch):
    """A dropped centering on a bigger model than the zoo's default, through each float64 path
    (ViT: onnxruntime + reference evaluator segments; GPT-2: onnxruntime alone)."""
    if name == "vit":
        module, args = zoo.vit(layers=4, hidden=128, heads=4, image=64, patch=8)
        model = export_quiet(module, args, ["pixel_values"], opset=18)
    else:
        module, args = zoo.gpt2(n_layer=4, n_embd=128, n_head=4, vocab=1000, positions=64)
        model = export_quiet(module, args, ["input_ids"], opset=18)
    _refuses_a_dropped_centering(model, monkeypatch)


def _bias_gelu_model():
    b = G.Builder(4)
    ids = b.input("ids", TensorProto.INT64, [2, 5])
    h = b.op("Gather", [b.weight("emb", (13, 8), mean=3.0), ids], axis=0)
    mlp = b.linear(b.op("BiasGelu", [b.linear(b.layernorm(h), 8, 16), b.weight("bg", (16,))],
                        domain="com.microsoft"), 16, 8)
    h = b.op("Add", [h, mlp])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (8, 3))]), shape=None)
    return b.model(17, extra_opsets=[("com.microsoft", 1)])


def test_a_missing_float64_run_says_why(monkeypatch):
    model = _bias_gelu_model()
    folded = fold_model(model, verify=False).model
    verdict = verify.check(model, folded)
    assert verdict.ok and verdict.criterion in ("tolerance", "zero-mean norm inputs")
    assert "no float64 run: " in verdict.summary() and "BiasGelu" in verdict.summary(), verdict.summary()
    monkeypatch.setattr(exact, "EXACT_MAX_ELEMS", 10)
    small = G.pre_ln(layers=1)
    verdict = verify.check(small, fold_model(small, verify=False).model)
    assert "no float64 run: a float64 copy would hold more than 10 float weights" in verdict.summary()
    # and a failing fold says it too
    monkeypatch.setattr(exact, "EXACT_MAX_ELEMS", 2**27)
    from lnfold.onnx_rewrite import api

    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match=r"no float64 run of the model was possible \(.*BiasGelu"):
        fold_model(model)
