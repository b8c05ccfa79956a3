"""The fold plan: every edit of the fold, derived from the analysis.

A plan is data, and it states every decision: which constants change and how (`ConstEdit`s,
passes/edits.py), where β goes (`betas`, passes/beta.py), which streams get an explicit recenter,
which Muls by ones disappear, which norms are fused with their residual Add. A frontend only
executes it: it computes new constants with `edits.compute_constants` (which asks the frontend
for the original arrays), writes them, rewires the readers of cloned constants, inserts
recenters and swaps norms.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import beta as betas
from .analysis import Component, analyze
from .beta import BetaFold
from .compress import ComponentCompression, compress
from .edits import (AddWeightTimes, Center, ConstEdit, Drop, FoldDecompression, NewBias, Ones,  # noqa: F401
                    Recenter, Scale)
from .options import MODES, check_choice
from .report import CompressionVerdict, NearMiss, NormVerdict, Report, StreamEdits
from .rules import kind_of
from .view import View


@dataclass
class Plan:
    mode: str
    const_edits: list[ConstEdit] = field(default_factory=list)
    recenters: list[Recenter] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)  # LayerNorm nodes to replace by RMSNorm
    components: list[Component] = field(default_factory=list)
    compressions: list[ComponentCompression] = field(default_factory=list)  # mode="crms"
    new_biases: list[NewBias] = field(default_factory=list)
    betas: dict[str, BetaFold] = field(default_factory=dict)  # folded RMS norm -> where its β goes
    fuse_residual: list[str] = field(default_factory=list)  # norms emitted fused with the Add before them
    drop_muls: list[str] = field(default_factory=list)  # Muls by a LayerScale now all ones: bypassed
    report: Report = field(default_factory=Report)
    deferral: Any = None  # a defer.DeferDecision, when a frontend asked for deferred norms
    origins: dict[str, str] = field(default_factory=dict)  # view node -> its IR node, where they differ

    @property
    def empty(self) -> bool:
        return not self.swaps

    def origin(self, node: str) -> str:
        """The IR node that view node `node` stands for (a fused op's part: the op)."""
        return self.origins.get(node, node)

    def emits_beta_add(self, norm: str) -> bool:
        """Whether the RMSNorm that replaces `norm` is followed by its β Add."""
        bf = self.betas.get(norm)
        return bf is None or bf.emits_add

    def keep_beta(self, norm: str, note: str = "") -> None:
        """Withdraw the β fold of `norm` (an emission that places β itself: deferred norms, the
        module-level training fold): its bias edits go, β is the norm's own again."""
        for v in self.report.norms:
            if v.name == norm:
                v.beta = note
        bf = self.betas.pop(norm, None)
        if bf is None or not bf.folded:
            return
        mine = {(b.user, b.user_input): add for b, add in bf.edits}
        kept = []
        for e in self.const_edits:
            adds = {mine[u] for u in e.users if u in mine}
            if adds:
                e.ops = tuple(op for op in e.ops if op not in adds)
            if e.ops:
                kept.append(e)
        self.const_edits[:] = kept


def make_plan(view: View, mode: str = "rms",
              refuse: Optional[Callable[[Component], Optional[str]]] = None, *,
              zero: Optional[Callable[[str], bool]] = None, fuse_residual: bool = False) -> Plan:
    """The edits that fold every foldable component of `view`.

    `refuse(component)` lets a frontend keep a foldable component whose edits it cannot apply
    (the module-level training fold edits parameters, not Python numbers in `forward`); it
    returns the reason, which the report gives for each of the component's norms.
    `zero(value)`: whether a constant is all zeros, where its values are fixed (a β of zeros
    needs neither an Add nor a fold). `fuse_residual`: the target runs a residual Add and the
    norm after it fastest as one op (onnxruntime's SkipSimplifiedLayerNormalization on CUDA).
    """
    check_choice("mode", mode, MODES)
    components = analyze(view)
    plan = Plan(mode=mode, components=components, report=Report(mode=mode),
                origins={n.name: n.origin for n in view.nodes.values() if n.origin != n.name})

    verdicts: dict[str, NormVerdict] = {}
    stream_readers: list[set[str]] = []  # per reported stream: the nodes reading its edited constants
    # (value, user, input) -> (reader ops, source ops): a constant can be both a CRMS reader's
    # weight and a source of another stream; reader ops (on its input axis, or b + Wβ on a bias)
    # come first, then centering, as C(b + Wβ) = C(b) + C(W)β.
    uses: dict[tuple, tuple[list, list]] = {}

    owner: dict[tuple, int] = {}  # (value, user, input) -> the stream that centers it first
    scaled_by: dict[str, int] = {}  # LayerScale Mul -> its stream

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
        if not shrink:  # (CRMS: β goes with γ into the compressed readers, below)
            for n in comp.norms:
                bf = plan.betas[n] = betas.decide(view, n, zero)
                for b, add in bf.edits:
                    use(b.value, b.user, b.user_input)[0].append(add)
        for src in comp.sources:
            for s in src.scales:
                scaled_by.setdefault(s.user, k)
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
                    plan.new_biases.append(NewBias(a.node, add, w.value, w))

    for nb in plan.new_biases:  # W β joins the reader's output: it takes the source edits too
        w = nb.weight
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
            # exporters de-duplicate equal initializers: one all-zero tensor is then a bias and a β
            shared = (" (one all-zero tensor the exporter shared between them)"
                      if zero is not None and zero(value) and any(view.nodes[o].norm for o, _ in others) else "")
            note = (f"`{value}`: also read by {view.nodes[others[0][0]].describe()}"
                    + (f" and {len(others) - 1} more" if len(others) > 1 else "") + shared
                    + (", which keep" if len(others) > 1 else ", which keeps") + " the original")
            for s, readers_of_s in zip(plan.report.streams, stream_readers):
                if any(u[0] in readers_of_s for u in users) and note not in s.cloned:
                    s.cloned.append(note)

    for mul, k in scaled_by.items():
        if _bypassable(view, mul):
            plan.drop_muls.append(mul)
            plan.report.streams[k].dropped.append(view.nodes[mul].describe())
    crms_norms = {c.name: c for cc in plan.compressions if cc.compressed for c in cc.crms}
    for name in plan.swaps:
        if name in crms_norms:
            verdicts[name].beta = _crms_beta(view, crms_norms[name])
            continue
        verdicts[name].beta = plan.betas[name].describe()
        if fuse_residual and _fusable(view, name, plan):
            plan.fuse_residual.append(name)
            plan.report.streams[verdicts[name].stream].fused.append(name)
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


def _crms_beta(view: View, c) -> str:
    if view.nodes[c.name].norm.beta is None:
        return ""
    where = f"into the biases of {len(c.compressed_readers)} reader(s) (CRMS)" if c.compressed_readers else ""
    return "; ".join(w for w in (where, "added after the decompression" if c.decompress else "") if w)


def _bypassable(view: View, name: str) -> bool:
    """A LayerScale Mul whose vector is now all ones can go: it reads one tensor of its own
    output's shape (a broadcasting Mul would change the shape) and is no graph output."""
    node = view.nodes[name]
    kind, params = kind_of(node.rule)
    if kind != "scale" or params.get("divide") or len(node.outputs) != 1:
        return False
    out = view.values[node.outputs[0]]
    data = [v for v in node.inputs if v and not view.values[v].is_const]
    return (not out.is_graph_output and len(data) == 1 and out.shape is not None
            and view.values[data[0]].shape == out.shape)


def _fusable(view: View, name: str, plan: Plan) -> bool:
    """The norm reads, over its last axis, the sum of two equal-shaped rank-3 tensors (the
    shape onnxruntime's fused residual kernel takes), which no recenter comes between."""
    node = view.nodes[name]
    spec = node.norm
    x = view.values[node.inputs[spec.input]]
    if x.rank is None or spec.axis != x.rank - 1 or x.producer is None:
        return False
    if any(r.value == x.name for r in plan.recenters):
        return False
    if any(view.nodes[n].inputs[view.nodes[n].norm.input] == x.name for n in plan.fuse_residual):
        return False  # another norm reading the same sum fuses its Add already
    add = view.nodes[x.producer]
    kind, p = kind_of(add.rule)
    if add.origin == node.origin:  # the norm's own op: SkipLayerNormalization's Add, not Embed's lookups
        return kind == "broadcast"
    if kind != "broadcast" or p.get("minus") or len(add.inputs) != 2 or sorted(p["data"]) != [0, 1]:
        return False
    shapes = [view.values[v].shape for v in add.inputs]
    if any(view.values[v].is_const for v in add.inputs) or shapes[0] is None or shapes[0] != shapes[1]:
        return False
    return len(shapes[0]) == 3 and all(d is not None for d in shapes[0])


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


def first_kept_reason(report: Report) -> Optional[str]:
    for n in report.norms:
        if n.verdict == "keep":
            return f"{n.name}: {n.reason}"
    return None
