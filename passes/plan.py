"""The fold plan: `make_plan(view, request)` decides every edit of the fold from the analysis and
the request, and returns it as data, final (DESIGN §2, "The pipeline"); a frontend only executes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np

from . import beta as betas
from . import gamma as gammas
from .analysis import Component, analyze
from .beta import BetaFold
from .compress import ComponentCompression, CrmsNorm, compress, size_along
from .defer import DeferDecision, Deferral, gamma_edits, plan_deferral
from .frozen import FrozenList
from .gamma import GammaFold
from .rotate import StreamBasis, plan_rotation, spared_for
from . import online, slicing
from .online import OnlineRotation
from .edits import (AddWeightTimes, Basis, Center, ConstEdit, FoldDecompression, Identity, NewBias,  # noqa: F401
                    Ones, Project, Recenter, Scale, const_edits, dense)
from .errors import LnfoldError
from .report import CompressionVerdict, NearMiss, NormVerdict, Report, RmsNorm, StreamEdits
from .request import Capabilities, PlanRequest
from .rules import is_product, is_sum_of_two, kind_of
from .view import ConstRef, DimRef, View


def _frozen_dict() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class Readout:
    """A constant product after a unit-weight norm on a stream carried in another basis B:
    `· B[:, :keep]ᵀ · diag γ` takes its output back to the original features (a norm whose readers
    cannot take the basis), or, `rotated`, `· Bᵀ · diag γ · B` applies γ and stays in the basis (γ
    kept in float, its readers rotated; unsliced streams only). Exact: passes/rotate.py."""

    basis: Basis
    keep: int
    gamma: Optional[str]  # the norm's γ constant (None: no γ)
    rotated: bool = False

    def matrix(self, gamma: Optional[np.ndarray]) -> np.ndarray:
        """The float64 (keep × d) matrix (keep × keep, `rotated`), given γ's values."""
        g = np.ones(self.basis.dim) if gamma is None else np.asarray(gamma, dtype=np.float64).reshape(-1)
        b = dense(self.basis)[:, :self.keep]
        return (b.T * g[None, :]) @ b if self.rotated else b.T * g[None, :]


# How a swapped norm is emitted (NormEmission.how)
FOLDED = "folded"  # the target's RMSNorm (or a LayerNorm on the centered stream), exact
AS_GIVEN = "as given"  # an RMSNorm as given, emitted anew with unit weight (γ in its readers or a readout)
DEFERRED = "deferred"  # no norm: γ in its readers' weights, the row scale on their products (`deferred`)
CRMS = "crms"  # a CRMSNorm over the stream compressed to d-1 features (`crms`)
APPROXIMATE = "approximate"  # NOT exact: an RMSNorm on the uncentered stream, β kept (passes/approx.py)


@dataclass(frozen=True)
class NormEmission:
    """How one swapped norm is emitted, as decided: every mode fills one, and the emitters dispatch
    on `how` alone (no other Plan record says how a norm is emitted)."""

    norm: str
    how: str  # FOLDED, AS_GIVEN, DEFERRED, CRMS or APPROXIMATE
    beta_add: bool = False  # its β Add follows the norm (False: β went into the readers, or is zero)
    unit_gamma: bool = False  # γ went into the readers' weights: the norm's weight is ones
    # its input is not zero-mean (its stream is carried in a basis with B·1 ≠ 1, or kept its mean):
    # an RMSNorm, never a LayerNorm on the centered stream
    rms_only: bool = False
    fuse_residual: bool = False  # emitted fused with the residual Add before it
    readout: Optional[Readout] = None
    # a sliced stream (passes/slicing.py): the norm reads `width` of its d features (None: all, as
    # matched); RMSNorm over them with its weight times `scale` = √(d/k) and ε times `eps_scale` = d/k
    # is the d-feature RMSNorm on the kept subspace, exactly
    width: Optional[int] = None
    scale: float = 1.0
    eps_scale: float = 1.0
    deferred: Optional[Deferral] = None  # DEFERRED: its readers and β (passes/defer.py)
    crms: Optional[CrmsNorm] = None  # CRMS: its compressed readers and decompression (passes/compress.py)


