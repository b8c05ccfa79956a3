"""Stream rotation: which folded streams can carry x·Q instead of x, and the edits that
make them — a `Project` of each writer's output side and each norm reader's input side. Why that is
exact (computational invariance), the recentered starts' MatMul and what keeps a stream unrotated:
DESIGN §6b.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import numpy as np

from . import orthogonal
from .analysis import Component
from .compress import size_along
from .edits import Basis, Project, Seeded, dense
from .errors import LnfoldError
from .frozen import FrozenList
from .options import MASSIVE
from .segments import segments
from .gamma import GammaFold
from .rules import kind_of
from .view import ConstRef, DimRef, View

# readers that see no values of the stream, or none a rotation of finite values changes: shapes and
# dtypes (an assert, Shape), isinf/isnan (finite in, finite out)
_BLIND = ("metadata", "nonfinite_test")


@dataclass(frozen=True)
class BasisShortcut:
    """Per-block bases (passes/segments.py): input `input` of the residual Add `node` is carried in
    `source` (its first `source_keep` entries) and the Add's output in `target` (`target_keep`); a
    constant MatMul by `B_s[:, :k_s]ᵀ·B_t[:, :k_t]` (k_s × k_t) on that input re-expresses it (at
    k = d exactly: B_sᵀB_t is orthogonal; k_s < k_t = d: into a full-width head segment)."""

    node: str
    input: int
    source: Basis
    target: Basis
    source_keep: int
    target_keep: int

    def matrix(self) -> np.ndarray:
        return dense(self.source)[:, :self.source_keep].T @ dense(self.target)[:, :self.target_keep]


@dataclass(frozen=True)
class StreamBasis:
    """One folded stream's basis, as the plan holds it: a rotation by Q of `kind` (width `dim`; a
    calibrated basis per stream or per segment where slicing asked for one, `width` < `dim` kept),
    or the stream kept in its own basis (`why`). Final: a change is a new one (`unrotated`, replace)."""

    stream: int  # index into Report.streams
    norms: Sequence[str]
    kind: str = ""  # resolved: "hadamard" where d allows one, else "orthogonal" (and "-keep-ln")
    dim: Optional[int] = None
    seed: int = 0
    # channels the rotation leaves as they are (spare_channels: a trained model's few massive-activation
    # channels, whose weights a rotation would spread over every channel's quantization blocks)
    spared: Sequence[int] = ()
    why: str = ""
    writers: Sequence[tuple[ConstRef, Project]] = ()  # output side
    readers: Sequence[tuple[ConstRef, Project]] = ()  # input side
    # norms whose γ stayed because of what reads them (a graph output, a non-linear reader): emitted
    # with unit weight followed by a constant `· Qᵀ·diag γ` (`plan.Readout`), which un-rotates
    # their output exactly, at the cost of one d×d MatMul each
    readouts: Sequence[str] = ()
    # norms whose γ stays in float (gamma_in_float): emitted with unit weight followed by a constant
    # `· Qᵀ·diag γ·Q` (a `plan.Readout` that stays rotated), their readers taking Q alone — so that
    # a quantizer never rounds γ's suppression of outlier channels into their weights
    float_gammas: Sequence[str] = ()
    # a basis given by the request (a calibrated one: passes/slicing.py) and the entries of it kept:
    # `keep` < `dim` slices the stream (NOT exact); None: the Seeded basis of `kind`, all kept
    given: Optional[Basis] = None
    keep: Optional[int] = None
    # per-block slices: the norms whose segment keeps another width than `keep` (full_width_head: the
    # segment the model's head reads keeps all d, as SliceGPT's does)
    norm_widths: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # sliced: the layout ops' size entries that spell d, each with the width it becomes
    dims: Sequence[tuple[DimRef, int]] = ()
    # recentered stream starts (passes/analysis.OpaqueStart): their recenter is followed by a MatMul
    # that projects the recentered tensor (value, the Project along its feature axis)
    starts: Sequence[tuple[str, Project]] = ()
    # per-block bases (a calibrated slice, passes/segments.py): each norm's own basis (absent: `basis`)
    # and the MatMuls on the residual shortcuts where one segment's basis meets the next's
    norm_bases: Mapping[str, Basis] = field(default_factory=lambda: MappingProxyType({}))
    shortcuts: Sequence[BasisShortcut] = ()
    # parameters the constant MatMuls above add (readouts, starts, shortcuts) and those a slice
    # deletes from the writers' and readers' constants (`parameter_change`)
    added: int = 0
    saved: int = 0

    @property
    def basis(self) -> Basis:
        return self.given if self.given is not None else Seeded(self.kind, self.dim, self.seed, tuple(self.spared))

    def basis_of(self, norm: str) -> Basis:
        """The basis `norm`'s input is carried in."""
        return self.norm_bases.get(norm, self.basis)

    @property
    def width(self) -> Optional[int]:
        """The stream's width once projected (`dim` unless sliced)."""
        return self.dim if self.keep is None else self.keep

    def width_of(self, norm: str) -> Optional[int]:
        """The width `norm`'s input is carried in (its segment's)."""
        return self.norm_widths.get(norm, self.width)

    @property
    def sliced(self) -> bool:
        return self.rotated and self.width != self.dim

    @property
    def rotated(self) -> bool:
        return not self.why

    @property
    def keeps_mean(self) -> bool:
        """Q·1 = 1: the rotated stream stays zero-mean (a LayerNorm on it stays exact)."""
        return self.given is None and self.kind.endswith("-keep-ln")

    def unrotated(self, why: str) -> "StreamBasis":
        """This stream with its rotation withdrawn (a target or a frontend cannot make it): it stays as it is."""
        return replace(self, why=why, writers=(), readers=(), readouts=(), float_gammas=(), starts=(),
                       norm_bases=MappingProxyType({}), shortcuts=())

    def describe(self) -> str:
        if not self.rotated:
            return f"not rotated: {self.why}"
        how = (f"projected on a calibrated basis ({self.kind}), d={self.dim} -> {self.width}" if self.given is not None
               else f"rotated ({self.kind}, d={self.dim}, seed {self.seed}"
               + (f"; channel(s) {', '.join(map(str, self.spared))} left unrotated)" if self.spared else ")"))
        text = f"{how}: {len(self.writers)} writer constant(s), {len(self.readers)} reader weight(s)"
        if self.shortcuts:
            text += (f"; {len(set(self.norm_bases.values()))} per-block bases, "
                     f"{len(self.shortcuts)} residual shortcut(s) re-expressed by a constant "
                     f"{self.width}×{self.width} MatMul")
            if self.norm_widths:
                text += (f" ({', '.join(f'`{n}`' for n in self.norm_widths)} read(s) all {self.dim} features: "
                         f"{self.width}×{self.dim} into that segment)")
        if self.starts:
            text += (f"; {len(self.starts)} recentered start(s) projected by a constant {self.dim}×{self.width} "
                     "MatMul after the recenter")
        if self.readouts:
            text += (f"; un-rotated after {', '.join(f'`{n}`' for n in self.readouts)} by a constant "
                     f"{self.width}×{self.dim} MatMul (Qᵀ·diag γ, one GEMM more)")
        if self.float_gammas:
            text += (f"; γ kept in float after {len(self.float_gammas)} norm(s) by a constant "
                     f"{self.width}×{self.width} MatMul (Qᵀ·diag γ·Q)")
        if self.added:
            text += f"; its constant MatMuls add {self.added:,} parameters"
            text += f" and the slice deletes {self.saved:,}" if self.sliced else ""
        return text


