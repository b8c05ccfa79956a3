"""LayerNorms written as several ops, recognized once over the view for every IR.

    u = mean(x, A)            d = x - u            (one or several Subs, each x - u)
    [d = cast(d)]             v = mean(d², A)      (d² = pow(d, 2) or d * d)
    [v = v + eps]             n = d / sqrt(v)  or  d * rsqrt(v)  or  d * reciprocal(sqrt(v))
    [n = cast(n)]             [n = n * γ]          [n = n + β]  (γ, β constants along A)

as exporters and hand-written modules spell it (BERT and DeBERTa with fp32 casts, ConvNeXt's
channels-first LayerNorm, Cohere's rsqrt, torch's ONNX exporter dropping an eps it rounds to zero).
`collapse_norms` replaces each match in the view by one LayerNorm node named after its first op;
the frontend keeps the match to apply the swap: drop the mean subtraction (each `x - u` reads x),
leaving an RMSNorm. A chain that stops short of one is a near miss, which the report lists with
`match`'s reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .match import MatchResult, NoMatch
from .rules import (data_input, difference, is_cast_or_identity, is_product, is_quotient, is_sum_of_two, mean_axes,
                    norm_axis, operands, rule, squared_inputs)
from .view import Node, View


@dataclass
class DecomposedNorm:
    name: str  # the first mean: the norm's name in the view and the report
    nodes: list[str]  # covered view nodes
    x: str
    output: str
    axis: Optional[int]
    rejection: Optional[str]
    centered: list[str] = field(default_factory=list)  # the Subs computing x - mean
    gamma: Optional[str] = None
    beta: Optional[str] = None
    epsilon: float = 0.0
    rms: bool = False  # an RMSNorm as given (`match_rms`): nothing is centered, no β


def _readers(view: View, value: str) -> list[Node]:
    """Each node that reads `value`, once (d * d reads it twice)."""
    return [view.nodes[c] for c in dict.fromkeys(c for c, _ in view.values[value].consumers)]


def _only_reader(view: View, value: str, *kinds: str, ignored: Callable[[str], bool] = lambda name: False
                 ) -> Optional[Node]:
    """The one node, of one of `kinds`, that reads `value` (`ignored` readers aside)."""
    v = view.values[value]
    readers = {c for c, _ in v.consumers if not ignored(c)}
    if v.is_graph_output or len(readers) != 1:
        return None
    n = view.nodes[readers.pop()]
    return n if n.rule is not None and n.rule.kind in kinds else None


def _sole_reader(view: View, value: str, *kinds: str) -> Optional[Node]:
    """`_only_reader`, reads of `value`'s metadata aside (torch.export asserts dtypes in between)."""
    return _only_reader(view, value, *kinds, ignored=lambda c: _reads_metadata(view, c))


def _eps(view: View, add: Node, t: str) -> Optional[float]:
    """The constant scalar that `add` adds to `t`; None where it adds no such eps."""
    o = _other(add, t)
    return view.values[add.inputs[o]].scalar if o is not None and add.inputs[o] and is_sum_of_two(add.rule) else None


def _other(node: Node, value: str) -> Optional[int]:
    """The index of the other operand of a binary rule one of whose operands is `value`."""
    ops, i = operands(node.rule), node.inputs.index(value)
    return None if ops is None or i not in ops else ops[1 - ops.index(i)]


def _const_along(view: View, node: Node, i: Optional[int], axis: int, rank: int) -> bool:
    """Input `i` is a constant varying along `axis` only (a γ or β for that axis)."""
    if i is None or not node.inputs[i] or not view.values[node.inputs[i]].is_const:
        return False
    s = view.values[node.inputs[i]].shape
    if s is None or len(s) > rank:
        return False
    s = (1,) * (rank - len(s)) + tuple(s)
    return all(d == 1 for k, d in enumerate(s) if k != axis)


