"""`lnfold.slice_module`: the torch side of slicing (passes/slicer.py runs the steps). NOT exact."""
from __future__ import annotations

import operator
from typing import Optional

import torch

from ..passes import make_plan, slicing
from ..passes.calibration import check_calibration
from ..passes.options import FoldOptions
from ..passes.slicer import SliceResult, SliceScheme, Slicing, check_request, slice_with
from . import calibration as calibration_io
from .api import ExportFolds


def module_float_parameters(module: torch.nn.Module) -> int:
    """The floating-point parameters and buffers of a module as given, each tensor once (tied ones too)."""
    own = {t.data_ptr(): t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()}
    return sum(t.numel() for t in own.values())


def float_parameters(gm: torch.fx.GraphModule) -> int:
    """The floating-point tensors the graph reads (the exported module also keeps unread originals),
    each once."""
    read = [operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"]
    tensors = {t.data_ptr(): t for t in read if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return sum(t.numel() for t in tensors.values())


def slice_module(module: torch.nn.Module, calibration, *, fraction=None, budget=None, kwargs: Optional[dict] = None,
                 heldout=None, dynamic: bool = True, per_block: bool = False,
                 full_width_head: bool = False, center_embeddings: bool = False) -> SliceResult:
    """`slice_onnx` for a module: `calibration` is an args tuple, or a list of them (rows along the
    first axis); `result.module` runs like the module. NOT exact. Bad input: LnfoldError."""
    scheme = SliceScheme(per_block, full_width_head, center_embeddings)
    fraction, budget = check_request(fraction, budget)
    check_calibration(calibration, slicing.CALIBRATED)
    data = calibration_io.split(calibration_io.batches_of(calibration, ())[0], heldout)
    # the first calibration batch is the example input (export, verification)
    folds = ExportFolds(module, data.deciding[0], dict(kwargs or {}), FoldOptions(gamma_into_readers=True),
                        dynamic=dynamic)
    frontend = Slicing(folds, data, lambda result: float_parameters(result.module), module_float_parameters(module))
    exact, sliced, report = slice_with(frontend, fraction, make_plan, budget, scheme)
    return SliceResult(report, exact, module=sliced.module)
