"""Slicing (SliceGPT, Ashkboos et al., ICLR 2024): a folded stream carried in its first k principal
directions instead of its d features. NOT exact: what lies outside them is deleted. DESIGN §6b.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping, Optional

import numpy as np

from .analysis import Component
from .compress import absorbing, follows_stream, producer_width_refs, sized_off_stream
from .edits import DataBasis
from .errors import LnfoldError
from .frozen import FrozenList
from .rotate import StreamBasis, rotatable
from .segments import segments
from .view import View

NOT_EXACT = "NOT exact"
METADATA_KEY = "lnfold.slice"
CALIBRATED = ("slicing", "the stream's principal directions are computed from them")  # (check_calibration)


def check_fraction(fraction) -> float:
    """F, the share of each sliced stream's width deleted, as a float in (0, 1); else a one-line error."""
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise LnfoldError(f"fraction must be a number in (0, 1), got {fraction!r}") from None
    if not math.isfinite(f) or not 0 < f < 1:
        raise LnfoldError(f"fraction must be in (0, 1) (the share of each stream's width deleted), got {fraction!r}")
    return f


def kept_width(d: int, fraction: float) -> int:
    """k = d − round(F·d), at least 1."""
    return max(1, d - int(round(fraction * d)))


def second_moment(batches: list[np.ndarray], axis: int, unit_rms: bool = True) -> tuple[np.ndarray, int]:
    """(Σ uuᵀ / n over the rows of the batches along `axis`, n), in float64: each row u = x / rms(x)
    (`unit_rms`: every row weighs the same) or x as it is (SliceGPT's: a row weighs its norm², so a
    few tokens with massive activations set the leading directions). Rows of all zeros (padding) have
    no direction and are left out."""
    total, n = None, 0
    for x in batches:
        x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
        x = x.reshape(-1, x.shape[-1])
        rms = np.sqrt((x * x).mean(axis=1))
        u = x[rms > 0] / rms[rms > 0, None] if unit_rms else x[rms > 0]
        m = u.T @ u
        total = m if total is None else total + m
        n += u.shape[0]
    if total is None or n == 0:
        raise LnfoldError("no calibration row reached the stream (all rows zero)")
    return total / n, n


