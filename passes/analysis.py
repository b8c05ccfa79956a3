"""Foldability analysis: stream components, their sources and sinks, and a verdict per LayerNorm.

Pure function of a `View`: `analyze(view)` returns the components found, and `make_plan`
(passes/plan.py) turns them into edits. DESIGN.md §1 is the specification.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional

from .view import FeatureRuns, ChannelScale, ConstRef, Node, View

# Recenter only where the swaps it enables outnumber the recenters by this factor (THEORY §1).
RECENTER_PAYOFF = 2


@dataclass
class CenteredSource:
    """A source made zero-mean by centering constants (after folding `scales` into them)."""

    node: Optional[str]  # None for a constant added straight into the stream
    refs: list[ConstRef]
    scales: list[ConstRef] = field(default_factory=list)  # LayerScale vectors folded into refs


@dataclass
class OpaqueStart:
    """A stream tensor only an explicit Recenter can center."""

    value: str
    axis: int
    what: str  # e.g. "Tanh `/h.0/mlp/act`", "graph input `x`"
    stored: Optional[str] = None  # the integer type its writer's weights are stored as ("int8")


@dataclass
class Blocker:
    """One reason a component cannot fold: `subject` (a stream tensor, "`h`") and what is wrong
    with it (`what`, "is also read by MatMul `fc` (a linear layer, which sees the mean)")."""

    value: Optional[str]
    subject: str
    what: str
    post_ln: bool = False  # a norm's output read by a linear layer: what a Post-LN block is

    @property
    def text(self) -> str:
        return f"{self.subject} {self.what}"


POST_LN = "a Post-LN block: the stream is read by a linear layer (expected, not a defect)"


@dataclass
class Component:
    """One connected set of stream tensors, with the feature axis of each."""

    axes: dict[str, int] = field(default_factory=dict)
    # stream tensors centered per block (per-head q/k norms' input before the split into heads)
    blocks: dict[str, FeatureRuns] = field(default_factory=dict)
    norms: list[str] = field(default_factory=list)
    sources: list[CenteredSource] = field(default_factory=list)
    opaque: list[OpaqueStart] = field(default_factory=list)
    blockers: list[Blocker] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)  # norm -> the stream tensor it normalizes
    # its RMSNorms as given: nothing centers this stream (its LayerNorms are kept), but all of
    # them RMSNorms, it can still be rotated (passes/rotate.py)
    rms: list[str] = field(default_factory=list)

    @property
    def foldable(self) -> bool:
        return not self.blockers and self.recenter_pays

    @property
    def recenter_pays(self) -> bool:
        return len(self.norms) >= RECENTER_PAYOFF * len(self.opaque)

    def add_blocker(self, b: "Blocker") -> None:
        if all(have.text != b.text for have in self.blockers):
            self.blockers.append(b)

    def blocker_texts(self) -> list[str]:
        return [b.text for b in self.blockers]

    def reason(self, norm: Optional[str] = None) -> str:
        """Why `norm` (one of this component's) is kept: its own input, the first blocker."""
        x = self.inputs.get(norm) if norm is not None else None
        if self.blockers:
            b = self.blockers[0]
            if x is None or b.value is None:
                why = b.text
            elif b.value == x:
                why = f"its input {b.subject} {b.what}"
            else:
                why = f"its input `{x}` is in one stream with {b.subject}, which {b.what}"
            if b.post_ln:
                why += f" — {POST_LN}"
            if len(self.blockers) > 1:
                why += f" (+{len(self.blockers) - 1} more, all in the JSON report)"
            return why
        if not self.recenter_pays:
            starts = ", ".join(o.what for o in self.opaque[:3]) + (" and more" if len(self.opaque) > 3 else "")
            why = (f"its stream is started by {starts}, which no weight edit can make zero-mean; "
                   f"{len(self.opaque)} recenter(s) would buy only {len(self.norms)} fold(s)")
            stored = sorted({o.stored for o in self.opaque if o.stored})
            if stored:
                why += f"; its writer's weights are stored as {'/'.join(stored)}: fold the float model, then quantize"
            return why
        return ""


def _fmt_blocks(block: Optional[FeatureRuns]) -> str:
    if block is None:
        return "the whole axis"
    span = "" if not block.lo and block.hi is None else f" in entries [{block.lo}, {block.hi if block.hi is not None else 'end'})"
    every = "" if block.step == block.size else f" every {block.step} entries"
    row = "" if block.row is None else f" at index {block.row[1]} of axis {block.row[0]}"
    apart = "" if block.spacing is None else f" entries {'*'.join([str(block.spacing[0]), *block.spacing[1]])} apart (a merged axis)"
    return f"block of {block.size}{apart}{every}{span}{row}"


class _ComponentBuilder:
    def __init__(self, view: View) -> None:
        self.view = view
        self.comp = Component()
        self.queue: deque[str] = deque()
        self._seen_sources: set[tuple] = set()

    def block(self, value: Optional[str], what: str, post_ln: bool = False) -> None:
        """A blocker on `value` (None: the stream), named with the norm that makes it where one does."""
        norm = self._norm_behind(value) if value is not None else None
        named = f"`{value}`" if norm is None else f"`{value}` (from {norm.describe()})"
        self.comp.add_blocker(Blocker(value, "the stream" if value is None else named, what, post_ln))

    def _norm_behind(self, value: str) -> Optional[Node]:
        """The norm whose output `value` is, directly or through ops that only copy, cast,
        reshape it or apply constants (an eval dropout; a γ and β written out after the norm)."""
        for _ in range(8):
            p = self.view.values[value].producer
            node = self.view.nodes.get(p) if p is not None else None
            if node is None:
                return None
            if node.norm is not None or node.norm_rejection:
                return node
            if node.rule is None or node.rule.kind not in ("elementwise", "reshape", "permute", "scale", "broadcast"):
                return None
            data = [x for x in node.inputs if x and not self.view.values[x].is_const]
            if len(data) != 1:
                return None
            value = data[0]
        return None

    def _read_by(self, value: str, c: Node, i: int, axis: int) -> None:
        """`c` reads stream tensor `value` (input `i`) and sees its mean: say what it is."""
        if c.rule is None:
            self.block(value, f"is read by {c.describe()}: no rule for op `{c.op}`, so lnfold cannot tell "
                              "whether it sees the mean")
            return
        from_norm = self._norm_behind(value) is not None
        if c.linear(i, axis) is not None or c.rule.kind in ("linear", "conv"):
            self.block(value, f"is also read by {c.describe()} (a linear layer, which sees the mean)", from_norm)
        elif c.rule.kind == "matmul":
            self.block(value, f"is also read by {c.describe()} (a matrix product, which sees the mean)", from_norm)
        else:
            self.block(value, f"is also read by {c.describe()}, whose result depends on the mean")

    def visit(self, value: str, axis: int, block: Optional[FeatureRuns] = None) -> None:
        if block is not None:
            block = self._normalized(value, axis, block)
            if block is False:
                return
        have = self.comp.axes.get(value)
        if have is None:
            self.comp.axes[value] = axis
            if block is not None:
                self.comp.blocks[value] = block
            self.queue.append(value)
        elif have != axis:
            self.block(value, f"is reached with feature axis {have} and {axis} (a reshape or transpose mixes "
                              "the feature axis)")
        elif self.comp.blocks.get(value) != block:
            self.block(value, f"is reached centered per {_fmt_blocks(self.comp.blocks.get(value))} "
                              f"and per {_fmt_blocks(block)}")

    def _normalized(self, value: str, axis: int, block: FeatureRuns):
        """`block` with its span clipped to the axis; None where it is one run over the whole
        axis; False (and a blocker) where the runs do not tile the axis."""
        if block.spacing is not None:  # a merged axis (the reshape proved the grouping): taken as it is
            return block
        shape = self.view.values[value].shape
        size = shape[axis] if shape is not None and axis < len(shape) else None
        hi = size if block.hi is None else block.hi
        if not isinstance(size, int) or size % block.size or block.lo % block.size or hi % block.size or hi > size:
            self.block(value, f"would be centered per block of {block.size} along axis {axis}, whose size "
                              f"{size} is not a multiple of it")
            return False
        stride = block.step
        if stride != block.size and block.lo + stride >= hi:  # one run: a contiguous span
            stride = block.size
        elif stride != block.size and (stride % block.size or size % stride or block.hi is not None
                                       or block.lo + block.size > stride):
            self.block(value, f"would be centered in runs of {block.size} every {stride} entries from "
                              f"{block.lo} along axis {axis} of size {size}: they do not tile it")
            return False
        if stride != block.size:
            return replace(block, hi=None)
        block = FeatureRuns(block.size, block.lo, None if hi == size else hi, row=block.row)
        return None if block == FeatureRuns(size) else block

    def run(self, start: str, axis: int) -> Component:
        self.visit(start, axis)
        while self.queue:
            value = self.queue.popleft()
            axis, block = self.comp.axes[value], self.comp.blocks.get(value)
            if block is None:
                self._producer_side(value, axis)
                self._consumer_side(value, axis)
            else:
                self._producer_side_blocks(value, axis, block)
                self._consumer_side_blocks(value, axis, block)
        return self.comp

    # -- how a stream tensor comes to be -------------------------------------------------------
    def _producer_side(self, value: str, axis: int) -> None:
        v = self.view.values[value]
        if v.producer is None:  # a constant as the stream's start is rare: no edit of ours centers it
            self._add_opaque(value, axis, f"{'constant' if v.is_const else 'graph input'} `{value}`")
            return
        node = self.view.nodes[v.producer]
        o = node.outputs.index(value)

        ins = node.backward(o, axis)
        if ins is not None:
            for i, in_axis in ins:
                self._stream_input(node, i, in_axis)
            # Sibling outputs (a Split's) join when the inputs' readers are visited.
            return
        ins = node.backward_block(o, axis, None)
        if ins is not None and all(self._splits_back_out(node.inputs[i], a, b) for i, a, b in ins):
            # the feature axis is a split-off part of an input axis (head_dim)
            for i, in_axis, in_block in ins:
                self._stream_input(node, i, in_axis, in_block)
            return

        scale = node.channel_scale(o, axis)
        if scale is not None:
            src = self._scaled_source(node, scale)
            if src is not None:
                self._add_source(src)
                return

        refs = node.centering(o, axis)
        if refs is not None:
            self._add_source(CenteredSource(node.name, list(refs)))
            return
        stored = self._stored_behind(node)
        what = node.describe() if stored is None else f"{node.describe()} (weights stored as {stored})"
        self._add_opaque(value, axis, what, stored)

    def _stored_behind(self, node: Node, depth: int = 4) -> Optional[str]:
        """The integer type of the weights an opaque writer computes from, if they are stored as
        integers: the node dequantizes them itself, or reads them a few ops upstream (a MatMul on
        an int8 weight dequantized by Cast -> Mul). A norm ends the search (its input is a stream)."""
        if node.stored_as is not None or depth == 0 or node.norm is not None:
            return node.stored_as
        writers = [self.view.values[name].producer for name in node.inputs if name]
        found = (self._stored_behind(self.view.nodes[p], depth - 1) for p in writers if p and p in self.view.nodes)
        return next((stored for stored in found if stored is not None), None)

    def _splits_back_out(self, value: str, axis: int, block: Optional[FeatureRuns], depth: int = 32) -> bool:
        """Does a feature axis merged with other axes (`block.spacing`) come out whole again
        upstream, through layout ops and reshapes only (MobileViT's unfolding of conv_1x1's
        output)? Where it does not, the value stays an opaque start that a recenter can center."""
        if block is None or block.spacing is None:
            return True
        v = self.view.values[value]
        node = self.view.nodes.get(v.producer) if v.producer is not None else None
        if node is None or depth == 0:
            return False
        ins = node.backward_block(node.outputs.index(value), axis, block)
        return ins is not None and all(not self.view.values[node.inputs[i]].is_const
                                       and self._splits_back_out(node.inputs[i], a, b, depth - 1) for i, a, b in ins)

    def _stream_input(self, node: Node, i: int, axis: int, block: Optional[FeatureRuns] = None) -> None:
        name = node.inputs[i]
        if self.view.values[name].is_const:
            ref = ConstRef(name, axis, node.name, i, block)
            if self._spans_its_runs(ref):
                self._add_source(CenteredSource(None, [ref]))
        else:
            self.visit(name, axis, block)

    def _spans_its_runs(self, ref: ConstRef) -> bool:
        """A constant edited in part of its axis must hold that part itself: one broadcast along
        the axis (a scalar bias) also feeds the rows no norm reads (v's, of a fused q/k/v)."""
        b = ref.block
        if b is not None and b.spacing is not None:
            self.block(None, f"`{ref.value}` would be centered along an axis that merges the features "
                             "with other axes, which no constant edit here does")
            return False
        if b is not None and b.row is not None:  # a constant edited in one row of another axis: no such edit
            self.block(None, f"`{ref.value}` would be centered only at index {b.row[1]} of its axis "
                             f"{b.row[0]}, which no constant edit does")
            return False
        if b is None or (not b.lo and b.hi is None and b.step == b.size):
            return True
        shape = self.view.values[ref.value].shape
        size = None if shape is None or ref.axis is None or ref.axis >= len(shape) else shape[ref.axis]
        if isinstance(size, int) and size > 1 and size % b.step == 0 and (b.hi or 0) <= size:
            return True
        self.block(None, f"`{ref.value}` would be centered in part ({_fmt_blocks(b)}) but is broadcast "
                         "along the feature axis to the rest too")
        return False

    def _producer_side_blocks(self, value: str, axis: int, block: FeatureRuns) -> None:
        """A tensor centered per block: only constant edits that center each block will do (a
        recenter centers the whole axis, a LayerScale fold is not tried)."""
        v = self.view.values[value]
        node = self.view.nodes[v.producer] if v.producer is not None else None
        if node is not None:
            o = node.outputs.index(value)
            ins = node.backward_block(o, axis, block)
            if ins is not None:
                for i, in_axis, in_block in ins:
                    self._stream_input(node, i, in_axis, in_block)
                return
            refs = node.centering(o, axis) if node.block_centering else None
            if refs is not None:
                refs = [replace(r, block=block) for r in refs]
                if all([self._spans_its_runs(r) for r in refs]):
                    self._add_source(CenteredSource(node.name, refs))
                return
        what = node.describe() if node is not None else f"graph input `{value}`"
        self.block(value, f"must be centered per {_fmt_blocks(block)} (a per-head norm reads it), but it is "
                          f"made by {what}, which no per-block edit can center")

    def _consumer_side_blocks(self, value: str, axis: int, block: FeatureRuns) -> None:
        """Every reader must carry a per-block shift on to norms, or ignore it (shapes only)."""
        v = self.view.values[value]
        if v.is_graph_output:
            self.block(value, "is a graph output (the model's output would see the mean)")
        for cname, i in v.consumers:
            c = self.view.nodes[cname]
            outs = c.transfer_block(i, axis, block)
            if outs is not None:
                self._visit_outputs(c, outs)
                continue
            if c.shape_only:
                continue
            why = f"no rule for op `{c.op}`" if c.rule is None else "it would see the per-block means"
            self.block(value, f"is centered per {_fmt_blocks(block)} along axis {axis}, and {c.describe()} reads "
                              f"it otherwise than per block ({why})")

    def _scaled_source(self, node: Node, scale: ChannelScale) -> Optional[CenteredSource]:
        """LayerScale: fold a per-channel constant into the centerable sources feeding it, where
        every tensor between them feeds only this path (the scaled weights' readers all see it)."""
        refs: list[ConstRef] = []
        stack = [(node.inputs[scale.input], scale.input_axis)]
        while stack:
            name, axis = stack.pop()
            v = self.view.values[name]
            readers = [c for c in v.consumers if not self.view.nodes[c[0]].shape_only]
            if v.producer is None or len(readers) != 1 or v.is_graph_output:
                return None
            p = self.view.nodes[v.producer]
            if len(p.outputs) != 1:
                return None
            ins = p.backward(0, axis)
            if ins is not None:
                for i, in_axis in ins:
                    if self.view.values[p.inputs[i]].is_const:
                        refs.append(ConstRef(p.inputs[i], in_axis, p.name, i))
                    else:
                        stack.append((p.inputs[i], in_axis))
                continue
            got = p.centering(0, axis)
            if got is None:
                return None
            refs.extend(got)
        if any(not self._has_channels(r) for r in refs):
            return None
        return CenteredSource(node.name, refs, scales=[scale.scale]) if refs else None

    def _has_channels(self, ref: ConstRef) -> bool:
        """Can a per-channel scale fold into `ref`? Not into a constant that is one number per row
        (no axis, or size 1 along it: a [T, 1] bias broadcast along the features), which would have
        to grow to hold a different number per channel."""
        shape = self.view.values[ref.value].shape
        return ref.axis is not None and (shape is None or ref.axis >= len(shape) or shape[ref.axis] != 1)

    def _add_source(self, src: CenteredSource) -> None:
        key = (src.node, tuple(src.refs))
        if key not in self._seen_sources:
            self._seen_sources.add(key)
            self.comp.sources.append(src)

    def _add_opaque(self, value: str, axis: int, what: str, stored: Optional[str] = None) -> None:
        if all(o.value != value for o in self.comp.opaque):
            self.comp.opaque.append(OpaqueStart(value, axis, what, stored))

    # -- who reads a stream tensor -------------------------------------------------------------
    def _visit_outputs(self, node: Node, outs: list) -> None:
        """Follow the stream into the outputs `node` passes it to: (index, axis, runs) each."""
        for o, axis, block in outs:
            if node.outputs[o]:
                self.visit(node.outputs[o], axis, block)

    def _consumer_side(self, value: str, axis: int) -> None:
        v = self.view.values[value]
        if v.is_graph_output:
            self.block(value, "is a graph output (the model's output would see the mean)")
        for cname, i in v.consumers:
            c = self.view.nodes[cname]
            outs = c.transfer(i, axis)
            if outs is not None:
                self._visit_outputs(c, [(o, oaxis, None) for o, oaxis in outs])
                continue
            outs = c.transfer_block(i, axis, None) if c.norm is None else None
            if outs is not None:  # head_dim merged into a wider axis: per-block from here on
                self._visit_outputs(c, outs)
                continue
            if c.norm is not None and c.norm.input == i:
                if c.norm.axis == axis:
                    if cname not in self.comp.norms:
                        self.comp.norms.append(cname)
                        self.comp.inputs[cname] = value
                        if c.norm.rms:
                            self.comp.rms.append(cname)
                else:
                    self.block(value, f"is read by {c.describe()} over axis {c.norm.axis}, but its feature axis "
                                      f"is {axis}")
                continue
            if c.invariant(i, axis):
                continue
            self._read_by(value, c, i, axis)


def analyze(view: View) -> list[Component]:
    """The stream components of `view`, one per connected set of norm inputs (LayerNorms, and
    RMSNorms as given: `Component.rms`)."""
    components: list[Component] = []
    placed: set[str] = set()
    for node in view.nodes.values():
        if node.norm is None or node.name in placed:
            continue
        comp = _ComponentBuilder(view).run(node.norm_input, node.norm.axis)  # it reaches its own norm
        placed.update(comp.norms)
        components.append(comp)
    _block_shared(components)
    return components


def _block_shared(components: list[Component]) -> None:
    """A stream tensor in two components takes the edits of both: only disjoint runs of the same
    blocks compose (the q and the k rows of one fused projection). Anything else keeps both (a
    component is closed under its readers and writers; per-block spans are where it is not)."""
    seen: dict[str, list[Component]] = {}
    for comp in components:
        for value, axis in comp.axes.items():
            mine = comp.blocks.get(value)
            for other in seen.setdefault(value, []):
                if other.axes[value] == axis and _disjoint(mine, other.blocks.get(value)):
                    continue
                for c in (other, comp):
                    shared = "is shared with another group of norms, with edits of its own"
                    c.add_blocker(Blocker(value, f"`{value}`", shared))
            seen[value].append(comp)


def _disjoint(a: Optional[FeatureRuns], b: Optional[FeatureRuns]) -> bool:
    if a is None or b is None or a.size != b.size or a.spacing is not None or b.spacing is not None:
        return False
    if a.row is not None or b.row is not None:  # two selections of the same axis, different rows
        return a.row is not None and b.row is not None and a.row[0] == b.row[0] and a.row[1] != b.row[1]
    big = float("inf")
    if (a.hi if a.hi is not None else big) <= b.lo or (b.hi if b.hi is not None else big) <= a.lo:
        return True
    # runs every `step` entries, whole runs only (_normalized): apart where their phases differ
    return a.step == b.step != a.size and (a.lo - b.lo) % a.step != 0