def rotatable(view: View, comp: Component, gammas: dict[str, GammaFold]) -> tuple[Optional[int], Optional[str]]:
    """(the stream's width, None) where the folded component can be carried in another basis,
    else (None, why not)."""
    why = _blocker(view, comp, gammas)
    return (None, why) if why is not None else _width(view, comp)


def spared_for(spare_channels, first_norm: str) -> tuple:
    """The channels a stream (by its first norm) spares: `spare_channels` as FoldOptions checked it
    (every stream's channels, or per stream: what MASSIVE resolved to); MASSIVE itself is resolved on
    rows before any plan (passes/massive.py) and never reaches one."""
    if spare_channels == MASSIVE:
        raise LnfoldError(f"spare_channels={MASSIVE!r} is found on rows by the fold's entry point (fold_onnx, "
                          "fold_module, quantize_onnx, quantize_module) before the plan: this entry point does not")
    if not spare_channels:
        return ()
    if isinstance(spare_channels[0], tuple):
        return dict(spare_channels).get(first_norm, ())
    return tuple(spare_channels)


def plan_rotation(view: View, comp: Component, stream: int, kind: Optional[str], seed: int,
                  gammas: dict[str, GammaFold], given: Optional[tuple[Basis, int]] = None,
                  blocks: Optional[Mapping[str, tuple[Basis, int]]] = None, spared: Sequence[int] = (),
                  guarded: bool = True) -> StreamBasis:
    """The rotation of one folded component, or why it stays as it is (pure, on the view):
    by the Seeded Q of `kind` (the identity on the channels `spared`), or by `given` = (basis,
    entries kept) (a calibrated slice); with `blocks` (the first norm of each segment -> its basis
    and entries kept, passes/segments.py), each segment in its own basis and width. `guarded`:
    refused where it costs more parameters than it saves (`_costs_more`; not for a capture's fold)."""
    out = StreamBasis(stream, FrozenList(comp.norms), seed=seed)
    d, why = rotatable(view, comp, gammas)
    if why is None and given is not None and given[0].dim != d:
        why = f"the basis given has width {given[0].dim}, the stream {d}"
    if why is not None:
        return replace(out, why=why)
    if given is not None:
        out = replace(out, dim=d, given=given[0], keep=given[1], kind=getattr(given[0], "key", type(given[0]).__name__))
    elif not orthogonal.can_spare(d, spared):
        return replace(out, why=f"the channels to spare ({', '.join(map(str, spared))}) are not channels of its "
                                f"width {d} (or leave fewer than two to rotate)")
    else:
        out = replace(out, dim=d, kind=orthogonal.resolved_kind(kind, d - len(spared)),
                      spared=FrozenList(sorted(spared)))
    if blocks:  # (the stream's width is its narrowest segment's: a segment kept d wide is one of norm_widths)
        out = replace(out, keep=min(w for _, w in blocks.values()))
    keep = out.width
    project_value = lambda axis, value: Project(axis, out.basis, keep)  # noqa: E731 (one basis, one width)
    if blocks:
        seg = segments(view, comp)
        if seg.why is not None or set(seg.heads) != set(blocks):
            return out.unrotated(f"per-block bases: {seg.why or 'the bases given are not one per segment'}")
        out = replace(out, norm_bases=MappingProxyType({n: blocks[h][0] for n, h in seg.of_norm.items()}),
                      norm_widths=MappingProxyType({n: blocks[h][1] for n, h in seg.of_norm.items()
                                                    if blocks[h][1] != keep}),
                      shortcuts=FrozenList(BasisShortcut(s.node, s.input, blocks[s.source][0], blocks[s.target][0],
                                                         blocks[s.source][1], blocks[s.target][1])
                                           for s in seg.shortcuts))
        project_value = lambda axis, value: Project(axis, *blocks[seg.of_value[value]])  # noqa: E731
    writers = []
    for src in comp.sources:
        for ref in src.refs:
            if ref.axis is None or size_along(view, ref.value, ref.axis) == 1:
                continue  # uniform along the features: centered to zero, nothing to rotate
            written = _written(view, comp, src, ref) if blocks else None
            if blocks and written is None:
                return out.unrotated(f"per-block bases: which stream tensor `{ref.value}` writes is not known")
            writers.append((ref, project_value(ref.axis, written)))
    out = replace(out, writers=FrozenList(writers),
                  readers=FrozenList((r.weight, Project(r.weight.axis, out.basis_of(n), out.width_of(n)))
                                     for n in comp.norms for r in gammas[n].readers),
                  starts=FrozenList((o.value, project_value(o.axis, o.value)) for o in comp.opaque),
                  readouts=FrozenList(n for n in comp.norms if _readout(view, gammas[n])),
                  float_gammas=FrozenList(n for n in comp.norms if gammas[n].in_float))
    added, saved = parameter_change(view, out)
    out = replace(out, added=added, saved=saved)
    why = _costs_more(view, out) if guarded else None
    return out if why is None else out.unrotated(why)


