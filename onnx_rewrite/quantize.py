"""`quantize_model` (lnfold.quantize_onnx, `lnfold quantize`): the exact fold in front of
onnxruntime's own quantizers.

    fold (exact, verified)  →  γ into the readers  →  rotate the stream  →  onnxruntime quantizer

The first three steps are the one pipeline's (fold_model; each verified against float64 like any
fold). The last is onnxruntime's, as users already run it — lnfold quantizes nothing itself:

- `weights="int8"`: `onnxruntime.quantization.quantize_dynamic` (int8 weights; activations
  quantized at run time, per tensor: MatMulInteger);
- `weights="int8", activations="int8"`: `quantize_static` in QDQ format, calibrated on the
  user's inputs (a CalibrationDataReader over an .npz) — W8A8;
- `weights="int4"`: `MatMulNBitsQuantizer` (weight-only, blocks of `block_size` along K).

Quantized are the linear layers: MatMuls with a constant 2-D weight (linear_layers.py; Gemms are
rewritten into MatMul + Add first, exactly, so that every quantizer sees them). Embedding tables and
attention's activation × activation products stay float.

Quantization is NOT exact. The result's report (quantize_report.py) says so, and says by how much:
the quantized model against the float original on the verification inputs (made-up ones, or the
user's). So do the model's metadata and the command's output.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from ..passes import FoldResult, LnfoldError, NothingToFold
from ..passes.options import ROTATIONS
from ..passes.weights import max_rel_err
from . import inputs as synth
from . import verify
from .api import check_verify_args, fold_model
from .linear_layers import gemm_to_matmul, linear_layers, name_nodes
from .quantize_report import QuantizeReport, scheme_name
from .read import load

WEIGHTS = ("int8", "int4")
ACTIVATIONS = ("int8",)
CALIBRATION_BATCH = 8  # rows per calibration run, where the inputs have a batch axis
METADATA_KEY = "lnfold.quantize"


@dataclass
class Prepared:
    """The float model handed to the quantizer: folded (and rotated), Gemms rewritten."""

    model: onnx.ModelProto
    fold: Optional[FoldResult]
    notes: list[str]
    gemms_rewritten: int


@dataclass
class QuantizeResult:
    model: onnx.ModelProto  # the quantized model
    report: QuantizeReport
    fold: Optional[FoldResult] = None  # the exact part's result (None when nothing folded)


def check_options(weights: str, activations: Optional[str], calibrate, rotate: Optional[str],
                  block_size: int, seed: int) -> None:
    """Every option, checked before any work: one-line LnfoldErrors."""
    if weights not in WEIGHTS:
        raise LnfoldError(f"weights={weights!r}: one of {', '.join(WEIGHTS)}")
    if activations is not None and activations not in ACTIVATIONS:
        raise LnfoldError(f"activations={activations!r}: int8, or none (int8 weights alone: dynamic activations)")
    if activations == "int8" and weights != "int8":
        raise LnfoldError("int8 activations go with int8 weights (W8A8); int4 is weight-only here")
    if activations == "int8" and calibrate is None:
        raise LnfoldError("int8 activations (static, W8A8) need calibration inputs: --calibrate FILE.npz "
                          "(API: calibrate=), representative inputs, one array per model input")
    if activations is None and calibrate is not None:
        raise LnfoldError("--calibrate is for static int8 activations: add --activations int8")
    if rotate is not None and rotate not in ROTATIONS:
        raise LnfoldError(f"rotate={rotate!r}: one of {', '.join(ROTATIONS)}")
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise LnfoldError(f"block size {block_size}: a power of two, at least 16 (onnxruntime's MatMulNBits)")
    if block_size != 128 and weights != "int4":
        raise LnfoldError("--block-size is for int4 weights")
    if not isinstance(seed, int) or seed < 0:
        raise LnfoldError(f"seed {seed!r}: a non-negative integer")


def prepare(model: onnx.ModelProto, *, fold: bool = True, rotate: Optional[str] = None, seed: int = 0,
            gamma_into_readers: Optional[bool] = None, inputs=None, dims=None) -> Prepared:
    """The exact steps: fold (verified), γ into readers and rotation where asked, Gemm → MatMul."""
    gamma = bool(rotate) if gamma_into_readers is None else gamma_into_readers
    if rotate and not gamma:
        raise LnfoldError("a rotation needs the norms' weights in their readers (gamma_into_readers=True)")
    if not fold and (rotate or gamma):
        raise LnfoldError("rotation and γ into the readers are part of the fold: they need fold=True")
    notes, result = [], None
    work = model
    if fold:
        try:
            result = fold_model(model, target="ort", inputs=inputs, dims=dims, gamma_into_readers=gamma,
                                rotate=rotate, seed=seed)
            work = result.model
        except NothingToFold as e:
            if rotate or gamma:
                raise LnfoldError(f"cannot rotate: {e}") from None
            notes.append(f"nothing folded ({e}); quantized as given")
    work = _copy(work)
    name_nodes(work)
    rewritten, kept = gemm_to_matmul(work)
    if rewritten:
        notes.append(f"{rewritten} Gemm(s) rewritten as MatMul + Add (exact) so that the quantizer sees them")
    notes += [f"Gemm kept float: {k}" for k in kept]
    return Prepared(work, result, notes, rewritten)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _calibration_reader(feeds: dict[str, np.ndarray]):
    """onnxruntime's CalibrationDataReader over the user's arrays, CALIBRATION_BATCH rows at a time
    where every array shares its first axis (a batch), else the arrays as one feed."""
    from onnxruntime.quantization import CalibrationDataReader

    rows = {a.shape[0] if a.ndim else -1 for a in feeds.values()}
    if len(rows) == 1 and min(rows) > CALIBRATION_BATCH:
        (n,) = rows
        batches = [{k: v[i:i + CALIBRATION_BATCH] for k, v in feeds.items()} for i in range(0, n, CALIBRATION_BATCH)]
    else:
        batches = [feeds]

    class NpzReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(batches)

        def get_next(self):
            return next(self.left, None)

    return NpzReader()


def run_quantizer(prepared: onnx.ModelProto, weights: str, activations: Optional[str], *,
                  calibration: Optional[dict] = None, block_size: int = 128,
                  per_channel: bool = False) -> onnx.ModelProto:
    """onnxruntime's quantizer for the scheme, on the linear layers of `prepared` (not edited)."""
    nodes = linear_layers(prepared)
    if not nodes:
        branches = any(a.type == onnx.AttributeProto.GRAPH for n in prepared.graph.node for a in n.attribute)
        raise LnfoldError("no linear layer to quantize in the main graph" + (
            " (its layers are inside If/Loop branches, as in a merged decoder: quantize the decoder files "
            "before merging)" if branches else " (no MatMul or Gemm with a constant 2-D weight)"))
    with _quiet_quantizers():
        return _quantize(prepared, nodes, weights, activations, calibration, block_size, per_channel)


