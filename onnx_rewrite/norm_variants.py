"""Decomposed LayerNorms as tf2onnx and jax2onnx write them (three rules of norm_patterns.PATTERNS;
passes/patterns.py has torch's form, and the RMSNorms written out).

tf2onnx, Keras `LayerNormalization` (keras 3: `moments`, `rsqrt`, then `x·inv + (β − μ·inv)`):

    μ = GlobalAveragePool(x)            (or ReduceMean; GAP averages axes 2.. = the last of [B,S,D])
    d = Sub(x, μ);  v = GAP(Mul(d, d));  inv = Reciprocal(Sqrt(Add(v, eps)))  [· γ]
    y = Add(Mul(x, inv), Add(Mul(Neg(μ), inv), β))

jax2onnx, flax `LayerNorm` (flax's fast variance, E[x²] − E[x]², clipped at 0):

    μ = ReduceMean(x);  v = Max(Sub(ReduceMean(Mul(x, x)), Mul(μ, μ)), 0)
    y = Div(Sub(x, μ), Sqrt(Add(v, eps)))  [· γ] [+ β]

jax2tf + tf2onnx, flax.linen `LayerNorm` (the same fast variance, spelled with sums and TF's
broadcasts: ReduceSum drops the axis, Reshape + Expand put it back):

    μ = Mul(ReduceSum(x), 1/n);  v = Max(0, Sub(Mul(ReduceSum(Mul(x, x)), 1/n), Mul(μ, μ)))
    inv = Reciprocal(Sqrt(Add(Expand(Reshape(v)), eps)))  [· γ]
    y = Mul(Sub(x, Expand(Reshape(μ))), inv)  [+ β]

All compute (x − μ)/sqrt(var + eps)·γ + β: an RMSNorm of x (same eps, γ, β) once x is zero-mean
(the fast variance is then E[x²], its Max a no-op; the sums' 1/n must be 1/width). A match covers
every node of its pattern, and no tensor inside it may be read from outside (the swap removes them).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs

from ..passes.axes import Shape
from ..passes.match import MatchResult, NoMatch
from ..passes.rules import norm_axis as _norm_axis
from .norms import NormMatch, const_values, rank_of, reduce_axes

MEANS = ("ReduceMean", "GlobalAveragePool")  # the ops both patterns start at: the mean of x


def _scalar(t) -> Optional[float]:
    v = const_values(t) if t is not None else None
    return float(np.asarray(v).reshape(-1)[0]) if v is not None and np.size(v) == 1 else None


def _readers(t: gs.Tensor) -> list:
    """Distinct readers (graphsurgeon lists Mul(d, d) twice among d's outputs)."""
    return list({id(n): n for n in t.outputs}.values())


def _square_of(t: gs.Tensor) -> Optional[gs.Node]:
    """The Mul(t, t) among t's readers."""
    return next((n for n in _readers(t) if n.op == "Mul" and list(n.inputs) == [t, t]), None)


def _one(t: gs.Tensor, op: str) -> Optional[gs.Node]:
    r = _readers(t)
    return r[0] if len(r) == 1 and r[0].op == op else None


def _other(node: gs.Node, t: gs.Tensor) -> Optional[gs.Tensor]:
    ins = list(node.inputs)
    if len(ins) != 2 or t not in ins:
        return None
    return ins[1] if ins[0] is t else ins[0]


def _mean_axes(node: gs.Node, rank: Optional[int]) -> Optional[tuple]:
    """Axes a keepdims mean reduces: ReduceMean's, or GlobalAveragePool's (2 .. rank-1)."""
    if node.op == "GlobalAveragePool":
        return None if rank is None or rank < 3 else tuple(range(2, rank))
    if node.op != "ReduceMean" or int(node.attrs.get("keepdims", 1)) != 1:
        return None
    axes = reduce_axes(node)
    if not axes or rank is None:
        return None
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


def _same_mean(node: Optional[gs.Node], axes: tuple, rank: Optional[int]) -> bool:
    return node is not None and _mean_axes(node, rank) == axes


def _desc(node: gs.Node) -> str:
    return f"{node.op} `{node.name}`"


def _what_reads(t: gs.Tensor) -> str:
    r = _readers(t)
    return ", ".join(_desc(n) for n in r[:3]) + (f" and {len(r) - 3} more" if len(r) > 3 else "") if r else "nothing"


def _sqrt(v: gs.Tensor, nodes: list) -> MatchResult[tuple[gs.Tensor, float]]:
    """[Add eps] -> Sqrt: returns (sqrt output, eps)."""
    eps, t = 0.0, v
    add = _one(t, "Add")
    if add is not None:
        other = _other(add, t)
        e = _scalar(other)
        if e is None:
            what = f"`{other.name}`" if other is not None else "something"
            return NoMatch(f"{_desc(add)} adds {what} to the variance: not a constant scalar eps", 3)
        eps, t = e, add.outputs[0]
        nodes.append(add)
    sqrt = _one(t, "Sqrt")
    if sqrt is None:
        return NoMatch(f"the variance `{t.name}` is read by {_what_reads(t)}, not by one Sqrt", 3)
    nodes.append(sqrt)
    return sqrt.outputs[0], eps


def _inverse_std(v: gs.Tensor, nodes: list) -> MatchResult[tuple[gs.Tensor, float]]:
    """[Add eps] -> Sqrt -> Reciprocal (TF's rsqrt): returns (1/std, eps)."""
    got = _sqrt(v, nodes)
    if not got:
        return got
    s, eps = got
    rec = _one(s, "Reciprocal")
    if rec is None:
        return NoMatch(f"the standard deviation `{s.name}` is read by {_what_reads(s)}, not by one Reciprocal", 3)
    nodes.append(rec)
    return rec.outputs[0], eps


def _affine_after(t: gs.Tensor, op: str, axis, rank, nodes: list) -> tuple:
    """An optional γ (Mul) or β (Add) that alone reads `t`: (the constant or None, the output)."""
    n = _one(t, op)
    c = _other(n, t) if n is not None else None
    if c is None or not _affine_const(c, axis, rank):
        return None, t
    nodes.append(n)
    return c, n.outputs[0]


def _affine_const(t, axis: Optional[int], rank: int) -> bool:
    """A γ or β: a constant that varies along `axis` only."""
    v = const_values(t) if t is not None else None
    if v is None or np.ndim(v) > rank:
        return False
    shape = (1,) * (rank - np.ndim(v)) + np.shape(v)
    return all(s == 1 for i, s in enumerate(shape) if i != axis)


def _not_affine(t, axis, rank: int, what: str) -> str:
    """Why `t` is not a γ (or β) of this norm."""
    if t is None or const_values(t) is None:
        return f"its {what} `{t.name if t is not None else '?'}` is not a constant"
    shape = tuple(np.shape(const_values(t)))
    shape = (1,) * (rank - len(shape)) + shape
    along = tuple(i for i, d in enumerate(shape) if d != 1 and i != axis)
    feature = f"the feature axis {axis}" if axis is not None else "one feature axis"
    others = f"axis {along[0]}" if len(along) == 1 else f"axes {along}"
    return (f"looks like a LayerNorm, but its {what} `{t.name}` (shape {shape}) varies along {others} "
            f"too, not only along {feature}")


def _mean_head(mean: gs.Node, shapes: dict[str, Shape], reader_ops: set[str]):
    """Both variants start alike: a keepdims mean μ of x read by exactly one node of each of
    `reader_ops`, one of them the Sub x − μ. (x, rank, axes, axis, rejection, μ, readers by op)."""
    x = mean.inputs[0]
    rank = rank_of(x, shapes)
    axes = _mean_axes(mean, rank)
    if axes is None:
        return NoMatch("not a mean over constant axes that keeps its dims (or the rank is unknown)")
    mu = mean.outputs[0]
    by_op = {n.op: n for n in _readers(mu)}
    if len(_readers(mu)) != len(reader_ops) or set(by_op) != reader_ops or list(by_op["Sub"].inputs) != [x, mu]:
        return NoMatch(f"its mean is read by {_what_reads(mu)}, not by {' and '.join(sorted(reader_ops))}")
    axis, rejection = _norm_axis(list(axes), rank)
    return x, rank, axes, axis, rejection, mu, by_op


def match_keras(mean: gs.Node, shapes: dict[str, Shape], outputs: set) -> MatchResult[NormMatch]:
    head = _mean_head(mean, shapes, {"Neg", "Sub"})
    if not head:
        return head
    x, rank, axes, axis, rejection, mu, by_op = head
    neg, sub = by_op["Neg"], by_op["Sub"]
    d = sub.outputs[0]
    sq = _one(d, "Mul")
    if sq is None or list(sq.inputs) != [d, d]:
        if _square_of(x) is not None:
            return NoMatch(f"the variance is not of the centered input: it squares `{x.name}`, not x - mean", 2)
        return NoMatch(f"the centered value `{d.name}` is read by {_what_reads(d)}, not by one Mul(d, d)")
    var = _one(sq.outputs[0], mean.op)
    if not _same_mean(var, axes, rank):
        return NoMatch(f"the square `{sq.outputs[0].name}` is not averaged over the mean's axes {axes} "
                       f"(read by {_what_reads(sq.outputs[0])})", 2)
    nodes = [mean, neg, sub, sq, var]
    got = _inverse_std(var.outputs[0], nodes)
    if not got:
        return got
    inv, eps = got
    gamma = None
    if len(_readers(inv)) == 1:  # γ: inv = rsqrt(...) * γ
        mul_g = _one(inv, "Mul")
        if mul_g is None:
            return NoMatch(f"the inverse std `{inv.name}` is read by {_what_reads(inv)}, not by a Mul by γ", 3)
        if not _affine_const(_other(mul_g, inv), axis, rank):
            return NoMatch(_not_affine(_other(mul_g, inv), axis, rank, "γ"), 4)
        gamma, inv = _other(mul_g, inv), mul_g.outputs[0]
        nodes.append(mul_g)
    readers = _readers(inv)
    if len(readers) != 2 or any(r.op != "Mul" for r in readers):
        return NoMatch(f"the inverse std `{inv.name}` is read by {_what_reads(inv)}: expected two Muls, "
                       "by x and by -mean", 4)
    mx = next((r for r in readers if _other(r, inv) is x), None)
    mn = next((r for r in readers if _other(r, inv) is neg.outputs[0]), None)
    if mx is None or mn is None or mx is mn:
        return NoMatch(f"the inverse std `{inv.name}` does not scale both x and -mean", 4)
    nodes += [mx, mn]
    beta, shift = _affine_after(mn.outputs[0], "Add", axis, rank, nodes)
    final = _one(shift, "Add")
    if final is None or _other(final, shift) is not mx.outputs[0] or len(_readers(mx.outputs[0])) != 1:
        b = _other(final, shift) if final is not None and beta is None else None
        if b is not None and b is not mx.outputs[0]:  # an Add of a β that is no β of this norm
            return NoMatch(_not_affine(b, axis, rank, "β"), 4)
        return NoMatch("x·inv and the shift (β - mean·inv) are not added together", 4)
    nodes.append(final)
    return _finish(NormMatch(mean.name, "decomposed", nodes, x, final.outputs[0], gamma=gamma, beta=beta,
                             epsilon=eps, axis=axis, rejection=rejection, axes=list(axes)), x, outputs)


def match_flax(mean: gs.Node, shapes: dict[str, Shape], outputs: set) -> MatchResult[NormMatch]:
    if mean.op != "ReduceMean":
        return NoMatch("flax's LayerNorm starts at a ReduceMean")
    head = _mean_head(mean, shapes, {"Sub", "Mul"})
    if not head:
        return head
    x, rank, axes, axis, rejection, mu, by_op = head
    sub, mu2 = by_op["Sub"], by_op["Mul"]
    if list(mu2.inputs) != [mu, mu]:
        return NoMatch(f"{_desc(mu2)} does not square the mean")
    xx = _square_of(x)
    if xx is None:
        return NoMatch(f"the mean is squared but `{x.name}` is not (no E[x²] - E[x]² variance)", 1)
    m2 = _one(xx.outputs[0], "ReduceMean")
    if not _same_mean(m2, axes, rank):
        return NoMatch(f"x² is not averaged over the mean's axes {axes} (read by {_what_reads(xx.outputs[0])})", 2)
    var = _one(m2.outputs[0], "Sub")
    if var is None or list(var.inputs) != [m2.outputs[0], mu2.outputs[0]] or len(_readers(mu2.outputs[0])) != 1:
        return NoMatch("the variance is not E[x²] - E[x]²", 2)
    nodes = [mean, sub, xx, m2, mu2, var]
    v = var.outputs[0]
    mx = _one(v, "Max")
    if mx is not None:
        if _scalar(_other(mx, v)) != 0.0:
            return NoMatch(f"{_desc(mx)} clips the variance at something other than 0", 3)
        nodes.append(mx)
        v = mx.outputs[0]
    got = _sqrt(v, nodes)
    if not got:
        return got
    s, eps = got
    div = _one(s, "Div")
    if div is None or list(div.inputs) != [sub.outputs[0], s] or len(_readers(sub.outputs[0])) != 1:
        return NoMatch(f"the standard deviation `{s.name}` does not divide x - mean alone "
                       f"(it is read by {_what_reads(s)})", 3)
    nodes.append(div)
    gamma, out = _affine_after(div.outputs[0], "Mul", axis, rank, nodes)
    beta, out = _affine_after(out, "Add", axis, rank, nodes)
    return _finish(NormMatch(mean.name, "decomposed", nodes, x, out, gamma=gamma, beta=beta, epsilon=eps,
                             axis=axis, rejection=rejection, axes=list(axes)), x, outputs)


def _sum_mean(node: Optional[gs.Node], shapes: dict[str, Shape]):
    """ReduceSum(t) over one axis without keepdims, times 1/width: (t, axis, rank, mean output),
    or why not (a str)."""
    if node is None or node.op != "ReduceSum" or int(node.attrs.get("keepdims", 1)) != 0:
        return "not a sum that drops its axis"
    t = node.inputs[0]
    rank, axes = rank_of(t, shapes), reduce_axes(node)
    if rank is None or not axes or len(axes) != 1:
        return "a sum over axes that are not one known axis"
    axis = axes[0] + rank if axes[0] < 0 else axes[0]
    width = (shapes.get(t.name) or [None] * rank)[axis]
    scale = _one(node.outputs[0], "Mul")
    if scale is None or not isinstance(width, int) or _scalar(_other(scale, node.outputs[0])) is None:
        return f"the sum `{node.outputs[0].name}` is read by {_what_reads(node.outputs[0])}, not by one Mul by 1/width"
    if not np.isclose(_scalar(_other(scale, node.outputs[0])), 1.0 / width, rtol=1e-6, atol=0):
        return f"{_desc(scale)} scales the sum by something other than 1/{width}: not a mean"
    return t, axis, rank, scale


def _restored(r: Optional[gs.Node], nodes: list) -> Optional[gs.Tensor]:
    """Reshape `r` -> Expand: the dropped axis put back (jax2tf's broadcast_in_dim); its output."""
    e = _one(r.outputs[0], "Expand") if r is not None and r.op == "Reshape" else None
    if e is None:
        return None
    nodes += [r, e]
    return e.outputs[0]


def match_jax2tf(first: gs.Node, shapes: dict[str, Shape], outputs: set) -> MatchResult[NormMatch]:
    head = _sum_mean(first, shapes)
    if isinstance(head, str):
        return NoMatch(head)
    x, axis, rank, mean = head
    mu = mean.outputs[0]
    readers = _readers(mu)
    square_mu = _square_of(mu)
    back = next((n for n in readers if n.op == "Reshape"), None)
    if square_mu is None or back is None or len(readers) != 2:
        return NoMatch(f"its mean is read by {_what_reads(mu)}, not by its square and a broadcast back")
    xx = _square_of(x)
    if xx is None:
        return NoMatch(f"the mean is squared but `{x.name}` is not (no E[x²] - E[x]² variance)", 1)
    sum2 = _one(xx.outputs[0], "ReduceSum")
    head2 = _sum_mean(sum2, shapes)
    if isinstance(head2, str) or head2[1] != axis:
        return NoMatch(f"x² is not averaged over the mean's axis {axis} (read by {_what_reads(xx.outputs[0])})", 2)
    m2 = head2[3]
    var = _one(m2.outputs[0], "Sub")
    if var is None or list(var.inputs) != [m2.outputs[0], square_mu.outputs[0]] or len(_readers(square_mu.outputs[0])) != 1:
        return NoMatch("the variance is not E[x²] - E[x]²", 2)
    nodes = [first, mean, square_mu, xx, sum2, m2, var]
    v = var.outputs[0]
    mx = _one(v, "Max")
    if mx is None or _scalar(_other(mx, v)) != 0.0:
        return NoMatch(f"the variance `{v.name}` is not clipped at 0 by one Max (flax's fast variance)", 3)
    nodes.append(mx)
    vb = _restored(_one(mx.outputs[0], "Reshape"), nodes)
    mb = _restored(back, nodes)
    if vb is None or mb is None:
        return NoMatch("the mean or the variance is not broadcast back (Reshape, Expand) to x's rank", 3)
    got = _inverse_std(vb, nodes)
    if not got:
        return got
    inv, eps = got
    gamma, inv = _affine_after(inv, "Mul", axis, rank, nodes)
    sub = _one(mb, "Sub")
    if sub is None or list(sub.inputs) != [x, mb]:
        return NoMatch(f"the broadcast mean `{mb.name}` is read by {_what_reads(mb)}, not by x - mean", 4)
    final = _one(sub.outputs[0], "Mul")
    if final is None or _other(final, sub.outputs[0]) is not inv or len(_readers(inv)) != 1:
        return NoMatch(f"x - mean is read by {_what_reads(sub.outputs[0])}, not by one Mul by the inverse std", 4)
    nodes += [sub, final]
    beta, out = _affine_after(final.outputs[0], "Add", axis, rank, nodes)
    axis_, rejection = _norm_axis([axis], rank)
    return _finish(NormMatch(first.name, "decomposed", nodes, x, out, gamma=gamma, beta=beta, epsilon=eps,
                             axis=axis_, rejection=rejection, axes=[axis]), x, outputs)


def _finish(m: NormMatch, x: gs.Tensor, outputs: set) -> MatchResult[NormMatch]:
    """Every tensor the pattern makes, but its output, is read inside the pattern only; x is read
    by pattern nodes (and anything else: it is the stream)."""
    inside = {id(n) for n in m.nodes}
    for n in m.nodes:
        for o in n.outputs:
            if o is m.output:
                continue
            if o.name in outputs:
                return NoMatch(f"`{o.name}`, inside the norm, is a model output (the swap would remove it)", 5)
            outside = [r for r in o.outputs if id(r) not in inside]
            if outside:
                return NoMatch(f"`{o.name}`, inside the norm, is also read by {_desc(outside[0])} "
                               "(the swap would remove it)", 5)
    # the swap reads x from the first node's input 0 (emit.py): both patterns start at mean(x)
    return m if m.nodes[0].inputs[0] is x else NoMatch("the norm does not start at the mean of its input", 5)
