"""A slice's steps over any frontend, one procedure for `slice_onnx` and `slice_module`: the verified
exact fold with γ in the readers, its norm inputs captured on the calibration rows, the bases
(passes/slicing.py decides them), and the fold again with those bases, unverified (it is not exact)
but measured against the exact fold on the held-out rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

from . import calibration, edits, search
from .approx import check_budget
from .metric import relative_error
from .calibration import Data, Folds
from .errors import LnfoldError
from .options import SLICE_OPTIONS
from .result import FoldResult
from .slicing import SlicePlan, SliceReport, StreamSlice, check_fraction, norm_input, plan_slices

GRID = tuple(i / 40 for i in range(1, 40))  # the fractions a budget tries: 0.025, 0.05, ..., 0.975


@dataclass(frozen=True)
class SliceScheme:
    """How a slice is shaped (passes/options.SLICE_OPTIONS declares each field and says what it does)."""

    per_block: bool = False
    full_width_head: bool = False
    center_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, SLICE_OPTIONS[f.name].checked(getattr(self, f.name)))
        for name, what in (("full_width_head", "keeps the last segment of a per-block slice d wide"),
                           ("center_embeddings", "centers the embeddings before SliceGPT's per-block bases")):
            if getattr(self, name) and not self.per_block:
                raise LnfoldError(f"{name} ({SLICE_OPTIONS[name].flag}) {what}: give per_block (--per-block) too")


def check_request(fraction, budget) -> tuple[Optional[float], Optional[float]]:
    """(F, None) or (None, B): exactly one of a fraction in (0, 1) and a budget >= 0; else a one-line error."""
    if (fraction is None) == (budget is None):
        raise LnfoldError("slicing needs exactly one of a fraction (--fraction F, API fraction=: the share of each "
                          "stream's width deleted) and an error budget (--budget B, API budget=: the largest "
                          "slicing whose held-out error is <= B)")
    return (check_fraction(fraction), None) if budget is None else (None, check_budget(budget))


@dataclass
class SliceResult:
    """A slice (NOT exact): the sliced model (ONNX) or module (torch), its report, and the verified
    exact fold it was sliced from (the reference of its error)."""

    report: SliceReport
    exact: FoldResult
    model: Any = None  # onnx.ModelProto
    module: Any = None  # torch.nn.Module


class Slicing:
    """The steps' frontend, over any IR's `calibration.Folds` (its options: γ into the readers), the
    calibration data split by the one held-out rule, and the IR's count of a fold's parameters."""

    def __init__(self, folds: Folds, data: Data, parameters: Callable[[FoldResult], int], original: int) -> None:
        self.folds, self.data = folds, data
        self.parameters = parameters  # the parameters of a fold's model
        self.original = original  # the model's own, as given (a fold that unties a shared weight has more)
        self.measured = data.held if data.held is not None else data.deciding  # where the error is measured
        self.in_sample = data.held is None  # the error is then measured on the rows that chose the bases
        self.rows = (f"{folds.rows(data.held)} held-out row(s)" if data.held is not None else
                     f"the {folds.rows(data.deciding)} calibration row(s) (none held out: NOT an independent measure)")
        self.rows += f"; {data.dropped}" if data.dropped else ""

    def exact(self, planner: Callable) -> FoldResult:
        """The verified exact fold with γ in the readers."""
        return self.folds.fold(planner, self.folds.opts)

    def capture(self, result: FoldResult, values: list[str]) -> dict:
        """value -> its batches in a fold's model (the exact fold's; per-block, sliced ones too) on
        the deciding rows."""
        return calibration.capture(self.folds, result, values, self.data.deciding)

    def sliced(self, bases: dict, planner: Callable, center_embeddings: bool = False,
               capture: bool = False) -> FoldResult:
        """The fold with PlanRequest.bases = `bases` (and `center_embeddings`, `capture`), unverified."""
        return self.folds.fold(planner, replace(self.folds.opts, verify=False), bases=bases,
                               center_embeddings=center_embeddings, capture=capture)

    def outputs(self, result: FoldResult) -> list:
        """The outputs on the held-out rows (the calibration rows where none are held out: `rows` says)."""
        return calibration.run(self.folds, result, self.measured)


def slice_with(frontend: Slicing, fraction: Optional[float], planner: Callable,
               budget: Optional[float] = None,
               scheme: SliceScheme = SliceScheme()) -> tuple[FoldResult, FoldResult, SliceReport]:
    """(the exact fold, the sliced fold, the report) at `fraction`, or at the largest fraction of GRID
    whose error is <= `budget`; LnfoldError where no stream can be sliced or no fraction is within it.
    `scheme`: per block, the head kept d wide, the embeddings centered (SLICE_OPTIONS)."""
    exact = frontend.exact(planner)
    view, plan = exact.view, exact.plan
    stream_of = {v.name: v.stream for v in plan.report.norms if v.verdict == "fold"}
    # streams of RMSNorms as given: their norms' inputs are the stream itself (not centered)
    stream_of.update({r.name: r.stream for r in plan.report.rms_norms if r.stream is not None})
    rms_inputs = [norm_input(view, r.name)[0] for r in plan.report.rms_norms if r.stream is not None]
    captured = frontend.capture(exact, list(dict.fromkeys(list(plan.needs) + rms_inputs)))
    params_before = frontend.parameters(exact)
    reference = frontend.outputs(exact)

    def decide(f: float, captures: dict) -> SlicePlan:
        return plan_slices(view, list(plan.components), plan.gammas, stream_of, captures, f, scheme.per_block,
                           scheme.full_width_head)

    def attempt(f: float) -> tuple[FoldResult, SliceReport]:
        decided, steps = sequential(frontend, planner, lambda captures: decide(f, captures), captured,
                                    scheme.center_embeddings)
        if not decided.bases:
            why = next((s.line() for s in decided.streams), "no LayerNorm folds and no stream is of RMSNorms only")
            raise LnfoldError(f"no stream can be sliced (each needs its norms' γ in the readers and only "
                              f"transparent readers): {why}")
        sliced = frontend.sliced(decided.bases, planner, scheme.center_embeddings)
        for rot in sliced.plan.stream_bases:
            for s in decided.streams:
                if s.stream == rot.stream and not rot.rotated:
                    s.why, s.keep = rot.why, None
        if not any(s.sliced for s in decided.streams):
            raise LnfoldError(f"no stream can be sliced: {decided.streams[0].line()}")
        report = SliceReport(f, decided.streams, params_before, frontend.parameters(sliced),
                             error=relative_error(reference, frontend.outputs(sliced)), error_rows=frontend.rows,
                             in_sample=frontend.in_sample, params_original=frontend.original)
        if scheme.center_embeddings:
            tables = [c for s in sliced.plan.report.streams if s.rms for c in s.centered]
            report.notes.append(f"center_embeddings (SliceGPT's choice; NOT exact even unsliced: an RMSNorm reads "
                                f"the mean): centered {', '.join(tables)}" if tables else
                                "center_embeddings: no sliced stream of RMSNorms as given is written by an embedding "
                                "table (a LayerNorm stream's are centered by the exact fold already)")
        if steps:
            report.notes.append(f"per-block bases computed sequentially (each segment's on the model sliced "
                                f"before it): {steps} sliced fold(s) and capture(s) more")
        return sliced, report

    sliced, report = attempt(fraction) if budget is None else _largest_within(attempt, budget, frontend.rows)
    deletes = any(s.sliced and s.keep < s.dim for s in report.streams)  # (at full width: a rotation, the exact fold)
    if deletes and report.params_after > frontend.original:  # (each stream pays for itself; a weight cloned may not)
        cloned = [c for s in sliced.plan.report.streams for c in s.cloned]
        raise LnfoldError(f"slicing at F={report.fraction:g} would leave {report.params_after:,} parameters, more than "
                          f"the model's own {frontend.original:,}"
                          + (f" (a weight shared by the stream's writer and a reader is written apart, each copy "
                             f"k of d wide: {cloned[0]})" if cloned else "")
                          + "; slicing never adds parameters: give a larger fraction")
    return exact, sliced, report


def sequential(frontend: Slicing, planner: Callable, decide: Callable[[dict], SlicePlan],
               captured: dict, center_embeddings: bool = False) -> tuple[SlicePlan, int]:
    """(the slice plan, the sliced folds it took): `decide(captured)`, its per-block bases made
    sequential as SliceGPT's are: step i captures every stream's segment i's norm inputs at full width
    in the model sliced at segments < i (`full_width_inputs`), and decides again from them. With
    `center_embeddings` step 0 too: the first segment's inputs with the embeddings centered."""
    decided, folds = decide(captured), 0
    for i in range(0 if center_embeddings else 1, max((len(heads) for _, heads in decided.order), default=0)):
        at = [(s, heads[i]) for s, heads in decided.order if len(heads) > i]
        captured = {**captured, **full_width_inputs(frontend, planner, decided, at, center_embeddings)}
        decided, folds = decide(captured), folds + 1
    return decided, folds


