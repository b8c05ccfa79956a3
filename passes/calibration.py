"""Calibration, one phase of the pipeline (DESIGN §2, "Calibration, one phase"): the approximate swap,
slicing, the geometry figures and quantization run calibration data through a model and its folds
over the same pieces: `Folds` (one per IR: onnx_rewrite/api.OnnxFolds, fx_rewrite/api.ExportFolds),
`Rows` (arrays fed in the model's own batch) and `deciding_units`, the one held-out rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .errors import LnfoldError
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
    dropped: str = ""  # rows left out, said where the rows are ("" : none)


def deciding_units(units: int) -> int:
    """THE held-out rule, for every calibrated decision (the approximate swap, slicing, `--budget`,
    quantization's measurement and `--rotate auto`): of `units` (batches, or rows where one batch
    holds them all) the first half, rounded up, decide and the rest only report; all of them decide
    where there are fewer than two (nothing is held out: the report says so)."""
    return units if units < 2 else (units + 1) // 2


def split(batches: list, rows: Callable[[Any], Optional[int]], cut: Callable[[Any, int, Optional[int]], Any],
          heldout: Optional[list] = None) -> Data:
    """`deciding_units` over `batches`: two or more, by batch; one, by its rows; nothing held out from
    inputs that share no batch axis; `heldout` given: used as given. `rows(batch)` is a batch's shared
    first-axis size (None: none), `cut(batch, lo, hi)` its rows [lo, hi): each IR's own."""
    if heldout is not None:
        return Data(batches, heldout)
    if len(batches) >= 2:
        h = deciding_units(len(batches))
        return Data(batches[:h], batches[h:])
    (batch,) = batches
    n = rows(batch)
    h = deciding_units(n or 0)
    if n is None or h == n:
        return Data(batches)
    return Data([cut(batch, 0, h)], [cut(batch, h, None)])


def check_calibration(calibration, needed_for: tuple[str, str]) -> None:
    """A calibrated decision without calibration inputs: one line saying which (`needed_for[0]`) and
    what for (`needed_for[1]`)."""
    if calibration is None:
        what, why = needed_for
        raise LnfoldError(f"{what} needs calibration inputs (--calibrate FILE.npz; API: calibration=): {why}")


