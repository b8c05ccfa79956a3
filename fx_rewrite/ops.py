"""Recognize an FX node's operation, whichever tracer wrote it, as one canonical `Call`.

torch.export writes ATen overloads (`aten.linear.default`, `aten.view.default`); Dynamo hands
backends torch-level calls (`F.linear`, `operator.add`, `x.view(...)` as a `call_method`). The
classifier (classify.py) should not care: `canonical(node)` names the operation's *kind* and binds
its arguments by name, so one builder serves every spelling. Adding a spelling is one entry in a
table below.

ATen arguments are bound through the op's schema; torch-level functions and methods through the
positional parameter lists in `_TORCH` and `_METHODS` (the names of torch's Python API, with
`self` read as `input`).
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
_aten("neg", "neg")
_aten("add", "add", "add_")
_aten("sub", "sub", "sub_")
_aten("rsub", "rsub")
_aten("mul", "mul", "mul_")
_aten("div", "div", "div_")
_aten("reshape", "view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
      "view_as", "reshape_as")
_aten("expand", "expand", "expand_as", "broadcast_to")
_aten("transpose", "transpose", "swapaxes", "swapdims")
_aten("permute", "permute")
_aten("t", "t")
_aten("slice", "slice", "narrow")
_aten("select", "select")
_aten("index", "index")
_aten("index_select", "index_select")
_aten("cat", "cat", "concat", "concatenate")
_aten("split", "split", "split_with_sizes", "chunk", "tensor_split")
_aten("unbind", "unbind")
_aten("mean", "mean")
_aten("sum", "sum")
_aten("pow", "pow")
_aten("sqrt", "sqrt")
_aten("rsqrt", "rsqrt")
_aten("reciprocal", "reciprocal")
_aten("gather", "gather")
_aten("masked_fill", "masked_fill")
_aten("repeat", "repeat")
_aten("upsample", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
      "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_nearest_exact1d",
      "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa",
      "_upsample_bicubic2d_aa")
_aten("numpy_T", "numpy_T")
_aten("softmax", "softmax", "_softmax", "log_softmax", "_log_softmax", "argmax", "argmin")
_aten("layer_norm", "layer_norm", "native_layer_norm")
_aten("linear", "linear")
_aten("addmm", "addmm")
_aten("matmul", "mm", "matmul", "bmm")
_aten("einsum", "einsum")
_aten("embedding", "embedding")
_aten("conv", "convolution", "conv1d", "conv2d", "conv3d", "_convolution")
_aten("conv_transpose", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_aten("pad", "constant_pad_nd", "pad")
_aten("reorder", "roll", "flip")
# Reads only a tensor's metadata (shape, dtype): unchanged by any shift.
_aten("metadata", "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
      "_assert_scalar", "_assert_async")


# --- torch-level functions (Dynamo): callable -> (kind, positional parameter names) -------------
def _f(*names: str) -> tuple:
    return names


_TORCH: dict[Any, tuple[str, tuple]] = {
    operator.add: ("add", _f("input", "other")), operator.iadd: ("add", _f("input", "other")),
    torch.add: ("add", _f("input", "other")),
    operator.sub: ("sub", _f("input", "other")), operator.isub: ("sub", _f("input", "other")),
    torch.sub: ("sub", _f("input", "other")), torch.subtract: ("sub", _f("input", "other")),
    torch.rsub: ("rsub", _f("input", "other")),
    operator.mul: ("mul", _f("input", "other")), operator.imul: ("mul", _f("input", "other")),
    torch.mul: ("mul", _f("input", "other")), torch.multiply: ("mul", _f("input", "other")),
    operator.truediv: ("div", _f("input", "other")), operator.itruediv: ("div", _f("input", "other")),
    torch.div: ("div", _f("input", "other")), torch.true_divide: ("div", _f("input", "other")),
    operator.neg: ("neg", _f("input")), torch.neg: ("neg", _f("input")),
    torch.clone: ("identity", _f("input")), torch.detach: ("identity", _f("input")),
    F.dropout: ("dropout", _f("input", "p", "training", "inplace")),
    torch.dropout: ("dropout", _f("input", "p", "training")),
    F.dropout1d: ("dropout", _f("input", "p", "training", "inplace")),
    torch.reshape: ("reshape", _f("input")), torch.flatten: ("reshape", _f("input")),
    torch.squeeze: ("reshape", _f("input")), torch.unsqueeze: ("reshape", _f("input")),
    torch.unflatten: ("reshape", _f("input")),
    torch.broadcast_to: ("expand", _f("input")),
    torch.transpose: ("transpose", _f("input", "dim0", "dim1")),
    torch.swapaxes: ("transpose", _f("input", "dim0", "dim1")),
    torch.permute: ("permute", _f("input", "*dims")),
    torch.t: ("t", _f("input")),
    torch.narrow: ("slice", _f("input", "dim", "start", "length")),
    torch.select: ("select", _f("input", "dim", "index")),
    torch.index_select: ("index_select", _f("input", "dim", "index")),
    torch.cat: ("cat", _f("tensors", "dim")), torch.concat: ("cat", _f("tensors", "dim")),
    torch.concatenate: ("cat", _f("tensors", "dim")),
    torch.split: ("split", _f("input", "split_size", "dim")),
    torch.chunk: ("split", _f("input", "chunks", "dim")),
    torch.unbind: ("unbind", _f("input", "dim")),
    torch.mean: ("mean", _f("input", "dim", "keepdim")), torch.sum: ("sum", _f("input", "dim", "keepdim")),
    torch.pow: ("pow", _f("input", "exponent")), operator.pow: ("pow", _f("input", "exponent")),
    torch.sqrt: ("sqrt", _f("input")), torch.rsqrt: ("rsqrt", _f("input")),
    torch.reciprocal: ("reciprocal", _f("input")),
    torch.gather: ("gather", _f("input", "dim", "index")),
    torch.masked_fill: ("masked_fill", _f("input", "mask", "value")),
    F.interpolate: ("upsample", _f("input", "size", "scale_factor", "mode")),
    F.softmax: ("softmax", _f("input", "dim")), torch.softmax: ("softmax", _f("input", "dim")),
    F.log_softmax: ("softmax", _f("input", "dim")), torch.log_softmax: ("softmax", _f("input", "dim")),
    torch.argmax: ("softmax", _f("input", "dim")), torch.argmin: ("softmax", _f("input", "dim")),
    F.layer_norm: ("layer_norm", _f("input", "normalized_shape", "weight", "bias", "eps")),
    torch.layer_norm: ("layer_norm", _f("input", "normalized_shape", "weight", "bias", "eps")),
    F.linear: ("linear", _f("input", "weight", "bias")),
    torch.einsum: ("einsum", _f("equation", "*tensors")),
    torch.addmm: ("addmm", _f("input", "mat1", "mat2")),
    torch.mm: ("matmul", _f("input", "other")), torch.matmul: ("matmul", _f("input", "other")),
    torch.bmm: ("matmul", _f("input", "other")), operator.matmul: ("matmul", _f("input", "other")),
    # F.embedding takes the indices first, aten.embedding the table first: bind by name.
    F.embedding: ("embedding", _f("indices", "weight", "padding_idx", "max_norm")),
    F.conv1d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    F.conv2d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    F.conv3d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    torch.conv1d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    torch.conv2d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    torch.conv3d: ("conv", _f("input", "weight", "bias", "stride", "padding", "dilation", "groups")),
    F.conv_transpose1d: ("conv_transpose", _f("input", "weight", "bias", "stride", "padding", "output_padding", "groups")),
    F.conv_transpose2d: ("conv_transpose", _f("input", "weight", "bias", "stride", "padding", "output_padding", "groups")),
    F.conv_transpose3d: ("conv_transpose", _f("input", "weight", "bias", "stride", "padding", "output_padding", "groups")),
    F.pad: ("pad", _f("input", "pad", "mode", "value")),
    torch._C._nn.pad: ("pad", _f("input", "pad", "mode", "value")),
    torch.roll: ("reorder", _f("input", "shifts", "dims")),
    torch.flip: ("reorder", _f("input", "dims")),
    torch._assert: ("metadata", _f("input")),
}

# --- tensor methods (Dynamo call_method): name -> (kind, positional parameter names) -------------
_METHODS: dict[str, tuple[str, tuple]] = {
    "add": ("add", _f("input", "other")), "add_": ("add", _f("input", "other")),
    "__add__": ("add", _f("input", "other")), "__radd__": ("add", _f("input", "other")),
    "sub": ("sub", _f("input", "other")), "sub_": ("sub", _f("input", "other")),
    "__sub__": ("sub", _f("input", "other")), "__rsub__": ("rsub", _f("input", "other")),
    "mul": ("mul", _f("input", "other")), "mul_": ("mul", _f("input", "other")),
    "__mul__": ("mul", _f("input", "other")), "__rmul__": ("mul", _f("input", "other")),
    "div": ("div", _f("input", "other")), "div_": ("div", _f("input", "other")),
    "__truediv__": ("div", _f("input", "other")),
    "neg": ("neg", _f("input")), "__neg__": ("neg", _f("input")),
    "clone": ("identity", _f("input")), "detach": ("identity", _f("input")),
    "contiguous": ("identity", _f("input")), "to": ("identity", _f("input")),
    "type": ("identity", _f("input")), "type_as": ("identity", _f("input")),
    "float": ("identity", _f("input")), "double": ("identity", _f("input")),
    "half": ("identity", _f("input")), "bfloat16": ("identity", _f("input")),
    "view": ("reshape", _f("input")), "reshape": ("reshape", _f("input")),
    "flatten": ("reshape", _f("input")), "unflatten": ("reshape", _f("input")),
    "squeeze": ("reshape", _f("input")), "unsqueeze": ("reshape", _f("input")),
    "view_as": ("reshape", _f("input")), "reshape_as": ("reshape", _f("input")),
    "expand": ("expand", _f("input")), "expand_as": ("expand", _f("input")),
    "transpose": ("transpose", _f("input", "dim0", "dim1")), "swapaxes": ("transpose", _f("input", "dim0", "dim1")),
    "permute": ("permute", _f("input", "*dims")),
    "t": ("t", _f("input")),
    "narrow": ("slice", _f("input", "dim", "start", "length")),
    "select": ("select", _f("input", "dim", "index")),
    "index_select": ("index_select", _f("input", "dim", "index")),
    "split": ("split", _f("input", "split_size", "dim")),
    "chunk": ("split", _f("input", "chunks", "dim")),
    "unbind": ("unbind", _f("input", "dim")),
    "mean": ("mean", _f("input", "dim", "keepdim")), "sum": ("sum", _f("input", "dim", "keepdim")),
    "pow": ("pow", _f("input", "exponent")), "__pow__": ("pow", _f("input", "exponent")),
    "sqrt": ("sqrt", _f("input")), "rsqrt": ("rsqrt", _f("input")), "reciprocal": ("reciprocal", _f("input")),
    "gather": ("gather", _f("input", "dim", "index")),
    "masked_fill": ("masked_fill", _f("input", "mask", "value")),
    "repeat": ("repeat", _f("input", "*repeats")),
    "softmax": ("softmax", _f("input", "dim")), "log_softmax": ("softmax", _f("input", "dim")),
    "argmax": ("softmax", _f("input", "dim")), "argmin": ("softmax", _f("input", "dim")),
    "roll": ("reorder", _f("input", "shifts", "dims")), "flip": ("reorder", _f("input", "*dims")),
    "size": ("metadata", _f("input")), "dim": ("metadata", _f("input")), "numel": ("metadata", _f("input")),
    "stride": ("metadata", _f("input")),
}


def _bind(params: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, p in enumerate(params):
        if p.startswith("*"):  # varargs: x.permute(0, 2, 1) or x.permute((0, 2, 1))
            rest = tuple(args[k:])
            out[p[1:]] = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            break
        if k < len(args):
            out[p] = args[k]
    for k, v in kwargs.items():
        out[ALIASES.get(k, k)] = v
    return out


def _bind_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
    out = {ALIASES.get(name, name): v for name, v in zip(positional, args)}
    for k, v in kwargs.items():
        out[ALIASES.get(k, k)] = v
    return out


def canonical(node: fx.Node) -> Optional[Call]:
    """The kind and named arguments of `node`'s operation, or None when it is not one we know."""
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            kind = _ATEN.get(t.overloadpacket._qualified_op_name)
            return None if kind is None else Call(kind, _bind_schema(t, node.args, node.kwargs))
        if t is operator.getitem:
            return Call("getitem", {"input": node.args[0], "index": node.args[1]})
        try:
            entry = _TORCH.get(t)
        except TypeError:  # unhashable target
            entry = None
        if entry is not None:
            return Call(entry[0], _bind(entry[1], node.args, node.kwargs))
    elif node.op == "call_module" and t == "_guards_fn":
        return Call("metadata", {})  # ExportedProgram.module()'s check of the input shapes
    elif node.op == "call_method" and isinstance(t, str):
        entry = _METHODS.get(t)
        if entry is not None:
            return Call(entry[0], _bind(entry[1], node.args, node.kwargs))
    return None


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
        args = list(node.args)
        args[k] = value
        node.args = tuple(args)
        return
    key = next(key for key in node.kwargs if ALIASES.get(key, key) == name)
    node.update_kwarg(key, value)
