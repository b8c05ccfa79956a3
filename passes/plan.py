"""The fold plan: what to edit, derived from the analysis, and the weight math to do it.

A plan is data. A frontend applies it: it computes new constants with `compute_constants`
(which asks the frontend for the original arrays), writes them, rewires the readers of cloned
constants, inserts recenters and swaps norms.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from . import weights
from .analysis import Component, analyze
from .compress import ComponentCompression, compress
from .options import MODES, check_choice
from .report import CompressionVerdict, NearMiss, NormVerdict, Report, StreamEdits
from .view import View


@dataclass(frozen=True)
class Center:
    axis: int
    # center each run of `block` entries on its own (per-head q/k norms), only in entries
    # [lo, hi) of the axis (hi None: to the end)
    block: Optional[int] = None
    lo: int = 0
    hi: Optional[int] = None


@dataclass(frozen=True)
class Scale:
    """Multiply along `axis` by the vector that constant `by` holds along its axis `by_axis`."""

    by: str
    by_axis: int
    axis: int


@dataclass(frozen=True)
class Ones:
    """The LayerScale vector once folded into its sources: becomes all ones."""


@dataclass(frozen=True)
class Drop:
    """Keep the first n-1 entries along `axis` (CRMSNorm: a source's redundant last row)."""

    axis: int


@dataclass(frozen=True)
class FoldDecompression:
    """`a[:n-1] - a[n-1:]` along `axis`: a reader's weight absorbs `concat(z, -Σz)` (CRMSNorm)."""

    axis: int


@dataclass(frozen=True)
class AddWeightTimes:
    """`a + W v` where constant `weight` holds its input features on `axis` (β into a bias)."""

    weight: str
    axis: int
    vector: str


Op = Union[Center, Scale, Ones, Drop, FoldDecompression, AddWeightTimes]


def _op_sources(op) -> list[str]:
    if isinstance(op, Scale):
        return [op.by]
    if isinstance(op, AddWeightTimes):
        return [op.weight, op.vector]
    return []


@dataclass
class ConstEdit:
    value: str
    ops: tuple  # of Op, applied left to right to the original array
    users: list[tuple[str, int]]  # (node, input index) that must read the edited tensor
    clone: bool  # other readers exist: write a new constant and rewire `users` to it
    new_name: str = ""  # the name of the clone (or of the edited constant when not cloned)


@dataclass
class Recenter:
    value: str
    axis: int


@dataclass
class NewBias:
    """A linear reader with no bias absorbs a CRMS norm's β: add `W β` after `node`."""

    node: str
    op: AddWeightTimes
    dtype_of: str  # the constant whose dtype the new bias takes
    then: tuple = ()  # the reader is also a source of a stream: its centering (and drop), on W β


@dataclass
class Plan:
    mode: str
    const_edits: list[ConstEdit] = field(default_factory=list)
    recenters: list[Recenter] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)  # LayerNorm nodes to replace by RMSNorm
    components: list[Component] = field(default_factory=list)
    compressions: list[ComponentCompression] = field(default_factory=list)  # mode="crms"
    new_biases: list[NewBias] = field(default_factory=list)
    report: Report = field(default_factory=Report)
    deferral: Any = None  # a defer.DeferDecision, when a frontend asked for deferred norms

    @property
    def empty(self) -> bool:
        return not self.swaps