def _what_reads(view: View, value: str) -> str:
    v = view.values[value]
    names = [n.describe() for n in _readers(view, value)] + (["the model's output"] if v.is_graph_output else [])
    if not names:
        return "nothing"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _squared_mean_of(view: View, value: str, axes: tuple) -> bool:
    """`value` is squared and the square averaged over `axes` (a variance of it, uncentered)."""
    means = [_only_reader(view, n.outputs[0], "reduce") for n in _readers(view, value) if _is_square(view, n, {value})]
    return any(m is not None and mean_axes(m.rule) == axes for m in means)


def _axes_text(axes) -> str:
    return f"axes {tuple(axes)}" if len(axes) != 1 else f"axis {axes[0]}"


def match(view: View, mean1: Node) -> MatchResult[DecomposedNorm]:
    """The LayerNorm starting at this mean, or why there is none (depth >= 1: a near miss)."""
    axes = mean_axes(mean1.rule)
    if axes is None:
        return NoMatch("not a mean over constant axes that keeps its dims")
    x = mean1.inputs[data_input(mean1.rule)]
    u = mean1.outputs[0]
    if view.values[u].is_graph_output:
        return NoMatch(f"its mean `{u}` is a model output")
    subs = _readers(view, u)
    if not subs:
        return NoMatch(f"its mean `{u}` is read by nothing")
    for s in subs:
        diff = difference(s.rule)
        if diff is None:
            return NoMatch(f"its mean `{u}` is read by {s.describe()}, not only by x - mean")
        keep, m = diff
        if s.inputs[m] != u or s.inputs[keep] != x:
            return NoMatch(f"{s.describe()} does not compute x - mean")
    covered = [mean1] + subs
    # The centered values, after an optional up-cast each (fp16 models take statistics in fp32).
    centered: set[str] = set()
    up_cast = False
    for s in subs:
        d = s.outputs[0]
        c = _only_reader(view, d, "elementwise")
        if c is not None and is_cast_or_identity(c.rule):
            covered.append(c)
            d, up_cast = c.outputs[0], True
        centered.add(d)
    readers = {n.name: n for d in centered for n in _readers(view, d)}
    square = [n for n in readers.values() if _is_square(view, n, centered)]
    if not square:
        if _squared_mean_of(view, x, axes):
            return NoMatch(f"the variance is not of the centered input: it averages the square of `{x}`, "
                           "not of x - mean", 2)
        return NoMatch("x - mean is never squared: a centering, not a LayerNorm")  # a recenter: not near
    dname = sorted(centered)[0]
    if any(view.values[d].is_graph_output for d in centered):
        return NoMatch(f"the centered value `{dname}` is a model output", 2)
    if len(square) != 1 or len(readers) != 2:
        return NoMatch(f"the centered value `{dname}` is read by {_what_reads(view, dname)}: expected only its "
                       "square and the division by the standard deviation", 2)
    square = square[0]
    (final,) = [n for n in readers.values() if n is not square]
    if final.rule is None or final.rule.kind != "scale":
        return NoMatch(f"the centered value is read by {final.describe()} where a division by the standard "
                       "deviation is expected", 2)
    mean2 = _only_reader(view, square.outputs[0], "reduce")
    if mean2 is None:
        return NoMatch(f"the square `{square.outputs[0]}` is read by {_what_reads(view, square.outputs[0])}, "
                       "not by one mean (the variance)", 2)
    axes2 = mean_axes(mean2.rule)
    if axes2 != axes:
        over = _axes_text(axes2) if axes2 is not None else "no constant axes"
        return NoMatch(f"the variance is a mean over {over} but the mean over {_axes_text(axes)}", 3)
    covered += [square, mean2]
    t = mean2.outputs[0]
    eps = 0.0
    add = _only_reader(view, t, "broadcast")
    if add is not None:
        eps, o = _eps(view, add, t), _other(add, t)
        if eps is None:
            what = f"`{add.inputs[o]}`" if o is not None and add.inputs[o] else "something"
            return NoMatch(f"{add.describe()} adds {what} to the variance: not a constant scalar eps", 3)
        t = add.outputs[0]
        covered.append(add)
    root = _only_reader(view, t, "sqrt", "rsqrt")
    if root is None:
        return NoMatch(f"the variance `{t}` is read by {_what_reads(view, t)}, not by one square root", 3)
    covered.append(root)
    t = root.outputs[0]
    if root.rule.kind == "sqrt":
        if is_product(final.rule):
            inv = _only_reader(view, t, "reciprocal")  # d * (1 / sqrt(v))
            if inv is None:
                return NoMatch(f"{final.describe()} multiplies the centered value, and the standard deviation "
                               f"`{t}` is read by {_what_reads(view, t)}, not by one reciprocal", 3)
            covered.append(inv)
            t = inv.outputs[0]
    if not _divides(final, t, centered, divide=root.rule.kind == "sqrt" and is_quotient(final.rule)):
        return NoMatch(f"{final.describe()} does not divide the centered value by the standard deviation", 3)
    if len(view.values[t].consumers) != 1 or view.values[t].is_graph_output:
        return NoMatch(f"the standard deviation `{t}` is also read by {_what_reads(view, t)}", 3)
    covered.append(final)
    out = final.outputs[0]
    if up_cast:
        down = _only_reader(view, out, "elementwise")
        if down is not None and is_cast_or_identity(down.rule):
            covered.append(down)
            out = down.outputs[0]
    escapes = _escapes(view, covered, out, "norm", 4)  # every intermediate value read inside the pattern only
    if escapes is not None:
        return escapes
    rank = view.values[x].rank
    axis, why = norm_axis(list(axes), rank)
    m = DecomposedNorm(mean1.name, [], x, out, axis, why, [s.name for s in subs], epsilon=eps)
    if why is None:
        gm = _only_reader(view, out, "scale")
        if gm is not None and is_product(gm.rule) and _const_along(view, gm, _other(gm, out), axis, rank):
            m.gamma, out = gm.inputs[_other(gm, out)], gm.outputs[0]
            covered.append(gm)
        bt = _only_reader(view, out, "broadcast") if m.gamma is not None else None
        if bt is not None and is_sum_of_two(bt.rule) and _const_along(view, bt, _other(bt, out), axis, rank):
            m.beta, out = bt.inputs[_other(bt, out)], bt.outputs[0]
            covered.append(bt)
    m.nodes, m.output = [n.name for n in covered], out
    return m


