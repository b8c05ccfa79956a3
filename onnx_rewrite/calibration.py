"""The ONNX side of calibration (passes/calibration.py runs the phase): calibration and held-out
inputs, and a model run on them in onnxruntime — its outputs (`run`), or named values made extra
graph outputs of a copy (`capture`) — in batches of rows. `OnnxFrontend.run` / `.capture` are these."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from ..passes import LnfoldError
from ..passes.calibration import Data, Rows
from .inputs import load_rows
from .sessions import ModelLike, pruned
from .verify import original_run, session


def calibration_data(model: onnx.ModelProto, calibration, heldout=None) -> Data:
    """The calibration rows as `Data`, run by run in the model's batch: the held-out rows given, else
    passes/calibration's one held-out rule (`Rows.split`). Its first deciding run verifies the folds."""
    rows = load_rows(calibration, model, "calibration")
    return rows.data(None if heldout is None else load_rows(heldout, model, "held-out inputs"))


def rows_for(model: onnx.ModelProto, calibration, dims: Optional[dict] = None) -> tuple[Rows, bool]:
    """(rows, synthetic): the user's calibration rows (checked), else made-up ones the model runs on."""
    if calibration is not None:
        return load_rows(calibration, model, "calibration"), False
    _, feeds, _ = original_run(model, dims=dims)
    return Rows(feeds), True


def run(model: onnx.ModelProto, batches: list[dict]) -> list[np.ndarray]:
    """Every output of `model` on each batch of feeds (runs of `Rows.runs`), each output's pieces
    joined (`joined`)."""
    sess = session(model)
    parts = [sess.run(None, feeds) for feeds in batches]
    return [joined(outs) for outs in zip(*parts)]


def joined(pieces: list) -> np.ndarray:
    """One output's pieces, one per run, as one array: along the first axis (a scalar output:
    stacked); flattened and concatenated where the runs' rows differ in length (a folder of rows),
    which a comparison of two models on the same runs reads element by element all the same."""
    if not np.ndim(pieces[0]):
        return np.stack(pieces)
    if len({np.shape(p)[1:] for p in pieces}) == 1:
        return np.concatenate(pieces, axis=0)
    return np.concatenate([np.ravel(p) for p in pieces])


def row_output_bytes(model: ModelLike, rows: Rows) -> Optional[int]:
    """The bytes of `model`'s outputs on one row (the first of `rows`), run once: what
    passes/calibration.Rows.bounded sizes a measurement's runs by. None where there is nothing to
    size (a fixed batch, pieces, one row, rows that share no first axis) or the model does not run
    on one row (a batch its export fixed: made-up rows do not say it; the runs stay as they are)."""
    if rows.batch or rows.pieces or (rows.count or 0) < 2:
        return None
    try:
        return sum(np.asarray(o).nbytes for o in session(model).run(None, rows.cut(0, 1).runs()[0]))
    except Exception:  # (a model that runs on no rows at all says so when it is measured)
        return None


def paired_runs(reference: ModelLike, candidate: ModelLike, batches: list[dict]):
    """(the reference's outputs, the candidate's) per batch of feeds, the two models run in lockstep:
    a generator, so that its consumer (passes/quantize.streamed_errors) holds one batch's outputs at
    a time, never every row's. A model given as a path is read by onnxruntime from its file; one given
    as a ModelProto is serialized for its session, that copy dropped once the session is made; a
    model onnxruntime cannot run is one line."""
    try:
        ref_sess, got_sess = session(reference), session(candidate)
        for feeds in batches:  # (no name holds a pair while the generator waits: the consumer's drop frees it)
            yield ref_sess.run(None, feeds), got_sess.run(None, feeds)
    except LnfoldError:
        raise
    except Exception as e:
        raise LnfoldError(f"onnxruntime cannot run the model: {str(e).splitlines()[0][:200]}") from None


def capture(model: onnx.ModelProto, names: list[str], batches: list[dict]) -> dict[str, list[np.ndarray]]:
    """name -> one array per batch: the values of tensors `names` when `model` runs on `batches` (runs
    of `Rows.runs`; a folded model keeps the stream tensors' names: the fold edits constants and norms)."""
    computed = {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output if o}
    names = [n for n in dict.fromkeys(names) if n in computed]
    if not names:
        return {}
    sess = session(pruned(model, names))
    out: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feeds in batches:
        for n, v in zip(names, sess.run(names, feeds)):
            out[n].append(np.asarray(v))
    return out
