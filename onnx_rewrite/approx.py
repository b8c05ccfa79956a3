"""The ONNX side of calibration (passes/calibration.py runs the phase): calibration and held-out
inputs, and a model run on them in onnxruntime — its outputs (`run`), or named values made extra
graph outputs of a copy (`capture`) — in batches of rows. `OnnxFrontend.run` / `.capture` are these."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from ..passes.calibration import batch_rows, chunks, cut_rows, split
from .inputs import check_feeds, load_npz
from .sessions import with_outputs
from .verify import original_run, session


def load_feeds(model: onnx.ModelProto, data, where: str) -> dict:
    """Inputs as a dict name -> array, or from an .npz path, checked against the model."""
    if isinstance(data, dict):
        return check_feeds(dict(data), model, where)
    return load_npz(data, model)


def calibration_split(model: onnx.ModelProto, calibration, heldout=None) -> tuple[dict, Optional[dict]]:
    """(calibration feeds, held-out feeds): the held-out inputs given, else the calibration batch's
    second half (passes/calibration.split; none where the batch has one row)."""
    feeds = load_feeds(model, calibration, "calibration")
    if heldout is not None:
        return feeds, load_feeds(model, heldout, "held-out inputs")
    data = split([feeds], batch_rows, cut_rows)
    return data.deciding[0], None if data.held is None else data.held[0]


def feeds_for(model: onnx.ModelProto, calibration: Optional[dict], dims: Optional[dict] = None) -> tuple[dict, bool]:
    """(feeds, synthetic): the user's calibration inputs (checked), else made-up ones the model runs on."""
    if calibration is not None:
        return load_feeds(model, calibration, "calibration"), False
    _, feeds, _ = original_run(model, dims=dims)
    return feeds, True


def run(model: onnx.ModelProto, batches: list[dict]) -> list[np.ndarray]:
    """Every output of `model` on each batch of feeds, run in pieces of rows, each output's pieces
    joined along its first axis (a scalar output: stacked)."""
    sess = session(model)
    parts = [sess.run(None, c) for feeds in batches for c in chunks(feeds)]
    return [np.concatenate(outs, axis=0) if np.ndim(outs[0]) else np.stack(outs) for outs in zip(*parts)]


def capture(model: onnx.ModelProto, names: list[str], batches: list[dict]) -> dict[str, list[np.ndarray]]:
    """name -> one array per piece of rows: the values of tensors `names` when `model` runs on
    `batches` (a folded model keeps the stream tensors' names: the fold edits constants and norms)."""
    computed = {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output if o}
    names = [n for n in dict.fromkeys(names) if n in computed]
    if not names:
        return {}
    sess = session(with_outputs(model, names))
    out: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feeds in (c for b in batches for c in chunks(b)):
        for n, v in zip(names, sess.run(names, feeds)):
            out[n].append(np.asarray(v))
    return out
