"""onnxruntime's quantizers leave the caller's logging as it was (onnx_rewrite/quantize.py,
_quiet_quantizers): importing MatMulNBitsQuantizer's module calls logging.basicConfig(INFO), once
per process, so the check runs in a fresh one."""
from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import logging

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from lnfold.onnx_rewrite import quantize

root = logging.getLogger()
before = (list(root.handlers), root.level, logging.root.manager.disable)
weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((128, 32)).astype(np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], [weight])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
quantized = quantize.run_quantizer(model, "int4", None)
assert any(n.op_type == "MatMulNBits" for n in quantized.graph.node)
after = (list(root.handlers), root.level, logging.root.manager.disable)
assert after == before, (before, after)
"""


def test_int4_quantization_leaves_the_root_logger_as_it_was():
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
