"""Calibration, one phase of the pipeline (DESIGN §2, "Calibration, one phase"): the approximate swap,
slicing and the geometry figures run calibration data through a model and its folds over the same
two pieces, `Folds` (one per IR: onnx_rewrite/api.OnnxFolds, fx_rewrite/api.ExportFolds) and `split`,
the one held-out rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .options import FoldOptions
from .pipeline import Frontend, Planner
from .plan import Plan
from .result import FoldResult
from .view import View


@dataclass
class Data:
    """Calibration batches in the IR's own form (ONNX: dicts of arrays; torch: args tuples)."""

    deciding: list  # the batches a decision is made on
    held: Optional[list] = None  # the batches that only report (None: nothing held out)


def split(batches: list, rows: Callable[[Any], Optional[int]], cut: Callable[[Any, int, Optional[int]], Any],
          heldout: Optional[list] = None) -> Data:
    """The one held-out rule over `batches`: two or more, the first half of them (rounded up) decide and
    the rest only report; one, the first half of its rows (rounded up); nothing held out from a single
    row or inputs that share no batch axis; `heldout` given: used as given. `rows(batch)` is a batch's
    shared first-axis size (None: none), `cut(batch, lo, hi)` its rows [lo, hi): each IR's own."""
    if heldout is not None:
        return Data(batches, heldout)
    if len(batches) >= 2:
        h = (len(batches) + 1) // 2
        return Data(batches[:h], batches[h:])
    (batch,) = batches
    n = rows(batch)
    if n is None or n < 2:
        return Data(batches)
    h = (n + 1) // 2
    return Data([cut(batch, 0, h)], [cut(batch, h, None)])


def batch_rows(feeds: dict) -> Optional[int]:
    """The first axis all named arrays share (the batch), or None when they do not share one."""
    sizes = {np.shape(a)[0] for a in feeds.values() if np.ndim(a) >= 1}
    return sizes.pop() if len(sizes) == 1 and all(np.ndim(a) >= 1 for a in feeds.values()) else None


def cut_rows(feeds: dict, lo: int, hi: Optional[int]) -> dict:
    """The rows [lo, hi) of every named array."""
    return {k: a[lo:hi] for k, a in feeds.items()}


def chunks(feeds: dict, rows: int = 16) -> list[dict]:
    """Named arrays cut along the batch axis into pieces of at most `rows` (memory: a run keeps each
    captured value); whole where they share no batch axis."""
    n = batch_rows(feeds)
    if n is None or n <= rows:
        return [feeds]
    return [cut_rows(feeds, i, i + rows) for i in range(0, n, rows)]


class Recorded:
    """A planner that keeps the view and the plan it made (the exact fold's, read by the decision)."""

    def __init__(self, planner: Planner) -> None:
        self.planner, self.view, self.plan = planner, None, None

    def __call__(self, view, request):
        self.view, self.plan = view, self.planner(view, request)
        return self.plan


class Folds(Protocol):
    """An IR analysed once and folded as often as a calibrated decision needs."""

    frontend: Frontend  # the first frontend: `plan` viewed it; its capture/run measure any artifact
    opts: FoldOptions  # the decision's options (its exact fold verifies when opts.verify)

    def plan(self, planner: Planner) -> tuple[View, Plan]:
        """The view and the plan of `opts` (viewed once; nothing applied)."""

    def fold(self, planner: Planner, opts: FoldOptions, *, approx: frozenset = frozenset(),
             bases: Optional[dict] = None, final: bool = False) -> FoldResult:
        """`pipeline.fold` of a fresh frontend over the analysed IR, `approx` and `bases` in its
        request (`final`: the result the user gets, written where they asked; unverified tries are silent)."""

    def artifact(self, result: FoldResult) -> Any:
        """What `frontend.run` / `frontend.capture` take for a fold (ONNX: the model as written)."""

    def rows(self, batches: list) -> int:
        """How many input rows `batches` hold."""


def run(folds: Folds, result: Optional[FoldResult], batches: list) -> list:
    """The outputs of a fold (None: the original as given) over `batches`."""
    return folds.frontend.run(None if result is None else folds.artifact(result), batches)


def capture(folds: Folds, result: Optional[FoldResult], values: list[str], batches: list) -> dict:
    """value -> its per-batch arrays in a fold (None: the original as viewed) over `batches`."""
    return folds.frontend.capture(None if result is None else folds.artifact(result), values, batches)
