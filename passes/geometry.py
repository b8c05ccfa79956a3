"""Where each LayerNorm's input points: its angle to the uniform vector 1 (seed 003, Figure 3: ≈ 90°
in trained LLMs). For a row x, cos θ = μ(x) / rms(x): 90° ⇔ a zero mean, so a folded norm's input is
at 90° by construction (THEORY §1), a built-in sanity check. `measure` captures the norm inputs
through the calibration phase (passes/calibration.py); the statistics are computed here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

import numpy as np

from . import calibration
from .calibration import Folds, Planner
from .errors import NothingToFold
from .options import FoldOptions
from .slicing import norm_input
from .view import View

# Made-up inputs (random token ids, noise pixels) are not what the model was trained on.
SYNTHETIC_NOTE = ("no calibration data: the inputs were made up (random ids / noise), so these angles say "
                  "little about the model on real data; pass --calibrate FILE.npz")


@dataclass(frozen=True)
class NormInput:
    """A norm's input as the view names it: the value to capture and its feature axis."""

    norm: str
    value: str
    axis: int


@dataclass
class AngleStats:
    """Over the rows (tokens) of one norm's input: the angle to 1 in degrees and |mean|/rms."""

    rows: int
    mean_deg: float
    std_deg: float
    worst_deg: float  # the row farthest from 90°
    mean_over_rms: float  # mean over rows of |μ(x)| / rms(x)

    def line(self) -> str:
        return (f"{self.mean_deg:6.2f}° ± {self.std_deg:4.2f}  worst {self.worst_deg:6.2f}°  "
                f"|μ|/rms {self.mean_over_rms:.3f}")


@dataclass
class NormGeometry:
    name: str
    verdict: str  # the plan's: "fold", "keep" (or "approx")
    before: Optional[AngleStats] = None
    after: Optional[AngleStats] = None  # folded norms: the folded model's input to the norm
    note: str = ""


@dataclass
class Geometry:
    """Every norm's angle statistics in graph order; `synthetic`: the inputs were made up."""

    norms: list[NormGeometry] = field(default_factory=list)
    synthetic: bool = False
    rows: int = 0

    def to_dict(self) -> dict:
        return {"synthetic": self.synthetic, "rows": self.rows, "note": SYNTHETIC_NOTE if self.synthetic else "",
                "norms": [asdict(n) for n in self.norms]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self, clip=lambda s: s) -> str:
        lines = [f"angle between each norm's input and 1 over {self.rows} row(s) (90° = zero mean; seed 003)"]
        for n in self.norms:
            before = n.before.line() if n.before else f"not measured ({n.note})"
            lines.append(f"  {clip(n.name)}  {n.verdict:<6} before {before}")
            if n.after is not None:
                lines.append(f"  {' ' * len(clip(n.name))}  {'':<6} after  {n.after.line()}")
        if self.synthetic:
            lines.append(f"note: {SYNTHETIC_NOTE}")
        return "\n".join(lines)


def norm_inputs(view: View) -> list[NormInput]:
    """Each LayerNorm of the view, in graph order, with the value it normalizes and its axis."""
    return [NormInput(node.name, *norm_input(view, node.name)) for node in view.norms()]


def angle_stats(rows: Iterable[np.ndarray], axis: int = -1) -> AngleStats:
    """The angle statistics of the rows of `x` along `axis` (the feature axis), in float64. Rows
    of all zeros (padding) have no direction and are left out."""
    cos = []
    for x in rows:
        x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
        x = x.reshape(-1, x.shape[-1])
        mean = x.mean(axis=1)
        rms = np.sqrt((x * x).mean(axis=1))
        ok = rms > 0
        cos.append(mean[ok] / rms[ok])
    c = np.clip(np.concatenate(cos) if cos else np.zeros(0), -1.0, 1.0)
    if c.size == 0:
        return AngleStats(0, float("nan"), float("nan"), float("nan"), float("nan"))
    deg = np.degrees(np.arccos(c))
    worst = deg[np.argmax(np.abs(deg - 90.0))]
    return AngleStats(int(c.size), float(deg.mean()), float(deg.std()), float(worst), float(np.abs(c).mean()))


def geometry(view: View, verdicts: dict[str, str], before: dict[str, list], after: Optional[dict[str, list]] = None,
             *, synthetic: bool = False) -> Geometry:
    """The report's geometry: `before[value]` / `after[value]` are the captured batches of each
    norm input (the folded model's values for its folded norms), `verdicts` the plan's."""
    g = Geometry(synthetic=synthetic)
    for ni in norm_inputs(view):
        verdict = verdicts.get(ni.norm, "keep")
        ng = NormGeometry(ni.norm, verdict)
        if before.get(ni.value):
            ng.before = angle_stats(before[ni.value], ni.axis)
            g.rows = max(g.rows, ng.before.rows)
        else:
            ng.note = f"its input `{ni.value}` is not a tensor the model computes by itself (a fused op's part)"
        if after is not None and verdict == "fold" and after.get(ni.value):
            ng.after = angle_stats(after[ni.value], ni.axis)
        g.norms.append(ng)
    return g


def measure(folds: Folds, view: View, verdicts: dict[str, str], batches: list, planner: Planner, *,
            synthetic: bool = False) -> Geometry:
    """Every norm of `view` (the plan's `verdicts`), its angle to 1 on `batches` (every row: the figures
    decide nothing, so nothing is held out), and for the folded norms the same in the fold (mode
    "rms", unverified) of the IR `folds` analysed."""
    names = [ni.value for ni in norm_inputs(view)]
    before = calibration.capture(folds, None, names, batches)
    after = None
    if "fold" in verdicts.values():
        try:
            after = calibration.capture(folds, folds.fold(planner, FoldOptions(verify=False)), names, batches)
        except NothingToFold:
            pass
    return geometry(view, verdicts, before, after, synthetic=synthetic)
