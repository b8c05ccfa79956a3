"""Issue 10, part 3: patterns other exporters emit, each rule with a test that fails without it.

Graphs are built with onnx.helper to reproduce each producer's exact node pattern (the corpus
test, tests/test_corpus.py, runs the real producers' files).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lnfold import onnx_rewrite
from lnfold.onnx_rewrite import fold_model

from .onnx_graphs import FLOAT, INT64, D, T, Builder

RTOL = 1e-5


def _ops(model):
    return [n.op_type for n in model.graph.node]


# --- Hugging Face's fp16 overflow clamp ---------------------------------------------------------

def _clamped_encoder(dtype, lo: float, hi: float, t5_where: bool = False) -> onnx.ModelProto:
    """Whisper's encoder layer: h = h + fc2(relu(fc1(LN(h)))); h = Clip(h, -c, c) after every layer
    (modeling_whisper.py: `clamp_value = finfo(fp16).max - 1000`); T5's variant picks the bound with
    Where(IsInf(h).any(), max - 1000, max)."""
    b = Builder(21, dtype)
    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids)
    for _ in range(2):
        h = b.block(h)
        if t5_where:
            any_inf = b.op("Cast", [b.op("ReduceMax", [b.op("Cast", [b.op("IsInf", [h])], to=TensorProto.INT32)],
                                         keepdims=0)], to=TensorProto.BOOL)
            hi_t = b.op("Where", [any_inf, b.const("c1", np.array(hi, dtype)), b.const("c2", np.array(np.finfo(dtype).max, dtype))])
            lo_t = b.op("Neg", [hi_t])
        else:
            lo_t, hi_t = b.const("lo", np.array(lo, dtype)), b.const("hi", np.array(hi, dtype))
        h = b.op("Clip", [h, lo_t, hi_t])
    b.output(b.layernorm(h), shape=[2, T, D])
    return b.model(20 if t5_where else 17)  # IsInf takes fp16 from opset 20


@pytest.mark.parametrize("dtype,t5", [(np.float16, False), (np.float32, False), (np.float16, True)])
def test_hf_overflow_clamp_is_transparent(dtype, t5):
    top = float(np.finfo(dtype).max) - 1000
    model = _clamped_encoder(dtype, -top, top, t5_where=t5)
    res = fold_model(model)  # verifies in onnxruntime (fp16: against its fp16 tolerance)
    assert (res.report.folded, res.report.kept) == (3, 0)
    assert _ops(res.model).count("Clip") == 2  # the guard stays, on the centered stream
    if dtype == np.float32:
        assert res.max_rel_err < RTOL


@pytest.mark.parametrize("bound", [6.0, 60000.0])
def test_clip_that_can_act_blocks(bound):
    """ReLU6-style clamps and bounds below finfo.max - 1000 compute something: not transparent."""
    report = onnx_rewrite.analyze_model(_clamped_encoder(np.float16, -bound, bound))
    assert report.folded == 0
    assert any("Clip" in n.reason for n in report.norms)
