"""FX nodes -> the stream view of passes/: one builder per op kind (`ops.canonical`'s) names the op in
the vocabulary of passes/rules.py, with view input indices and non-negative axes; nothing here decides
a fold. View names are FX node names; a tuple result (split, native_layer_norm) has one view output
per element, named after its `getitem`. A Python number added to the stream becomes a synthetic
constant (`<node>#<arg>`), so the plan can zero it like any constant.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..passes import Node, View
from ..passes.patterns import DecomposedNorm, collapse_norms
from ..passes.rules import Rule, rule

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


def is_tuple_getitem(node: fx.Node) -> bool:
    """`getitem` on a tuple result (split, native_layer_norm): part of its producer's outputs."""
    if node.op != "call_function" or node.target is not operator.getitem or not node.args:
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and isinstance(meta_val(src), (tuple, list))


def norm_outputs(node: fx.Node) -> tuple[list[fx.Node], Optional[fx.Node]]:
    """A layer_norm node's getitems (native_layer_norm returns (y, mean, rstd)) and the node that
    holds y (None: nothing reads it)."""
    if not isinstance(meta_val(node), (tuple, list)):
        return [], node
    outs = [u for u in node.users if is_tuple_getitem(u)]
    return outs, next((u for u in outs if u.args[1] == 0), None)


class GraphInfo:
    """Shapes and view-input positions of one FX graph's nodes, and what the view made of them."""

    def __init__(self, graph: fx.Graph, rms: bool = False) -> None:
        self.nodes = {n.name: n for n in graph.nodes}
        self.rms = rms  # RMSNorms as given are norms of the view (γ into readers or a rotation asked)
        self.inputs: dict[str, list[str]] = {}  # view node name -> its input value names
        self.scalars: dict[str, tuple[fx.Node, str]] = {}  # synthetic constant -> (node, argument)
        self.decomposed: dict[str, DecomposedNorm] = {}  # multi-op LayerNorms, by view name
        self.decomposed_rms: dict[str, DecomposedNorm] = {}  # multi-op RMSNorms as given, by view name

    def shape(self, x: Any) -> Shape:
        if isinstance(x, numbers.Number) and not isinstance(x, bool):
            return ()
        return shape_of(x)

    def rank(self, x: Any) -> Optional[int]:
        s = self.shape(x)
        return None if s is None else len(s)

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


def _norm_axis(axis: Any, rank: Optional[int]) -> Optional[int]:
    if not isinstance(axis, int) or rank is None:
        return None
    return axis + rank if axis < 0 else axis


def _perm_of(g: GraphInfo, call: Call) -> Optional[list[int]]:
    """Output axis k of a transpose/permute/t reads input axis perm[k]."""
    rank = g.rank(call.node("input"))
    if rank is None:
        return None
    if call.kind == "t":
        return list(reversed(range(rank))) if rank <= 2 else None
    if call.kind == "numpy_T":  # `x.T`: every axis reversed
        return list(reversed(range(rank)))
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


# --- op kinds: each returns the node's Rule, or None (opaque) ----------------------------------
Built = Optional[Rule]


