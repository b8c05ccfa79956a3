"""Capture each LayerNorm's input in onnxruntime, for passes/geometry.py's angle statistics.

The norm inputs become extra graph outputs of a copy of the model; one session runs the
calibration batches. After the fold the same tensors are read from the folded model (the fold
edits constants and swaps norms; the stream tensors keep their names).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx

from ..passes import NothingToFold, View
from ..passes.geometry import Geometry, chunks, geometry, norm_inputs
from .inputs import check_feeds, load_npz
from .verify import original_run, session


def computed(model: onnx.ModelProto) -> set[str]:
    """The tensors a run of `model` can hand back: graph inputs and node outputs."""
    return {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output if o}


def capture(model: onnx.ModelProto, names: list[str], batches: list[dict]) -> dict[str, list[np.ndarray]]:
    """name -> one array per batch: the values of tensors `names` when `model` runs on `batches`."""
    names = [n for n in dict.fromkeys(names) if n in computed(model)]
    if not names:
        return {}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    sess = session(m)
    out: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feeds in batches:
        for n, v in zip(names, sess.run(names, feeds)):
            out[n].append(np.asarray(v))
    return out


def feeds_for(model: onnx.ModelProto, calibration: Optional[dict], dims: Optional[dict] = None) -> tuple[dict, bool]:
    """(feeds, synthetic): the user's calibration inputs (checked), else made-up ones the model runs on."""
    if calibration is not None:
        if isinstance(calibration, dict):
            return check_feeds(dict(calibration), model, "calibration"), False
        return load_npz(calibration, model), False
    _, feeds, _ = original_run(model, dims=dims)
    return feeds, True


def measure(model: onnx.ModelProto, view: View, verdicts: dict[str, str], fold: Callable[[], onnx.ModelProto],
            calibration=None, *, dims: Optional[dict] = None) -> Geometry:
    """Every norm of `view` (the plan's `verdicts`), its angle to 1 on the calibration inputs (a
    dict or an .npz path; None: made-up inputs, and the result says so), and for the folded norms
    the same in the folded model `fold()` returns."""
    feeds, synthetic = feeds_for(model, calibration, dims)
    names = [ni.value for ni in norm_inputs(view)]
    batches = chunks(feeds)
    before = capture(model, names, batches)
    after = None
    if "fold" in verdicts.values():
        try:
            after = capture(fold(), names, batches)
        except NothingToFold:
            pass
    return geometry(view, verdicts, before, after, synthetic=synthetic)
