"""What the ONNX frontend knows of a LayerNorm in the graph: `NormMatch`, the one result type of
every norm pattern (norm_patterns.py, DESIGN §7), and the constants and shapes the patterns read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from ..passes.axes import Shape
from ..passes.errors import LnfoldError
from .read import is_lazy, read_external


@dataclass
class NormMatch:
    name: str
    kind: str  # "LayerNormalization", "decomposed", "SkipLayerNormalization"
    nodes: list  # gs.Node covered, in graph order; the last one produces `output`
    x: gs.Tensor  # normalized input (for Skip: input; skip/bias are separate)
    output: gs.Tensor
    gamma: Optional[gs.Tensor] = None
    beta: Optional[gs.Tensor] = None
    epsilon: float = 1e-5
    axis: Optional[int] = None  # normalized axis of x (non-negative), when a single one
    rejection: Optional[str] = None  # why this is not a foldable single-axis LayerNorm
    axes: list = field(default_factory=lambda: [-1])  # normalized axes, as the op names them
    stats_used: bool = False  # its mean / inverse-std outputs are read
    skip: Optional[gs.Tensor] = None  # SkipLayerNormalization only
    bias: Optional[gs.Tensor] = None
    sum_output: Optional[gs.Tensor] = None  # Skip's input+skip+bias output, when used


def given(slots, i: int):
    """Slot `i` of a node's inputs or outputs where it is given (an omitted optional one is
    missing or named "")."""
    return slots[i] if i < len(slots) and slots[i] is not None and slots[i].name else None


def replace_input(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    # graphsurgeon's input lists keep tensor.outputs in sync only through item assignment
    for i, t in enumerate(node.inputs):
        if t is old:
            node.inputs[i] = new


def _constant_node_value(t):
    if t is not None and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        return t.inputs[0].attrs.get("value")
    return None


def is_constant(t) -> bool:
    """Without loading its data (weights of a big model stay on disk until edited)."""
    return isinstance(t, gs.Constant) or isinstance(_constant_node_value(t), gs.Constant)


def constant_shape(t) -> Optional[tuple]:
    if isinstance(t, gs.Constant):
        return tuple(t.shape)
    c = _constant_node_value(t)
    return tuple(c.shape) if isinstance(c, gs.Constant) else None


def const_values(t) -> Optional[np.ndarray]:
    """The value of a constant tensor (an initializer or a Constant node's output), else None;
    read afresh each time, not kept: a big model's weights are read one at a time where the fold
    uses them, and graphsurgeon exports the untouched ones from their original TensorProto."""
    c = t if isinstance(t, gs.Constant) else _constant_node_value(t)
    if not isinstance(c, gs.Constant):
        return None
    v = c._values
    if type(v) is gs.ir.tensor.LazyValues:  # (not SparseValues: their values are computed)
        if is_lazy(v.tensor):
            return read_external(v.tensor)
        if v.tensor.data_type in _NUMPY_NATIVE:  # one copy of the bytes, read-only (load() copies it again)
            return numpy_helper.to_array(v.tensor)
        return v.load()  # (bf16 and the like: graphsurgeon's load casts them)
    if isinstance(v, gs.ir.tensor.SparseValues):
        return dense(v.tensor)
    return c.values


def dense(sp: onnx.SparseTensorProto) -> np.ndarray:
    """The dense array a sparse initializer stands for, in its values' dtype (graphsurgeon's own
    reading ignores raw_data and makes float64 zeros). Indices that do not fit the shape are the
    input's fault: a one-line LnfoldError."""
    values = read_external(sp.values) if is_lazy(sp.values) else numpy_helper.to_array(sp.values)
    indices = read_external(sp.indices) if is_lazy(sp.indices) else numpy_helper.to_array(sp.indices)
    shape = tuple(int(d) for d in sp.dims)
    out = np.zeros(shape, values.dtype)
    try:
        if any(d < 0 for d in shape) or values.ndim != 1 or indices.ndim not in (1, 2) \
                or len(indices) != len(values) or (indices.ndim == 2 and indices.shape[1] != len(shape)):
            raise ValueError("layout")
        at = indices.astype(np.int64)
        if at.size and (at.min() < 0 or (at.max(axis=0) >= (out.size if at.ndim == 1 else shape)).any()):
            raise ValueError("range")
        if at.ndim == 1:
            out.reshape(-1)[at] = values
        else:
            out[tuple(at.T)] = values
    except (ValueError, TypeError):
        raise LnfoldError(f"sparse initializer `{sp.values.name}`: {values.size} values at indices of shape "
                          f"{list(indices.shape)} do not fit its shape {list(shape)}") from None
    return out


