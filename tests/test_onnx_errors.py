"""Branches of the ONNX frontend the rest of the suite does not reach: the float64 reference's handling
of ops that make float tensors from attributes (a wrong reference misjudges every fold), and the
one-line errors a user meets with bad input or bad options (exit 2, the input untouched, nothing written).
Every model is hand-built and tiny: the whole file runs in seconds."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.onnx_rewrite.cli import main
from lnfold.onnx_rewrite.exact import exact_run
from tests.onnx_graphs import D, IR_VERSION, Builder, no_layernorm, pre_ln, save_model, unknown_domain_op


def _refused(argv: list[str], capsys, *words: str) -> str:
    """Run the CLI in-process; it must fail with exit 2 and one line on stderr holding `words`."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("lnfold: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def _untouched(path: Path, before: bytes, *outputs: Path) -> None:
    assert path.read_bytes() == before
    for out in outputs:
        assert not out.exists(), out


# --- the float64 reference (exact.py): attributes that make float tensors become double ----------

def _stream_scaled_by(op: onnx.NodeProto) -> onnx.ModelProto:
    """x [2, D] (mean 40) + the float tensor `op` makes -> LayerNorm with random γ, β."""
    b = Builder(5)
    x = b.input("x", TensorProto.FLOAT, [2, D])
    b.nodes.append(op)
    b.output(b.layernorm(b.op("Add", [x, op.output[0]])), shape=[2, D])
    return b.model(17)


@pytest.mark.parametrize("op", [
    helper.make_node("Constant", [], ["c"], value_float=0.3),
    helper.make_node("Constant", [], ["c"], value_floats=[0.5, -1.0, 2.0, 0.25, 3.0, -0.5, 1.5, 0.75]),
    helper.make_node("EyeLike", ["x"], ["c"], dtype=TensorProto.FLOAT),
], ids=["value_float", "value_floats", "EyeLike-dtype"])
def test_the_float64_reference_makes_attribute_floats_double_and_runs_in_onnxruntime(op):
    model = _stream_scaled_by(op)
    x = (np.random.default_rng(0).standard_normal((2, D)) + 40).astype(np.float32)
    (got,), how = exact_run(model, {"x": x})
    assert how == "onnxruntime"  # a float constant left float32 makes onnxruntime refuse the double copy
    assert got.dtype == np.float64
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    ln = model.graph.node[-1]
    if op.op_type == "EyeLike":
        c = np.eye(2, D)
    else:
        c = np.array(helper.get_attribute_value(op.attribute[0]), dtype=np.float32).astype(np.float64)
    s = x.astype(np.float64) + c
    centered = s - s.mean(-1, keepdims=True)
    want = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + 1e-5) * inits[ln.input[1]] + inits[ln.input[2]]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