def parameter_change(view: View, rot: StreamBasis) -> tuple[int, int]:
    """(parameters `rot` adds, parameters it deletes): its constant MatMuls (readouts, recentered
    starts, residual shortcuts, float γ products) against the share (d − k)/d of each writer and
    reader constant a slice to k cuts off (each constant once)."""
    d, k = rot.dim, rot.width
    added = (sum(d * rot.width_of(n) for n in rot.readouts) + sum(d * p.keep for _, p in rot.starts)
             + sum(s.source_keep * s.target_keep for s in rot.shortcuts) + len(rot.float_gammas) * k * k)
    cut = {ref.value: _elements(view, ref.value) * (d - p.keep) for ref, p in rot.writers + rot.readers}
    return added, sum(cut.values()) // d


def _costs_more(view: View, rot: StreamBasis) -> Optional[str]:
    """Why the stream keeps its basis where changing it costs more than it gives: a slice
    must never add parameters, so its un-projections may not outweigh what it deletes; a rotation is
    absorbed by its readers' weights, so its un-rotations may not outweigh those (a stream read by
    nothing but non-linear ops would only gain d×d MatMuls). None where it pays."""
    if not rot.added:
        return None
    what = ", ".join(f"{len(items)} {name}" for items, name in (
        (rot.readouts, "un-rotating readout(s)"), (rot.starts, "projected recentered start(s)"),
        (rot.shortcuts, "residual shortcut(s)"), (rot.float_gammas, "float γ product(s)")) if items)
    if rot.width < rot.dim:
        if rot.added > rot.saved:
            return (f"slicing it would add parameters: the constant MatMuls of its {what} hold {rot.added:,}, "
                    f"more than the {rot.saved:,} the slice deletes from its writers and readers")
        return None
    absorbed = sum({ref.value: _elements(view, ref.value) for ref, _ in rot.readers}.values())
    if rot.added > absorbed:
        return (f"its readers' weights absorb too little of a rotation: the constant MatMuls of its {what} would "
                f"add {rot.added:,} parameters, more than the {absorbed:,} of the {len(rot.readers)} reader "
                "weight(s) that take it")
    return None


