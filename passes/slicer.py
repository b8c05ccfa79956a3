"""A slice's steps over any frontend (passes/slicing.py decides; this runs the decisions), so that
`slice_onnx` and `slice_module` are one procedure:

1. the exact fold with γ in the readers, verified on the calibration rows;
2. each folded norm's input captured in that model on the calibration rows;
3. `slicing.plan_slices`: a principal basis and its kept width per rotatable stream;
4. the fold again, asking for those bases (PlanRequest.bases): not verified (it is not exact), but
5. measured: its outputs against the exact fold's on the held-out rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .approx import relative_error
from .errors import LnfoldError
from .result import FoldResult
from .slicing import SliceReport, plan_slices


@dataclass
class SliceResult:
    """A slice (NOT exact): the sliced model (ONNX) or module (torch), its report, and the verified
    exact fold it was sliced from (the reference of its error)."""

    report: SliceReport
    exact: FoldResult
    model: Any = None  # onnx.ModelProto
    module: Any = None  # torch.nn.Module


class Recorded:
    """A planner that keeps the view and the plan it made (the slice reads both)."""

    def __init__(self, planner: Callable) -> None:
        self.planner, self.view, self.plan = planner, None, None

    def __call__(self, view, request):
        self.view, self.plan = view, self.planner(view, request)
        return self.plan


class SliceFrontend(Protocol):
    def exact(self, planner: Recorded) -> FoldResult:
        """The verified exact fold with γ in the readers."""

    def capture(self, exact: FoldResult, values: list[str]) -> dict:
        """value -> its batches in the exact fold's model on the calibration rows."""

    def sliced(self, bases: dict, planner: Recorded) -> FoldResult:
        """The fold with PlanRequest.bases = `bases`, unverified."""

    def outputs(self, result: FoldResult) -> list:
        """The model's outputs on the held-out rows (the calibration rows where none are held out)."""

    def parameters(self, result: FoldResult) -> int:
        """Its floating-point parameters' element count."""

    rows: str  # which rows `outputs` runs on, in words


def slice_with(frontend: SliceFrontend, fraction: float, planner: Callable) -> tuple[FoldResult, FoldResult, SliceReport]:
    """(the exact fold, the sliced fold, the report); LnfoldError where no stream can be sliced."""
    exact_plan = Recorded(planner)
    exact = frontend.exact(exact_plan)
    view, plan = exact_plan.view, exact_plan.plan
    swapped = set(plan.swaps)
    captured = frontend.capture(exact, [n.inputs[n.norm.input] for n in view.norms() if n.name in swapped])
    stream_of = {v.name: v.stream for v in plan.report.norms if v.verdict == "fold"}
    decided = plan_slices(view, list(plan.components), plan.gammas, stream_of, captured, fraction)
    if not decided.bases:
        why = next((s.line() for s in decided.streams), "no LayerNorm folds")
        raise LnfoldError(f"no stream can be sliced (each needs its norms' γ in the readers and only transparent "
                          f"readers): {why}")
    sliced_plan = Recorded(planner)
    sliced = frontend.sliced(decided.bases, sliced_plan)
    for rot in sliced_plan.plan.rotations:
        for s in decided.streams:
            if s.stream == rot.stream and not rot.rotated:
                s.why, s.keep = rot.why, None
    if not any(s.sliced for s in decided.streams):
        raise LnfoldError(f"no stream can be sliced: {decided.streams[0].line()}")
    report = SliceReport(fraction, decided.streams, frontend.parameters(exact), frontend.parameters(sliced),
                         error=relative_error(frontend.outputs(exact), frontend.outputs(sliced)),
                         error_rows=frontend.rows)
    return exact, sliced, report
