"""The torch side of calibration (passes/calibration.py runs the phase): calibration batches (args
tuples), and a module run on them — its outputs (`outputs`), or named nodes of an FX graph recorded by
the interpreter (`capture`). `ExportFrontend.run` / `.capture` are these."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import fx

from ..passes import calibration

from .hf import pytree


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names, self.seen = names, {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.seen[n.name] = out.detach().to(torch.float64).cpu().numpy()
        return out


def capture(gm: fx.GraphModule, names: list[str], batches: list[tuple]) -> dict[str, list[np.ndarray]]:
    """name -> one array per batch: the values of nodes `names` when `gm` runs on each args tuple."""
    out: dict[str, list[np.ndarray]] = {n: [] for n in names}
    with torch.no_grad():
        for args in batches:
            rec = _Recorder(gm, set(names))
            rec.run(*args)
            for n, v in rec.seen.items():
                out[n].append(v)
    return {n: v for n, v in out.items() if v}


def batches_of(calibration, args: tuple) -> tuple[list[tuple], bool]:
    """(list of args tuples, synthetic): calibration as one args tuple or a list of them; None:
    the example `args` (not data the model was trained on: the report says the figures mean little)."""
    if calibration is None:
        return [tuple(args)], True
    if isinstance(calibration, tuple):
        return [calibration], False
    return [tuple(c) if isinstance(c, (tuple, list)) else (c,) for c in calibration], False


def outputs(module, batches: list[tuple]) -> list[np.ndarray]:
    """The module's float outputs (flattened) over the batches, each joined along its first axis."""
    parts = []
    with torch.no_grad():
        for args in batches:
            leaves = [t for t in pytree.tree_leaves(module(*args)) if isinstance(t, torch.Tensor)]
            parts.append([t.detach().to(torch.float64).cpu().numpy() if t.is_floating_point() else t.cpu().numpy()
                          for t in leaves])
    return [np.concatenate(o, axis=0) if np.ndim(o[0]) else np.stack(o) for o in zip(*parts)]


def paired_runs(reference, candidate, batches: list[tuple]):
    """(the reference module's outputs, the candidate's) per batch, as `outputs` gives them: a
    generator, so that its consumer (passes/quantize.streamed_errors) holds one batch's outputs at a
    time, never every row's."""
    for args in batches:
        yield outputs(reference, [args]), outputs(candidate, [args])


def split(batches: list[tuple], heldout: Optional[list]) -> calibration.Data:
    """The held-out batches given, else passes/calibration.split's rule."""
    return calibration.split(batches, _rows, _cut, None if heldout is None else batches_of(heldout, ())[0])


def _rows(args: tuple) -> Optional[int]:
    rows = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.ndim}
    return rows.pop() if len(rows) == 1 else None


def _cut(args: tuple, lo: int, hi: Optional[int]) -> tuple:
    return tuple(a[lo:hi] if isinstance(a, torch.Tensor) and a.ndim else a for a in args)