@dataclass(frozen=True)
class Plan:
    """The complete fold, as `make_plan` decided it; nothing assigns to it afterwards."""

    mode: str
    const_edits: Sequence[ConstEdit] = FrozenList()
    recenters: Sequence[Recenter] = FrozenList()
    swaps: Sequence[str] = FrozenList()  # LayerNorm nodes to replace by RMSNorm
    # RMSNorms as given (NormSpec.rms) emitted anew with unit weight: γ went into their
    # readers, or into a readout's matrix (a rotated stream's norm whose readers cannot take γ)
    rms_swaps: Sequence[str] = FrozenList()
    components: Sequence[Component] = FrozenList()
    compressions: Sequence[ComponentCompression] = FrozenList()  # mode="crms"
    new_biases: Sequence[NewBias] = FrozenList()
    betas: Mapping[str, BetaFold] = field(default_factory=_frozen_dict)  # folded RMS norm -> where its β goes
    fuse_residual: Sequence[str] = FrozenList()  # norms emitted fused with the Add before them
    drop_muls: Sequence[str] = FrozenList()  # Muls by a LayerScale now all ones: bypassed
    report: Report = field(default_factory=Report)
    deferral: DeferDecision = field(default_factory=DeferDecision)  # the norms emitted deferred (passes/defer.py)
    origins: Mapping[str, str] = field(default_factory=_frozen_dict)  # view node -> its IR node, where they differ
    training: bool = False  # the edited constants are trained: edits computed in the graph
    kept_by_target: Sequence[str] = FrozenList()  # folded streams' norms the target keeps (Capabilities.swap_refusal)
    gammas: Mapping[str, GammaFold] = field(default_factory=_frozen_dict)  # gamma_into_readers: per folded norm
    stream_bases: Sequence[StreamBasis] = FrozenList()  # rotate=: per folded stream, rotated or why not
    # online_hadamard: the stream writers' inputs rotated by a constant MatMul, Hᵀ in their weights
    online: Sequence[OnlineRotation] = FrozenList()

    approx: Sequence[str] = FrozenList()  # kept norms swapped to RMSNorm anyway, β kept: NOT exact (passes/approx.py)
    # how each swapped norm is emitted, in the order the emitters emit them (swaps, rms_swaps, approx)
    emissions: Mapping[str, NormEmission] = field(default_factory=_frozen_dict)
    # what a calibrated decision on this fold measures (passes/calibration.py captures them in the
    # folded model): each swapped norm's input, the stream a principal basis is computed from
    needs: Sequence[str] = FrozenList()

    @property
    def unit_gamma(self) -> frozenset:
        """The norms emitted as norms with unit weight (γ in their readers, or in a readout's matrix)."""
        return frozenset(n for n, e in self.emissions.items() if e.how in (FOLDED, AS_GIVEN) and e.unit_gamma)

    @property
    def rotated_norms(self) -> frozenset:
        """The norms whose input is no longer zero-mean (a stream rotated by a Q with Q·1 ≠ 1)."""
        return frozenset(n for n, e in self.emissions.items() if e.how in (FOLDED, AS_GIVEN) and e.rms_only)

    @property
    def resized_dims(self) -> list[tuple[DimRef, int]]:
        """The layout ops' size entries that spell a stream's width, each with how much it shrinks:
        1 on a CRMS stream (d−1 features), d−k on a sliced one."""
        out = [(ref, 1) for cc in self.compressions if cc.compressed for ref in cc.dims]
        out += [(ref, r.dim - width) for r in self.stream_bases if r.sliced for ref, width in r.dims]
        return out

    @property
    def shortcuts(self) -> list:
        """The residual shortcuts re-expressed by a constant MatMul (per-block bases, passes/rotate.py)."""
        return [s for r in self.stream_bases if r.rotated for s in r.shortcuts]

    @property
    def empty(self) -> bool:
        """Nothing to apply: no norm swapped (folded, approximated, or an RMSNorm as given re-emitted),
        no stream rotated (a stream of γ-less RMSNorms rotates with no norm to swap) and no layer's
        input rotated online."""
        return not self.swaps and not self.approx and not self.rms_swaps and \
            not any(r.rotated for r in self.stream_bases) and not self.online

    @property
    def plain_rms(self) -> list[str]:
        """The swapped norms emitted as a plain RMSNorm: neither CRMSNorms (exact only on their
        compressed stream) nor deferred (no norm any more). Verification checks them as RMSNorms
        where a frontend emits them as a LayerNorm on the centered stream."""
        return FrozenList(n for n, e in self.emissions.items() if e.how == FOLDED)

    def origin(self, node: str) -> str:
        """The IR node that view node `node` stands for (a fused op's part: the op)."""
        return self.origins.get(node, node)

    def scoped(self, mine: Callable[[str], bool], local: Callable[[str], str], *, main: bool) -> "Plan":
        """The share of the plan that one graph of a model with subgraphs applies (ONNX If branches:
        onnx_rewrite/subgraphs.py), in that graph's own names (`local`) for the names it owns (`mine`).
        Deferred and CRMS norms are the main graph's alone (branch ops offer neither); new biases,
        like the constant edits, are applied once for every graph (their W β reads any graph's constants)."""
        def names(ns) -> FrozenList:
            return FrozenList(local(n) for n in ns if mine(n))

        def keyed(by_name: Mapping) -> dict:
            return {local(n): v for n, v in by_name.items() if mine(n)}

        stream_bases = FrozenList(replace(r, norms=list(names(r.norms)), readouts=list(names(r.readouts)),
                                          dims=[(replace(d, node=local(d.node)), w) for d, w in r.dims if mine(d.node)],
                                          norm_bases=keyed(r.norm_bases), norm_widths=keyed(r.norm_widths),
                                          shortcuts=[replace(s, node=local(s.node)) for s in r.shortcuts
                                                     if mine(s.node)])
                                  for r in self.stream_bases)
        main_only = dict(deferral=self.deferral, compressions=self.compressions, origins=self.origins) if main else {}
        return Plan(mode=self.mode, swaps=names(self.swaps), rms_swaps=names(self.rms_swaps),
                    recenters=FrozenList(replace(r, value=local(r.value)) for r in self.recenters if mine(r.value)),
                    betas=MappingProxyType(keyed(self.betas)), fuse_residual=names(self.fuse_residual),
                    gammas=MappingProxyType(keyed(self.gammas)), stream_bases=stream_bases, approx=names(self.approx),
                    online=FrozenList(replace(o, node=local(o.node), value=local(o.value))
                                      for o in self.online if mine(o.node)),
                    emissions=MappingProxyType({n: replace(e, norm=n) for n, e in keyed(self.emissions).items()}),
                    **main_only)


