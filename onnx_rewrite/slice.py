"""`lnfold slice` / `lnfold.slice_onnx`: the ONNX side of slicing (passes/slicer.py runs the steps). NOT exact."""
from __future__ import annotations

import onnx

from ..passes import make_plan
from ..passes import slicing
from ..passes.slicer import SliceResult, SliceScheme, Slicing, check_request, slice_with
from ..passes.calibration import Data, check_calibration
from ..passes.options import FoldOptions
from . import calibration as calibration_io
from . import targets
from .api import OnnxFolds, Progress, as_model, stamp
from .linear_layers import float_parameters


def slicing_frontend(model: onnx.ModelProto, target, data: Data, progress: Progress) -> Slicing:
    """passes/slicer's steps over ONNX: one validation of the model, folds run in onnxruntime (and
    verified on the first deciding run)."""
    folds = OnnxFolds(model, FoldOptions(gamma_into_readers=True), target, inputs=data.deciding[0], progress=progress)
    return Slicing(folds, data, lambda result: float_parameters(result.model), float_parameters(model))


def slice_model(model, calibration, *, fraction=None, budget=None, heldout=None, target: str = "ort",
                device: str = "cpu", per_block: bool = False, full_width_head: bool = False,
                center_embeddings: bool = False, progress: Progress = None) -> SliceResult:
    """Slice every rotatable folded stream of `model` to k = d − round(F·d) features on the principal
    directions of `calibration` (a dict of input arrays or an .npz path; rows along the first axis).
    NOT exact: `result.report` has per stream the widths and the variance kept, the parameters
    before and after and the relative error against the exact fold on `heldout` (default: the
    calibration rows' second half, which then does not calibrate). `budget=B` instead of
    `fraction`: the largest F (passes/slicer.GRID) whose error there is <= B. `per_block`,
    `full_width_head`, `center_embeddings`: passes/options.SLICE_OPTIONS. Bad input: LnfoldError."""
    scheme = SliceScheme(per_block, full_width_head, center_embeddings)
    fraction, budget = check_request(fraction, budget)
    check_calibration(calibration, slicing.CALIBRATED)
    model = as_model(model)
    data = calibration_io.calibration_data(model, calibration, heldout)
    exact, sliced, report = slice_with(slicing_frontend(model, targets.resolve(target, device), data, progress),
                                       fraction, make_plan, budget, scheme)
    stamp(sliced.model, slicing.METADATA_KEY, report.metadata())
    return SliceResult(report, exact, model=sliced.model)
