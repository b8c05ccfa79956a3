"""`lnfold slice` / `lnfold.slice_onnx`: the ONNX side of slicing (passes/slicing.py decides,
passes/slicer.py runs the steps: exact fold, capture, bases, sliced fold, error). NOT exact.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx

from ..passes import FoldResult, make_plan
from ..passes import slicing
from ..passes.slicer import SliceResult, check_request, slice_with
from ..passes.geometry import chunks
from ..passes.options import FoldOptions
from . import approx as approx_io
from . import targets
from .api import OnnxFrontend, Progress, as_model, run_frontend
from .geometry import capture


def parameters(model: onnx.ModelProto) -> int:
    """The floating-point constants' element count (initializers and Constant nodes' values)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.name == "value"]
    return sum(int(np.prod(t.dims)) for t in tensors if t.data_type in floats)


class _OnnxSlice:
    """passes/slicer.SliceFrontend over ONNX: the model validated once, folds run in onnxruntime."""

    def __init__(self, model: onnx.ModelProto, target, feeds: dict, held: Optional[dict], progress: Progress) -> None:
        self.model, self.target, self.feeds, self.progress = model, target, feeds, progress
        self.opts = FoldOptions(gamma_into_readers=True)
        self.held = held if held is not None else feeds
        self.rows = (f"{_rows(held)} held-out row(s)" if held is not None
                     else f"the {_rows(feeds)} calibration row(s) (none held out: NOT an independent measure)")
        self.prepared = None

    def exact(self, planner) -> FoldResult:
        first = OnnxFrontend(self.model, self.opts, self.target, inputs=self.feeds, progress=self.progress)
        result = run_frontend(first, self.progress, planner)
        self.prepared = first.prepared
        return result

    def capture(self, exact: FoldResult, values: list[str]) -> dict:
        return capture(exact.model, values, chunks(self.feeds))

    def sliced(self, bases: dict, planner) -> FoldResult:
        frontend = OnnxFrontend(self.model, dataclasses.replace(self.opts, verify=False), self.target,
                                prepared=self.prepared, progress=self.progress)
        frontend.bases = bases
        return run_frontend(frontend, self.progress, planner)

    def outputs(self, result: FoldResult) -> list:
        return approx_io.run(result.model, [self.held])

    def parameters(self, result: FoldResult) -> int:
        return parameters(result.model)


def slice_model(model, calibration, *, fraction=None, budget=None, heldout=None, target: str = "ort",
                device: str = "cpu", per_block: bool = False, progress: Progress = None) -> SliceResult:
    """Slice every rotatable folded stream of `model` to k = d − round(F·d) features on the principal
    directions of `calibration` (a dict of input arrays or an .npz path; rows along the first axis).
    NOT exact: `result.report` has per stream the widths and the variance kept, the parameters
    before and after and the relative error against the exact fold on `heldout` (default: the
    calibration batch's second half, which then does not calibrate). `budget=B` instead of
    `fraction`: the largest F (passes/slicer.GRID) whose error there is <= B. `per_block`: a basis
    per block input, the residual shortcuts re-expressed by a k×k MatMul (SliceGPT's scheme;
    passes/slicing.py). Bad input: LnfoldError."""
    fraction, budget = check_request(fraction, budget)
    slicing.check_calibration(calibration)
    model = as_model(model)
    feeds, held = approx_io.calibration_split(model, calibration, heldout)
    exact, sliced, report = slice_with(_OnnxSlice(model, targets.resolve(target, device), feeds, held, progress),
                                       fraction, make_plan, budget, per_block)
    out = sliced.model
    for p in [p for p in out.metadata_props if p.key == slicing.METADATA_KEY]:
        out.metadata_props.remove(p)
    out.metadata_props.append(onnx.StringStringEntryProto(key=slicing.METADATA_KEY, value=report.metadata()))
    return SliceResult(report, exact, model=out)


def _rows(feeds: dict) -> Optional[int]:
    return len(next(iter(feeds.values()))) if feeds else 0