def make_plan(view: View, mode: str = "rms",
              refuse: Optional[Callable[[Component], Optional[str]]] = None) -> Plan:
    """The edits that fold every foldable component of `view`.

    `refuse(component)` lets a frontend keep a foldable component whose edits it cannot apply
    (the module-level training fold edits parameters, not Python numbers in `forward`); it
    returns the reason, which the report gives for each of the component's norms.
    """
    check_choice("mode", mode, MODES)
    components = analyze(view)
    plan = Plan(mode=mode, components=components, report=Report(mode=mode))

    verdicts: dict[str, NormVerdict] = {}
    stream_readers: list[set[str]] = []  # per reported stream: the nodes reading its edited constants
    # (value, user, input) -> (reader ops, source ops): a constant can be both a CRMS reader's
    # weight and a source of another stream; reader ops (on its input axis, or b + Wβ on a bias)
    # come first, then centering, as C(b + Wβ) = C(b) + C(W)β.
    uses: dict[tuple, tuple[list, list]] = {}

    owner: dict[tuple, int] = {}  # (value, user, input) -> the stream that centers it first

    def use(ref_value: str, user: str, idx: int) -> tuple[list, list]:
        return uses.setdefault((ref_value, user, idx), ([], []))

    for comp in components:
        reason = comp.reason() if not comp.foldable else (refuse(comp) if refuse else None)
        if reason:
            for n in comp.norms:  # each kept norm's reason names its own input
                verdicts[n] = NormVerdict(n, "keep", comp.reason(n) if not comp.foldable else reason,
                                          blockers=comp.blocker_texts())
            continue
        k = len(plan.report.streams)
        edits, readers = _stream_edits(view, comp)
        plan.report.streams.append(edits)
        stream_readers.append(readers)
        for n in comp.norms:
            verdicts[n] = NormVerdict(n, "fold", recentered=bool(comp.opaque), stream=k)
        plan.swaps.extend(comp.norms)
        plan.recenters.extend(Recenter(o.value, o.axis) for o in comp.opaque)
        cc = compress(view, comp) if mode == "crms" else None
        if cc is not None:
            plan.compressions.append(cc)
        shrink = cc is not None and cc.compressed
        for src in comp.sources:
            for s in src.scales:
                ops = use(s.value, s.user, s.user_input)[1]
                ops[:] = [Ones()] + ([Drop(s.axis)] if shrink and _size(view, s.value, s.axis) != 1 else [])
            for ref in src.refs:
                key = (ref.value, ref.user, ref.user_input)
                ops = use(*key)[1]
                center = _center(ref)
                if owner.setdefault(key, k) != k:  # disjoint runs of one constant, another stream's
                    ops.append(center)
                    continue
                ops[:] = [Scale(s.value, s.axis, ref.axis) for s in src.scales] + [center]
                if shrink and ref.axis is not None and _size(view, ref.value, ref.axis) != 1:
                    ops.append(Drop(ref.axis))
        if shrink:
            for a in cc.absorbs:
                w = a.read.weight
                ops = use(w.value, w.user, w.user_input)[0]
                if a.gamma is not None:
                    ops.append(Scale(a.gamma, 0, w.axis))
                ops.append(FoldDecompression(w.axis))
                if a.beta is None:
                    continue
                add = AddWeightTimes(w.value, w.axis, a.beta)
                if a.read.bias is not None:
                    b = a.read.bias
                    use(b.value, b.user, b.user_input)[0].append(add)
                else:
                    plan.new_biases.append(NewBias(a.node, add, w.value))

    for nb in plan.new_biases:  # W β joins the reader's output: it takes the source edits too
        w = next(a.read.weight for cc in plan.compressions for a in cc.absorbs if a.node == nb.node)
        nb.then = tuple(_drop_axis(op, w.axis) for op in uses[(w.value, w.user, w.user_input)][1])

    wanted: dict[tuple, list[tuple[str, int]]] = {}
    for (value, user, idx), (reader_ops, source_ops) in uses.items():
        wanted.setdefault((value, tuple(reader_ops + source_ops)), []).append((user, idx))
    for (value, ops), users in wanted.items():
        readers = set(view.values[value].consumers)
        users = sorted(set(users))
        clone = readers != set(users)
        plan.const_edits.append(ConstEdit(value, ops, users, clone))
        if clone:
            others = sorted(readers - set(users))
            note = (f"`{value}`: also read by {view.nodes[others[0][0]].describe()}"
                    + (f" and {len(others) - 1} more, which keep" if len(others) > 1 else ", which keeps")
                    + " the original")
            for s, readers_of_s in zip(plan.report.streams, stream_readers):
                if any(u[0] in readers_of_s for u in users) and note not in s.cloned:
                    s.cloned.append(note)

    for node in view.norms():
        if node.name not in verdicts:
            verdicts[node.name] = NormVerdict(node.name, "keep", node.norm_rejection or "not analyzed")
    plan.report.norms = [verdicts[n.name] for n in view.norms()]
    plan.report.near_misses = [NearMiss(name, m.reason) for name, m in view.near_misses.items()]
    plan.report.recentered = len(plan.recenters)
    for cc in plan.compressions:
        plan.report.compression.append(CompressionVerdict(
            list(cc.norms), "compressed" if cc.compressed else "rms", cc.reason, cc.width,
            cc.decompressions))
    return plan