@dataclass
class _Draft:
    """The plan while make_plan decides it (the same fields, mutable)."""

    mode: str
    const_edits: list[ConstEdit] = field(default_factory=list)
    recenters: list[Recenter] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)
    rms_swaps: list[str] = field(default_factory=list)
    components: list[Component] = field(default_factory=list)
    compressions: list[ComponentCompression] = field(default_factory=list)
    new_biases: list[NewBias] = field(default_factory=list)
    betas: dict[str, BetaFold] = field(default_factory=dict)
    fuse_residual: list[str] = field(default_factory=list)
    drop_muls: list[str] = field(default_factory=list)
    report: Report = field(default_factory=Report)
    origins: dict[str, str] = field(default_factory=dict)
    gammas: dict[str, GammaFold] = field(default_factory=dict)
    stream_bases: list[StreamBasis] = field(default_factory=list)
    online: list[OnlineRotation] = field(default_factory=list)

    def freeze(self, **decided) -> Plan:
        def final(v):
            return FrozenList(v) if isinstance(v, list) else MappingProxyType(v) if isinstance(v, dict) else v

        return Plan(**{f.name: final(getattr(self, f.name)) for f in fields(self)}, **decided)

    def keep_beta(self, norm: str, note: str = "") -> None:
        """Withdraw the β fold of `norm` (a deferred emission places β itself): its bias edits
        go, β is the norm's own again."""
        for v in self.report.norms:
            if v.name == norm:
                v.beta = note
        bf = self.betas.pop(norm, None)
        if bf is None or not bf.folded:
            return
        gone = {(n, add) for n, add, _ in bf.new}
        self.new_biases[:] = [nb for nb in self.new_biases if (nb.node, nb.op) not in gone]
        mine = {(b.user, b.user_input): add for b, add in bf.edits}
        kept = []
        for e in self.const_edits:
            adds = {mine[u] for u in e.users if u in mine}
            if adds:
                e = replace(e, ops=tuple(op for op in e.ops if op not in adds))
            if e.ops:
                kept.append(e)
        self.const_edits[:] = kept


def make_plan(view: View, request: Union[PlanRequest, str, None] = None, **fields) -> Plan:
    """The complete plan that folds every foldable component of `view`, as `request` asks
    (passes/request.py; a mode name, or PlanRequest's fields as keywords, stand for a request)."""
    if not isinstance(request, PlanRequest):
        request = PlanRequest(**({} if request is None else {"mode": request}), **fields)
    elif fields:
        request = replace(request, **fields)
    caps = request.target
    mode = request.mode if caps.compresses else "rms"
    plan = _draft(view, mode, request)
    if mode != request.mode:
        plan.report.notes.append(f"{caps.name} does not compress (CRMSNorm); folded norms are RMSNorms, "
                                 "which compute the same values")
    kept_by_target = _kept_by_target(plan, caps)
    edited = [n for e in plan.const_edits for n in e.sources()]
    training = request.trainable is not None and any(request.trainable(n) for n in edited)
    # under autograd the graph computes its edited weights itself: no deferral there; γ into the
    # readers (and a rotation) place γ themselves: no deferral either
    defer = "off" if training or request.gamma_into_readers else request.defer
    if request.gamma_into_readers and request.defer != "off":
        plan.report.notes.append("deferred normalization is off: γ goes into the readers (gamma_into_readers)")
    deferral = plan_deferral(view, plan, defer, caps.costs)
    _defer(view, plan, deferral)
    approx = approximate(view, plan.report, request.approx)
    swapped = set(plan.swaps)
    needs = FrozenList(n.norm_input for n in view.norms() if n.name in swapped)
    return plan.freeze(deferral=deferral, training=training, kept_by_target=kept_by_target, approx=approx,
                       emissions=MappingProxyType(_emissions(view, plan, deferral, approx)), needs=needs)


