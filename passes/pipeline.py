"""The one pipeline every entry point runs: view → plan → apply → verify → result (DESIGN §2, "The
pipeline"). Every decision is made once, in `make_plan`; verification is decided and recorded here.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional, Protocol

from .errors import NothingToFold
from .gate import Verdict
from .plan import Plan
from .request import PlanRequest
from .result import FoldResult
from .view import View

__all__ = ["Frontend", "fold", "in_memory", "plan", "record", "stage"]

Progress = Optional[Callable[[str], None]]
Planner = Callable[..., Plan]  # make_plan, or a test's sabotaged copy of it


class Frontend(Protocol):
    def view(self) -> View:
        """The stream view of the IR (what the analysis reads)."""

    def request(self) -> PlanRequest:
        """What this fold asks of the planner (after `view`: the predicates read the IR's constants)."""

    def check(self, plan: Plan) -> None:
        """Raise NothingToFold (in the frontend's words) when the plan folds nothing."""

    def apply(self, plan: Plan) -> Any:
        """Execute the plan on (a copy of) the IR; the folded artifact."""

    def emit(self, folded: Any) -> ContextManager[Any]:
        """The folded artifact as verification runs it (a model in memory, or files written
        beside the output and published only when the block exits without an error)."""

    def verify(self, plan: Plan, artifact: Any) -> Optional[Verdict]:
        """The gate's verdict on the artifact against the original (raises VerificationError when
        it fails); None where it cannot be run here."""

    def result(self, plan: Plan, folded: Any) -> FoldResult:
        """The FoldResult carrying the folded artifact and the plan's report."""

    def capture(self, artifact: Any, values: list[str], batches: list) -> dict:
        """value -> one numpy array per batch, as `artifact` (None: the original as viewed) runs on `batches`."""

    def run(self, artifact: Any, batches: list) -> list:
        """`artifact`'s outputs (None: the original as given) on `batches`, each joined along its first axis."""


def in_memory(folded: Any) -> ContextManager[Any]:
    """`Frontend.emit` for an artifact that lives in memory: itself."""
    return contextlib.nullcontext(folded)


def plan(frontend: Frontend, planner: Planner) -> tuple[View, Plan]:
    view = frontend.view()
    return view, planner(view, frontend.request())


def fold(frontend: Frontend, *, verify: bool, planner: Planner, progress: Progress = None) -> FoldResult:
    """Fold with `frontend` from start to end; the FoldResult with its timings and verdict."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    stage(progress, "analyzing")
    view, p = plan(frontend, planner)
    try:
        frontend.check(p)
    except NothingToFold as e:  # (the analysis said why: `--json` prints its report with the reason)
        if getattr(e, "report", None) is None:
            e.report = p.report
        raise
    timings["analysis"] = time.perf_counter() - t0

    stage(progress, f"editing ({len(p.swaps)} norms, {len(p.const_edits)} constants)")
    t1 = time.perf_counter()
    folded = frontend.apply(p)
    timings["editing"] = time.perf_counter() - t1
    result = frontend.result(p, folded)
    result.timings, result.plan, result.view = timings, p, view
    t2 = time.perf_counter()
    with frontend.emit(folded) as artifact:
        timings["writing"] = time.perf_counter() - t2  # (the output's files, where the frontend writes any)
        if verify:
            t2 = time.perf_counter()
            verdict = frontend.verify(p, artifact)
            if verdict is not None:
                record(result, verdict)
                timings["verification"] = time.perf_counter() - t2
    return result


def record(result: FoldResult, verdict: Verdict) -> None:
    result.max_rel_err, result.criterion = verdict.diff, verdict.criterion
    result.exact_err, result.original_exact_err = verdict.folded_err, verdict.original_err
    result.no_float64, result.verdict = verdict.no_float64, verdict


def stage(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)