def _center(ref) -> Center:
    b = ref.block
    return Center(ref.axis) if b is None else Center(ref.axis, b.size, b.lo, b.hi)


def _stream_edits(view: View, comp: Component) -> tuple[StreamEdits, set[str]]:
    """The report's account of one foldable component (what gets centered, scaled, recentered),
    and the nodes that read its edited constants (to tell which clones it needed)."""
    edits, readers = StreamEdits(norms=list(comp.norms)), set()
    for src in comp.sources:
        for ref in src.refs:
            via = (view.nodes[src.node].describe() if src.node is not None
                   else f"added to the stream by {view.nodes[ref.user].describe()}")
            item = f"`{ref.value}` ({via})"
            if item not in edits.centered:
                edits.centered.append(item)
            readers.add(ref.user)
        for s in src.scales:
            edits.scaled.append(f"`{s.value}` ({view.nodes[s.user].describe()})")
            readers.add(s.user)
    edits.recentered = [o.what for o in comp.opaque]
    return edits, readers


def _drop_axis(op, gone: int):
    """`op` on a weight, moved to `W v`, which lacks the weight's axis `gone`."""
    shift = (lambda a: a if a is None or a < gone else a - 1)
    if isinstance(op, Scale):
        return Scale(op.by, op.by_axis, shift(op.axis))
    if isinstance(op, Center):
        return Center(shift(op.axis), op.block, op.lo, op.hi)
    if isinstance(op, Drop):
        return type(op)(shift(op.axis))
    return op


def _size(view: View, value: str, axis: int):
    s = view.values[value].shape
    return s[axis] if s is not None and axis < len(s) else None


def compute_constants(
    plan: Plan, get_array: Callable[[str], np.ndarray]
) -> list[tuple[ConstEdit, np.ndarray]]:
    """The new value of every edited constant, computed from the originals in float64 and cast
    back once (a LayerScale fold and its centering round together, not one after the other)."""
    last_use: dict[str, int] = {}  # originals are dropped after their last reader: big models
    for k, edit in enumerate(plan.const_edits):
        for name in [edit.value] + [n for op in edit.ops for n in _op_sources(op)]:
            last_use[name] = k
    cache: dict[str, np.ndarray] = {}

    def original(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = np.asarray(get_array(name))
        return cache[name]

    out = []
    for k, edit in enumerate(plan.const_edits):
        src = original(edit.value)
        a = _apply_ops(src.astype(np.float64), edit.ops, original)
        out.append((edit, a.astype(src.dtype)))
        for name in [n for n, last in last_use.items() if last == k]:
            cache.pop(name, None)
    return out


def _apply_ops(a: np.ndarray, ops: tuple, original: Callable[[str], np.ndarray]) -> np.ndarray:
    for op in ops:
        if isinstance(op, Center):
            a = (weights.center(a, op.axis) if op.block is None
                 else weights.center(a, op.axis, op.block, op.lo, op.hi))
        elif isinstance(op, Scale):
            a = weights.scale(a, weights.vector_along(original(op.by), op.by_axis), op.axis)
        elif isinstance(op, Ones):
            a = np.ones_like(a)
        elif isinstance(op, Drop):
            a = weights.drop_last(a, op.axis)
        elif isinstance(op, FoldDecompression):
            a = weights.fold_decompression(a, op.axis)
        elif isinstance(op, AddWeightTimes):
            a = a + weights.weight_times(original(op.weight), original(op.vector), op.axis).reshape(a.shape)
        else:  # pragma: no cover - Op is closed
            raise TypeError(op)
    return a


def compute_new_bias(nb: NewBias, get_array: Callable[[str], np.ndarray]) -> np.ndarray:
    """`W β` for a CRMS reader that has no bias to absorb β into (the weight's dtype), with the
    reader's own source edits when it writes a stream."""
    w = np.asarray(get_array(nb.op.weight))
    a = weights.weight_times(w, np.asarray(get_array(nb.op.vector)), nb.op.axis)
    return _apply_ops(a, nb.then, lambda n: np.asarray(get_array(n))).astype(w.dtype)


def first_kept_reason(report: Report) -> Optional[str]:
    for n in report.norms:
        if n.verdict == "keep":
            return f"{n.name}: {n.reason}"
    return None