def full_width_inputs(frontend: Slicing, planner: Callable, decided: SlicePlan,
                      at: list[tuple[StreamSlice, str]], center_embeddings: bool = False) -> dict:
    """Norm input -> its full-width batches: the inputs of the norms of segments `at` (each a
    stream's and its segment's first norm) in the model sliced by `decided`'s bases, these segments
    kept at all d features in the stream's own basis (per-segment widths, as full_width_head's): one
    sliced fold, whatever k. A stream whose rotation its fold withdraws is left out (its slice is
    withdrawn alike)."""
    bases = {**decided.bases, **{head: (edits.Identity(s.dim), s.dim) for s, head in at}}
    sliced = frontend.sliced(bases, planner, center_embeddings, capture=True)
    rotated = {r.stream for r in sliced.plan.stream_bases if r.rotated}
    return frontend.capture(sliced, [value for s, head in at if s.stream in rotated
                                     for value, _ in decided.inputs[head]])


def _largest_within(attempt: Callable, budget: float, rows: str) -> tuple[FoldResult, SliceReport]:
    """The attempt at the largest fraction of GRID whose error is <= budget, by bisection
    (`search.largest_within`): it assumes the error grows with F, as the deleted directions' energy does."""
    tried: dict[int, tuple[FoldResult, SliceReport]] = {}

    def within(i: int) -> bool:
        tried[i] = attempt(GRID[i])
        return tried[i][1].error <= budget

    found = search.largest_within(len(GRID), within)
    fits, fails = found.fits, found.fails
    deletes = fits >= 0 and any(s.sliced and s.keep < s.dim for s in tried[fits][1].streams)
    if not deletes:  # (every fraction within: the largest, which deleted nothing, is said)
        said = tried[fails if fails < len(GRID) else fits][1]
        raise LnfoldError(f"no slicing that deletes a feature keeps the error within the budget {budget:g} "
                          f"(F={said.fraction:g} gives {said.error:.3e} on {rows})")
    sliced, report = tried[fits]
    steps = ", ".join(f"F={GRID[i]:g}: {r.error:.2e}" for i, (_, r) in sorted(tried.items()))
    report.budget = budget
    report.tries = [(GRID[i], r.error, r.params_after) for i, (_, r) in sorted(tried.items())]
    report.notes.append(f"budget {budget:g}: F={report.fraction:g} is the largest fraction of {GRID[0]:g}, "
                        f"{GRID[1]:g}, ..., {GRID[-1]:g} whose error is within it, by bisection on {rows} "
                        f"(assumes the error grows with F); tried {steps}")
    return sliced, report