def _emissions(view: View, plan: _Draft, deferral: DeferDecision,
               approx: Sequence[str]) -> dict[str, NormEmission]:
    """How each swapped norm is emitted, from the decisions about β, γ, rotation, fusion, deferral,
    compression and the approximate swap: one record per norm, in the order they are emitted."""
    deferred = {d.norm: d for d in deferral.deferred}
    crms_norms = {c.name: c for cc in plan.compressions if cc.compressed for c in cc.crms}
    readouts = {n: Readout(r.basis_of(n), r.width_of(n), plan.gammas[n].gamma, rotated=n in r.float_gammas)
                for r in plan.stream_bases if r.rotated for n in (*r.readouts, *r.float_gammas)}
    rms_only = {n for r in plan.stream_bases if r.rotated and not r.keeps_mean for n in r.norms}
    sliced = {n: r for r in plan.stream_bases if r.sliced for n in r.norms}
    moved = {n for n, g in plan.gammas.items() if g.moved}

    def resized(n: str) -> dict:
        r = sliced.get(n)
        k = None if r is None else r.width_of(n)
        return {} if k is None or k == r.dim else dict(width=k, scale=(r.dim / k) ** 0.5, eps_scale=r.dim / k)

    out = {}
    for n in plan.swaps:
        if n in deferred:  # (β: placed by the deferral itself, W β + b after the row scale)
            out[n] = NormEmission(n, DEFERRED, unit_gamma=True, deferred=deferred[n])
            continue
        if n in crms_norms:  # (γ and β: in the compressed readers, or after the decompression)
            out[n] = NormEmission(n, CRMS, crms=crms_norms[n])
            continue
        bf = plan.betas.get(n)
        out[n] = NormEmission(n, FOLDED, beta_add=bf is None or bf.emits_add, unit_gamma=n in moved or n in readouts,
                              rms_only=n in rms_only, fuse_residual=n in plan.fuse_residual, readout=readouts.get(n),
                              **resized(n))
    for n in plan.rms_swaps:  # RMSNorms as given: no β; fused with the residual Add where the given op was
        out[n] = NormEmission(n, AS_GIVEN, beta_add=False, unit_gamma=True, rms_only=True,
                              fuse_residual=_own_add(view, n), readout=readouts.get(n), **resized(n))
    for n in approx:
        out[n] = NormEmission(n, APPROXIMATE, beta_add=True, rms_only=True)
    return out


def approximate(view: View, report: Report, names: frozenset) -> FrozenList:
    """Mode "rms-approx": the kept norms of `names` become RMSNorms with their β (not exact; the
    choice and its measured error are passes/approx.py's). A folded norm is exact already; a norm
    that is no single-axis LayerNorm cannot be swapped."""
    verdicts = {v.name: v for v in report.norms}
    unknown = sorted(n for n in names if n not in verdicts)
    if unknown:
        raise LnfoldError(f"approximate swap: `{unknown[0]}` is not a LayerNorm of the model")
    out = []
    for node in view.norms():
        v = verdicts.get(node.name) if node.name in names else None
        if v is not None and v.verdict == "keep" and not node.norm_rejection:
            v.verdict = "approx"
            v.reason = "swapped to RMSNorm although its input keeps its mean: NOT exact (" + v.reason + ")"
            v.beta = "kept as an Add"
            out.append(node.name)
    return FrozenList(out)


def _kept_by_target(plan: _Draft, caps: Capabilities) -> list[str]:
    """The folded norms the target keeps (its stream stays centered), each reported with why."""
    swaps = frozenset(plan.swaps)
    verdicts = {v.name: v for v in plan.report.norms}
    out = []
    for name in plan.swaps:
        reason = caps.swap_refusal(name, swaps) if caps.swap_refusal is not None else None
        bf = plan.betas.get(name)
        if reason is None and not caps.norm_beta and bf is not None and bf.emits_add:
            reason = (f"its β stays ({bf.why}) and {caps.name}'s RMSNorm has no β; it stays a LayerNorm on "
                      "its centered stream")
        if reason is not None:
            verdicts[name].verdict, verdicts[name].reason = "keep", reason
            out.append(name)
            plan.keep_beta(name)  # the norm it keeps adds its own β
    plan.swaps[:] = [n for n in plan.swaps if n not in out]
    return FrozenList(out)


def _defer(view: View, plan: _Draft, decision: DeferDecision) -> None:
    """The deferred norms place β themselves (W β + b after the row scale) and fuse no Add;
    γ goes into their readers' weights (constant edits, float64, cast once)."""
    for d in decision.deferred:
        plan.keep_beta(d.norm, "into the bias of " + ", ".join(f"`{r.node}`" for r in d.readers) + " (deferred)"
                       if d.beta else "")
        if d.norm in plan.fuse_residual:
            plan.fuse_residual.remove(d.norm)
            for s in plan.report.streams:
                if d.norm in s.fused:
                    s.fused.remove(d.norm)
    for v in plan.report.norms:
        if v.name in decision.reasons:
            v.defer_reason = decision.reasons[v.name]
        elif any(d.norm == v.name for d in decision.deferred):
            v.deferred = True
    plan.const_edits.extend(gamma_edits(view, decision))