def _is_square(view: View, n: Node, centered: set[str]) -> bool:
    """`n` squares a value of `centered` (pow(d, 2), d * d)."""
    factors = squared_inputs(n.rule)
    return factors is not None and all(n.inputs[i] in centered for i in factors)


def _divides(final: Node, t: str, centered: set[str], divide: bool) -> bool:
    """`final` is d / t (divide) or d * t, with d centered."""
    ops = operands(final.rule)
    if not (is_quotient if divide else is_product)(final.rule) or ops is None or None in ops:
        return False
    a, b = (final.inputs[i] for i in ops)
    return (a in centered and b == t) or (not divide and b in centered and a == t)


def collapse_norms(view: View, rms: bool = False) -> dict[str, DecomposedNorm]:
    """Put one LayerNorm node in place of every multi-op LayerNorm (the near misses go to
    `view.near_misses`, with their reasons); `rms` (γ into the readers, or a rotation): then one
    RMSNorm-as-given node in place of every RMSNorm written out (`match_rms`) too."""
    found: dict[str, DecomposedNorm] = {}
    taken: set[str] = set()
    for matcher in (match, match_rms) if rms else (match,):
        for node in list(view.nodes.values()):
            if node.name in taken or node.name not in view.nodes or mean_axes(node.rule) is None:
                continue
            m = matcher(view, node)
            if not m:
                if m.near:  # the report lists it, with why it is not a LayerNorm (or an RMSNorm)
                    view.near_misses[node.name] = m
                continue
            if taken & set(m.nodes):
                continue
            taken.update(m.nodes)
            found[m.name] = m
            _replace(view, m)
    return found


