"""The approximate swap (mode "rms-approx"): LayerNorms that cannot be folded, swapped for RMSNorm
anyway, only where the measured error stays within a budget. NOT exact, and every place it shows
says so (ONNX: metadata_props `lnfold_approximate`).

A kept norm's input still has a mean, by which RMSNorm differs from LN (THEORY §1, Lemma 2); in
trained models it is small (seed 003; passes/geometry.py), so the swap may cost little. How little
is measured on the user's calibration inputs (`choose`), never assumed, and the error on a held-out
part is reported next to the budget. The choice is `PlanRequest.approx`: make_plan marks those norms
"approx" and keeps their β as an Add; the exact fold of the foldable norms stays verified.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from . import calibration, search
from .calibration import Data, Folds, Planner
from .errors import LnfoldError, NothingToFold
from .options import APPROX_MODE
from .metric import relative_error  # the default metric (passes/metric.py)
from .pipeline import Progress, stage
from .result import FoldResult

CALIBRATED = (f"--mode {APPROX_MODE}", "the error budget is measured on them")  # (calibration.check_calibration)
METADATA_KEY = "lnfold_approximate"

# metric(reference outputs, approximate outputs) -> error (0 = the same); the default is `relative_error`
Metric = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], float]


def check_budget(budget) -> float:
    """The budget as a float >= 0; a missing or bad one is a one-line error (the approximate swap
    never runs without one)."""
    if budget is None:
        raise LnfoldError(f"--mode {APPROX_MODE} needs an error budget (--budget B, e.g. 0.01; API: budget=): "
                          "it swaps norms that cannot be folded exactly, and only within a measured budget")
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise LnfoldError(f"budget must be a number >= 0, got {budget!r}") from None
    if not math.isfinite(b) or b < 0:
        raise LnfoldError(f"budget must be a finite number >= 0, got {budget!r}")
    return b


@dataclass
class Swap:
    name: str
    alone: float  # the error with this norm alone swapped
    added: float = 0.0  # how much the total grew when it joined the selection
    total: float = 0.0  # the selection's error right after it joined (or when it was tried)
    reason: str = ""  # refused: why


@dataclass
class Selection:
    """What the approximate swap decided and measured."""

    budget: float
    metric: str
    swapped: list[Swap] = field(default_factory=list)  # in the order they joined
    refused: list[Swap] = field(default_factory=list)
    total: float = 0.0  # calibration error of the selection (<= budget)
    heldout: Optional[float] = None  # its error on the held-out inputs (None: none given / split)
    calibration_rows: int = 0
    heldout_rows: int = 0

    @property
    def names(self) -> frozenset:
        return frozenset(s.name for s in self.swapped)

    def to_dict(self) -> dict:
        return {"exact": False, **asdict(self)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        held = ("no held-out inputs" if self.heldout is None
                else f"held-out error {self.heldout:.3g} ({self.heldout_rows} rows)")
        lines = [f"APPROXIMATE (not exactly equivalent): {len(self.swapped)} kept LayerNorm(s) swapped to RMSNorm; "
                 f"{self.metric} on calibration {self.total:.3g} <= budget {self.budget:g} "
                 f"({self.calibration_rows} rows); {held}"]
        lines += [f"  swapped  {s.name}: alone {s.alone:.3g}, added {s.added:.3g} (total {s.total:.3g})"
                  for s in self.swapped]
        lines += [f"  kept     {s.name}: {s.reason}" for s in self.refused]
        return "\n".join(lines)


def choose(candidates: Iterable[str], error: Callable[[frozenset], float], budget: float,
           metric: str = "relative output error") -> Selection:
    """`search.greedy`: each candidate alone, then smallest first, each kept only while the error
    of everything chosen so far stays <= `budget` (measured, not added up); budget 0: nothing measured."""
    budget = check_budget(budget)
    found = search.greedy(candidates, error, budget, chosen_word="swapped")

    def swap(s: search.Step) -> Swap:
        reason = "budget 0: exact folds only" if s.outcome == search.ZERO_BUDGET else s.reason
        return Swap(s.name, s.alone, s.added, s.total, reason)

    return Selection(budget, metric, [swap(s) for s in found.kept], [swap(s) for s in found.refused], found.total)


def swap_within_budget(folds: Folds, data: Data, budget, planner: Planner, *, metric: Optional[Metric] = None,
                       progress: Progress = None) -> FoldResult:
    """Mode "rms-approx" for any frontend: the exact fold verified as always (when `folds.opts.verify`),
    then `choose` over the kept norms by their measured error on `data.deciding`, the chosen fold
    built once more and measured on `data.held`. NOT exact: the result says so."""
    budget = check_budget(budget)
    measure = metric or relative_error
    view = plan = None
    if folds.opts.verify:  # the exact part is judged by the gate, as in every fold; its plan is the one read
        stage(progress, "verifying the exact fold")
        try:
            exact = folds.fold(planner, folds.opts)
            view, plan = exact.view, exact.plan
        except NothingToFold:  # nothing folds exactly: the swap may still (planned below)
            pass
    if plan is None:
        view, plan = folds.plan(planner)
    verdicts = plan.report.verdicts()
    candidates = [n.name for n in view.norms() if verdicts[n.name] == "keep" and not n.norm_rejection]
    reference = calibration.run(folds, None, data.deciding)
    tries = replace(folds.opts, verify=False)  # not exact by design: measured, never verified

    def error(names: frozenset) -> float:
        return measure(reference, calibration.run(folds, folds.fold(planner, tries, approx=names), data.deciding))

    stage(progress, f"measuring {len(candidates)} candidate norm(s) on the calibration inputs")
    selection = choose(candidates, error, budget,
                       "relative output error" if metric is None else getattr(metric, "__name__", "metric"))
    selection.calibration_rows = folds.rows(data.deciding)
    if not plan.swaps and not selection.names:
        raise NothingToFold(f"no LayerNorm can be folded, and none swapped within budget {budget:g}")
    result = folds.fold(planner, tries, approx=selection.names, final=True)  # (built again: returned, and written)
    if data.held:
        selection.heldout = measure(calibration.run(folds, None, data.held), calibration.run(folds, result, data.held))
        selection.heldout_rows = folds.rows(data.held)
    result.report = replace(result.report, approx=selection)
    result.criterion = "approximate: not verified as equivalent; its error measured against the budget"
    return result