@dataclass
class _Work:
    """What the steps of `_draft` share while they decide: each norm's verdict, each reported
    stream's edited readers, and the edits of each constant use. (value, user, input) -> (reader
    ops, source ops): a constant can be both a CRMS reader's weight and a source of another
    stream; reader ops (on its input axis, or b + Wβ on a bias) come first, then the centering,
    as C(b + Wβ) = C(b) + C(W)β."""

    verdicts: dict[str, NormVerdict] = field(default_factory=dict)
    stream_readers: list[set[str]] = field(default_factory=list)  # per reported stream: its edited readers
    rms_streams: dict[str, int] = field(default_factory=dict)  # an all-RMSNorm component's first norm -> stream
    uses: dict[tuple, tuple[list, list]] = field(default_factory=dict)
    owner: dict[tuple, int] = field(default_factory=dict)  # (value, user, input) -> the stream that centers it first
    scaled_by: dict[str, int] = field(default_factory=dict)  # LayerScale Mul -> its stream

    def use(self, ref: ConstRef) -> tuple[list, list]:
        return self.uses.setdefault(_key(ref), ([], []))


def _key(ref: ConstRef) -> tuple:
    return ref.value, ref.user, ref.user_input


def _draft(view: View, mode: str, request: PlanRequest) -> _Draft:
    """The edits of every foldable component: what the analysis and the request allow, decided
    by the steps below in this order (each reads what the ones before it decided)."""
    plan = _Draft(mode=mode, components=analyze(view), report=Report(mode=mode),
                  origins={n.name: n.origin for n in view.nodes.values() if n.origin != n.name})
    work = _Work()
    for step in (_fold_streams, _gamma_and_rotation, _online_rotations, _bias_sources, _collect_const_edits,
                 _layer_scales, _betas_and_fusion, _verdicts):
        step(view, plan, request, work)
    return plan