def match_rms(view: View, mean: Node) -> MatchResult[DecomposedNorm]:
    """An RMSNorm written out, named after its mean, as LlamaRMSNorm (Qwen2, Mistral, Phi-3),
    GemmaRMSNorm and T5LayerNorm spell it, in either IR (torch.export's graph, or the ONNX exporters'
    Pow or Mul, ReduceMean, Add, Sqrt, Reciprocal or Div(1, ·), Mul or Div, Casts):

        [xs = cast(x)]   v = mean(xs², A)   [v = v + eps]   n = y / sqrt(v)  or  y * rsqrt(v)
        or  y * reciprocal(sqrt(v))  or  y * (1 / sqrt(v)),  y = xs or x (T5 divides the uncast x)
        [n = cast(n)]    [n = n * γ]  [n = cast(n)]     (γ a constant along A; Gemma's 1 + γ once
                                                         the frontend computed it; the casts
                                                         only after xs = cast(x))

    The mean square of x - mean(x) is a LayerNorm's variance (`match`'s): no match. Reads of an
    intermediate value's metadata that nothing uses (torch.export's dtype asserts) are allowed: the
    swap drops them."""
    axes = mean_axes(mean.rule)
    if axes is None:
        return NoMatch("not a mean over constant axes that keeps its dims")
    sq = view.nodes.get(view.values[mean.inputs[data_input(mean.rule)]].producer or "")
    factors = squared_inputs(sq.rule) if sq is not None else None
    xs = sq.inputs[factors[0]] if factors else None
    if xs is None or not _is_square(view, sq, {xs}):
        return NoMatch("not a mean of a square")
    up = view.nodes.get(view.values[xs].producer or "")
    x = up.inputs[data_input(up.rule)] if up is not None and is_cast_or_identity(up.rule) else xs
    up = up if x != xs else None
    if _is_centered(view, x) or _is_centered(view, xs):
        return NoMatch("the mean square of x - mean: a LayerNorm's variance")
    covered = ([up] if up is not None else []) + [sq, mean]
    t, eps = mean.outputs[0], 0.0
    add = _sole_reader(view, t, "broadcast")
    if add is not None:
        eps = _eps(view, add, t)
        if eps is None:
            return NoMatch(f"{add.describe()} adds something other than a constant eps to the mean square")
        t = add.outputs[0]
        covered.append(add)
    root = _sole_reader(view, t, "sqrt", "rsqrt")
    if root is None:
        return NoMatch(f"the mean square `{t}` is read by {_what_reads(view, t)}, not by one square root")
    covered.append(root)
    t = root.outputs[0]
    inv = _reciprocal_of(view, t) if root.rule.kind == "sqrt" else None  # y * (1 / sqrt(v))
    if inv is not None:
        covered.append(inv)
        t = inv.outputs[0]
    final = _sole_reader(view, t, "scale")
    divide = root.rule.kind == "sqrt" and inv is None
    if final is None or not _divides(final, t, {x, xs}, divide):
        return NoMatch(f"the root mean square `{t}` of `{xs}` is not what it is divided by "
                       f"(it is read by {_what_reads(view, t)})", 1)
    covered.append(final)
    out = final.outputs[0]
    rank = view.values[x].rank
    axis, why = norm_axis(list(axes), rank)
    if why is not None:
        return NoMatch(f"a root mean square that {why}")  # (not near: an RMS over several axes)
    gamma = None
    for _ in range(3):  # [cast] [γ] [cast], in any order once each; casts back only after a cast up
        nxt = _sole_reader(view, out, "elementwise", "scale")
        if nxt is None:
            break
        if is_cast_or_identity(nxt.rule) and up is not None:
            covered.append(nxt)
            out = nxt.outputs[0]
        elif gamma is None and is_product(nxt.rule) and _const_along(view, nxt, _other(nxt, out), axis, rank):
            gamma = nxt.inputs[_other(nxt, out)]
            covered.append(nxt)
            out = nxt.outputs[0]
        else:
            break
    names = {n.name for n in covered}
    if up is not None and (view.values[xs].is_graph_output or any(
            c not in names and not _reads_metadata(view, c) for c, _ in view.values[xs].consumers)):
        # the upcast read elsewhere too (torch.export names a same-dtype `to` as the stream itself,
        # which the residual Add then reads): the norm starts after it
        covered.remove(up)
        names.discard(up.name)
        x = xs
    escapes = _escapes(view, covered, out, "RMSNorm", 1, lambda c: _reads_metadata(view, c))
    if escapes is not None:
        return escapes
    return DecomposedNorm(mean.name, [n.name for n in covered], x, out, axis, None, gamma=gamma, epsilon=eps, rms=True)


