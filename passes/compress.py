"""CRMSNorm compression plan (THEORY §1, "CRMSNorm"): a foldable component carried in d-1 features
(which layout ops spell d, which readers absorb γ, β and the decompression, which norms still emit
the decompressed vector), or a fallback to RMSNorm with a reason naming the node. Compressed only where
it saves more (a multiply-add per output row of each absorbing reader's weight, an element per stream
tensor) than its decompressions cost (~`DECOMPRESS_COST·d` per token each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Optional

from .analysis import Component
from .rules import spelled_sizes, writes_product
from .view import ConstRef, DimRef, LinearRead, SizeOf, View

# A decompression reads d-1 values (the sum) and writes d (the concat): ~2d element operations.
DECOMPRESS_COST = 2


@dataclass
class CrmsNorm:
    """One LayerNorm emitted as CRMSNorm over its compressed (d-1 wide) input."""

    name: str
    width: int  # d of the original norm
    epsilon: float
    compressed_readers: list[tuple[str, int]] = field(default_factory=list)  # read n (d-1, unscaled)
    decompress: bool = False  # the norm's own output is still produced, as γ⊙[n, -Σn] + β


@dataclass
class Absorb:
    """A linear reader of a CRMS norm: γ, β and the decompression go into its constants."""

    node: str
    read: LinearRead
    gamma: Optional[str]
    beta: Optional[str]


@dataclass
class ComponentCompression:
    norms: list[str]
    width: Optional[int] = None
    compressed: bool = False
    reason: str = ""
    dims: list[DimRef] = field(default_factory=list)
    crms: list[CrmsNorm] = field(default_factory=list)
    absorbs: list[Absorb] = field(default_factory=list)
    decompressions: int = 0


class _Fallback(Exception):
    pass


def compress(view: View, comp: Component) -> ComponentCompression:
    """The compression of one foldable component, or its fallback with a reason."""
    out = ComponentCompression(list(comp.norms))
    try:
        _plan(view, comp, out)
    except _Fallback as e:
        return ComponentCompression(list(comp.norms), out.width, False, str(e))
    out.compressed = True
    return out


def _plan(view: View, comp: Component, out: ComponentCompression) -> None:
    d = _width(view, comp)
    out.width = d
    if comp.blocks:
        raise _Fallback("the stream is centered per head (a per-head norm reads it); compressing it is not implemented")
    if comp.opaque:
        raise _Fallback(f"the stream is recentered at {comp.opaque[0].what}; compressing a recentered "
                        "stream is not implemented")
    why = sized_off_stream(view, comp)
    if why is not None:
        raise _Fallback(why)
    for value, axis in comp.axes.items():
        v = view.values[value]
        size = size_along(view, value, axis)
        if size != d:
            raise _Fallback(f"stream tensor `{value}` has {'unknown' if size is None else size} features, not {d}")
        refs, why = follows_stream(producer_width_refs(view, value, axis), comp)
        if refs is None:
            raise _Fallback(f"{view.nodes[v.producer].describe()} sets the stream's width {d} in a shape no edit "
                            f"can change{why}")
        out.dims.extend(r for r in refs if r not in out.dims)
        for c, i in v.consumers:
            node = view.nodes[c]
            if node.norm is not None and node.norm.input == i:
                continue
            if node.shape_only and follows_stream(node.width_refs(0, axis), comp)[0] == []:
                continue  # reads the shape but not the width (a dtype assert), or only as the stream's sizes
            if node.shape_only or node.transfer(i, axis) is None:
                raise _Fallback(f"stream tensor `{value}` is read by {node.describe()}, which needs all {d} features")
    for src in comp.sources:
        for ref in list(src.refs) + list(src.scales):
            size = _size_along(view, ref)
            if size not in (1, d):
                where = "a constant added to the stream" if src.node is None else view.nodes[src.node].describe()
                raise _Fallback(f"constant `{ref.value}` of {where} has {size} features along its axis {ref.axis}, "
                                f"not {d}")
    for name in comp.norms:
        out.crms.append(_norm(view, comp, name, d, out))
    out.decompressions = sum(c.decompress for c in out.crms)
    # (multiply-adds and element operations per token, the cost rule's units)
    saved = len(comp.axes) + len(comp.norms) + sum(_reader_saving(view, a.read) for a in out.absorbs)
    cost = DECOMPRESS_COST * d * out.decompressions
    if cost >= saved:
        where = ", ".join(f"`{c.name}`" for c in out.crms if c.decompress)
        raise _Fallback(f"decompressing the output of {where} (~{cost} operations per token) would cost more "
                        f"than compression saves (~{saved})")


def producer_width_refs(view: View, value: str, axis: int) -> Optional[list[DimRef]]:
    """The size entries with which the op that computes stream tensor `value` spells its width along
    `axis` (a Reshape's or Expand's target shape), to be patched when the stream narrows ([]: none;
    None: it sets the width in a shape no edit can change)."""
    producer = view.values[value].producer
    if producer is None:
        return []
    p = view.nodes[producer]
    return p.width_refs(p.outputs.index(value), axis)


def follows_stream(refs: Optional[list], comp: Component) -> tuple[Optional[list[DimRef]], str]:
    """(the entries of `refs` to patch, "") where every size the op reads at run time (a `SizeOf`)
    is that of a tensor of this stream along its feature axis — it narrows with the stream, so it
    needs no patch; else (None, why not)."""
    if refs is None:
        return None, ""
    for r in refs:
        if isinstance(r, SizeOf) and comp.axes.get(r.value) != r.axis:
            return None, f" (it reads it from `{r.value}`'s shape, axis {r.axis}, which is not on the stream)"
    return [r for r in refs if not isinstance(r, SizeOf)], ""


def sized_off_stream(view: View, comp: Component) -> Optional[str]:
    """Why the stream cannot narrow where an op off it takes an output size from the stream's width
    (a `SizeOf` of a stream tensor's feature axis among its sizes, its output not on the stream
    along that axis: it would narrow too), else None."""
    for node in view.nodes.values():
        for axis, e in enumerate(spelled_sizes(node.rule) or ()):
            if isinstance(e, SizeOf) and comp.axes.get(e.value) == e.axis and comp.axes.get(node.outputs[0]) != axis:
                return (f"{node.describe()} takes its size along axis {axis} from the stream's width (the shape of "
                        f"`{e.value}`) but is not on the stream")
    return None


def _width(view: View, comp: Component) -> int:
    widths = set()
    for name in comp.norms:
        n = view.nodes[name]
        w = size_along(view, n.norm_input, n.norm.axis)
        if not isinstance(w, int):
            raise _Fallback(f"the feature size of {n.describe()} is not static")
        widths.add(w)
    if len(widths) != 1:
        raise _Fallback(f"the norms of the stream have different feature sizes {sorted(widths)}")
    d = widths.pop()
    if d < 3:
        raise _Fallback(f"a {d}-feature stream has nothing to compress")
    return d


def size_along(view: View, value: str, axis: Optional[int]):
    """The size of `value` along `axis` (None: not known)."""
    s = view.values[value].shape
    return s[axis] if s is not None and axis is not None and axis < len(s) else None


def _size_along(view: View, ref: ConstRef):
    return 1 if ref.axis is None else size_along(view, ref.value, ref.axis)


def _reader_saving(view: View, read: LinearRead) -> int:
    s = view.values[read.weight.value].shape
    if s is None or not all(isinstance(x, int) for x in s):
        return 0
    return prod(s) // s[read.weight.axis]


def _norm(view: View, comp: Component, name: str, d: int, out: ComponentCompression) -> CrmsNorm:
    node = view.nodes[name]
    spec = node.norm
    y = node.outputs[0]
    crms = CrmsNorm(name, d, spec.epsilon, decompress=view.values[y].is_graph_output)
    const_affine = all(p is None or view.values[p].is_const for p in (spec.gamma, spec.beta))
    for c, i in view.values[y].consumers:
        got = absorbing(view, c, i, spec.axis, d) if const_affine else None
        dims = follows_stream(got[1], comp)[0] if got is not None else None
        if dims is None:
            crms.decompress = True
            continue
        crms.compressed_readers.append((c, i))
        out.absorbs.extend(Absorb(r, read, spec.gamma, spec.beta) for r, read in got[0])
        out.dims.extend(r for r in dims if r not in out.dims)
    return crms


def absorbing(view: View, c: str, i: int, axis: int, d: int, depth: int = 0):
    """([(linear reader, its LinearRead)], [DimRef]) when everything `c` leads to through layout
    ops is a linear reader with constant weights; None when anything needs the d-vector."""
    node = view.nodes[c]
    read = node.linear(i, axis) if writes_product(node) else None
    if read is not None:
        w = _size_along(view, read.weight)
        return ([(c, read)], []) if w == d else None
    if node.shape_only and node.width_refs(0, axis) == []:
        return [], []
    if not node.layout or depth > 16 or node.shape_only:
        return None
    outs = node.transfer(i, axis)
    if not outs:
        return None
    for o, oaxis in outs:  # the inputs each output is made of (a shape input is a parameter)
        ins = node.backward(o, oaxis) or []
        if any(node.inputs[j] != node.inputs[i] and not view.values[node.inputs[j]].is_const for j, _ in ins):
            return None  # mixes the normalized tensor with another one
    reads, dims = [], []
    for o, oaxis in outs:
        value = node.outputs[o]
        if not value:
            continue
        v = view.values[value]
        refs = node.width_refs(o, oaxis)
        if refs is None or v.is_graph_output or not v.consumers:
            return None
        dims.extend(refs)
        for c2, i2 in v.consumers:
            got = absorbing(view, c2, i2, oaxis, d, depth + 1)
            if got is None:
                return None
            reads += got[0]
            dims += got[1]
    return reads, dims