def _fold_streams(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """Each component's verdicts and edits: the centering of its sources (after their LayerScale),
    β into the readers' biases, and for CRMS the compression the readers absorb."""
    refuse, zero, caps, use = request.refuse, request.zero, request.target, work.use
    for comp in plan.components:
        if comp.rms:
            _as_given(view, plan, comp, work)
            continue
        reason = comp.reason() if not comp.foldable else (refuse(comp) if refuse else None)
        if reason:
            for n in comp.norms:  # each kept norm's reason names its own input
                work.verdicts[n] = NormVerdict(n, "keep", comp.reason(n) if not comp.foldable else reason,
                                               blockers=comp.blocker_texts())
            continue
        k = len(plan.report.streams)
        edits, readers = _stream_edits(view, comp)
        plan.report.streams.append(edits)
        work.stream_readers.append(readers)
        for n in comp.norms:
            work.verdicts[n] = NormVerdict(n, "fold", recentered=bool(comp.opaque), stream=k)
        plan.swaps.extend(comp.norms)
        plan.recenters.extend(Recenter(o.value, o.axis) for o in comp.opaque)
        cc = compress(view, comp) if plan.mode == "crms" else None
        if cc is not None:
            plan.compressions.append(cc)
        shrink = cc is not None and cc.compressed
        if not shrink and caps.folds_beta:  # (CRMS: β goes with γ into the compressed readers, below)
            for n in comp.norms:
                # (the hand-off's nn.RMSNorm has no β: it asks for new biases even with γ kept)
                bf = plan.betas[n] = betas.decide(view, n, zero,
                                                  into_readers=request.gamma_into_readers or caps.new_biases)
                for b, add in bf.edits:
                    use(b)[0].append(add)
                plan.new_biases.extend(NewBias(node, add, w.value, w) for node, add, w in bf.new)
        for src in comp.sources:
            for s in src.scales:
                work.scaled_by.setdefault(s.user, k)
                ops = use(s)[1]
                narrows = shrink and size_along(view, s.value, s.axis) != 1
                ops[:] = [Ones()] + ([_drop_last(s.axis, cc.width)] if narrows else [])
            for ref in src.refs:
                ops = use(ref)[1]
                center = _center(ref)
                if work.owner.setdefault(_key(ref), k) != k:  # disjoint runs of one constant, another stream's
                    ops.append(center)
                    continue
                ops[:] = [Scale(s.value, s.axis, ref.axis) for s in src.scales] + [center]
                if shrink and ref.axis is not None and size_along(view, ref.value, ref.axis) != 1:
                    ops.append(_drop_last(ref.axis, cc.width))
        if shrink:
            _absorb_compression(plan, cc, use)
    for n in view.rms_norms():
        first = next((c.norms[0] for c in plan.components if n.name in c.norms), None)
        plan.report.rms_norms.append(RmsNorm(n.name, n.op, stream=work.rms_streams.get(first)))


def _absorb_compression(plan: _Draft, cc: ComponentCompression, use: Callable) -> None:
    """CRMS: each compressed reader's weight takes γ and the decompression, its bias W β."""
    for a in cc.absorbs:
        w = a.read.weight
        ops = use(w)[0]
        if a.gamma is not None:
            ops.append(Scale(a.gamma, 0, w.axis))
        ops.append(FoldDecompression(w.axis))
        if a.beta is None:
            continue
        add = AddWeightTimes(w.value, w.axis, a.beta)
        if a.read.bias is not None:
            b = a.read.bias
            use(b)[0].append(add)
        else:
            plan.new_biases.append(NewBias(a.node, add, w.value, w))


def _bias_sources(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """W β joins the reader's output: a new bias takes its weight's source edits too."""
    plan.new_biases[:] = [replace(nb, then=tuple(op.without_axis(nb.weight.axis)
                                                 for op in work.uses.get(_key(nb.weight), ([], []))[1]))
                          for nb in plan.new_biases]


def _collect_const_edits(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """One ConstEdit per constant and ops; a constant other nodes read too is cloned, and the
    stream whose readers it edits says so."""
    zero = request.zero
    plan.const_edits += const_edits(view, ((value, tuple(reader_ops + source_ops), (user, idx))
                                           for (value, user, idx), (reader_ops, source_ops) in work.uses.items()))
    for e in (e for e in plan.const_edits if e.clone):
        others = sorted(set(view.values[e.value].consumers) - set(e.users))
        # exporters de-duplicate equal initializers: one all-zero tensor is then a bias and a β
        shared = (" (one all-zero tensor the exporter shared between them)"
                  if zero is not None and zero(e.value) and any(view.nodes[o].norm for o, _ in others) else "")
        note = (f"`{e.value}`: also read by {view.nodes[others[0][0]].describe()}"
                + (f" and {len(others) - 1} more" if len(others) > 1 else "") + shared
                + (", which keep" if len(others) > 1 else ", which keeps") + " the original")
        for s, readers_of_s in zip(plan.report.streams, work.stream_readers):
            if any(u[0] in readers_of_s for u in e.users) and note not in s.cloned:
                s.cloned.append(note)


def _layer_scales(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """A LayerScale Mul whose γ went into its sources' weights (Ones) goes, where nothing else needs it."""
    for mul, k in work.scaled_by.items():
        if _bypassable(view, mul):
            plan.drop_muls.append(mul)
            plan.report.streams[k].dropped.append(view.nodes[mul].describe())


def _betas_and_fusion(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """Each swapped norm's β as the report says it, and the residual Adds the target fuses into it."""
    caps = request.target
    crms_norms = {c.name: c for cc in plan.compressions if cc.compressed for c in cc.crms}
    for name in plan.swaps:
        if name in crms_norms:
            work.verdicts[name].beta = _crms_beta(view, crms_norms[name])
            continue
        work.verdicts[name].beta = plan.betas[name].describe() if name in plan.betas else ""
        if caps.fuses_residual is not None and _fusable(view, name, plan, caps.fuses_residual):
            plan.fuse_residual.append(name)
            plan.report.streams[work.verdicts[name].stream].fused.append(name)


def _verdicts(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """The report's records in the graph's order: every norm's verdict, near misses, compressions."""
    for node in view.norms():
        if node.name not in work.verdicts:
            work.verdicts[node.name] = NormVerdict(node.name, "keep", node.norm_rejection or "not analyzed")
    plan.report.norms = [work.verdicts[n.name] for n in view.norms()]
    plan.report.near_misses = [NearMiss(name, m.reason) for name, m in view.near_misses.items()]
    plan.report.recentered = len(plan.recenters)
    for cc in plan.compressions:
        plan.report.compression.append(CompressionVerdict(
            list(cc.norms), "compressed" if cc.compressed else "rms", cc.reason, cc.width,
            cc.decompressions))


def _as_given(view: View, plan: _Draft, comp: Component, work: _Work) -> None:
    """A component some of whose norms are RMSNorms as given: nothing centers it, since
    an RMSNorm's output depends on its input's mean; its LayerNorms are kept, naming the RMSNorm.
    All of them RMSNorms, it is a stream of the report, for γ into the readers and rotation."""
    layer_norms = [n for n in comp.norms if n not in comp.rms]
    if layer_norms:
        why = (f"its stream is also normalized by {view.nodes[comp.rms[0]].describe()}, an RMSNorm as given, whose "
               "output depends on the stream's mean: centering the stream would change it")
        for n in layer_norms:
            work.verdicts[n] = NormVerdict(n, "keep", why, blockers=[why] + comp.blocker_texts())
        return
    work.rms_streams[comp.norms[0]] = len(plan.report.streams)
    plan.report.streams.append(StreamEdits(rms=list(comp.norms)))
    work.stream_readers.append(set())


def _gamma_and_rotation(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """γ into the readers' weights (passes/gamma.py), then each folded stream's rotation
    (passes/rotate.py): reader ops (Scale by γ, then Project of the input side) and source ops
    (after the centering: Project of the output side). The streams of RMSNorms as given alike,
    with nothing centered."""
    if not request.gamma_into_readers:
        return
    caps = request.target
    swaps = frozenset(plan.swaps)
    refusal = (lambda n: caps.swap_refusal(n, swaps)) if caps.swap_refusal is not None else (lambda n: None)
    crms = {n for cc in plan.compressions if cc.compressed for n in cc.norms}
    plan.gammas.update({n: gammas.decide(view, n, plan.betas.get(n), refusal(n), n in crms) for n in plan.swaps})
    as_given = [n for c in plan.components if c.norms and c.norms[0] in work.rms_streams for n in c.norms]
    plan.gammas.update({n: gammas.decide(view, n, None, refusal(n)) for n in as_given})
    if request.gamma_in_float:  # (where γ could move: it stays beside the rotation instead)
        plan.gammas.update({n: replace(g, in_float=True) for n, g in plan.gammas.items() if g.moved and g.gamma})
    said = {**{r.name: r for r in plan.report.rms_norms}, **work.verdicts}  # each norm's record in the report
    for n, g in list(plan.gammas.items()):
        if g.moved and request.trainable is not None and any(request.trainable(r.weight.value) for r in g.readers):
            g = plan.gammas[n] = replace(g, why="its readers' weights are trained "
                                         "(the training fold computes no γ edit)")
        said[n].gamma = g.describe(view)
        for ref, op in g.edits(view):
            work.use(ref)[0].append(op)
    if request.rotate is not None or request.bases is not None:
        _rotations(view, plan, request, work, said)
    readouts = {n for r in plan.stream_bases if r.rotated for n in (*r.readouts, *r.float_gammas)}
    sliced = {n for r in plan.stream_bases if r.sliced for n in r.norms}  # re-emitted over k features
    plan.rms_swaps[:] = [n for n in as_given
                         if n in readouts or n in sliced or (plan.gammas[n].moved and plan.gammas[n].gamma)]


def _online_rotations(view: View, plan: _Draft, request: PlanRequest, work: _Work) -> None:
    """online_hadamard (passes/online.py): each stream writer's input times H before it, Hᵀ into its
    weight's input side (after γ and a stream rotation's Project there: the ops compose in order)."""
    if not request.online_hadamard:
        return
    if not request.target.readout_matmul:
        plan.report.notes.append(f"online_hadamard: not applied ({request.target.name} cannot emit the constant "
                                 "MatMul before each layer)")
        return
    plan.online[:] = online.plan_online(view, [c for c in plan.components if c.norms], request.seed,
                                        request.trainable)
    if not plan.online:
        plan.report.notes.append("online_hadamard: no linear layer with a constant weight writes a stream")
        return
    for o in plan.online:
        work.use(o.weight)[0].append(o.edit)
    matrices = " / ".join(f"{n}×{n} {kind}" for n, kind in sorted({(o.basis.dim, o.basis.kind) for o in plan.online}))
    plan.report.notes.append(
        f"online_hadamard: the input of {len(plan.online)} linear layer(s) that write a stream times a constant "
        f"{matrices} matrix before it, its transpose folded into the layer's weight (exact; kept float by the "
        "quantizers)")


def _rotations(view: View, plan: _Draft, request: PlanRequest, work: _Work, said: dict) -> None:
    caps, rms_streams = request.target, work.rms_streams
    swaps = frozenset(plan.swaps)
    for comp in (c for c in plan.components
                 if c.norms and (all(n in swaps for n in c.norms) or c.norms[0] in rms_streams)):
        given = request.bases.get(comp.norms[0]) if request.bases is not None else None
        if request.rotate is None and given is None:
            continue  # a slice that leaves this stream as it is
        # per-block bases (passes/segments.py): the request names each segment's first norm
        blocks = {n: request.bases[n] for n in comp.norms if n in request.bases} if given is not None else {}
        stream = rms_streams[comp.norms[0]] if comp.norms[0] in rms_streams else work.verdicts[comp.norms[0]].stream
        rot = plan_rotation(view, comp, stream, request.rotate, request.seed, plan.gammas,
                            given, blocks if len(blocks) > 1 else None,
                            spared_for(request.spare_channels, comp.norms[0]), guarded=not request.capture)
        if rot.rotated and request.trainable is not None and any(request.trainable(r.value) for r, _ in rot.writers):
            rot = rot.unrotated("its writers are trained (the training fold computes no rotation)")
        if rot.rotated and not caps.readout_matmul and (needs := _needs_matmul(rot)):
            rot = rot.unrotated(f"{needs}, which {caps.name} cannot emit")
        refused = next((w for n in comp.norms if (w := caps.resize_refusal(n))), None) \
            if rot.sliced and caps.resize_refusal is not None else None
        if refused is not None:
            rot = rot.unrotated(refused)
        if rot.sliced:
            rot = slicing.resize(view, comp, rot)
        plan.stream_bases.append(rot)
        plan.report.streams[rot.stream].rotation = rot.describe()
        if rot.sliced and request.center_embeddings and comp.norms[0] in rms_streams:
            _center_embeddings(view, comp, work.use, plan.report.streams[rot.stream])
        for n in rot.readouts:
            said[n].gamma += "; its output is un-rotated by a constant MatMul (Qᵀ·diag γ)"
        for n in rot.float_gammas:
            said[n].gamma = ("kept in float after the norm, by a constant MatMul (Qᵀ·diag γ·Q); its readers "
                             "take Q alone")
        for ref, op in rot.readers:
            work.use(ref)[0].append(op)
        for ref, op in rot.writers:
            work.use(ref)[1].append(op)
    projected = {value: op for r in plan.stream_bases for value, op in r.starts}
    plan.recenters[:] = [replace(rc, project=projected.get(rc.value)) for rc in plan.recenters]


def _needs_matmul(rot: StreamBasis) -> Optional[str]:
    """What of a rotated stream needs a constant MatMul emitted (None: nothing)."""
    if rot.readouts:
        return f"{', '.join(f'`{n}`' for n in rot.readouts)} would need its output un-rotated by a constant MatMul"
    if rot.float_gammas:
        return f"γ kept in float after `{rot.float_gammas[0]}` would need a constant MatMul"
    if rot.shortcuts:
        return f"its residual shortcut into `{rot.shortcuts[0].node}` would need a constant MatMul (per-block bases)"
    if rot.starts:
        return f"its recentered start `{rot.starts[0][0]}` would need a constant MatMul after the recenter"
    return None


def _center_embeddings(view: View, comp: Component, use: Callable, edits: StreamEdits) -> None:
    """SliceGPT's centering of the embedding tables (PlanRequest.center_embeddings), before the
    slice's Project on their feature axis: NOT exact on a stream of RMSNorms."""
    for src in comp.sources:
        if src.node is None or view.nodes[src.node].rule is None or view.nodes[src.node].rule.kind != "embedding":
            continue
        for ref in src.refs:
            use(ref)[1].append(_center(ref))
            edits.centered.append(f"`{ref.value}` ({view.nodes[src.node].describe()})")


def _crms_beta(view: View, c) -> str:
    if view.nodes[c.name].norm.beta is None:
        return ""
    where = f"into the biases of {len(c.compressed_readers)} reader(s) (CRMS)" if c.compressed_readers else ""
    return "; ".join(w for w in (where, "added after the decompression" if c.decompress else "") if w)


def _bypassable(view: View, name: str) -> bool:
    """A LayerScale Mul whose vector is now all ones can go: it reads one tensor of its own
    output's shape (a broadcasting Mul would change the shape) and is no graph output."""
    node = view.nodes[name]
    if not is_product(node.rule) or len(node.outputs) != 1:
        return False
    out = view.values[node.outputs[0]]
    data = [v for v in node.inputs if v and not view.values[v].is_const]
    return (not out.is_graph_output and len(data) == 1 and out.shape is not None
            and view.values[data[0]].shape == out.shape)


def _fusable(view: View, name: str, plan: _Draft, fuses: Callable[[tuple], bool]) -> bool:
    """The norm reads, over its last axis, the sum of two equal-shaped tensors of a shape the
    target fuses (`fuses(shape)`), which no recenter comes between."""
    node = view.nodes[name]
    spec = node.norm
    x = view.values[node.inputs[spec.input]]
    if x.rank is None or spec.axis != x.rank - 1 or x.producer is None:
        return False
    if any(r.value == x.name for r in plan.recenters):
        return False
    if any(view.nodes[n].norm_input == x.name for n in plan.fuse_residual):
        return False  # another norm reading the same sum fuses its Add already
    add = view.nodes[x.producer]
    if add.origin == node.origin:  # the norm's own op: SkipLayerNormalization's Add, not Embed's lookups
        return kind_of(add.rule)[0] == "broadcast"
    if not is_sum_of_two(add.rule) or len(add.inputs) != 2:
        return False
    shapes = [view.values[v].shape for v in add.inputs]
    if any(view.values[v].is_const for v in add.inputs) or shapes[0] is None or shapes[0] != shapes[1]:
        return False
    return fuses(tuple(shapes[0]))


def _own_add(view: View, name: str) -> bool:
    """The norm's input is the sum its own op computes (SkipSimplifiedLayerNormalization's Add)."""
    node = view.nodes[name]
    x = view.values[node.norm_input]
    return x.producer is not None and view.nodes[x.producer].origin == node.origin


def _drop_last(axis: int, width: int) -> Project:
    """A compressed stream's writer keeps its first d−1 entries (CRMSNorm: the last is minus their sum)."""
    return Project(axis, Identity(width), width - 1)


def _center(ref) -> Center:
    b = ref.block
    return Center(ref.axis) if b is None else Center(ref.axis, b.size, b.lo, b.hi, b.stride)


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


def first_kept_reason(report: Report) -> Optional[str]:
    return next((f"{n.name}: {n.reason}" for n in report.norms if n.verdict == "keep"), None)