def _identity(g: GraphInfo, node: fx.Node, call: Call, op: str = "identity") -> Built:
    """Shape- and value-preserving ops (clone, contiguous, float casts; a copy of any dtype that
    keeps it: ViT-MAE's `index.to(device)`, which passes/rules.uniform_along looks through)."""
    x = call.node("input")
    i, xv, v = g.index(node, x), meta_val(x), meta_val(node)
    if i is None or not (isinstance(xv, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    if xv.dtype != v.dtype and not (xv.dtype.is_floating_point and v.dtype.is_floating_point):
        return None
    return rule("elementwise", data=i, op="cast" if call.kind == "identity" and xv.dtype != v.dtype else op)


def _dropout(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    # Train-mode dropout scales each element by its own random mask: eval mode (or p=0) is the
    # identity, which is all the vocabulary knows.
    if call.get("training", True) is not False and call.get("p", 0.5) != 0:
        return None
    return _identity(g, node, call, "dropout")


def _add(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """Add/Sub (also `rsub`): both operands carry the stream; a number is a constant operand."""
    idx = []
    for arg in ("input", "other"):
        x = call.args.get(arg)
        if isinstance(x, fx.Node):
            if meta_val(x) is not None and not isinstance(meta_val(x), torch.Tensor):
                return None  # a symbolic number: not a tensor the plan could edit
            i = g.index(node, x)
        elif isinstance(x, numbers.Number) and not isinstance(x, bool):
            i = g.scalar_input(node, arg)
        else:
            return None
        if i is None:
            return None
        idx.append(i)
    alpha = call.get("alpha", 1)
    if not isinstance(alpha, numbers.Number):
        return None
    minus = {"add": [], "sub": [idx[1]], "rsub": [idx[0]]}[call.kind]
    if alpha != 1 or idx[0] == idx[1]:
        minus = []  # x - 2*y: both carry the stream, but it is no `x - mean` for patterns
    return rule("broadcast", data=sorted(set(idx)), minus=minus)


def _operand(g: GraphInfo, node: fx.Node, x: Any) -> Any:
    """The view input index of a tensor operand, None for a Python number, False otherwise."""
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return None
    if not isinstance(x, fx.Node) or not isinstance(meta_val(x), torch.Tensor):
        return False
    i = g.index(node, x)
    return False if i is None else i


def _mul(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    if call.kind == "div" and call.get("rounding_mode") is not None:
        return None
    ops = [_operand(g, node, call.args.get("input")), _operand(g, node, call.args.get("other"))]
    if any(o is False for o in ops) or ops == [None, None]:
        return None
    return rule("scale", operands=ops, divide=call.kind == "div")


def _pow(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    i, e = g.index(node, call.node("input")), call.get("exponent")
    return None if i is None else rule("pow", data=i, exponent=float(e) if isinstance(e, numbers.Number) else None)


def _unary(kind: str, **extra):
    def build(g: GraphInfo, node: fx.Node, call: Call) -> Built:
        i = g.index(node, call.node("input"))
        return None if i is None else rule(kind, data=i, **extra)
    return build


def _expand(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    i = g.index(node, call.node("input"))
    return None if i is None else rule("broadcast", data=[i], **_sizes(node, call))


def _reshape(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    i = g.index(node, call.node("input"))
    return None if i is None else rule("reshape", data=i, **_sizes(node, call))


# Spellings whose output sizes come from an argument (a list, or another tensor's shape).
_SPELLED = ("view", "reshape", "_unsafe_view", "expand", "broadcast_to", "unflatten", "view_as", "reshape_as",
            "expand_as")


def _sizes(node: fx.Node, call: Call) -> dict:
    """Where view/reshape/expand spell the output's sizes (CRMSNorm edits them): the list argument
    ("size"/"shape", or a method's positional arguments: `x.view(-1, 64)`), its entries as ints
    (None: a symbolic size); `fixed` when the sizes come from another tensor (view_as)."""
    slot = next((k for k in ("size", "shape") if isinstance(call.args.get(k), (list, tuple))), None)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if slot is None and node.op == "call_method" and target in ("view", "reshape", "expand"):
        slot = ("varargs", 1)
    if slot is None:
        return dict(fixed=target.split(".")[0] in _SPELLED)
    sizes = varargs_sizes(node) if isinstance(slot, tuple) else call.args[slot]
    return dict(sizes=[d if isinstance(d, int) and not isinstance(d, bool) else None for d in sizes], slot=slot)


def varargs_sizes(node: fx.Node) -> list:
    rest = list(node.args[1:])
    return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest


def _permute(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    i = g.index(node, call.node("input"))
    perm = _perm_of(g, call)
    return None if i is None or perm is None else rule("permute", data=i, perm=perm)


def _changed_axes(src: Shape, dst: Shape) -> Optional[set]:
    """Axes whose size a same-rank op changes (a full-range slice changes nothing)."""
    if src is None or dst is None or len(src) != len(dst):
        return None
    return {k for k, (a, b) in enumerate(zip(src, dst)) if a != b or not isinstance(a, int)}


def _slice(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i = g.index(node, x)
    if i is None:
        return None
    axes = _changed_axes(g.shape(x), g.shape(node))
    start, step = call.get("start", 0), call.get("step", 1)
    dim = _norm_axis(call.get("dim", 0), g.rank(x))
    if dim is not None:  # aten.slice cuts `dim` only (the others may just be symbolic)
        axes = {dim} if axes is None else axes & {dim}
    start = 0 if start is None else start
    sliced = axes == {dim} and step == 1 and isinstance(start, int)
    return rule("along", data=[i], axes=axes, **({"starts": [start]} if sliced else {}))


def _pad(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i = g.index(node, x)
    zero = call.get("mode", "constant") != "constant" or call.get("value", 0) in (0, 0.0, None)
    return None if i is None else rule("pad", data=i, axes=_changed_axes(g.shape(x), g.shape(node)), zero=zero)


def _reorder(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """roll/flip: rows move along the axes named; every axis stays where it is."""
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    dims = call.get("dims")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    axes = {_norm_axis(d, rank) for d in dims}
    if i is None or not dims or None in axes:  # roll without dims: the flattened tensor moves
        return None
    return rule("along", data=[i], axes=axes)


def _select(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """select (one index of `dim`) and unbind (each index, one output each): a take of that axis."""
    x = call.node("input")
    i, dim = g.index(node, x), _norm_axis(call.get("dim", 0), g.rank(x))
    if call.kind == "unbind":
        n = len(meta_val(node) or ())
        picked = dict(outs=list(range(n)), index=list(range(n)))
    else:
        k = call.get("index")
        picked = dict(index=[k] if isinstance(k, int) and not isinstance(k, bool) else None)  # a SymInt: not known
    return None if i is None or dim is None else rule("take", data=i, start=dim, stop=dim + 1, q=0, **picked)


def _index_select(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i, dim = g.index(node, x), _norm_axis(call.get("dim"), g.rank(x))
    return None if i is None else rule("along", data=[i], axes=None if dim is None else {dim})


def _gather(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x, idx = call.node("input"), call.node("index")
    i, j, dim = g.index(node, x), g.index(node, idx), _norm_axis(call.get("dim"), g.rank(x))
    return None if None in (i, j, dim) else rule("gather_rows", data=i, index=j, axis=dim)


def _masked_fill(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """masked_fill with zeros (another value, or a tensor value: opaque)."""
    i, j, value = g.index(node, call.node("input")), g.index(node, call.node("mask")), call.get("value")
    zero = isinstance(value, numbers.Number) and not isinstance(value, bool) and value == 0
    return rule("zero_rows", data=i, mask=j) if zero and None not in (i, j) else None


def _repeat(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """x.repeat(*repeats): tiled along the axes whose count is not 1 (a symbolic count: tiled)."""
    i, reps, rank = g.index(node, call.node("input")), call.get("repeats"), g.rank(node)
    if i is None or rank is None or not isinstance(reps, (list, tuple)) or len(reps) != rank:
        return None
    return rule("tile", data=i, axes=[k for k, r in enumerate(reps) if not (isinstance(r, int) and r == 1)])


def _upsample(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """upsample_* / F.interpolate: (N, C, spatial...) resampled along the spatial axes."""
    i, rank = g.index(node, call.node("input")), g.rank(node)
    return None if i is None or rank is None or rank < 3 else rule("resample", data=i, axes=list(range(2, rank)))


def _index(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """aten.index: tensors index a contiguous block of axes; the others keep their order."""
    x = call.node("input")
    i, r, R = g.index(node, x), g.rank(x), g.rank(node)
    used = [k for k, t in enumerate(call.get("indices") or []) if t is not None]
    return None if i is None else _take_block(i, used, r, R)


def _take_block(i: int, used: list[int], r: Optional[int], R: Optional[int]) -> Built:
    """Index tensors on the axes `used` of a rank-`r` input (rank-`R` output): a take when they are
    one contiguous block, else opaque."""
    if r is None or R is None or not used or used != list(range(used[0], used[-1] + 1)):
        return None
    s, e = used[0], used[-1] + 1
    return rule("take", data=i, start=s, stop=e, q=R - (r - (e - s)))


def _getitem(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """Basic tensor indexing `x[:, 0]`, `x[..., None]` (Dynamo graphs); tensor indices: opaque."""
    x = call.node("input")
    i, src, dst = g.index(node, x), g.shape(x), g.shape(node)
    if i is None or src is None or dst is None:
        return None
    idx = call.get("index")
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(k, fx.Node) for k in idx):
        return _tensor_getitem(g, i, x, node, idx)
    if any(not (k is None or k is Ellipsis or isinstance(k, (int, slice))) for k in idx):
        return None
    fill = len(src) - sum(1 for k in idx if k is not None and k is not Ellipsis)
    if Ellipsis not in idx:  # the axes not indexed are full slices after the last index
        idx += (Ellipsis,)
    expanded = [s for k in idx for s in ([slice(None)] * fill if k is Ellipsis else [k])]
    perm: list = [None] * len(dst)  # output axis -> the input axis it holds whole
    a = b = 0
    for k in expanded:
        if k is None:
            b += 1
        elif isinstance(k, int):
            a += 1
        else:
            if b < len(dst) and a < len(src) and src[a] == dst[b] and isinstance(src[a], int):
                perm[b] = a
            a, b = a + 1, b + 1
    # A permute whose missing axes are dropped or new: the same transfer on the axes it keeps.
    return rule("permute", data=i, perm=perm)


def _tensor_getitem(g: GraphInfo, i: int, x: fx.Node, node: fx.Node, idx: tuple) -> Built:
    """`table[position_ids]`, `x[:, idx]` (Dynamo graphs): integer tensors indexing a contiguous
    block of axes, full slices elsewhere, as aten.index (`_index`); anything else is opaque."""
    used = [k for k, t in enumerate(idx) if isinstance(t, fx.Node)]
    ints = all(isinstance(v := meta_val(idx[k]), torch.Tensor) and not v.dtype.is_floating_point
               and v.dtype != torch.bool for k in used)
    full = all(isinstance(t, fx.Node) or t == slice(None) for t in idx)
    return _take_block(i, used, g.rank(x), g.rank(node)) if ints and full else None


def _cat(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    data = [g.index(node, t) for t in call.get("tensors") or []]
    if not data or any(d is None for d in data):
        return None
    dim = _norm_axis(call.get("dim", 0), g.rank(node))
    return rule("along", data=sorted(set(data)), axes=None if dim is None else {dim})


def _split(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i = g.index(node, x)
    n = len(meta_val(node) or ())
    dim = _norm_axis(call.get("dim", 0), g.rank(x))
    return None if i is None else rule("along", data=[i], outs=list(range(n)), axes=None if dim is None else {dim},
                                       partition=True)


def _reduce(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    dims = call.get("dim")
    if i is None or rank is None:
        return None
    if dims in (None, [], ()):
        axes = set(range(rank))  # over every axis, the feature axis included
    else:
        axes = {_norm_axis(d, rank) for d in ([dims] if isinstance(dims, int) else dims)}
    if None in axes:
        return None
    return rule("reduce", data=i, axes=sorted(axes), keepdims=bool(call.get("keepdim", False)), op=call.kind)


def _softmax(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i, dim = g.index(node, x), _norm_axis(call.get("dim"), g.rank(x))
    return None if i is None or dim is None else rule("invariant_along", data=i, axis=dim)


def _metadata(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    # a dtype/device assert ignores the width; a size assert does not
    return rule("metadata", sized=call.get("size") is not None or call.get("stride") is not None)


def _source(g: GraphInfo, node: fx.Node, call: Call, **roles) -> Optional[dict]:
    """View input indices of the tensor arguments named in `roles` (None stays None)."""
    out = {}
    for role, arg in roles.items():
        x = call.args.get(arg)
        out[role] = None if x is None else g.index(node, x)
        if x is not None and out[role] is None:
            return None
    return out


def _linear(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    r = _source(g, node, call, data="input", weight="weight", bias="bias")
    return None if r is None or r["weight"] is None else rule("linear", w_axis=0, out_axis=-1, **r)


def _addmm(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """addmm(bias, x, W) with W stored [in, out] (GPT-2's Conv1D)."""
    r = _source(g, node, call, data="mat1", weight="mat2", bias="input")
    if r is None or None in r.values():
        return None
    return rule("linear", w_axis=1, out_axis=1, alpha=call.get("alpha", 1), beta=call.get("beta", 1), **r)


def _matmul(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    r = _source(g, node, call, a="input", b="other" if "other" in call.args else "mat2")
    return None if r is None or None in r.values() else rule("matmul", **r)


def _einsum(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    ops = [g.index(node, t) for t in call.get("tensors") or ()]
    if not isinstance(call.get("equation"), str) or len(ops) != 2 or None in ops:
        return None
    return rule("einsum", equation=call.get("equation"), operands=ops)


def _written_in_place(x: fx.Node) -> bool:
    """A mutating op writes into `x`'s tensor, or into a detached alias of it (torch.export spells
    nn.Embedding(max_norm=...) as `embedding_renorm_(detach(weight), ...)` before the lookup)."""
    for u in x.users:
        schema = getattr(u.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if u.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) and _written_in_place(u):
            return True
    return False


def _embedding(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    # max_norm renormalizes the looked-up rows: centering them first would change that.
    table, idx = call.node("weight"), call.args.get("indices")
    i, q = g.index(node, table), g.rank(idx)
    if call.get("max_norm") is not None or i is None or q is None or g.rank(table) != 2 or _written_in_place(table):
        return None
    return rule("embedding", table=i, q=q)


def _conv(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    transposed = call.kind == "conv_transpose" or bool(call.get("transposed", False))
    r = _source(g, node, call, weight="weight", bias="bias")
    groups = call.get("groups", 1)
    if r is None or r["weight"] is None:
        return None
    return rule("conv", w_axis=1 if transposed else 0, groups=groups if isinstance(groups, int) else 0, **r)


def _layer_norm(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    x = call.node("input")
    i, rank = g.index(node, x), g.rank(x)
    shape = call.get("normalized_shape")
    n = len(shape) if isinstance(shape, (list, tuple)) else 1
    eps = call.get("eps", 1e-5)
    return rule("layer_norm", data=0 if i is None else i, axes=list(range(-n, 0)) if rank is not None else [-1],
                gamma=g.index(node, call.get("weight")), beta=g.index(node, call.get("bias")),
                eps=eps if isinstance(eps, numbers.Number) else None,
                # native_layer_norm also returns mean and rstd; a fold changes both
                stats_used=any(is_tuple_getitem(u) and u.args[1] != 0 and u.users for u in node.users))


def _rms_norm(g: GraphInfo, node: fx.Node, call: Call) -> Built:
    """aten.rms_norm (torch.nn.RMSNorm): an RMSNorm as given over its last axis, where asked (g.rms);
    its eps None is torch's default, the input dtype's machine epsilon."""
    x = call.node("input")
    i, shape, v = g.index(node, x), call.get("normalized_shape"), meta_val(x)
    if not g.rms or i is None or not isinstance(shape, (list, tuple)) or len(shape) != 1 or not isinstance(v, torch.Tensor):
        return None
    eps = call.get("eps")
    eps = torch.finfo(v.dtype).eps if eps is None else eps
    return rule("layer_norm", data=i, axes=[-1], gamma=g.index(node, call.get("weight")),
                eps=eps if isinstance(eps, numbers.Number) else None, rms=True)


Builder = Callable[[GraphInfo, fx.Node, Call], Built]

# op kind (see ops.py for the spellings of each) -> builder. Adding an op is one entry here.
KINDS: dict[str, Builder] = {
    "identity": _identity,
    "dropout": _dropout,
    "neg": _unary("elementwise", op="neg"),
    **dict.fromkeys(("add", "sub", "rsub"), _add),
    **dict.fromkeys(("mul", "div"), _mul),
    "pow": _pow,
    "sqrt": _unary("sqrt"),
    "rsqrt": _unary("rsqrt"),
    "reciprocal": _unary("reciprocal"),
    "reshape": _reshape,
    "expand": _expand,
    **dict.fromkeys(("transpose", "permute", "t", "numpy_T"), _permute),
    "slice": _slice,
    "pad": _pad,
    "reorder": _reorder,
    **dict.fromkeys(("select", "unbind"), _select),
    "index": _index,
    "index_select": _index_select,
    "gather": _gather,
    "masked_fill": _masked_fill,
    "upsample": _upsample,
    "repeat": _repeat,
    "getitem": _getitem,
    "cat": _cat,
    "split": _split,
    **dict.fromkeys(("mean", "sum"), _reduce),
    "softmax": _softmax,
    "metadata": _metadata,
    "linear": _linear,
    "addmm": _addmm,
    "matmul": _matmul,
    "einsum": _einsum,
    "embedding": _embedding,
    **dict.fromkeys(("conv", "conv_transpose"), _conv),
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
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


def build_view(graph: fx.Graph, consts: set[str], rms: bool = False) -> tuple[View, GraphInfo]:
    """The stream view of `graph`; `consts` names the nodes that hold constant tensors. `rms`: the
    RMSNorms as given too (aten.rms_norm, and written out: passes/patterns.match_rms), as norms with
    `NormSpec.rms`."""
    g = GraphInfo(graph, rms)
    view = View()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or is_tuple_getitem(node):
            continue
        g.inputs[node.name] = [n.name for n in node.all_input_nodes]
        call = canonical(node)
        r = KINDS[call.kind](g, node, call) if call is not None and call.kind in KINDS else None
        outs, dupes = _outputs(node)
        view.add_node(Node(node.name, op_name(node), g.inputs[node.name], outs, rule=r))
        for d in dupes:  # a second getitem of the same element: an identity of the first
            src = outs[d.args[1]]
            g.inputs[d.name] = [src]
            view.add_node(Node(d.name, "getitem", [src], [d.name], rule=rule("elementwise", op="identity")))

    for name, v in view.values.items():
        fxn = g.nodes.get(name)
        if name in g.scalars:
            node, arg = g.scalars[name]
            v.shape, v.rank, v.is_const = (), 0, True
            v.scalar = float(canonical(node).args[arg])
            continue
        v.shape = shape_of(fxn) if fxn is not None else None
        v.rank = None if v.shape is None else len(v.shape)
        v.is_const = name in consts
        v.is_graph_input = fxn is not None and fxn.op == "placeholder" and not v.is_const
    outputs: list[fx.Node] = []
    fx.node.map_arg([n.args for n in graph.nodes if n.op == "output"], outputs.append)
    for leaf in outputs:
        if leaf.name in view.values:
            view.values[leaf.name].is_graph_output = True
    found = collapse_norms(view, rms=rms)
    g.decomposed = {k: m for k, m in found.items() if not m.rms}
    g.decomposed_rms = {k: m for k, m in found.items() if m.rms}
    return view, g
