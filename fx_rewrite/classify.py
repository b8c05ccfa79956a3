"""FX nodes -> the stream view of passes/. One builder per op kind; nothing here decides a fold.

Each builder returns the callables a `passes.Node` carries (transfer / backward / centering /
channel_scale / invariant) for one graph node, reading the shapes torch recorded on the node
(`meta["val"]` from torch.export, `meta["example_value"]` from Dynamo) to place the feature axis.
`ops.canonical` has already reduced every spelling of an op (ATen overload, torch function,
tensor method) to one kind with named arguments.

View names are FX node names. A node with a tuple result (split, native_layer_norm) has one view
output per element, named after the `getitem` node that reads it. A Python number added to the
stream becomes a synthetic constant (`<node>#<arg>`), so the plan can zero it like any constant.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..passes import ConstRef, Node, NormSpec, View
from ..passes.axes import broadcast_rules, permute_rules, reshape_axis, same_axes_rules
from ..passes.view import ChannelScale, DimRef, LinearRead

from .ops import Call, canonical, op_name

Shape = Optional[tuple]


def meta_val(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return node.meta.get("example_value") if v is None else v


def _dim(d: Any) -> Any:
    if isinstance(d, int):
        return d
    try:
        i = d.node.maybe_as_int()  # a SymInt that is in fact a known constant
    except AttributeError:
        i = None
    return int(i) if i is not None else str(d)


def shape_of(node: Any) -> Shape:
    v = meta_val(node)
    return tuple(_dim(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _is_float(node: Any) -> bool:
    v = meta_val(node)
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def is_tuple_getitem(node: fx.Node) -> bool:
    """`getitem` on a tuple result (split, native_layer_norm): part of its producer's outputs."""
    if node.op != "call_function" or node.target is not operator.getitem or not node.args:
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and isinstance(meta_val(src), (tuple, list))


class GraphInfo:
    """Shapes, constant-ness and view-input positions of one FX graph's nodes."""

    def __init__(self, graph: fx.Graph, consts: set[str]) -> None:
        self.graph = graph
        self.consts = consts  # node names of constant tensors (parameters, buffers, constants)
        self.nodes = {n.name: n for n in graph.nodes}
        self.inputs: dict[str, list[str]] = {}  # view node name -> its input value names
        self.scalars: dict[str, tuple[fx.Node, str]] = {}  # synthetic constant -> (node, argument)

    def shape(self, x: Any) -> Shape:
        if isinstance(x, numbers.Number) and not isinstance(x, bool):
            return ()
        return shape_of(x)

    def rank(self, x: Any) -> Optional[int]:
        s = self.shape(x)
        return None if s is None else len(s)

    def is_const(self, x: Any) -> bool:
        return isinstance(x, fx.Node) and x.name in self.consts

    def index(self, node: fx.Node, x: Any) -> Optional[int]:
        """Position of `x` among the view inputs of `node`."""
        if not isinstance(x, fx.Node):
            return None
        ins = self.inputs[node.name]
        return ins.index(x.name) if x.name in ins else None

    def scalar_input(self, node: fx.Node, arg: str) -> int:
        """A Python number argument, seen by the view as a constant input of `node`."""
        name = f"{node.name}#{arg}"
        self.scalars[name] = (node, arg)
        ins = self.inputs[node.name]
        if name not in ins:
            ins.append(name)
        return ins.index(name)

    def const_ref(self, node: fx.Node, x: Any, axis: Optional[int]) -> Optional[ConstRef]:
        """The constant behind `x` (an input of `node`), through layout ops that only it reads.

        `F.linear`'s weight is read directly; an exported `addmm` may read `aten.t(weight)`.
        """
        if not isinstance(x, fx.Node):
            return None
        i = self.index(node, x)
        if i is None:
            return None
        if self.is_const(x):
            return ConstRef(x.name, axis, node.name, i)
        if len(x.users) != 1 or x.name not in self.inputs:
            return None
        call = canonical(x)
        src = call.node("input") if call is not None else None
        if src is None:
            return None
        if call.kind == "identity" and _is_float(src) and _is_float(x):
            return self.const_ref(x, src, axis)
        perm = _perm_of(self, x, call)
        if perm is not None and axis is not None and axis < len(perm):
            return self.const_ref(x, src, perm[axis])
        return None


