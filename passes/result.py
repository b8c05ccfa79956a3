"""What a fold returns, whichever frontend did it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .report import Report


@dataclass
class FoldResult:
    report: Report
    model: Any = None  # onnx.ModelProto (ONNX frontend)
    module: Any = None  # torch.nn.Module (torch frontend)
    # Verification (passes/gate.py), all None when skipped. max_rel_err: worst relative difference
    # between the folded and the original model's outputs (max |a - b| / max |a| per output).
    # exact_err / original_exact_err: the folded / original model's worst relative error against a
    # float64 run (None where none was possible). criterion: what the gate judged by ("float64",
    # or a fallback: "tolerance", "zero-mean norm inputs").
    max_rel_err: Optional[float] = None
    exact_err: Optional[float] = None
    original_exact_err: Optional[float] = None
    criterion: Optional[str] = None
    no_float64: str = ""  # why verification made no float64 run, where it made none
    verdict: Any = field(default=None, repr=False, compare=False)  # the gate's Verdict these fields come from
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    # the Plan that made it (passes/plan.py), set by pipeline.fold: its records, for a stage after the
    # fold that needs to know what was decided (quantization: which γ moved, which streams rotated)
    plan: Any = field(default=None, repr=False, compare=False)
    view: Any = field(default=None, repr=False, compare=False)  # the View that plan was made on (likewise)
