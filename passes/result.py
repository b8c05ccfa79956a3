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
    max_rel_err: Optional[float] = None  # verification: worst output difference, None if skipped
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