def principal_basis(moment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q, eigenvalues): the eigenvectors of the symmetric `moment` as columns, by descending
    eigenvalue (float64)."""
    values, vectors = np.linalg.eigh(moment)
    order = np.argsort(values)[::-1]
    return np.ascontiguousarray(vectors[:, order]), np.clip(values[order], 0.0, None)


@dataclass
class StreamSlice:
    """One folded stream: its width before and after, the share of the calibration rows' energy
    kept (Σ of the kept eigenvalues / Σ of all), or why it keeps its full width."""

    stream: int
    norms: list[str]
    dim: Optional[int] = None
    keep: Optional[int] = None
    variance_kept: Optional[float] = None
    rows: int = 0  # the stream vectors the basis is computed from: one per position of each row, per norm input
    # the fewest vectors any of its bases is computed from: below `dim` they span at most that many
    # directions, the basis's others are arbitrary and the variance kept describes these vectors only
    span: Optional[int] = None
    why: str = ""
    # --per-block: the number of bases (one per segment between norms, passes/segments.py), or why
    # the stream has one basis after all
    bases: int = 1
    one_basis_why: str = ""
    # full_width_head: the norms of the segments the model's head reads, which keep all `dim` features
    full_width: list[str] = field(default_factory=list)

    @property
    def sliced(self) -> bool:
        return not self.why

    def line(self) -> str:
        head = f"stream {self.stream} ({len(self.norms)} norm(s) from `{self.norms[0]}`)"
        if not self.sliced:
            return f"{head}: full width{f' {self.dim}' if self.dim else ''}: {self.why}"
        bases = f"; {self.bases} per-block bases" if self.bases > 1 else ""
        bases += (f"; {', '.join(f'`{n}`' for n in self.full_width)} (the last segment) read(s) all {self.dim} "
                  "features" if self.full_width else "")
        one = f"; one basis: {self.one_basis_why}" if self.one_basis_why else ""
        return (f"{head}: width {self.dim} -> {self.keep}, variance kept {self.variance_kept:.4%} "
                f"({self.rows} calibration vectors: one per position of each row, per norm input){self.deficient()}"
                f"{bases}{one}")

    def deficient(self) -> str:
        """What the line says where the calibration vectors span fewer directions than the width."""
        if self.span is None or self.dim is None or self.span >= self.dim:
            return ""
        return (f"; WARNING: {self.span} vectors span at most {self.span} of the {self.dim} directions (fewer vectors "
                f"than features: a rank-deficient basis whose other {self.dim - self.span} directions are arbitrary, "
                "and a variance kept that says nothing of other inputs): give more calibration rows")


@dataclass
class SlicePlan:
    """The calibrated bases a slice asks the planner for (PlanRequest.bases), and the per-stream account."""

    fraction: float
    # the stream's first norm -> (DataBasis, k); per-block, the first norm of each segment
    bases: dict = field(default_factory=dict)
    streams: list[StreamSlice] = field(default_factory=list)
    # per-block streams: each one's segments (their first norms) in the stream's order, and each
    # segment's norm inputs (value, feature axis): what a sequential step captures
    order: list[tuple[StreamSlice, list[str]]] = field(default_factory=list)
    inputs: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def plan_slices(view: View, components: list[Component], gammas: Mapping, stream_of: Mapping[str, int],
                captured: Mapping[str, list[np.ndarray]], fraction: float, per_block: bool = False,
                full_width_head: bool = False) -> SlicePlan:
    """The basis of every rotatable folded stream of the exact fold and of every stream of RMSNorms as
    given (`stream_of`: norm -> its stream's index in the report), from `captured` (norm input value ->
    its batches in the exact fold's model on the calibration rows). `per_block`: a basis per segment
    (passes/segments.py) from its own norms' inputs, where the residual Adds allow; else one basis from
    all the stream's norm inputs pooled. `full_width_head`: the last segments, which the head reads,
    keep all d features, as SliceGPT's head does."""
    out = SlicePlan(fraction)
    for comp in components:
        if not comp.norms or comp.norms[0] not in stream_of:
            continue
        s = StreamSlice(stream_of[comp.norms[0]], list(comp.norms))
        out.streams.append(s)
        s.dim, why = rotatable(view, comp, gammas)
        if why is None:
            missing = [n for n in comp.norms if not captured.get(norm_input(view, n)[0])]
            if missing:
                why = (f"the input of `{missing[0]}` is not a tensor the model computes by itself (a fused op's "
                       "part): it cannot be captured")
        if why is not None:
            s.why = why
            continue
        s.keep = kept_width(s.dim, fraction)
        groups = {comp.norms[0]: list(comp.norms)}  # the first norm of each basis's group -> its norms
        full = set()  # the groups that keep all d features
        if per_block:
            seg = segments(view, comp)
            if seg.why is None:
                groups = {h: [n for n, g in seg.of_norm.items() if g == h] for h in seg.heads}
                if full_width_head and len(groups) > 1:
                    full = set(groups) - {c.source for c in seg.shortcuts}
                    s.full_width = [n for h in groups if h in full for n in groups[h]]
            else:
                s.one_basis_why = seg.why
        if len(groups) > 1:
            out.order.append((s, list(groups)))
        kept, s.rows = 0.0, 0
        for head, norms in groups.items():
            out.inputs[head] = [norm_input(view, n) for n in norms]
            # a segment's own inputs: their raw moment, as SliceGPT's (SmolLM2 F=0.25 per block: 71.2
            # against 76.5 from unit-RMS rows; SliceGPT 68.3); pooled over every norm of a stream, the
            # raw moment is the deepest layers' massive activations' (161): unit-RMS rows there
            moments = [second_moment(captured[value], axis, unit_rms=len(groups) == 1)
                       for value, axis in out.inputs[head]]
            rows = sum(n for _, n in moments)
            q, eigenvalues = principal_basis(sum(m * n for m, n in moments) / rows)
            keep = s.dim if head in full else s.keep
            kept += rows * float(eigenvalues[:keep].sum() / eigenvalues.sum())
            s.rows += rows
            s.span = rows if s.span is None else min(s.span, rows)
            out.bases[head] = (DataBasis(f"pca:{head}", q), keep)
        s.variance_kept, s.bases = kept / s.rows, len(groups)
    return out


def norm_input(view: View, norm: str) -> tuple[str, int]:
    """The value `norm` normalizes and its feature axis (non-negative where the rank is known)."""
    node = view.nodes[norm]
    value = node.norm_input
    rank = view.values[value].rank
    axis = node.norm.axis
    return value, axis + rank if axis < 0 and rank is not None else axis


def resize(view: View, comp: Component, rot: StreamBasis) -> StreamBasis:
    """`rot` with the layout ops' size entries that spell d on a sliced stream and between its norms
    and their readers (patched to k by the frontends: `Plan.resized_dims`); or the stream keeps its
    full width (`rot.why`) where an op sets the width in a shape no edit can change. A size read at run time
    from a stream tensor's feature axis narrows with it: nothing to patch (compress.follows_stream)."""
    d = rot.dim
    dims = []
    why = sized_off_stream(view, comp)
    if why is not None:
        return rot.unrotated(why)
    starts = {value for value, _ in rot.starts}  # the MatMul after their recenter writes k features
    # each stream tensor's width: its segment's (per-block widths), else the stream's
    of_value = segments(view, comp).of_value if rot.norm_widths else {}
    for value, axis in comp.axes.items():
        width = rot.width_of(of_value[value]) if value in of_value else rot.width
        for c, _ in view.values[value].consumers:
            node = view.nodes[c]
            if node.shape_only and follows_stream(node.width_refs(0, axis), comp)[0] != []:
                return rot.unrotated(f"{node.describe()} reads the width {d} of stream tensor `{value}`, "
                                          "which slicing changes")
        if value in starts:
            continue
        refs, why = follows_stream(producer_width_refs(view, value, axis), comp)
        if refs is None:
            return rot.unrotated(f"{view.nodes[view.values[value].producer].describe()} sets the stream's "
                                      f"width {d} in a shape no edit can change{why}")
        dims += [(ref, width) for ref in refs]
    for n in comp.norms:
        if n in rot.readouts:
            continue  # its output is taken back to d features
        node = view.nodes[n]
        for c, i in view.values[node.outputs[0]].consumers:
            got = absorbing(view, c, i, node.norm.axis, d)
            refs, why = follows_stream(got[1], comp) if got is not None else (None, "")
            if refs is None:
                return rot.unrotated(f"{view.nodes[c].describe()} reads `{n}` through a shape that spells "
                                          f"its width {d}, which no edit can change{why}")
            dims += [(ref, rot.width_of(n)) for ref in refs]
    return replace(rot, dims=FrozenList((ref, w) for ref, w in dict.fromkeys(dims) if w != d))


@dataclass
class SliceReport:
    """A slice's account: per stream, the parameters, the error against the exact fold (NOT exact)."""

    fraction: float
    streams: list[StreamSlice]
    params_before: int  # the exact fold's (the original's, unless it wrote a shared weight apart)
    params_after: int
    error: Optional[float] = None  # relative error against the exact fold (passes/metric.relative_error)
    error_rows: str = ""  # which rows it was measured on
    # the error was measured on the rows that chose the bases (none held out): it understates the
    # error on other inputs, and the report says so
    in_sample: bool = False
    notes: list[str] = field(default_factory=list)
    params_original: Optional[int] = None  # the model's own, as given
    budget: Optional[float] = None  # `--budget`: the error allowed, and the search's (F, error, parameters) tries
    tries: list[tuple[float, float, int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"exact": False, "fraction": self.fraction, "params_before": self.params_before,
                "params_after": self.params_after, "params_original": self.params_original, "error": self.error, "error_rows": self.error_rows,
                "error_in_sample": self.in_sample, "budget": self.budget,
                "budget_tries": [list(t) for t in self.tries],
                "streams": [asdict(s) for s in self.streams], "notes": list(self.notes)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.as_dict(), **kw)

    def table(self) -> str:
        lines = [f"slice F={self.fraction:g}: {NOT_EXACT} (the directions of each sliced stream outside its "
                 "kept principal subspace are deleted)"]
        lines += ["  " + s.line() for s in self.streams]
        ratio = self.params_after / self.params_before if self.params_before else float("nan")
        lines.append(f"  parameters {self.params_before:,} (the exact fold's) -> {self.params_after:,} ({ratio:.3f}x)"
                     + (f"; the model's own: {self.params_original:,} ({self.params_after / self.params_original:.3f}x)"
                        if self.params_original and self.params_original != self.params_before else ""))
        if self.error is not None and self.in_sample:
            lines.append(f"  relative error against the exact fold: not measured on held-out rows; IN-SAMPLE only, "
                         f"{self.error:.3e} on {self.error_rows}, the rows that chose the bases: it understates the "
                         "error on other inputs (give two or more calibration rows, half are held out, or held-out "
                         "inputs: API heldout=)")
        elif self.error is not None:
            lines.append(f"  relative error against the exact fold: {self.error:.3e} on {self.error_rows}")
        short = [s for s in self.streams if s.sliced and s.deficient()]
        if short:
            lines.append(f"  WARNING: {len(short)} sliced stream(s) have fewer calibration vectors than features "
                         "(rank-deficient bases; see the stream lines)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def metadata(self) -> str:
        sliced = [s for s in self.streams if s.sliced]
        widths = ", ".join(f"{s.dim}->{s.keep}" for s in sliced)
        err = (f"; relative error {self.error:.3e}{' IN-SAMPLE' if self.in_sample else ''} on {self.error_rows}"
               if self.error is not None else "")
        return (f"{NOT_EXACT}: sliced by lnfold (F={self.fraction:g}, SliceGPT-style principal bases): "
                f"{len(sliced)} stream(s) {widths}; parameters {self.params_before} -> {self.params_after}{err}")