RUN_ROWS = 16  # rows per run where the model's batch is free (memory: a run keeps each captured value)
# ... and fewer where one row's outputs are big (an LM's logits: 256 tokens x 49,152 classes are 48 MiB
# a row): a measurement run's outputs stay about this size, whatever the row count (`Rows.bounded`)
RUN_OUTPUT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Rows:
    """Calibration rows: the user's arrays by input name, rows along the first axis, fed in the
    model's batch: b rows per run where its export fixed b (Whisper's encoder: [1, 80, 3000]), else
    at most RUN_ROWS. `dropped`: rows after the last whole batch, left out (and said). `pieces`: rows
    that share no shape (sequences of different lengths, which padding would change), fed one piece
    at a time; `feeds` is then empty. `unbatched`: inputs with no batch axis (a merged decoder's
    `use_cache_branch`), fed whole with every run."""

    feeds: dict
    batch: Optional[int] = None
    dropped: int = 0
    pieces: tuple = ()  # of Rows, each fed on its own (`of_pieces`)
    per_run: Optional[int] = None  # rows per run where the batch is free (None: RUN_ROWS; `bounded`)
    unbatched: dict = field(default_factory=dict)  # name -> array fed whole with every run

    @staticmethod
    def of(feeds: dict, batch: Optional[int], what: str) -> "Rows":
        """The rows of `feeds` for a model of fixed `batch` (None: free): whole batches, the rest
        dropped; fewer rows than one batch is a one-line LnfoldError."""
        rows = Rows(dict(feeds), batch)
        n = rows.count
        if batch is None or n == batch:
            return rows
        if n is None:
            raise LnfoldError(f"{what}: the arrays have different first axes ({rows.describe()}); the model takes "
                              f"batches of {batch} rows (fixed by its export)")
        if n < batch:
            raise LnfoldError(f"{what}: {n} row(s); the model takes batches of {batch} (fixed by its export): "
                              f"give at least {batch}")
        keep = n - n % batch
        return Rows({k: v[:keep] for k, v in rows.feeds.items()}, batch, n - keep)

    @staticmethod
    def of_pieces(pieces: list["Rows"]) -> "Rows":
        """Rows made of `pieces` (each from `of`), fed piece by piece: the held-out rule counts pieces."""
        if not pieces:
            raise LnfoldError("no calibration rows: the folder holds no .npz file")
        return Rows({}, pieces[0].batch, sum(p.dropped for p in pieces), tuple(pieces))

    @property
    def count(self) -> Optional[int]:
        """The rows, where every array shares its first axis; None otherwise (one run of everything)."""
        if self.pieces:
            counts = [p.count for p in self.pieces]
            return sum(1 if c is None else c for c in counts)
        n = {np.shape(a)[0] if np.ndim(a) else -1 for a in self.feeds.values()}
        return n.pop() if len(n) == 1 and min(n) >= 0 else None

    def runs(self) -> list[dict]:
        """The feeds, `batch` rows per run (RUN_ROWS at most where the batch is free); pieces one by one."""
        if self.pieces:
            return [feeds for p in self.pieces for feeds in p.runs()]
        n, step = self.count, self.batch or self.per_run or RUN_ROWS
        if n is None or n <= step:
            return [{**self.feeds, **self.unbatched}]
        return [{**self.cut(i, i + step).feeds, **self.unbatched} for i in range(0, n, step)]

    def cut(self, lo: int, hi: Optional[int]) -> "Rows":
        """Rows [lo, hi) (pieces [lo, hi) where the rows come in pieces)."""
        if self.pieces:
            return Rows.of_pieces(list(self.pieces[lo:hi]))
        return Rows({k: v[lo:hi] for k, v in self.feeds.items()}, self.batch, self.dropped, per_run=self.per_run,
                    unbatched=self.unbatched)

    def bounded(self, row_bytes: Optional[int]) -> "Rows":
        """These rows run so that a run's outputs stay about RUN_OUTPUT_BYTES: fewer than RUN_ROWS per
        run where one row's outputs take `row_bytes` (None: unknown, unchanged). A fixed batch, and
        pieces (each one run), are kept as they are."""
        if not row_bytes or self.batch or self.pieces:
            return self
        return replace(self, per_run=max(1, min(RUN_ROWS, RUN_OUTPUT_BYTES // row_bytes)))

    def split(self) -> tuple["Rows", Optional["Rows"]]:
        """(the rows that decide, the rows held out to report: None where nothing is), by
        `deciding_units` over whole batches (over rows where the batch is free; over pieces)."""
        if self.pieces:
            h = deciding_units(len(self.pieces))
            return (self, None) if h >= len(self.pieces) else (self.cut(0, h), self.cut(h, None))
        n, unit = self.count, self.batch or 1
        if n is None:
            return self, None
        h = deciding_units(n // unit) * unit
        return (self, None) if h >= n else (self.cut(0, h), self.cut(h, None))

    def data(self, heldout: Optional["Rows"] = None) -> Data:
        """As `Data`, run by run: `heldout` given, every row decides and it reports; else `split`."""
        deciding, held = (self, heldout) if heldout is not None else self.split()
        return Data(deciding.runs(), None if held is None else held.runs(), self.dropped_note())

    def dropped_note(self) -> str:
        return (f"the last {self.dropped} row(s) dropped: the model takes whole batches of {self.batch} (fixed by "
                "its export)") if self.dropped else ""

    def describe(self) -> str:
        if self.pieces:
            said = (f"{len(self.pieces)} files of {self.count} row(s), fed one file at a time (first: "
                    f"{self.pieces[0].describe()})")
        else:
            said = ", ".join([f"{k} {list(np.shape(v))}" for k, v in self.feeds.items()] +
                             [f"{k} {np.asarray(v).tolist()} (every row)" for k, v in self.unbatched.items()])
        return "; ".join(filter(None, [said, self.dropped_note()]))


class Folds(Protocol):
    """An IR analysed once and folded as often as a calibrated decision needs."""

    frontend: Frontend  # the first frontend: `plan` viewed it; its capture/run measure any artifact
    opts: FoldOptions  # the decision's options (its exact fold verifies when opts.verify)

    def plan(self, planner: Planner) -> tuple[View, Plan]:
        """The view and the plan of `opts` (viewed once; nothing applied)."""

    def fold(self, planner: Planner, opts: FoldOptions, *, final: bool = False, **decided) -> FoldResult:
        """`pipeline.fold` of a fresh frontend over the analysed IR, with `decided` (what a calibrated
        decision adds: passes/request.request_from's keywords) in its request. `final`: the result the
        user gets, written where they asked (unverified tries are silent)."""

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