def _norm_axis(axis: Any, rank: Optional[int]) -> Optional[int]:
    if not isinstance(axis, int) or rank is None:
        return None
    return axis + rank if axis < 0 else axis


def _perm_of(g: GraphInfo, node: fx.Node, call: Call) -> Optional[list[int]]:
    """Output axis k of a transpose/permute/t reads input axis perm[k]."""
    rank = g.rank(call.node("input"))
    if rank is None:
        return None
    if call.kind == "t":
        return list(reversed(range(rank))) if rank <= 2 else None
    if call.kind == "transpose":
        d0, d1 = _norm_axis(call.get("dim0"), rank), _norm_axis(call.get("dim1"), rank)
        if d0 is None or d1 is None:
            return None
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if call.kind == "permute":
        dims = call.get("dims")
        if not isinstance(dims, (list, tuple)) or len(dims) != rank:
            return None
        perm = [_norm_axis(d, rank) for d in dims]
        return None if None in perm else perm
    return None


# --- op kinds ------------------------------------------------------------------------------------
# Each returns a dict of keyword arguments for passes.Node.

def _identity(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """Shape- and value-preserving ops (clone, contiguous, float casts)."""
    x = call.node("input")
    i = g.index(node, x)
    if i is None or not (_is_float(x) and _is_float(node)):
        return {}
    return dict(transfer=lambda j, b: [(0, b)] if j == i else None,
                backward=lambda o, a: [(i, a)] if o == 0 else None)


def _dropout(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    # Train-mode dropout scales each element by its own random mask: a per-row shift does not
    # survive it. Eval mode (or p=0) is the identity.
    training = call.get("training", True)
    p = call.get("p", 0.5)
    if training is not False and p != 0:
        return {}
    return _identity(g, node, call)


def _add(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """Add/Sub (also `rsub`): both operands carry the stream; a number is a constant operand."""
    data = []
    for arg in ("input", "other"):
        x = call.args.get(arg)
        if isinstance(x, fx.Node):
            if meta_val(x) is not None and not isinstance(meta_val(x), torch.Tensor):
                return {}  # a symbolic number: not a tensor the plan could edit
            i = g.index(node, x)
            if i is None:
                return {}
        elif isinstance(x, numbers.Number) and not isinstance(x, bool):
            i = g.scalar_input(node, arg)
        else:
            return {}
        if i not in data:
            data.append(i)
    if not isinstance(call.get("alpha", 1), numbers.Number):
        return {}
    ins = g.inputs[node.name]
    ranks = [g.rank(_lookup(g, n)) for n in ins]
    const = [n in g.scalars or g.is_const(g.nodes.get(n)) for n in ins]
    return broadcast_rules(ranks, g.rank(node), const, data)


def _lookup(g: GraphInfo, name: str) -> Any:
    if name in g.scalars:
        node, arg = g.scalars[name]
        return canonical(node).args[arg]
    return g.nodes.get(name)


def _neg(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    if i is None:
        return {}
    return dict(transfer=lambda j, b: [(0, b)] if j == i else None,
                backward=lambda o, a: [(i, a)] if o == 0 else None)


def _expand(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    if i is None:
        return {}
    ins = g.inputs[node.name]
    ranks = [g.rank(g.nodes.get(n)) for n in ins]
    const = [g.is_const(g.nodes.get(n)) for n in ins]
    return broadcast_rules(ranks, g.rank(node), const, [i])


def _mul(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """Mul/Div by a factor constant along the feature axis is transparent; per-channel is LayerScale."""
    is_div = call.kind == "div"
    if is_div and call.get("rounding_mode") is not None:
        return {}
    R = g.rank(node)
    operands = [call.args.get("input"), call.args.get("other")]

    def aligned_dim(j, a):
        s = g.shape(operands[j])
        if s is None or R is None:
            return "unknown"
        k = a - (R - len(s))
        return 1 if k < 0 else s[k]

    idx = [g.index(node, x) for x in operands]

    def transfer(i, b):
        if R is None:
            return None
        for j in ((0,) if is_div else (0, 1)):
            if idx[j] == i and idx[1 - j] != i:
                a = b + R - g.rank(operands[j])
                return [(0, a)] if aligned_dim(1 - j, a) == 1 else None
        return None

    def backward(o, a):
        cands = [j for j in ((0,) if is_div else (0, 1))
                 if idx[j] is not None and aligned_dim(1 - j, a) == 1 and idx[1 - j] != idx[j]]
        if len(cands) != 1:
            return None
        j = cands[0]
        b = a - (R - g.rank(operands[j]))
        return [(idx[j], b)] if b >= 0 else None

    def channel_scale(o, a):
        if is_div or R is None:
            return None
        for j in (0, 1):
            x, s = operands[1 - j], operands[j]
            if not g.is_const(s) or g.is_const(x) or idx[1 - j] is None:
                continue
            shape = g.shape(s)
            k = a - (R - len(shape))
            if k < 0 or any(d != 1 for n, d in enumerate(shape) if n != k):
                continue
            b = a - (R - g.rank(x))
            if b < 0:
                continue
            return ChannelScale(idx[1 - j], b, ConstRef(s.name, k, node.name, idx[j]))
        return None

    return dict(transfer=transfer, backward=backward, channel_scale=channel_scale)


def _reshape(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    src, dst = g.shape(x), g.shape(node)
    if i is None:
        return {}

    def transfer(j, b):
        axis = reshape_axis(src, dst, b) if j == i else None
        return None if axis is None else [(0, axis)]

    def backward(o, a):
        axis = reshape_axis(dst, src, a) if o == 0 else None
        return None if axis is None else [(i, axis)]

    return dict(transfer=transfer, backward=backward, regroups=True)


def _permute(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    i = g.index(node, call.node("input"))
    perm = _perm_of(g, node, call)
    if i is None or perm is None:
        return {}
    return permute_rules(perm, i)


def _changed_axes(src: Shape, dst: Shape) -> Optional[set]:
    """Axes whose size a same-rank op changes (a full-range slice changes nothing)."""
    if src is None or dst is None or len(src) != len(dst):
        return None
    return {k for k, (a, b) in enumerate(zip(src, dst)) if a != b or not isinstance(a, int)}


def _slice(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    if i is None:
        return {}
    return same_axes_rules([i], [0], _changed_axes(g.shape(x), g.shape(node)))


def _pad(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """Pad on token axes: zero rows are zero-mean, copied rows (reflect/replicate/circular) carry
    their source rows' shift; rows of any other constant are neither."""
    if call.get("mode", "constant") == "constant" and call.get("value", 0) not in (0, 0.0, None):
        return {}
    return _slice(g, node, call)


def _reorder(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """roll/flip: rows move along the axes named; every axis stays where it is."""
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    dims = call.get("dims")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    axes = {_norm_axis(d, rank) for d in dims}
    if i is None or not dims or None in axes:  # roll without dims: the flattened tensor moves
        return {}
    return same_axes_rules([i], [0], axes)


def _drop_axis(i: Optional[int], dim: Optional[int], outs: list[int]) -> dict:
    """select/unbind: axis `dim` disappears, the ones after it move down."""
    if i is None or dim is None:
        return {}

    def transfer(j, b):
        if j != i or b == dim:
            return None
        return [(o, b if b < dim else b - 1) for o in outs]

    def backward(o, a):
        return [(i, a if a < dim else a + 1)] if o in outs else None

    return dict(transfer=transfer, backward=backward)


def _select(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    return _drop_axis(g.index(node, x), _norm_axis(call.get("dim", 0), g.rank(x)), [0])


def _unbind(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    n = len(meta_val(node) or ())
    return _drop_axis(g.index(node, x), _norm_axis(call.get("dim", 0), g.rank(x)), list(range(n)))


def _index_select(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    dim = _norm_axis(call.get("dim"), g.rank(x))
    return same_axes_rules([i] if i is not None else [], [0], None if dim is None else {dim})


def _index(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """aten.index: tensors index a contiguous block of axes; the others keep their order."""
    x = call.node("input")
    i, r, R = g.index(node, x), g.rank(x), g.rank(node)
    indices = list(call.get("indices") or [])
    used = [k for k, t in enumerate(indices) if t is not None]
    if i is None or r is None or R is None or not used or used != list(range(used[0], used[-1] + 1)):
        return {}
    s, e = used[0], used[-1] + 1
    q = R - (r - (e - s))  # rank of the broadcast index block

    def transfer(j, b):
        if j != i or s <= b < e:
            return None
        return [(0, b if b < s else b - (e - s) + q)]

    def backward(o, a):
        if o != 0 or s <= a < s + q:
            return None
        return [(i, a if a < s else a + (e - s) - q)]

    return dict(transfer=transfer, backward=backward)


def _getitem(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """Basic tensor indexing `x[:, 0]`, `x[..., None]` (Dynamo graphs); tensor indices: opaque."""
    x = call.node("input")
    i, src, dst = g.index(node, x), g.shape(x), g.shape(node)
    if i is None or src is None or dst is None:
        return {}
    idx = call.get("index")
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(not (k is None or k is Ellipsis or isinstance(k, (int, slice))) for k in idx):
        return {}
    fill = len(src) - sum(1 for k in idx if k is not None and k is not Ellipsis)
    expanded: list = []
    for k in idx:
        expanded.extend([slice(None)] * fill if k is Ellipsis else [k])
    if Ellipsis not in idx:
        expanded.extend([slice(None)] * (len(src) - sum(1 for k in idx if k is not None)))
    mapping: dict[int, int] = {}  # input axis -> output axis, for axes kept whole
    a = b = 0
    for k in expanded:
        if k is None:
            b += 1
        elif isinstance(k, int):
            a += 1
        else:
            if b < len(dst) and a < len(src) and src[a] == dst[b] and isinstance(src[a], int):
                mapping[a] = b
            a, b = a + 1, b + 1
    back = {v: k for k, v in mapping.items()}
    return dict(transfer=lambda j, ax: [(0, mapping[ax])] if j == i and ax in mapping else None,
                backward=lambda o, ax: [(i, back[ax])] if o == 0 and ax in back else None)


def _cat(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    tensors = call.get("tensors") or []
    data = [g.index(node, t) for t in tensors]
    if not data or any(d is None for d in data):
        return {}
    dim = _norm_axis(call.get("dim", 0), g.rank(node))
    return same_axes_rules(sorted(set(data)), [0], None if dim is None else {dim})


def _split(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    n = len(meta_val(node) or ())
    dim = _norm_axis(call.get("dim", 0), g.rank(x))
    return same_axes_rules([i] if i is not None else [], list(range(n)), None if dim is None else {dim})


def _reduce(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """mean/sum over token axes: the shift survives, the feature axis moves up."""
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    dims = call.get("dim")
    if i is None or rank is None or dims is None or dims == [] or dims == ():
        return {}  # over every axis, the feature axis included
    dims = [dims] if isinstance(dims, int) else list(dims)
    axes = {_norm_axis(d, rank) for d in dims}
    if None in axes:
        return {}
    keep = bool(call.get("keepdim", False))

    def transfer(j, b):
        if j != i or b in axes:
            return None
        return [(0, b if keep else b - sum(d < b for d in axes))]

    def backward(o, a):
        kept = [d for d in range(rank) if keep or d not in axes]
        if o != 0 or a >= len(kept) or kept[a] in axes:
            return None
        return [(i, kept[a])]

    return dict(transfer=transfer, backward=backward)


def _softmax(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    x = call.node("input")
    i = g.index(node, x)
    dim = _norm_axis(call.get("dim"), g.rank(x))
    if i is None or dim is None:
        return {}
    return dict(invariant=lambda j, b: j == i and b == dim)


def _metadata(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    # Reads shape/dtype only (`_assert_tensor_metadata`, `x.size()`): a shift changes nothing.
    return dict(invariant=lambda j, b: True)


def _linear(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    R = g.rank(node)

    def centering(o, a):
        if R is None or a != R - 1:
            return None
        refs = [g.const_ref(node, call.args.get("weight"), 0)]
        bias = call.args.get("bias")
        if bias is not None:
            refs.append(g.const_ref(node, bias, 0 if g.rank(bias) else None))
        return None if any(r is None for r in refs) else refs

    def linear(i, a):
        x, bias = call.args.get("input"), call.args.get("bias")
        r0 = g.rank(x)
        if r0 is None or i != g.index(node, x) or a != r0 - 1:
            return None
        w = g.const_ref(node, call.args.get("weight"), 1)
        b = None if bias is None else g.const_ref(node, bias, 0 if g.rank(bias) else None)
        return None if w is None or (bias is not None and b is None) else LinearRead(w, b)

    return dict(centering=centering, linear=linear)


def _addmm(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """addmm(bias, x, W) with W stored [in, out] (GPT-2's Conv1D)."""
    def centering(o, a):
        if a != 1:
            return None
        bias = call.args.get("input")
        rb = g.rank(bias)
        refs = [g.const_ref(node, call.args.get("mat2"), 1),
                g.const_ref(node, bias, rb - 1 if rb else None)]
        return None if any(r is None for r in refs) else refs

    def linear(i, a):
        if i != g.index(node, call.args.get("mat1")) or a != 1:
            return None
        if call.get("beta", 1) != 1 or call.get("alpha", 1) != 1:
            return None
        bias = call.args.get("input")
        s = g.shape(bias)
        if s is None or len(s) > 1 and s[0] != 1:
            return None  # a bias that varies along rows
        w = g.const_ref(node, call.args.get("mat2"), 0)
        b = g.const_ref(node, bias, len(s) - 1 if s else None)
        return None if w is None or b is None else LinearRead(w, b)

    return dict(centering=centering, linear=linear)


def _matmul(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    R = g.rank(node)

    def centering(o, a):
        if R is None or R < 2:
            return None
        x, w = call.args.get("input"), call.args.get("other", call.args.get("mat2"))
        r0, r1 = g.rank(x), g.rank(w)
        if a == R - 1 and r1 is not None and r1 >= 2:
            ref = g.const_ref(node, w, r1 - 1)
            if ref is not None:
                return [ref]
        if a == R - 2 and r0 is not None and r0 >= 2:  # W @ x: rows of W are output features
            ref = g.const_ref(node, x, r0 - 2)
            if ref is not None:
                return [ref]
        return None

    def linear(i, a):
        x, w = call.args.get("input"), call.args.get("other", call.args.get("mat2"))
        r0 = g.rank(x)
        if r0 is None or r0 < 2 or i != g.index(node, x) or a != r0 - 1 or g.rank(w) != 2 or x is w:
            return None
        ref = g.const_ref(node, w, 0)
        return None if ref is None else LinearRead(ref)

    return dict(centering=centering, linear=linear)


def _embedding(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    # max_norm renormalizes the looked-up rows: centering them first would change that.
    if call.get("max_norm") is not None:
        return {}
    table, idx = call.args.get("weight"), call.args.get("indices")
    q = g.rank(idx)
    if q is None or g.rank(table) != 2:
        return {}

    def centering(o, a):
        ref = g.const_ref(node, table, 1) if a == q else None  # center each row of the table
        return None if ref is None else [ref]

    return dict(centering=centering)


def _conv(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    transposed = call.kind == "conv_transpose" or bool(call.get("transposed", False))

    def centering(o, a):
        if a != 1 or call.get("groups", 1) != 1:
            return None
        refs = [g.const_ref(node, call.args.get("weight"), 1 if transposed else 0)]
        if call.args.get("bias") is not None:
            refs.append(g.const_ref(node, call.args.get("bias"), 0))
        return None if any(r is None for r in refs) else refs

    return dict(centering=centering)


def _layer_norm(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """A LayerNorm over exactly the last axis gets a NormSpec; any other is named and rejected."""
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    shape = call.get("normalized_shape")
    w, b = call.node("weight"), call.node("bias")
    eps = call.get("eps", 1e-5)
    if i is None or rank is None:
        return dict(norm_rejection="rank of its input is unknown")
    n = len(shape) if isinstance(shape, (list, tuple)) else 1
    if n != 1:
        return dict(norm_rejection=f"normalizes over the last {n} axes of a rank-{rank} tensor, not one feature axis")
    if _stats_used(node):
        return dict(norm_rejection="its mean/rstd outputs are used")
    if not isinstance(eps, numbers.Number):
        return dict(norm_rejection="its eps is not a constant")
    return dict(norm=NormSpec(i, rank - 1, None if w is None else w.name, None if b is None else b.name, float(eps)))


def _stats_used(node: fx.Node) -> bool:
    """native_layer_norm also returns mean and rstd; a fold changes both."""
    return any(is_tuple_getitem(u) and u.args[1] != 0 and u.users for u in node.users)


# --- what CRMSNorm compression asks (passes/compress.py): linear readers, sizes spelled in args --

# Kinds that only move or copy elements: they commute with any map along the feature axis.
LAYOUT = {"identity", "dropout", "reshape", "expand", "transpose", "permute", "t", "slice", "pad", "reorder",
          "select", "unbind", "index", "index_select", "getitem", "cat", "split"}


def _width_refs(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """view/reshape/expand spell the output's sizes in a list argument."""
    slot = next((k for k in ("size", "shape") if isinstance(call.args.get(k), (list, tuple))), None)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if slot is None and node.op == "call_method" and target in ("view", "reshape", "expand"):
        slot = ("varargs", 1)  # x.view(-1, 64): the sizes are the method's positional arguments
    spelled = target.split(".")[0] in ("view", "reshape", "_unsafe_view", "expand", "broadcast_to", "unflatten",
                                       "view_as", "reshape_as", "expand_as")

    def width_refs(o, axis):
        s = g.shape(node)
        if slot is None:
            return [] if not spelled and s is not None else None  # flatten/squeeze: no size
        sizes = varargs_sizes(node) if isinstance(slot, tuple) else call.args[slot]
        if s is None or len(sizes) != len(s) or not isinstance(s[axis], int):
            return None
        entry = sizes[axis]
        if entry == -1 or (call.kind == "expand" and entry == -1):
            return []
        return [DimRef(node.name, slot, axis)] if entry == s[axis] else None

    return dict(width_refs=width_refs)


def varargs_sizes(node: fx.Node) -> list:
    rest = list(node.args[1:])
    return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest


def _linear_reader(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """linear(x, W[out,in], b), addmm(b, x, W[in,out]), x @ W[in,out]: x's last axis is W's input."""
    x = call.node("mat1") if call.kind == "addmm" else call.node("input")
    i = g.index(node, x)

    def linear(j, axis):
        rank = g.rank(x)
        if j != i or rank is None or axis != rank - 1 or g.index(node, x) is None:
            return None
        if call.kind == "linear":
            w, b, w_axis = call.args.get("weight"), call.args.get("bias"), 1
        elif call.kind == "addmm":
            if call.get("beta", 1) != 1 or call.get("alpha", 1) != 1:
                return None
            w, b, w_axis = call.args.get("mat2"), call.args.get("input"), 0
        else:
            w, b, w_axis = call.args.get("other", call.args.get("mat2")), None, 0
        if g.rank(w) != 2 or w is x:
            return None
        wref = g.const_ref(node, w, w_axis)
        if wref is None:
            return None
        if b is None:
            return LinearRead(wref)
        rb = g.rank(b)
        bref = g.const_ref(node, b, rb - 1 if rb else None) if isinstance(b, fx.Node) else None
        return None if bref is None or (rb or 0) > 1 else LinearRead(wref, bref)

    return dict(linear=linear)


def crms_info(g: GraphInfo, node: fx.Node, call: Call) -> dict:
    """The view's CRMS fields for one node (see passes/view.py)."""
    kw: dict = {}
    if call.kind in LAYOUT:
        kw["layout"] = True
    if call.kind in ("reshape", "expand"):
        kw.update(_width_refs(g, node, call))
    if call.kind in ("linear", "addmm", "matmul"):
        kw.update(_linear_reader(g, node, call))
    if call.kind == "metadata":  # a dtype/device assert ignores the width; a size assert does not
        sized = call.get("size") is not None or call.get("stride") is not None
        kw.update(shape_only=True, width_refs=lambda o, a: None if sized else [])
    return kw


Builder = Callable[[GraphInfo, fx.Node, Call], dict]

# op kind (see ops.py for the spellings of each) -> builder. Adding an op is one entry here.
KINDS: dict[str, Builder] = {
    "identity": _identity,
    "dropout": _dropout,
    "neg": _neg,
    "add": _add,
    "sub": _add,
    "rsub": _add,
    "mul": _mul,
    "div": _mul,
    "reshape": _reshape,
    "expand": _expand,
    "transpose": _permute,
    "permute": _permute,
    "t": _permute,
    "slice": _slice,
    "pad": _pad,
    "reorder": _reorder,
    "select": _select,
    "unbind": _unbind,
    "index": _index,
    "index_select": _index_select,
    "getitem": _getitem,
    "cat": _cat,
    "split": _split,
    "reduce": _reduce,
    "softmax": _softmax,
    "metadata": _metadata,
    "linear": _linear,
    "addmm": _addmm,
    "matmul": _matmul,
    "embedding": _embedding,
    "conv": _conv,
    "conv_transpose": _conv,
    "layer_norm": _layer_norm,
}


def _outputs(node: fx.Node) -> tuple[list[str], list[fx.Node]]:
    """View outputs of `node` and the duplicate getitems that read an already-named element."""
    val = meta_val(node)
    if not isinstance(val, (tuple, list)):
        return [node.name], []
    outs = [""] * len(val)
    dupes = []
    for u in node.users:
        if is_tuple_getitem(u) and isinstance(u.args[1], int) and 0 <= u.args[1] < len(val):
            if outs[u.args[1]]:
                dupes.append(u)
            else:
                outs[u.args[1]] = u.name
    return outs, dupes


def build_view(graph: fx.Graph, consts: set[str]) -> tuple[View, GraphInfo]:
    """The stream view of `graph`; `consts` names the nodes that hold constant tensors."""
    g = GraphInfo(graph, consts)
    view = View()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or is_tuple_getitem(node):
            continue
        g.inputs[node.name] = [n.name for n in node.all_input_nodes]
        call = canonical(node)
        kwargs = KINDS[call.kind](g, node, call) if call is not None and call.kind in KINDS else {}
        if kwargs:
            kwargs.update(crms_info(g, node, call))
        outs, dupes = _outputs(node)
        view.add_node(Node(node.name, op_name(node), g.inputs[node.name], outs, **kwargs))
        for d in dupes:  # a second getitem of the same element: an identity of the first
            src = outs[d.args[1]]
            g.inputs[d.name] = [src]
            view.add_node(Node(d.name, "getitem", [src], [d.name],
                               transfer=lambda j, b: [(0, b)] if j == 0 else None,
                               backward=lambda o, a: [(0, a)] if o == 0 else None))

    for name, v in view.values.items():
        fxn = g.nodes.get(name)
        if name in g.scalars:
            v.shape, v.rank, v.is_const = (), 0, True
            continue
        v.shape = shape_of(fxn) if fxn is not None else None
        v.rank = None if v.shape is None else len(v.shape)
        v.is_const = name in consts
        v.is_graph_input = fxn is not None and fxn.op == "placeholder" and not v.is_const
    for node in graph.nodes:
        if node.op == "output":
            for leaf in _leaves(node.args):
                if leaf.name in view.values:
                    view.values[leaf.name].is_graph_output = True
    return view, g


def _leaves(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: out.append(n))
    return out
