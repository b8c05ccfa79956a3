"""IR-neutral core of lnfold: the stream view, the foldability analysis, the plan, weight math.

Nothing here imports torch.fx or onnx (DESIGN §2).
"""
from .analysis import Component, analyze
from .errors import LnfoldError, NothingToFold, VerificationError
from .edits import compute_constants
from . import pipeline
from .options import FoldOptions
from .plan import Plan, make_plan
from .report import NormVerdict, Report
from .result import FoldResult
from .view import ChannelScale, ConstRef, Node, NormSpec, Value, View

__all__ = [
    "ChannelScale", "Component", "ConstRef", "FoldOptions", "FoldResult", "LnfoldError", "Node", "NormSpec",
    "NormVerdict", "NothingToFold", "Plan", "Report", "Value", "VerificationError", "View",
    "analyze", "compute_constants", "make_plan",
]
