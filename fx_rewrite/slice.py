"""`lnfold.slice_module`: the torch side of slicing (passes/slicing.py decides, passes/slicer.py
runs the steps: exact fold, capture, bases, sliced fold, error). NOT exact. The result's `.module`
is the exported graph module with the sliced weights (as `fold_module` returns)."""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch

from ..passes import FoldResult, make_plan, pipeline, slicing
from ..passes.options import FoldOptions
from ..passes.slicer import SliceResult, check_request, slice_with
from . import geometry
from .api import ExportFrontend, export, program_view


class _ExportedOnce(ExportFrontend):
    """ExportFrontend over one torch.export shared by all of a slice's folds (the export is most of a
    fold's time, and a budget's search folds up to 8 times)."""

    def __init__(self, program, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.program = program

    def view(self):
        self.gm, self.attrs, view, self.info = program_view(self.program)
        self._view = view
        return view


class _TorchSlice:
    """passes/slicer.SliceFrontend over torch.export: the first calibration batch is the example
    input (export, verification); the norm inputs are captured by the FX interpreter."""

    def __init__(self, module, batches: list[tuple], held: Optional[list[tuple]], kwargs: dict, dynamic: bool):
        self.module, self.batches, self.kwargs, self.dynamic = module, batches, kwargs, dynamic
        self.program = export(module, batches[0], kwargs, dynamic=dynamic)
        self.opts = FoldOptions(gamma_into_readers=True)
        self.held = held if held is not None else batches
        rows = sum(len(b[0]) for b in self.held)
        self.rows = (f"{rows} held-out row(s)" if held is not None
                     else f"the {rows} calibration row(s) (none held out: NOT an independent measure)")

    def _fold(self, opts: FoldOptions, planner, bases=None) -> FoldResult:
        frontend = _ExportedOnce(self.program, self.module, self.batches[0], self.kwargs, opts, norm="auto",
                                 dynamic=self.dynamic)
        frontend.bases = bases
        return pipeline.fold(frontend, verify=opts.verify, planner=planner)

    def exact(self, planner) -> FoldResult:
        return self._fold(self.opts, planner)

    def capture(self, exact: FoldResult, values: list[str]) -> dict:
        return geometry.capture(exact.module, values, self.batches)

    def sliced(self, bases: dict, planner) -> FoldResult:
        return self._fold(dataclasses.replace(self.opts, verify=False), planner, bases)

    def outputs(self, result: FoldResult) -> list:
        return geometry.outputs(result.module, self.held)

    def parameters(self, result: FoldResult) -> int:
        """The floating-point tensors the graph reads (the exported module also keeps unread originals),
        each once."""
        gm = result.module
        read = [operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"]
        tensors = {t.data_ptr(): t for t in read if isinstance(t, torch.Tensor) and t.is_floating_point()}
        return sum(t.numel() for t in tensors.values())


def slice_module(module: torch.nn.Module, calibration, *, fraction=None, budget=None, kwargs: Optional[dict] = None,
                 heldout=None, dynamic: bool = True, per_block: bool = False) -> SliceResult:
    """Slice every rotatable folded stream of `module` to k = d − round(F·d) features on the principal
    directions of `calibration` (an args tuple, or a list of them; rows along the first axis).
    NOT exact: `result.report` as `slice_onnx`'s; the error is measured on `heldout` (default:
    passes/geometry.heldout_split's rule); `budget=B` instead of `fraction`: the largest F
    (passes/slicer.GRID) whose error there is <= B. `per_block`: a basis per block input, as
    `slice_onnx`'s. `result.module` runs like the module. Bad input: LnfoldError."""
    fraction, budget = check_request(fraction, budget)
    slicing.check_calibration(calibration)
    batches, held = geometry.split(geometry.batches_of(calibration, ())[0], heldout)
    frontend = _TorchSlice(module, batches, held, dict(kwargs or {}), dynamic)
    exact, sliced, report = slice_with(frontend, fraction, make_plan, budget, per_block)
    return SliceResult(report, exact, module=sliced.module)