def _quantize(prepared, nodes, weights, activations, calibration, block_size, per_channel) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    # onnx's type inference stops at contrib ops (onnxruntime's optimizer fuses them in): the
    # quantizer's own remedy, the type of untyped tensors, is the linear layers' weights' type
    inits = {t.name: t for t in prepared.graph.initializer}
    by_name = {n.name: n for n in prepared.graph.node}
    extra = {"DefaultTensorType": inits[by_name[nodes[0]].input[1]].data_type}
    if weights == "int4":
        MatMulNBitsQuantizer = _nbits_quantizer()
        q = MatMulNBitsQuantizer(_copy(prepared), bits=4, block_size=block_size, is_symmetric=True,
                                 nodes_to_include=nodes)
        q.process()
        return q.model.model
    with tempfile.TemporaryDirectory(prefix="lnfold-quantize-") as tmp:
        out = Path(tmp) / "quantized.onnx"
        if activations is None:
            quantize_dynamic(_copy(prepared), out, weight_type=QuantType.QInt8, per_channel=per_channel,
                             nodes_to_quantize=nodes, extra_options=extra)
        else:
            quantize_static(_copy(prepared), out, _calibration_reader(calibration), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=per_channel,
                            nodes_to_quantize=nodes, extra_options=extra)
        return onnx.load(str(out))


@contextlib.contextmanager
def _quiet_quantizers():
    """onnxruntime's quantizers log every node at INFO and advice at WARNING (a bare
    `logging.warning`, which installs a handler on the root logger): errors only while they run
    for lnfold, and the caller's logging as it was after."""
    root = logging.getLogger()
    handlers, disabled = list(root.handlers), logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(disabled)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)