_NUMPY_NATIVE = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64,
                 onnx.TensorProto.INT32, onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


def reduce_axes(node: gs.Node) -> Optional[list[int]]:
    """Axes of a Reduce* node (attribute before opset 18, input after); None if not constant."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if given(node.inputs, 1) is not None:
        v = const_values(node.inputs[1])
        return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    return []  # reduce over all axes (unless noop_with_empty_axes)


def rank_of(t: gs.Tensor, shapes: dict[str, Shape]) -> Optional[int]:
    s = shapes.get(t.name)
    return None if s is None else len(s)


def uses_stats(stats, graph_outputs: set[str]) -> bool:
    """Some of a norm's extra outputs are read (a LayerNorm's mean / inverse std: then it cannot
    become an RMSNorm; EmbedLayerNormalization's mask index)."""
    return any(o is not None and o.name and (o.outputs or o.name in graph_outputs) for o in stats)


def np_dtype(dtype):
    return np.dtype(dtype) if dtype is not None else np.float32


def dtype_of(x, gamma, nodes=(), memo: Optional[dict] = None):
    """The dtype a norm computes in: its input's (declared, or found walking back), else its
    γ's, else the Cast a decomposed float16 norm ends with. `memo`: float_dtype's."""
    found = float_dtype(x, memo)
    if found is not None:
        return found
    v = const_values(gamma) if gamma is not None else None
    if v is not None:
        return np.asarray(v).dtype
    if nodes and nodes[-1].op == "Cast":  # a decomposed fp16 norm casts its fp32 result back
        return onnx.helper.tensor_dtype_to_np_dtype(int(nodes[-1].attrs["to"]))
    return np.float32


_WALKING = object()  # float_dtype's mark of a tensor whose inputs are being walked


def float_dtype(t, memo: Optional[dict] = None):
    """The float dtype of tensor `t`: declared, or (where the exporter wrote no value_info) the
    first float one among its producer's inputs, walking back depth first (with a stack, not
    recursion: an 80-layer export is ~1,000 ops deep); a Cast says its own. None where the walk
    finds none. γ is no witness: an fp16 stream can carry an fp32 γ.

    `memo` (name -> dtype or None), shared by a caller asking for many tensors of one graph, stops
    each walk where an earlier one went (else every norm walks back to the stream's start)."""
    memo = {} if memo is None else memo
    frames: list = []  # [name, inputs to walk, the next one]: the walk's path, deepest last
    found = _enter(t, memo, frames)
    while frames:
        frame = frames[-1]
        name, inputs, k = frame
        if found is not None and found is not _WALKING:  # an input's walk found one: so did this tensor's
            memo[name] = found
            frames.pop()
        elif k < len(inputs):
            frame[2] = k + 1
            found = _enter(inputs[k], memo, frames)
        else:
            memo[name] = found = None
            frames.pop()
    return found


def _enter(t, memo: dict, frames: list):
    """`t`'s dtype where it says one itself (or the memo knows it), else _WALKING with its inputs
    pushed on `frames` (a tensor met again while its inputs are walked: None, as the walk of a
    cycle found nothing there)."""
    if t is None or not t.name:
        return None
    if t.name in memo:
        found = memo[t.name]
        return None if found is _WALKING else found
    v = const_values(t) if is_constant(t) else None
    dt = np.asarray(v).dtype if v is not None else (np.dtype(t.dtype) if t.dtype is not None else None)
    found = None
    if dt is not None:
        found = dt if dt.kind == "f" else None
    elif len(t.inputs) == 1:
        node = t.inputs[0]
        if node.op == "Cast":
            found = onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"]))
        else:
            # the data input decides: LayerNormalization's X, not its (possibly fp32) scale
            memo[t.name] = _WALKING
            frames.append([t.name, list(node.inputs[:1] if node.op in ("LayerNormalization", "Gather")
                                         else node.inputs), 0])
            return _WALKING
    memo[t.name] = found
    return found
