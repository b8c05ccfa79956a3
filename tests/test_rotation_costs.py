"""Rotation and slicing that would make a model bigger (issue 45 items 3 and 4): a stream whose
norms are read by no weight (a graph network's Gemm -> LayerNorm -> Relu message passing) can be
rotated only by un-rotating each norm's output with a constant d×d MatMul, and sliced only by a
d×k one: it keeps its basis and width, saying why, while a stream whose readers absorb the change
in the same model is rotated and sliced. Float64 graphs, tiny: seconds."""
from __future__ import annotations

import numpy as np
import onnx

import lnfold
from lnfold.onnx_rewrite.linear_layers import float_parameters as parameters
from tests.onnx_graphs import VOCAB, Builder

D, T, LAYERS = 16, 5, 3


def graph_network() -> onnx.ModelProto:
    """x -> LAYERS x Relu(LN(linear)) (no weight reads a norm: each its own stream) -> LN(linear)
    -> a head MatMul (a weight reads that norm)."""
    b = Builder(7, np.float64)
    h = b.input("x", onnx.TensorProto.DOUBLE, ["batch", T, D])
    for _ in range(LAYERS):
        h = b.op("Relu", [b.layernorm(b.linear(h, D, D), D)])
    y = b.op("MatMul", [b.layernorm(b.linear(h, D, D), D), b.weight("head", (D, VOCAB))])
    b.output(y, shape=["batch", T, VOCAB])
    return b.model(17)


def rows(n: int = 16, seed: int = 1) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((n, T, D)) * 3 + 1}


def test_rotation_leaves_a_stream_its_readers_cannot_absorb():
    model = graph_network()
    plain = lnfold.fold_onnx(model)
    rotated = lnfold.fold_onnx(model, rotate="hadamard")
    assert rotated.verdict.ok and rotated.criterion == "float64"
    *messages, head = [s.rotation for s in rotated.report.streams]
    assert len(messages) == LAYERS and head.startswith("rotated (hadamard"), head
    for text in messages:  # (before: each rotated, "0 reader weight(s)", un-rotated by a 16×16 MatMul)
        assert text.startswith("not rotated: its readers' weights absorb too little of a rotation"), text
        assert f"would add {D * D:,} parameters, more than the 0 of the 0 reader weight(s)" in text, text
    assert parameters(rotated.model) <= parameters(plain.model)  # before: LAYERS x 256 more


def test_slicing_never_adds_parameters():
    result = lnfold.slice_onnx(graph_network(), rows(), fraction=0.25)
    report = result.report
    *kept, head = report.streams
    assert head.sliced and (head.dim, head.keep) == (D, 12)
    k = 12
    for s in kept:  # writer 16×16 + 16 loses a quarter (68), the readout's 12×16 MatMul holds 192
        assert not s.sliced and "slicing it would add parameters" in s.why, s.why
        assert f"hold {k * D:,}, more than the {(D * D + D) // 4:,}" in s.why, s.why
        assert "full width" in s.line()
    # (before: 1,387 -> 1,631 parameters, 1.18x)
    assert report.params_after < report.params_before == parameters(result.exact.model)
    assert parameters(result.model) == report.params_after


def test_fewer_calibration_vectors_than_features_and_an_in_sample_error_are_said():
    """Issue 45 item 5: one row of T=5 positions for a 16-wide stream: 5 vectors span at most 5
    directions (the basis's other 11 are arbitrary, the variance kept 100 % of those 5 vectors), and with
    nothing held out the error is in-sample: both said, never printed as the result."""
    one = lnfold.slice_onnx(graph_network(), rows(1), fraction=0.25).report
    head = one.streams[-1]
    assert head.sliced and (head.rows, head.span, head.dim) == (T, T, D)
    line = head.line()
    assert f"({T} calibration vectors" in line and f"span at most {T} of the {D} directions" in line, line
    table = one.table()
    assert "IN-SAMPLE only" in table and "WARNING: 1 sliced stream(s) have fewer calibration vectors" in table, table
    assert one.as_dict()["error_in_sample"] and "IN-SAMPLE" in one.metadata()
    many = lnfold.slice_onnx(graph_network(), rows(16), fraction=0.25).report  # 8 rows x 5 positions decide
    head = many.streams[-1]
    assert head.rows == 8 * T and "WARNING" not in many.table() and "span at most" not in head.line()
    assert not many.in_sample and "IN-SAMPLE" not in many.table() and "held-out row(s)" in many.table()
