"""Which readers a norm's γ, β and a rotation can move into (passes/readers.py): a Shape reads no
values and never blocks them; a zero Pad or a Concat with other data between the norm and its
reader does (their other rows would get β, γ, Q). Each case is folded and verified against float64:
a move that is not exact would fail the gate."""
from __future__ import annotations

import numpy as np
import pytest

from lnfold.onnx_rewrite import fold_model
from tests.onnx_graphs import INT64, T, Builder, D, VOCAB


def _model(between: str):
    """ids -> embedding -> one Pre-LN block -> final LN -> [`between`] -> lm head; a Shape also
    reads the final norm's output (as in Optimum's and TorchScript's exports)."""
    b = Builder(seed=3)
    ids = b.input("ids", INT64, [2, T])
    h = b.block(b.embed(ids))
    n = b.layernorm(h)
    shape = b.op("Shape", [n])
    if between == "pad":  # one zero row before the tokens
        n = b.op("Pad", [n, b.const("pads", np.array([0, 1, 0, 0, 0, 0], np.int64))])
    elif between == "concat":  # a constant row after the tokens
        extra = b.weight("extra", (2, 1, D), mean=1.0)
        n = b.op("Concat", [n, extra], axis=1)
    elif between == "slice":  # the last token only
        n = b.op("Slice", [n, b.const("s", np.array([T - 1], np.int64)), b.const("e", np.array([T], np.int64)),
                           b.const("a", np.array([1], np.int64))])
    y = b.op("MatMul", [n, b.weight("head", (D, VOCAB))])
    b.output(y)
    b.output(shape, INT64, [3])
    return b.model()


@pytest.mark.parametrize("between", ["none", "slice", "pad", "concat"])
def test_gamma_and_rotation_move_only_where_every_row_is_a_copy(between):
    result = fold_model(_model(between), rotate="hadamard", seed=1)  # verified against float64
    final = result.report.norms[-1]
    assert result.report.folded == 2
    assert final.gamma.startswith("into the weight") == (between in ("none", "slice")), final.gamma
    assert all("Shape" not in v.gamma for v in result.report.norms)  # a Shape reader never blocks
    assert result.report.streams[0].rotation.startswith("rotated")  # un-rotated after the norm where kept