def _nbits_quantizer():
    """onnxruntime's MatMulNBitsQuantizer. Importing its module calls logging.basicConfig(INFO)
    (a handler on the root logger of the user's process): undone here."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    return MatMulNBitsQuantizer


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _is_scores(output: str) -> bool:
    """An output whose last axis scores classes (top-1 agreement means something there)."""
    low = output.lower()
    return "logit" in low or "prob" in low or "score" in low or low == "output"


def output_errors(original: onnx.ModelProto, quantized: onnx.ModelProto, *, inputs=None, dims=None) -> dict:
    """Per float output of the original: max relative error of the quantized model against it,
    and, for outputs that score classes (logits), the share of rows whose argmax agrees."""
    runner, feeds, ref = verify.original_run(original, inputs=inputs, dims=dims)
    try:
        got = verify.session(quantized).run(None, feeds)
    except Exception as e:
        raise LnfoldError(f"onnxruntime cannot run the quantized model: {str(e).splitlines()[0][:200]}") from None
    errors = {}
    for name, a, b in zip(runner.names, ref, got):
        a, b = np.asarray(a), np.asarray(b)
        if not np.issubdtype(a.dtype, np.floating):
            continue
        entry = {"max_rel_err": max_rel_err(a, b)}
        if _is_scores(name) and a.ndim >= 2 and a.shape[-1] > 1 and a.shape == b.shape:
            entry["top1_agreement"] = float((a.argmax(-1) == b.argmax(-1)).mean())
        errors[name] = entry
    described = "the given inputs" if inputs is not None else "made-up inputs (" + ", ".join(
        f"{k} {list(v.shape)}" for k, v in feeds.items()) + ")"
    return {"errors": errors, "inputs": described}


def quantize_model(model, *, weights: str = "int8", activations: Optional[str] = None, calibrate=None,
                   rotate: Optional[str] = None, seed: int = 0, block_size: int = 128, per_channel: bool = False,
                   fold: bool = True, gamma_into_readers: Optional[bool] = None, inputs=None,
                   dims: Optional[dict] = None) -> QuantizeResult:
    """Fold `model` exactly, then quantize it with onnxruntime's quantizer; NOT exact.

    `weights` "int8" (with `activations=None`: onnxruntime's quantize_dynamic) or "int4"
    (MatMulNBitsQuantizer, weight-only, `block_size` along K); `activations="int8"` with
    int8 weights: quantize_static, QDQ, calibrated on `calibrate` (an .npz path or a dict
    name -> array; rows along the first axis). `per_channel`: onnxruntime's per-channel int8
    weights. `rotate` ("hadamard", "orthogonal", seeded by `seed`) rotates each folded stream
    after moving the norms' γ into their readers (`gamma_into_readers`, default: with a
    rotation). `fold=False` hands the model to the quantizer as given (plain onnxruntime, with
    the same Gemm rewrite and settings: the baseline). `inputs` / `dims`: the verification inputs
    (as for fold_onnx), on which the fold is verified and the quantized model's error measured.

    Returns QuantizeResult(model, report, fold); report.exact is False.
    """
    t0 = time.perf_counter()
    check_options(weights, activations, calibrate, rotate, block_size, seed)
    if isinstance(model, (str, os.PathLike)):
        model = load(model)
    elif not isinstance(model, onnx.ModelProto):
        raise LnfoldError(f"expected an onnx.ModelProto or a path to one, got {type(model).__name__}")
    inputs, dims = check_verify_args(model, inputs, dims)
    calibration = None
    if calibrate is not None:
        calibration = synth.load_npz(calibrate, model) if isinstance(calibrate, (str, os.PathLike)) \
            else synth.check_feeds(dict(calibrate), model, "calibration inputs")
    prepared = prepare(model, fold=fold, rotate=rotate, seed=seed, gamma_into_readers=gamma_into_readers,
                       inputs=inputs, dims=dims)
    t1 = time.perf_counter()
    quantized = run_quantizer(prepared.model, weights, activations, calibration=calibration, block_size=block_size,
                              per_channel=per_channel)
    t2 = time.perf_counter()
    measured = output_errors(model, quantized, inputs=inputs, dims=dims)
    f = prepared.fold
    report = QuantizeReport(
        scheme=scheme_name(weights, activations, block_size, per_channel), weights=weights, activations=activations,
        block_size=block_size if weights == "int4" else None, per_channel=per_channel,
        folded=f.report.folded if f else 0, kept=f.report.kept if f else 0,
        fold_verified=f.criterion if f else None, fold_max_rel_err=f.max_rel_err if f else None,
        gamma_into_readers=bool(f) and (bool(rotate) if gamma_into_readers is None else gamma_into_readers),
        rotate=rotate, seed=seed if rotate else None, rotation=_rotation_summary(f), rotated_streams=rotated_streams(f),
        linear_layers=len(linear_layers(prepared.model)), ops_before=dict(op_counts(prepared.model)),
        ops_after=dict(op_counts(quantized)), bytes_before=model.ByteSize(), bytes_after=quantized.ByteSize(),
        errors=measured["errors"], error_inputs=measured["inputs"], notes=prepared.notes,
        timings={"fold": t1 - t0, "quantize": t2 - t1, "measure": time.perf_counter() - t2})
    _stamp(quantized, report)
    return QuantizeResult(quantized, report, f)


def rotated_streams(fold: Optional[FoldResult]) -> int:
    return sum(s.rotation.startswith("rotated") for s in fold.report.streams) if fold else 0


def _rotation_summary(fold: Optional[FoldResult]) -> Optional[str]:
    """The fold report's word on each folded stream's rotation (rotated by what, or its blocker)."""
    said = [f"stream {k}: {s.rotation}" for k, s in enumerate(fold.report.streams) if s.rotation] if fold else []
    return "; ".join(said) or None


def _stamp(model: onnx.ModelProto, report: QuantizeReport) -> None:
    """The model says what was done to it, and that it is not exact."""
    for p in [p for p in model.metadata_props if p.key == METADATA_KEY]:
        model.metadata_props.remove(p)
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=report.metadata()))
