"""The ONNX side of the approximate swap (passes/approx.py decides): the calibration and held-out
inputs, and running a model on them in onnxruntime (in batches of rows, outputs concatenated)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from ..passes.geometry import chunks, split_heldout
from .inputs import check_feeds, load_npz
from .verify import session


def load_feeds(model: onnx.ModelProto, data, where: str) -> dict:
    """Inputs as a dict name -> array, or from an .npz path, checked against the model."""
    if isinstance(data, dict):
        return check_feeds(dict(data), model, where)
    return load_npz(data, model)


def calibration_split(model: onnx.ModelProto, calibration, heldout=None) -> tuple[dict, Optional[dict]]:
    """(calibration feeds, held-out feeds): the held-out inputs given, else the calibration batch's
    second half (passes/geometry.split_heldout; none where the batch has one row)."""
    feeds = load_feeds(model, calibration, "calibration")
    if heldout is not None:
        return feeds, load_feeds(model, heldout, "held-out inputs")
    return split_heldout(feeds)


def run(model: onnx.ModelProto, batches: list[dict]) -> list[np.ndarray]:
    """Every output of `model` on each batch of feeds, run in pieces of rows, each output's pieces
    joined along its first axis (a scalar output: stacked)."""
    sess = session(model)
    parts = [sess.run(None, c) for feeds in batches for c in chunks(feeds)]
    return [np.concatenate(outs, axis=0) if np.ndim(outs[0]) else np.stack(outs) for outs in zip(*parts)]
