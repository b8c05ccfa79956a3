"""A residual stream cut into segments, one per block input (SliceGPT's per-block bases, DESIGN §6b):
x_{l+1} = x_l + f(x_l) is computed as `x_l·Q_l · (Q_lᵀQ_{l+1}) + f(x_l)·Q_{l+1}`.

A tensor's *segment* is the group of norms (those reading one tensor share a basis) it reaches
first, i.e. the one whose input reaches every other norm the tensor reaches. Segments may meet
only at an Add of two data inputs with the features last (a MatMul takes one across); any other
meeting, parallel branches, or a tensor reaching no norm leaves one basis (`Segments.why` says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from typing import Optional

from .analysis import Component
from .rules import kind_of, operands
from .view import View


@dataclass
class Shortcut:
    """The input `input` of the Add `node` comes from segment `source` into segment `target`
    (each named by its first norm): a MatMul by `Q_sourceᵀ·Q_target` on that input."""

    node: str
    input: int
    source: str
    target: str


@dataclass
class Segments:
    """A stream's segments: each stream tensor's (by the first norm of its segment), each norm's
    segment, the shortcuts between them, or why the stream keeps one basis."""

    of_value: dict[str, str] = field(default_factory=dict)
    of_norm: dict[str, str] = field(default_factory=dict)
    shortcuts: list[Shortcut] = field(default_factory=list)
    why: Optional[str] = None

    @property
    def heads(self) -> list[str]:
        """The first norm of each segment, in the stream's order of norms."""
        return list(dict.fromkeys(self.of_norm.values()))


def segments(view: View, comp: Component) -> Segments:
    """The segments of a folded stream `comp` (the module doc), or `why` it keeps one basis."""
    out = Segments()
    head_of_input: dict[str, str] = {}  # norm input tensor -> the first norm reading it
    for n in comp.norms:
        out.of_norm[n] = head_of_input.setdefault(view.nodes[n].norm_input, n)
    order = _topological(view, comp)
    if order is None:
        out.why = "its tensors do not form an acyclic graph"
        return out
    reach: dict[str, frozenset] = {}  # stream tensor -> the segments (heads) whose norms it reaches
    for value in reversed(order):
        got = {w for node, _ in _stream_edges(view, comp, value) for o in node.outputs if o in comp.axes
               for w in reach[o]}
        if value in head_of_input:
            got.add(head_of_input[value])
        reach[value] = frozenset(got)
    for value in order:
        first = [h for h in reach[value] if reach[value] <= reach[view.nodes[h].norm_input]]
        if len(first) != 1:
            heads = ", ".join(f"`{h}`" for h in sorted(reach[value]))
            out.why = (f"the stream tensor `{value}` reaches no norm" if not reach[value] else
                       f"the stream tensor `{value}` reaches the norms {heads}, none of them before the others "
                       "(parallel branches)")
            return out
        out.of_value[value] = first[0]
    out.why = _shortcuts(view, comp, out)
    return out


def _shortcuts(view: View, comp: Component, out: Segments) -> Optional[str]:
    """Each op where segments meet: a shortcut per input from another segment, or why not."""
    seen = set()
    for value in comp.axes:
        for node, i in _stream_edges(view, comp, value):
            if node.name in seen:
                continue
            seen.add(node.name)
            targets = {out.of_value[o] for o in node.outputs if o in comp.axes}
            if len(targets) != 1:
                return f"{node.describe()} writes stream tensors of different segments"
            target = targets.pop()
            crossing = [j for j, x in enumerate(node.inputs) if x in comp.axes and out.of_value[x] != target]
            if not crossing:
                continue
            why = _not_a_residual_add(view, comp, node)
            if why is not None:
                return f"{node.describe()} joins two segments of the stream and {why}"
            out.shortcuts += [Shortcut(node.name, j, out.of_value[node.inputs[j]], target) for j in crossing]
    return None


def _not_a_residual_add(view: View, comp: Component, node) -> Optional[str]:
    if kind_of(node.rule)[0] != "broadcast" or operands(node.rule) is None:
        return "is no Add of two tensors"
    if node.origin != node.name:
        return f"is part of the fused op `{node.origin}` (a MatMul cannot go between its inputs)"
    for x in node.inputs:
        rank = view.values[x].rank
        if x in comp.axes and (rank is None or comp.axes[x] != rank - 1):
            return f"reads `{x}` with the features not on its last axis (a MatMul cannot change their basis)"
    return None


def _stream_edges(view: View, comp: Component, value: str) -> list:
    """(node, input index) for each op that reads stream tensor `value` and writes a stream tensor."""
    return [(view.nodes[c], i) for c, i in view.values[value].consumers
            if any(o in comp.axes for o in view.nodes[c].outputs)]


def _topological(view: View, comp: Component) -> Optional[list[str]]:
    """The stream tensors, each after every stream tensor it is computed from (None: a cycle)."""
    # predecessors as dicts, not sets: an order (and so a `why`) that does not depend on string hashing
    preds: dict[str, dict] = {v: {} for v in comp.axes}
    for v in comp.axes:
        for node, _ in _stream_edges(view, comp, v):
            for o in node.outputs:
                if o in comp.axes and o != v:
                    preds[o][v] = None
    try:
        return list(TopologicalSorter(preds).static_order())
    except CycleError:
        return None
