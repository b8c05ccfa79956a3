"""What an op means for the stream, written once for every IR.

A frontend names each of its ops in this vocabulary (one table row per op: ATen
`aten.permute.default` -> `Rule("permute", perm=...)`, ONNX `Transpose` -> the same) with the
attributes decoded and the input positions given as indices into the view node's inputs. It
decides nothing: `attach(view)` derives every node's transfer / backward / centering /
channel_scale / invariant answers (passes/view.py) from its rule and the shapes in the view.

Vocabulary (params; `data` and friends are view input indices, axes are non-negative):

- `elementwise(data, op)`      same shape, value-wise (identity, float cast, neg, eval dropout)
- `broadcast(data, minus)`     numpy-broadcast sum of the `data` inputs (add, sub, expand);
                               `minus` lists the subtracted ones
- `scale(operands, divide)`    operands[0] * or / operands[1] (None: a Python number)
- `pow(data, exponent)`, `sqrt(data)`, `rsqrt(data)`, `reciprocal(data)`: opaque, named for
                               passes/patterns.py
- `reshape(data)`              view/reshape/flatten/squeeze/unsqueeze (read from the shapes)
- `permute(data, perm)`        output axis k is input axis perm[k]
- `along(data, outs, axes)`    every axis in place; acts only along `axes` (slice, concat,
                               split, roll, flip, index_select); axes None: unknown
- `pad(data, axes, zero)`      pad along `axes` with zeros or copied rows (`zero` False: another
                               constant)
- `take(data, start, stop, q, outs)` input axes [start, stop) become q index axes (gather,
                               index, select/unbind with q = 0)
- `gather_rows(data, index, axis)` out[.., t, .., f] = x[.., index[.., t, .., f], .., f]
                               (GatherElements, torch.gather)
- `reduce(data, axes, keepdims, op)` mean/sum over `axes` (None: not known)
- `invariant_along(data, axis)` softmax / argmax over `axis`
- `metadata()`                 reads shapes or dtypes only
- `linear(weight, w_axis, bias, out_axis)` output axis `out_axis` (negative: from the end)
                               holds the rows of `weight`'s axis `w_axis` (+ bias)
- `matmul(a, b)`               a @ b, either side possibly a constant
- `embedding(table, q)`        rows of a constant table looked up by a rank-q index
- `conv(weight, w_axis, bias, groups)` output channels are `weight`'s axis `w_axis`
- `layer_norm(data, axes, gamma, beta, eps, stats_used)` a LayerNorm op
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .axes import broadcast_rules, permute_rules, reshape_axis, same_axes_rules
from .view import ChannelScale, ConstRef, Node, NormSpec, View


@dataclass
class Rule:
    kind: str
    params: dict = field(default_factory=dict)


def rule(kind: str, **params) -> Rule:
    if kind not in RULES:
        raise KeyError(f"unknown rule kind {kind!r}")
    return Rule(kind, params)


def attach(view: View) -> None:
    """Fill in every node's answers from its rule (after the view's shapes are set)."""
    for node in view.nodes.values():
        if node.rule is not None:
            for k, v in RULES[node.rule.kind](view, node, **node.rule.params).items():
                setattr(node, k, v)


# --- what the view knows about a node's inputs -------------------------------------------------

def _shape(view: View, node: Node, i: Optional[int]):
    if i is None:
        return ()  # a Python number
    name = node.inputs[i] if i < len(node.inputs) else ""
    return view.values[name].shape if name else None


def _rank(view: View, node: Node, i: Optional[int]) -> Optional[int]:
    s = _shape(view, node, i)
    return None if s is None else len(s)


def _out_rank(view: View, node: Node, o: int = 0) -> Optional[int]:
    s = view.values[node.outputs[o]].shape if node.outputs[o] else None
    return None if s is None else len(s)


def _is_const(view: View, node: Node, i: Optional[int]) -> bool:
    return i is not None and i < len(node.inputs) and bool(node.inputs[i]) and view.values[node.inputs[i]].is_const


def const_ref(view: View, node: Node, i: int, axis: Optional[int]) -> Optional[ConstRef]:
    """The constant behind input `i` of `node`, through layout ops that only it reads
    (Falcon's `x @ self.weight.T`, an exported `addmm` reading `t(weight)`, a float cast)."""
    name = node.inputs[i]
    v = view.values[name]
    if v.is_const:
        return ConstRef(name, axis, node.name, i)
    p = view.nodes.get(v.producer) if v.producer else None
    if p is None or p.rule is None or v.is_graph_output or len(v.consumers) != 1 or len(p.outputs) != 1:
        return None
    kind, prm = p.rule.kind, p.rule.params
    if kind == "elementwise":  # centering commutes with a cast, a copy, a negation
        return const_ref(view, p, prm.get("data", 0), axis)
    if kind == "permute" and axis is not None and axis < len(prm["perm"]) and prm["perm"][axis] is not None:
        return const_ref(view, p, prm.get("data", 0), prm["perm"][axis])
    return None


# --- transparent ops ---------------------------------------------------------------------------

def _elementwise(view, node, data=0, op="identity"):
    return dict(transfer=lambda i, b: [(0, b)] if i == data else None,
                backward=lambda o, a: [(data, a)] if o == 0 else None)


def _broadcast(view, node, data, minus=()):
    n = len(node.inputs)
    return broadcast_rules([_rank(view, node, i) for i in range(n)], _out_rank(view, node),
                           [_is_const(view, node, i) for i in range(n)], list(data))


def _scale(view, node, operands, divide=False):
    """Mul/Div by a factor constant along the feature axis is transparent; a per-channel
    constant factor is LayerScale, folded into the sources upstream."""
    R = _out_rank(view, node)
    shapes = [_shape(view, node, i) for i in operands]
    carriers = (0,) if divide else (0, 1)

    def aligned_dim(j, a):
        s = shapes[j]
        if s is None or R is None:
            return "unknown"
        k = a - (R - len(s))
        return 1 if k < 0 else s[k]

    def transfer(i, b):
        if R is None:
            return None
        for j in carriers:
            if operands[j] == i and operands[1 - j] != i and shapes[j] is not None:
                a = b + R - len(shapes[j])
                return [(0, a)] if aligned_dim(1 - j, a) == 1 else None
        return None

    def backward(o, a):
        cands = [j for j in carriers if operands[j] is not None and shapes[j] is not None
                 and operands[1 - j] != operands[j] and aligned_dim(1 - j, a) == 1]
        if len(cands) != 1:
            return None
        j = cands[0]
        b = a - (R - len(shapes[j]))
        return [(operands[j], b)] if b >= 0 else None

    def channel_scale(o, a):
        if divide or R is None:
            return None
        for j in (0, 1):
            x, s = operands[1 - j], operands[j]
            if x is None or not _is_const(view, node, s) or _is_const(view, node, x):
                continue
            shape, xs = shapes[j], shapes[1 - j]
            if shape is None or xs is None:
                continue
            k = a - (R - len(shape))
            if k < 0 or any(d != 1 for n, d in enumerate(shape) if n != k):
                continue
            b = a - (R - len(xs))
            if b < 0:
                continue
            return ChannelScale(x, b, ConstRef(node.inputs[s], k, node.name, s))
        return None

    return dict(transfer=transfer, backward=backward, channel_scale=channel_scale)


def _opaque(view, node, **_):
    return {}


def _reshape(view, node, data=0):
    def transfer(i, b):
        axis = reshape_axis(_shape(view, node, data), view.values[node.outputs[0]].shape, b) if i == data else None
        return None if axis is None else [(0, axis)]

    def backward(o, a):
        axis = reshape_axis(view.values[node.outputs[0]].shape, _shape(view, node, data), a) if o == 0 else None
        return None if axis is None else [(data, axis)]

    return dict(transfer=transfer, backward=backward)


def _permute(view, node, perm, data=0):
    return permute_rules(list(perm), data)


def _along(view, node, data, outs=(0,), axes=None):
    return same_axes_rules(list(data), list(outs), None if axes is None else set(axes))


def _pad(view, node, data=0, axes=None, zero=True):
    # Zero rows are zero-mean and copied rows carry their source rows' shift; rows of any other
    # constant are neither.
    return _along(view, node, [data], [0], axes) if zero else {}


def _take(view, node, data, start, stop, q, outs=(0,)):
    def transfer(i, b):
        if i != data or start <= b < stop:
            return None
        return [(o, b if b < start else b - (stop - start) + q) for o in outs]

    def backward(o, a):
        if o not in outs or start <= a < start + q:
            return None
        return [(data, a if a < start else a + (stop - start) - q)]

    return dict(transfer=transfer, backward=backward)


def uniform_along(view: View, value: str, axis: int) -> bool:
    """Is `value` constant along `axis` (an index `idx.unsqueeze(-1).expand(..., d)`)?"""
    v = view.values.get(value)
    if v is None or v.shape is None or not 0 <= axis < len(v.shape):
        return False
    if v.shape[axis] == 1:
        return True
    p = view.nodes.get(v.producer) if v.producer else None
    if p is None or p.rule is None:
        return False
    kind, prm = p.rule.kind, p.rule.params
    if kind == "broadcast" and not prm.get("minus") and len(prm["data"]) == 1:  # expand
        d = prm["data"][0]
        s = _shape(view, p, d)
        k = None if s is None else axis - (len(v.shape) - len(s))
        return s is not None and (k < 0 or s[k] == 1 or uniform_along(view, p.inputs[d], k))
    if kind == "elementwise":
        return uniform_along(view, p.inputs[prm.get("data", 0)], axis)
    return False


def _gather_rows(view, node, data=0, index=1, axis=0):
    """Whole rows move when the index is the same for every feature (random token masking:
    `gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, d))`)."""

    def keeps_rows(f):
        xs, ix = _shape(view, node, data), _shape(view, node, index)
        return (f != axis and xs is not None and ix is not None and len(xs) == len(ix) and f < len(xs)
                and isinstance(xs[f], int) and xs[f] == ix[f] and uniform_along(view, node.inputs[index], f))

    return dict(transfer=lambda i, b: [(0, b)] if i == data and keeps_rows(b) else None,
                backward=lambda o, a: [(data, a)] if o == 0 and keeps_rows(a) else None)


def _reduce(view, node, data=0, axes=None, keepdims=True, op="mean"):
    """Pooling over token axes: the shift survives, the feature axis moves up."""
    rank = _rank(view, node, data)
    if rank is None or axes is None:
        return {}
    axes = set(axes)

    def transfer(i, b):
        if i != data or b in axes:
            return None
        return [(0, b if keepdims else b - sum(x < b for x in axes))]

    def backward(o, a):
        kept = [d for d in range(rank) if keepdims or d not in axes]
        if o != 0 or a >= len(kept) or kept[a] in axes:
            return None
        return [(data, kept[a])]

    return dict(transfer=transfer, backward=backward)


def _invariant_along(view, node, data=0, axis=None):
    return dict(invariant=lambda i, b: i == data and b == axis)


def _metadata(view, node):
    return dict(invariant=lambda i, b: True, shape_only=True)


# --- sources ----------------------------------------------------------------------------------

def _refs(view, node, wanted) -> Optional[list[ConstRef]]:
    refs = [const_ref(view, node, i, axis) for i, axis in wanted]
    return None if any(r is None for r in refs) else refs


def _bias_axis(view, node, bias):
    rb = _rank(view, node, bias)
    return None if not rb else rb - 1  # a scalar bias is a per-row shift: centered to zero


def _linear(view, node, weight, w_axis, bias=None, out_axis=-1):
    def centering(o, a):
        R = _out_rank(view, node)
        if R is None or a != (out_axis if out_axis >= 0 else R + out_axis):
            return None
        if bias is not None and _rank(view, node, bias) is None:
            return None
        return _refs(view, node, [(weight, w_axis)] + ([(bias, _bias_axis(view, node, bias))] if bias is not None else []))

    return dict(centering=centering)


def _matmul(view, node, a=0, b=1):
    def centering(o, ax):
        R = _out_rank(view, node)
        if R is None or R < 2:
            return None
        r0, r1 = _rank(view, node, a), _rank(view, node, b)
        if ax == R - 1 and r1 is not None and r1 >= 2:
            ref = const_ref(view, node, b, r1 - 1)
            if ref is not None:
                return [ref]
        if ax == R - 2 and r0 is not None and r0 >= 2:  # W @ x: rows of W are output features
            ref = const_ref(view, node, a, r0 - 2)
            if ref is not None:
                return [ref]
        return None

    return dict(centering=centering)


def _embedding(view, node, table, q):
    def centering(o, a):  # center each row of the table
        return _refs(view, node, [(table, a - q + 1)]) if a >= q else None

    return dict(centering=centering)


def _conv(view, node, weight, w_axis=0, bias=None, groups=1):
    def centering(o, a):
        if a != 1 or groups != 1:
            return None
        return _refs(view, node, [(weight, w_axis)] + ([(bias, 0)] if bias is not None else []))

    return dict(centering=centering)


# --- norms ------------------------------------------------------------------------------------

def norm_axis(axes, rank: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    """The one normalized axis, or why there is not one."""
    if rank is None:
        return None, "rank of its input is unknown"
    norm = sorted({a + rank if a < 0 else a for a in axes})
    if len(norm) != 1:
        return None, f"normalizes over axes {norm} of a rank-{rank} tensor, not one feature axis"
    return norm[0], None


def _layer_norm(view, node, data=0, axes=(-1,), gamma=None, beta=None, eps=1e-5, stats_used=False):
    axis, why = norm_axis(axes, _rank(view, node, data))
    if why is None and stats_used:
        why = "its mean/variance outputs are used"
    if why is None and not isinstance(eps, (int, float)):
        why = "its eps is not a constant"
    if why is not None:
        return dict(norm_rejection=why)
    name = lambda i: node.inputs[i] if i is not None and node.inputs[i] else None  # noqa: E731
    return dict(norm=NormSpec(data, axis, name(gamma), name(beta), float(eps)))


RULES: dict[str, Callable[..., dict]] = {
    "elementwise": _elementwise,
    "broadcast": _broadcast,
    "scale": _scale,
    "pow": _opaque,
    "sqrt": _opaque,
    "rsqrt": _opaque,
    "reciprocal": _opaque,
    "reshape": _reshape,
    "permute": _permute,
    "along": _along,
    "pad": _pad,
    "take": _take,
    "gather_rows": _gather_rows,
    "reduce": _reduce,
    "invariant_along": _invariant_along,
    "metadata": _metadata,
    "linear": _linear,
    "matmul": _matmul,
    "embedding": _embedding,
    "conv": _conv,
    "layer_norm": _layer_norm,
}
