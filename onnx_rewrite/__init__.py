"""ONNX frontend of lnfold: classify ONNX ops into the stream view, apply fold plans, emit RMSNorms."""
from ..passes import FoldResult, LnfoldError, NothingToFold, Report, VerificationError

from .api import analyze_model, check_equivalent, fold_model
from .check import CheckResult, check_onnx
from .quantize import quantize_model
from .read import load
from .slice import slice_model
from .write import save

__all__ = [
    "FoldResult", "LnfoldError", "NothingToFold", "Report", "VerificationError",
    "CheckResult", "analyze_model", "check_equivalent", "check_onnx", "fold_model", "load", "quantize_model", "save",
    "slice_model",
]
