"""`lnfold slice` / `lnfold.slice_onnx`: the ONNX side of slicing (passes/slicing.py decides). NOT exact.

1. the exact fold with γ in the readers, verified on the calibration rows;
2. each folded norm's input captured in that model on the calibration rows (onnxruntime);
3. passes/slicing.plan_slices: a principal basis and its kept width per rotatable stream;
4. the fold again, asking for those bases (PlanRequest.bases): writers and readers projected,
   norms over k features, layout shapes patched; not verified (it is not exact), but
5. measured: its outputs against the exact fold's on the held-out rows (passes/geometry's rule).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx

from ..passes import LnfoldError, FoldResult, make_plan
from ..passes import slicing
from ..passes.approx import relative_error
from ..passes.geometry import chunks
from ..passes.options import FoldOptions
from . import approx as approx_io
from . import targets
from .api import OnnxFrontend, Progress, as_model, run_frontend
from .geometry import capture


@dataclass
class SliceResult:
    model: onnx.ModelProto  # the sliced model (NOT exact)
    report: slicing.SliceReport
    exact: FoldResult  # the verified exact fold it was sliced from (its model: the error's reference)


def parameters(model: onnx.ModelProto) -> int:
    """The floating-point constants' element count (initializers and Constant nodes' values)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.name == "value"]
    return sum(int(np.prod(t.dims)) for t in tensors if t.data_type in floats)


class _Planned:
    """make_plan, keeping the view and the plan it made (the slice reads both)."""

    def __init__(self) -> None:
        self.view = self.plan = None

    def __call__(self, view, request):
        self.view, self.plan = view, make_plan(view, request)
        return self.plan


def slice_model(model, calibration, *, fraction, heldout=None, target: str = "ort", device: str = "cpu",
                progress: Progress = None) -> SliceResult:
    """Slice every rotatable folded stream of `model` to k = d − round(F·d) features on the principal
    directions of `calibration` (a dict of input arrays or an .npz path; rows along the first axis).
    NOT exact: `result.report` has per stream the widths and the variance kept, the parameters
    before and after and the relative error against the exact fold on `heldout` (default: the
    calibration batch's second half, which then does not calibrate). Bad input: LnfoldError."""
    fraction = slicing.check_fraction(fraction)
    slicing.check_calibration(calibration)
    model = as_model(model)
    tgt = targets.resolve(target, device)
    feeds, held = approx_io.calibration_split(model, calibration, heldout)
    opts = FoldOptions(gamma_into_readers=True)

    exact_plan = _Planned()
    first = OnnxFrontend(model, opts, tgt, inputs=feeds, progress=progress)
    exact = run_frontend(first, progress, exact_plan)
    view, plan = exact_plan.view, exact_plan.plan
    values = [node.inputs[node.norm.input] for node in view.norms() if node.name in set(plan.swaps)]
    captured = capture(exact.model, values, chunks(feeds))
    stream_of = {v.name: v.stream for v in plan.report.norms if v.verdict == "fold"}
    decided = slicing.plan_slices(view, list(plan.components), plan.gammas, stream_of, captured, fraction)
    if not decided.bases:
        why = next((s.line() for s in decided.streams), "no LayerNorm folds")
        raise LnfoldError(f"no stream can be sliced (each needs its norms' γ in the readers and only "
                          f"transparent readers): {why}")

    sliced_plan = _Planned()
    second = OnnxFrontend(model, dataclasses.replace(opts, verify=False), tgt, prepared=first.prepared,
                          progress=progress)
    second.bases = decided.bases
    sliced = run_frontend(second, progress, sliced_plan)
    for rot in sliced_plan.plan.rotations:
        for s in decided.streams:
            if s.stream == rot.stream and not rot.rotated:
                s.why, s.keep = rot.why, None
    if not any(s.sliced for s in decided.streams):
        raise LnfoldError(f"no stream can be sliced: {decided.streams[0].line()}")

    rows = held if held is not None else feeds
    reference, outputs = approx_io.run(exact.model, [rows]), approx_io.run(sliced.model, [rows])
    report = slicing.SliceReport(
        fraction, decided.streams, parameters(exact.model), parameters(sliced.model),
        error=relative_error(reference, outputs),
        error_rows=(f"{_rows(rows)} held-out row(s)" if held is not None
                    else f"the {_rows(rows)} calibration row(s) (none held out: NOT an independent measure)"))
    out = sliced.model
    for p in [p for p in out.metadata_props if p.key == slicing.METADATA_KEY]:
        out.metadata_props.remove(p)
    out.metadata_props.append(onnx.StringStringEntryProto(key=slicing.METADATA_KEY, value=report.metadata()))
    return SliceResult(out, report, exact)


def _rows(feeds: dict) -> Optional[int]:
    return len(next(iter(feeds.values()))) if feeds else 0
