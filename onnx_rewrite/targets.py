"""The ONNX frontend's emission targets: what each emits, what it fuses, which opset it needs.

Adding a target is one entry in `_TARGETS` (and, for a new kind of norm op, its emission in
emit.py): the CLI's choices, the option check and the planner's capabilities follow from it
(DESIGN §7).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..passes.defer import ORT_CPU
from ..passes.options import Option, check_choice
from ..passes.request import Capabilities

DEVICES = ("cpu", "cuda")  # where the ort target runs


@dataclass(frozen=True)
class Target:
    name: str
    # The op that normalizes over the last axis with γ (attributes axis, epsilon, stash_type),
    # in the default domain; None: primitive ops (ReduceMean, Sqrt, Reciprocal, Mul) any runtime runs.
    norm_op: Optional[str] = None
    opset: Optional[int] = None  # the opset norm_op needs: older models are converted first
    # the residual Add + norm sums it runs as one op (SkipSimplifiedLayerNormalization), by shape
    fuses_residual: Optional[Callable[[tuple], bool]] = None

    def capabilities(self) -> Capabilities:
        # onnxruntime runs the row scale as its own Mul on every target: one cost model for all
        return Capabilities(name=f"--target {self.name}", costs=ORT_CPU, fuses_residual=self.fuses_residual)


def _ort_cuda_fusable(shape: tuple) -> bool:
    """onnxruntime's fused residual kernel takes two equal rank-3 tensors of known sizes. On CPU it
    is slower than Add + SimplifiedLayerNormalization (benchmarks/RESULTS.md, op table); on CUDA
    one memory-bound kernel is the usual win: fuse only there."""
    return len(shape) == 3 and all(d is not None for d in shape)


_TARGETS = {
    ("ort", "cpu"): Target("ort", norm_op="SimplifiedLayerNormalization"),
    ("ort", "cuda"): Target("ort", norm_op="SimplifiedLayerNormalization", fuses_residual=_ort_cuda_fusable),
    ("onnx", None): Target("onnx", norm_op="RMSNormalization", opset=23),
    ("portable", None): Target("portable"),
}


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for name, _ in _TARGETS))


def resolve(name: str, device: str) -> Target:
    """The target `name` for `device` (a one-line LnfoldError for an unknown one of either)."""
    check_choice("target", name, names())
    check_choice("device", device, DEVICES)
    return _TARGETS.get((name, device)) or _TARGETS[(name, None)]


# The emission's options, declared as passes/options.OPTIONS are (the fold's and the slice's flags)
TARGET = Option("target", str, "ort", "ort (default): onnxruntime's SimplifiedLayerNormalization, the residual Add "
                "left separate (--device cpu), or SkipSimplifiedLayerNormalization where a residual Add feeds the "
                "norm (--device cuda); onnx: the standard RMSNormalization (opset 23; older models are converted); "
                "portable: primitive ops (ReduceMean, Sqrt, Reciprocal, Mul, Add) any runtime runs", choices=names())
DEVICE = Option("device", str, "cpu", "where the ort target will run: cpu emits Add + SimplifiedLayerNormalization "
                "(fastest on onnxruntime's CPU kernels), cuda the fused SkipSimplifiedLayerNormalization",
                choices=DEVICES)
