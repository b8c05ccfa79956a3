"""Weights stored as integers (weight-only int8/uint8/int4 files, onnxruntime's quantizers).

Such a file computes each float weight at run time from an integer constant (`Cast -> Mul(scale)`,
`DequantizeLinear`, onnxruntime's fused ops). No constant edit can center that weight: centered
integers are non-zero-mean again after rounding and wrap past the type's range. The node that turns
them into floats is `dequantized(stored)` (passes/rules.py), opaque, the storage named.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes.rules import Rule, rule
from .norms import is_constant

# Ops that only move or copy the elements of input 0: an integer table stays one through them.
_LAYOUT = frozenset(("Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "Slice",
                     "Expand", "Tile"))
# Ops whose output is computed from an integer weight at this input (the output of the first four
# is an integer too; a Cast to float follows them).
_WEIGHT_INPUT = {"MatMulInteger": 1, "ConvInteger": 1, "QLinearMatMul": 3, "QLinearConv": 3, "DequantizeLinear": 0,
                 "DynamicQuantizeMatMul": 1, "MatMulIntegerToFloat": 1, "MatMulNBits": 1, "GatherBlockQuantized": 0}
# ml_dtypes' sub-byte integers (numpy kind "V", not "i"/"u"): graphsurgeon types INT4/UINT4 constants as them
_SUB_BYTE_INTEGERS = frozenset(("int2", "uint2", "int4", "uint4"))


def stored_integer(t, depth: int = 8) -> Optional[str]:
    """The integer type ("int8") of the constant weight that `t` holds or is computed from, else
    None (a float, an integer graph input such as token ids, or nothing this can tell)."""
    if t is None or not t.name or depth == 0:
        return None
    if is_constant(t):
        c = t if isinstance(t, gs.Constant) else t.inputs[0].attrs["value"]
        return _integer_name(c.dtype)
    if len(t.inputs) != 1:
        return None  # a graph input
    p = t.inputs[0]
    k = 0 if p.op in _LAYOUT else _WEIGHT_INPUT.get(p.op)
    if k is None or k >= len(p.inputs):
        return None
    if p.op == "MatMulNBits":  # its weight is packed in uint8: name the bits it holds
        return f"int{int(p.attrs.get('bits', 4))}"
    return stored_integer(p.inputs[k], depth - 1)


def _integer_name(dtype) -> Optional[str]:
    try:
        if isinstance(dtype, int):  # an onnx element type graphsurgeon has no numpy type for (int4)
            name = onnx.TensorProto.DataType.Name(dtype)
            return name.lower() if "INT" in name else None
        d = np.dtype(dtype)
    except (TypeError, ValueError):
        return None
    return d.name if d.kind in "iu" or d.name in _SUB_BYTE_INTEGERS else None


def dequantized(node: gs.Node) -> Optional[Rule]:
    """`dequantized(stored)` for a node that turns an integer-stored weight into floats: a Cast to
    a float type of one, or a dequantizing op reading one; None otherwise."""
    stored = stored_integer(node.inputs[0] if node.op == "Cast" else node.outputs[0])
    return None if stored is None else rule("dequantized", stored=stored)


# com.microsoft ops that output floats computed from integer-stored weights (onnxruntime's
# quantizers and optimizer write them); classify.py's Cast and DequantizeLinear call `dequantized`.
MS_DEQUANTIZING = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits", "GatherBlockQuantized")