def _escapes(view: View, covered: list, out: str, what: str, priority: int,
             ignored: Callable[[str], bool] = lambda name: False) -> Optional[NoMatch]:
    """Why a value inside a matched norm (`covered`, output `out`), which the swap would remove, is
    read outside it (`ignored` readers aside); None where none is."""
    names = {n.name for n in covered}
    for n in covered:
        for v in n.outputs:
            if v == out:
                continue
            if view.values[v].is_graph_output:
                return NoMatch(f"`{v}`, inside the {what}, is a model output (the swap would remove it)", priority)
            outside = [c for c, _ in view.values[v].consumers if c not in names and not ignored(c)]
            if outside:
                return NoMatch(f"`{v}`, inside the {what}, is also read by {view.nodes[outside[0]].describe()} "
                               "(the swap would remove it)", priority)
    return None


def _reads_metadata(view: View, name: str) -> bool:
    """A read of a value's metadata whose result nothing reads (torch.export's dtype asserts): the
    swap drops it. (A used one, an ONNX Shape's, would be left reading a value the swap removes.)"""
    n = view.nodes[name]
    return (n.rule is not None and n.rule.kind == "metadata"
            and not any(view.values[v].consumers or view.values[v].is_graph_output for v in n.outputs if v))


def _reciprocal_of(view: View, value: str) -> Optional[Node]:
    """The one reader of `value` that computes 1 / value: a reciprocal, or a division of the constant
    1 by it (TorchScript's and Optimum's exports of rsqrt)."""
    n = _sole_reader(view, value, "reciprocal", "scale")
    if n is None or n.rule.kind == "reciprocal":
        return n
    ops = operands(n.rule)
    if not is_quotient(n.rule) or ops is None or None in ops:
        return None
    one, by = (n.inputs[i] for i in ops)
    return n if by == value and one and view.values[one].scalar == 1.0 else None


def _is_centered(view: View, value: str) -> bool:
    """`value` is some x - mean(x) (a Sub of a reduce-mean)."""
    p = view.nodes.get(view.values[value].producer or "")
    diff = difference(p.rule) if p is not None else None
    m = view.nodes.get(view.values[p.inputs[diff[1]]].producer or "") if diff is not None else None
    return m is not None and mean_axes(m.rule) is not None


def _replace(view: View, m: DecomposedNorm) -> None:
    inner = {v for n in m.nodes for v in view.nodes[n].outputs} - {m.output}
    for n in m.nodes:
        view.remove_node(n)
    for v in inner:
        view.values.pop(v, None)
    inputs = [m.x] + [v for v in (m.gamma, m.beta) if v]
    at = lambda v: inputs.index(v) if v else None  # noqa: E731
    if m.rms:
        view.add_node(Node(m.name, "DecomposedRMSNorm", inputs, [m.output],
                           rule=rule("layer_norm", axes=[m.axis], gamma=at(m.gamma), eps=m.epsilon, rms=True)))
        return
    view.add_node(Node(m.name, "DecomposedLayerNorm", inputs, [m.output],
                       rule=rule("layer_norm", axes=[m.axis], gamma=at(m.gamma), beta=at(m.beta), eps=m.epsilon,
                                 rejection=m.rejection)))
