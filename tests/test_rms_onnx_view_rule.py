"""The ONNX frontend finds RMSNorms written out with the view rule both IRs share
(passes/patterns.match_rms, issue 44): each spelling an ONNX exporter writes, in a hand-built
one-block model with random γ and large-mean embeddings, is found, rotated and verified against
float64. A spelling the rule lost would leave its norm unfound (no rotation, NothingToFold) or, read
wrongly, fail verification: Div(1, ·) for the reciprocal (TorchScript's and Optimum's rsqrt),
Gemma's gain 1 + γ (an Add of a stored γ - 1, computed once by the frontend), fp32 Casts around the
statistics, no γ, no eps, eps added first.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_rms_streams import EPS, B, D, F, T, V, _Graph, _ids, _run, rotated_exactly

FORMS = ("div_one", "gemma_div_one", "no_gamma_no_eps", "eps_first_div")


def _rms(g: _Graph, x: str, form: str) -> str:
    """One RMSNorm of `x` as `form` spells it; γ random and signed (Gemma's stored as γ - 1)."""
    gamma = g.const("gamma", (g.rng.uniform(0.5, 2.0, D) * g.rng.choice([-1, 1], D)).astype(np.float32))
    eps = g.const("eps", np.float32(EPS))
    up = form == "gemma_div_one"
    xs = g.op("Cast", [x], to=TensorProto.FLOAT) if up else x
    sq = g.op("Mul", [xs, xs]) if up else g.op("Pow", [xs, g.const("two", np.float32(2.0))])
    ms = g.op("ReduceMean", [sq, g.const("axes", np.array([-1], np.int64))], keepdims=1)
    if form == "no_gamma_no_eps":
        return g.op("Mul", [xs, g.op("Reciprocal", [g.op("Sqrt", [ms])])])
    if form == "eps_first_div":
        return g.op("Mul", [g.op("Div", [xs, g.op("Sqrt", [g.op("Add", [eps, ms])])]), gamma])
    inv = g.op("Div", [g.const("one", np.float32(1.0)), g.op("Sqrt", [g.op("Add", [ms, eps])])])
    n = g.op("Mul", [xs, inv])
    if not up:
        return g.op("Mul", [gamma, n])
    weight = next(t for t in g.inits if t.name == gamma)  # stored as γ - 1, read as 1 + weight
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) - np.float32(1), weight.name))
    gain = g.op("Add", [g.const("unit", np.float32(1.0)), g.op("Cast", [gamma], to=TensorProto.FLOAT)])
    return g.op("Cast", [g.op("Mul", [n, gain])], to=TensorProto.FLOAT)


def one_block(form: str) -> onnx.ModelProto:
    """Embedding -> RMSNorm -> MatMul -> SiLU -> MatMul -> residual Add -> RMSNorm -> lm head."""
    g = _Graph(0)
    h = g.op("Gather", [g.weight("embed", (V, D), mean=3.0), "input_ids"], axis=0)
    up = g.op("MatMul", [_rms(g, h, form), g.weight("up", (D, F))])
    act = g.op("Mul", [up, g.op("Sigmoid", [up])])
    h = g.op("Add", [h, g.op("MatMul", [act, g.weight("down", (F, D))])])
    last = "div_one" if form == "no_gamma_no_eps" else form  # (a model of γ-less norms alone folds nothing)
    logits = g.op("MatMul", [_rms(g, h, last), g.weight("lm_head", (D, V))])
    graph = helper.make_graph(g.nodes, "one_block", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [B, T, V])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("form", FORMS)
def test_each_onnx_spelling_of_an_rmsnorm_rotates_exactly(form):
    m = one_block(form)
    r, _ = rotated_exactly(m)
    assert [(n.op, n.stream) for n in r.report.rms_norms] == [("DecomposedRMSNorm", 0)] * 2, r.report.rms_norms
    moved = [n.gamma.startswith("into the weight of") for n in r.report.rms_norms]
    assert moved == [form != "no_gamma_no_eps", True], r.report.rms_norms
    chains = {n.name for n in m.graph.node if n.op_type in ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div", "Cast")}
    left = chains & {n.name for n in r.model.graph.node}  # each norm's chain replaced whole (γ-less: left as is)
    assert not left if form != "no_gamma_no_eps" else {n[:3] for n in left} == {"Pow", "Red", "Sqr", "Rec"}, left
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_an_rmsnorm_lookalike_is_a_near_miss_naming_the_op_that_stops_it():
    """With γ into the readers (RMSNorms as given looked for), the root mean square of x multiplied
    into x, not dividing it, is listed with the op that reads it (the view rule's near miss)."""
    from lnfold.onnx_rewrite import targets
    from lnfold.onnx_rewrite.api import OnnxFrontend
    from lnfold.passes.options import FoldOptions

    g = _Graph(0)
    x = g.input("x", TensorProto.FLOAT, [B, T, D])
    ms = g.op("ReduceMean", [g.op("Pow", [x, g.const("two", np.float32(2.0))]),
                             g.const("axes", np.array([-1], np.int64))], name="ms", keepdims=1)
    s = g.op("Sqrt", [g.op("Add", [ms, g.const("eps", np.float32(EPS))])])
    g.output(g.op("Mul", [s, x], name="times_not_div"), shape=[B, T, D])
    model = helper.make_model(helper.make_graph(g.nodes, "lookalike", g.inputs, g.outputs, g.inits),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    view = OnnxFrontend(model, FoldOptions(gamma_into_readers=True), targets.resolve("ort", "cpu")).view()
    assert view.rms_norms() == []
    assert "is read by Mul `times_not_div`" in view.near_misses["ms"].reason, view.near_misses


def test_a_cast_down_after_an_fp32_rmsnorm_stays_outside_it():
    """Only a cast up before the statistics lets the match take the casts after the norm: the ONNX
    emitter writes the RMSNorm in its input's dtype, so an fp32 norm taking a trailing fp16 Cast
    would leave an fp16 MatMul reading fp32 (onnxruntime refuses the model)."""
    from lnfold.onnx_rewrite import targets
    from lnfold.onnx_rewrite.api import OnnxFrontend
    from lnfold.passes.options import FoldOptions

    g = _Graph(0)
    x = g.input("x", TensorProto.FLOAT, [B, T, D])
    ms = g.op("ReduceMean", [g.op("Pow", [x, g.const("two", np.float32(2.0))]),
                             g.const("axes", np.array([-1], np.int64))], name="ms", keepdims=1)
    n = g.op("Div", [x, g.op("Sqrt", [g.op("Add", [ms, g.const("eps", np.float32(EPS))])])], name="normalized")
    half = g.op("Cast", [n], to=TensorProto.FLOAT16)
    y = g.op("MatMul", [g.op("Mul", [half, g.const("gamma", np.full(D, 2, np.float16))]),
                        g.const("w", np.ones((D, F), np.float16))])
    g.output(g.op("Cast", [y], to=TensorProto.FLOAT), shape=[B, T, F])
    model = helper.make_model(helper.make_graph(g.nodes, "fp16_after", g.inputs, g.outputs, g.inits),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    fe = OnnxFrontend(model, FoldOptions(gamma_into_readers=True), targets.resolve("ort", "cpu"))
    fe.view()
    assert fe.matches["ms"].output.name == n and fe.matches["ms"].gamma is None