def _elements(view: View, value: str) -> int:
    shape = view.values[value].shape
    return prod(shape) if shape is not None and all(isinstance(x, int) for x in shape) else 0


def _written(view: View, comp: Component, src, ref) -> Optional[str]:
    """The stream tensor a source constant's term enters (its user's output, or its writer's)."""
    for name in (ref.user, src.node):
        outs = [o for o in view.nodes[name].outputs if o in comp.axes] if name is not None else []
        if outs:
            return outs[0]
    return None


def _readout(view: View, g: GammaFold) -> bool:
    """The norm keeps γ because of its readers, γ is a constant (or absent) and the features are
    its output's last axis (a MatMul's): it can un-rotate its output."""
    node = view.nodes[g.norm]
    rank = view.values[node.outputs[0]].rank
    return (not g.moved and g.by_readers and rank is not None and node.norm.axis == rank - 1
            and (g.gamma is None or view.values[g.gamma].is_const))


def _blocker(view: View, comp: Component, gammas: dict[str, GammaFold]) -> Optional[str]:
    if comp.blocks:
        return "its norms normalize blocks of the features (per-head norms)"
    why = _as_given(view, comp) if comp.rms else None
    if why is not None:
        return why
    for o in comp.opaque:
        rank = view.values[o.value].rank
        if rank is None or o.axis not in (rank - 1, rank - 2):
            return (f"{o.what} starts the stream (recentered) with its features on axis {o.axis} of "
                    f"{'unknown rank' if rank is None else f'rank {rank}'}: a MatMul after the recenter "
                    "can project only the last two")
    for n in comp.norms:
        g = gammas.get(n)
        if g is None or (not g.moved and not g.in_float and not _readout(view, g)):
            why = g.why if g else "not asked"
            hint = ("; a model's hidden states as its output: fold it with the head that reads them"
                    if g is not None and g.read_as_output else "")
            return f"the γ of {view.nodes[n].describe()} stays in the norm ({why}){hint}"
    norms = set(comp.norms)
    for value in comp.axes:
        for name, i in view.values[value].consumers:
            node = view.nodes[name]
            if name in norms and node.norm_input == value:
                continue
            if any(o in comp.axes for o in node.outputs):
                continue  # a transparent op: it commutes with a map of the feature axis
            if node.rule is not None and kind_of(node.rule)[0] in _BLIND:
                continue
            return (f"{node.describe()} reads the stream tensor `{value}` and is neither one of its norms nor "
                    "transparent")
    for src in comp.sources:
        for ref in src.refs:
            if ref.block is not None:
                return f"`{ref.value}` is centered in blocks"
    if comp.blockers:  # (a stream that folds has none; one of RMSNorms as given may: its own words)
        return comp.blockers[0].text
    return None


def _as_given(view: View, comp: Component) -> Optional[str]:
    """Why a stream of RMSNorms as given cannot be rotated by its writers' constants alone:
    nothing centers or recenters it, so every term it is the sum of must be a constant's, able to
    take Q, and nothing else may see it (RMSNorm₁(xQ) = RMSNorm₁(x)·Q holds for any x)."""
    if len(comp.rms) != len(comp.norms):
        return f"its LayerNorms are kept: it is also normalized by RMSNorm `{comp.rms[0]}`"
    for value in comp.axes:
        if view.values[value].is_graph_output:
            return f"the stream tensor `{value}` is a graph output (the model's output would be rotated)"
    for o in comp.opaque:
        return (f"{o.what} starts the stream, and no constant edit can rotate what it writes (a stream of "
                "RMSNorms as given is not recentered)")
    for src in comp.sources:
        for s in src.scales:
            return (f"{view.nodes[s.user].describe()} scales the stream per feature (a LayerScale), which does not "
                    "commute with a rotation")
        for ref in src.refs:
            if ref.axis is None or size_along(view, ref.value, ref.axis) == 1:
                return (f"`{ref.value}` adds the same value to every feature of the stream, which a rotation would "
                        "spread over the features")
    return None


def _width(view: View, comp: Component) -> tuple[Optional[int], Optional[str]]:
    widths = set()
    for value, axis in comp.axes.items():
        w = size_along(view, value, axis)
        if not isinstance(w, int):
            return None, f"the width of the stream tensor `{value}` is not known"
        widths.add(w)
    if len(widths) != 1:
        return None, f"its tensors have different widths {sorted(widths)}"
    return widths.pop(), None
