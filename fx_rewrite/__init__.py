"""Torch frontend of lnfold: `fold_module` on torch.export graphs, the `lnfold` torch.compile backend,
and `fold_for_training`, which folds an eager module in place for (distributed) training.

`torch.compile(model, backend="lnfold")` works after `pip install` through the
`torch_dynamo_backends` entry point; importing this package registers the name too, for
checkouts that run without being installed.
"""
from ..passes import FoldResult, LnfoldError, NothingToFold, Report, VerificationError

from .api import analyze_module, check_equivalent, fold_module
from .backend import lnfold_backend, lnfold_backend_with, register
from .checkpoint_fold import fold_checkpoint
from .handoff import Handoff, HandoffResult, fold_to_rmsnorm, restore_rmsnorm
from .quantize import quantize_module
from .slice import slice_module
from .train import TrainingFold, fold_for_training, unfold_for_training

register()

__all__ = [
    "FoldResult", "Handoff", "HandoffResult", "LnfoldError", "NothingToFold", "Report", "VerificationError",
    "TrainingFold", "analyze_module", "check_equivalent", "fold_checkpoint", "fold_for_training", "fold_module",
    "fold_to_rmsnorm", "lnfold_backend", "lnfold_backend_with", "quantize_module", "restore_rmsnorm", "slice_module",
    "unfold_for_training",
]
