"""Recognize an FX node's operation, whichever tracer wrote it (torch.export's ATen overloads,
Dynamo's torch-level calls and `call_method`s), as one canonical `Call`: its kind, and its arguments
bound by name (an ATen op's through its schema, `self` read as `input`), so that one builder of
classify.py serves every spelling. Adding a spelling is one name in a registration below.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

ALIASES = {"self": "input", "tensor": "input", "train": "training", "split_size_or_sections": "split_size",
            "split_sizes": "split_size", "sections": "split_size"}


@dataclass
class Call:
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def node(self, name: str) -> Optional[fx.Node]:
        v = self.args.get(name)
        return v if isinstance(v, fx.Node) else None


# --- ATen (torch.export): qualified op name -> kind; arguments come from the schema -------------
_ATEN: dict[str, str] = {}


def _aten(kind: str, *names: str) -> None:
    for n in names:
        _ATEN[f"aten::{n}"] = kind


_aten("identity", "clone", "alias", "detach", "contiguous", "lift_fresh_copy", "_to_copy", "to", "type_as")
_aten("dropout", "dropout", "feature_dropout")
for _kind in ("add", "sub", "mul", "div"):
    _aten(_kind, _kind, _kind + "_")  # and its in-place spelling
_aten("reshape", "view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
      "view_as", "reshape_as")
_aten("expand", "expand", "expand_as", "broadcast_to")
_aten("transpose", "transpose", "swapaxes", "swapdims")
_aten("slice", "slice", "narrow")
_aten("cat", "cat", "concat", "concatenate")
_aten("split", "split", "split_with_sizes", "chunk", "tensor_split")
_aten("upsample", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
      "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_nearest_exact1d",
      "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa",
      "_upsample_bicubic2d_aa")
_aten("softmax", "softmax", "_softmax", "log_softmax", "_log_softmax", "argmax", "argmin")
_aten("layer_norm", "layer_norm", "native_layer_norm")
_aten("rms_norm", "rms_norm")
_aten("matmul", "mm", "matmul", "bmm")
_aten("conv", "convolution", "conv1d", "conv2d", "conv3d", "_convolution")
_aten("conv_transpose", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_aten("pad", "constant_pad_nd", "pad")
_aten("reorder", "roll", "flip")
for _kind in ("neg", "rsub", "permute", "t", "select", "index", "index_select", "unbind", "mean", "sum", "pow", "sqrt",
              "rsqrt", "reciprocal", "gather", "masked_fill", "repeat", "numpy_T", "linear", "addmm", "einsum",
              "embedding"):
    _aten(_kind, _kind)  # the ATen op of the same name
# Reads only a tensor's metadata (shape, dtype): unchanged by any shift.
_aten("metadata", "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
      "_assert_scalar", "_assert_async")


# --- torch-level functions (Dynamo) and tensor methods (call_method): target -> (kind, positional parameter names)
_TORCH: dict[Any, tuple[str, tuple]] = {}
_METHODS: dict[str, tuple[str, tuple]] = {}


def _torch(kind: str, params: tuple, *fns) -> None:
    _TORCH.update({f: (kind, params) for f in fns})


def _methods(kind: str, params: tuple, *names: str) -> None:
    _METHODS.update({n: (kind, params) for n in names})


def _both(kind: str, params: tuple, *names: str) -> None:
    """`torch.<name>` and the tensor method `<name>`, bound alike."""
    _torch(kind, params, *(getattr(torch, n) for n in names))
    _methods(kind, params, *names)


_X, _XY, _XDIM = ("input",), ("input", "other"), ("input", "dim")
_DIM_INDEX, _REDUCE = ("input", "dim", "index"), ("input", "dim", "keepdim")
_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups")
_both("identity", _X, "clone", "detach")
_both("reshape", _X, "reshape", "flatten", "squeeze", "unsqueeze", "unflatten")
_both("transpose", ("input", "dim0", "dim1"), "transpose", "swapaxes")
_both("slice", ("input", "dim", "start", "length"), "narrow")
_both("split", ("input", "split_size", "dim"), "split")
_both("split", ("input", "chunks", "dim"), "chunk")
_both("softmax", _XDIM, "softmax", "log_softmax", "argmax", "argmin")
_both("reorder", ("input", "shifts", "dims"), "roll")
for _kind, _params in {"add": _XY, "sub": _XY, "mul": _XY, "div": _XY, "neg": _X, "t": _X, "sqrt": _X,
                       "rsqrt": _X, "reciprocal": _X, "pow": ("input", "exponent"), "permute": ("input", "*dims"),
                       "select": _DIM_INDEX, "index_select": _DIM_INDEX, "gather": _DIM_INDEX, "unbind": _XDIM,
                       "mean": _REDUCE, "sum": _REDUCE, "masked_fill": ("input", "mask", "value")}.items():
    _both(_kind, _params, _kind)  # torch.<kind> and the tensor method of that name

_torch("add", _XY, operator.add, operator.iadd)
_torch("sub", _XY, operator.sub, operator.isub, torch.subtract)
_torch("rsub", _XY, torch.rsub)
_torch("mul", _XY, operator.mul, operator.imul, torch.multiply)
_torch("div", _XY, operator.truediv, operator.itruediv, torch.true_divide)
_torch("neg", _X, operator.neg)
_torch("dropout", ("input", "p", "training", "inplace"), F.dropout, F.dropout1d)
_torch("dropout", ("input", "p", "training"), torch.dropout)
_torch("expand", _X, torch.broadcast_to)
_torch("cat", ("tensors", "dim"), torch.cat, torch.concat, torch.concatenate)
_torch("pow", ("input", "exponent"), operator.pow)
_torch("upsample", ("input", "size", "scale_factor", "mode"), F.interpolate)
_torch("softmax", _XDIM, F.softmax, F.log_softmax)
_torch("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps"), F.layer_norm, torch.layer_norm)
_torch("rms_norm", ("input", "normalized_shape", "weight", "eps"), F.rms_norm, torch.rms_norm)
_torch("linear", ("input", "weight", "bias"), F.linear)
_torch("einsum", ("equation", "*tensors"), torch.einsum)
_torch("addmm", ("input", "mat1", "mat2"), torch.addmm)
_torch("matmul", _XY, torch.mm, torch.matmul, torch.bmm, operator.matmul)
# F.embedding takes the indices first, aten.embedding the table first: bind by name.
_torch("embedding", ("indices", "weight", "padding_idx", "max_norm"), F.embedding)
_torch("conv", _CONV, F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d)
_torch("conv_transpose", _CONV_T, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_torch("pad", ("input", "pad", "mode", "value"), F.pad, torch._C._nn.pad)
_torch("reorder", ("input", "dims"), torch.flip)
_torch("metadata", _X, torch._assert)

_methods("add", _XY, "add_", "__add__", "__radd__")
_methods("sub", _XY, "sub_", "__sub__")
_methods("rsub", _XY, "__rsub__")
_methods("mul", _XY, "mul_", "__mul__", "__rmul__")
_methods("div", _XY, "div_", "__truediv__")
_methods("neg", _X, "__neg__")
_methods("identity", _X, "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16")
_methods("reshape", _X, "view", "view_as", "reshape_as")
_methods("expand", _X, "expand", "expand_as")
_methods("pow", ("input", "exponent"), "__pow__")
_methods("repeat", ("input", "*repeats"), "repeat")
_methods("reorder", ("input", "*dims"), "flip")
_methods("metadata", _X, "size", "dim", "numel", "stride")


def _bind(params, args: tuple, kwargs: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, p in enumerate(params):
        if p.startswith("*"):  # varargs: x.permute(0, 2, 1) or x.permute((0, 2, 1))
            rest = tuple(args[k:])
            out[p[1:]] = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            break
        if k < len(args):
            out[ALIASES.get(p, p)] = args[k]  # (an ATen schema's names: `self` is `input`)
    for k, v in kwargs.items():
        out[ALIASES.get(k, k)] = v
    return out


def canonical(node: fx.Node) -> Optional[Call]:
    """The kind and named arguments of `node`'s operation, or None when it is not one we know."""
    t, entry = node.target, None  # entry: (kind, positional parameter names)
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            kind = _ATEN.get(t.overloadpacket._qualified_op_name)
            entry = None if kind is None else (kind, [a.name for a in t._schema.arguments if not a.kwarg_only])
        elif t is operator.getitem:
            return Call("getitem", {"input": node.args[0], "index": node.args[1]})
        else:
            try:
                entry = _TORCH.get(t)
            except TypeError:  # unhashable target
                pass
    elif node.op == "call_module" and t == "_guards_fn":
        return Call("metadata", {})  # ExportedProgram.module()'s check of the input shapes
    elif node.op == "call_method" and isinstance(t, str):
        entry = _METHODS.get(t)
    return None if entry is None else Call(entry[0], _bind(entry[1], node.args, node.kwargs))


def op_name(node: fx.Node) -> str:
    """How reports name an op: `aten.linear.default`, `linear`, `.view()`."""
    t = node.target
    if node.op == "call_method":
        return f".{t}()"
    if node.op == "call_module":
        return f"module {t}"
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return getattr(t, "__name__", str(t))


def set_arg(node: fx.Node, name: str, value: Any) -> None:
    """Replace argument `name` (as canonical() bound it) of `node` by `value`."""
    names = list(canonical(node).args)  # bound positionally first, in order, then by keyword
    k = names.index(name)
    if k < len(node.args):
        node.update_arg(k, value)
        return
    key = next(key for key in node.kwargs if ALIASES.get(key, key) == name)
    node.update_kwarg(key, value)
