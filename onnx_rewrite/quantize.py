"""`quantize_model` (lnfold.quantize_onnx, `lnfold quantize`): the exact fold in front of
onnxruntime's own quantizers.

    fold (exact, verified)  →  γ into the readers  →  rotate the stream  →  onnxruntime quantizer

The first three steps are the one pipeline's (fold_model); quantization is a stage after it that
reads the fold's plan records (`FoldResult.plan`), never its report's sentences. The gate verifies
the fold and the Gemm → MatMul rewrite together (`check_exact_steps`). The last step is
onnxruntime's, as users already run it (`quantize_model` says which quantizer for which scheme) —
lnfold quantizes nothing itself — on the linear layers only (linear_layers.py: which ones, and why
the fold's basis changes stay float; the report names those and their share of the parameters).

Quantization is NOT exact. The result's report (quantize_report.py) says so, and says by how much
(relative RMS and max relative error per output): the quantized model against the float original
on the user's rows — `inputs`, else the `calibrate` rows (the second half held out of static
calibration: passes/calibration's one held-out rule) — or, only without either, on made-up inputs, which the report says are not the
user's data. Rows are fed in the model's own batch size (`Rows`). So do the model's metadata and
the command's output. `rotate="auto"` quantizes each of AUTO_CANDIDATES and keeps the lowest error
on those rows (issue 33: on DINOv2 rotation pays for int8 and hurts weight-only int4).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from ..passes import FoldResult, LnfoldError, NothingToFold
from ..passes.errors import first_line
from ..passes.calibration import Rows
from ..passes.options import ROTATIONS
from ..passes import metric, search
from . import approx as approx_io
from . import inputs as synth
from . import verify
from ..passes.pipeline import record
from .api import as_model, check_equivalent, check_verify_args, fold_model, stamp
from .linear_layers import WEIGHT_VIEWS, basis_changes, constant_weights, gemm_to_matmul, linear_layers, name_nodes
from .quantize_report import QuantizeReport, scheme_name
from .write import is_large

WEIGHTS = ("int8", "int4")
ACTIVATIONS = ("int8",)
BLOCK_SIZES = (16, 32, 64, 128, 256)  # int4 (MLAS MlasQuantizeBlockwise: no other)
AUTO = "auto"  # --rotate auto: the best of AUTO_CANDIDATES on the user's rows
METADATA_KEY = "lnfold.quantize"
# --rotate auto's candidates, simplest first (a tie keeps the earlier): prepare() options. The
# model not folded is one of them (onnxruntime's quantizer on lnfold's selection: the linear
# layers, Gemms as MatMuls, weights seen through aliases as the constants they are), so that the
# choice is never worse than the same quantization without the fold on the rows it is judged on.
# Plain onnxruntime (its quantizer on the model as given, every op it takes) is measured beside
# them as a reference (`scheme_name(..., plain=True)`), never chosen: it quantizes other ops than lnfold says
# it quantizes (issue 45 item 9).
NOT_FOLDED = "not folded (onnxruntime's quantizer on lnfold's linear layers)"
AUTO_CANDIDATES = ((NOT_FOLDED, dict(fold=False)), ("fold", dict()),
                   ("fold, γ into the readers", dict(gamma_into_readers=True)),
                   *((r, dict(rotate=r)) for r in ROTATIONS))
# a later (less simple) candidate is kept only where it cuts the error by more than this share: a
# few held-out rows rank near-equal candidates by chance (measured on MiniLM: 2% apart, reversed
# on other rows)
AUTO_MARGIN = 0.05


@dataclass
class Prepared:
    """The float model handed to the quantizer: folded (and rotated), Gemms rewritten."""

    model: onnx.ModelProto
    fold: Optional[FoldResult]
    notes: list[str]
    gamma_into_readers: bool = False
    rewritten: int = 0  # weights made constants and Gemms made MatMuls (constant_weights, gemm_to_matmul)


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
    if rotate is not None and rotate not in ROTATIONS + (AUTO,):
        raise LnfoldError(f"rotate={rotate!r}: one of {', '.join(ROTATIONS + (AUTO,))}")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:  # MLAS refuses others (an internal error)
        sizes = ", ".join(map(str, BLOCK_SIZES))
        raise LnfoldError(f"block size {block_size}: a power of two from 16 to 256 ({sizes}: what onnxruntime's "
                          "MatMulNBits quantizer takes)")
    if block_size != 128 and weights != "int4":
        raise LnfoldError("--block-size is for int4 weights")
    if not isinstance(seed, int) or seed < 0:
        raise LnfoldError(f"seed {seed!r}: a non-negative integer")


def prepare(model: onnx.ModelProto, *, fold: bool = True, rotate: Optional[str] = None, seed: int = 0,
            gamma_into_readers: Optional[bool] = None, inputs=None, dims=None, verify: bool = True) -> Prepared:
    """The exact steps: fold (verified unless verify=False), γ into readers and rotation where
    asked, Gemm → MatMul. A rotation that rotates no stream leaves γ in the norms unless
    `gamma_into_readers=True` asks for it: γ moved alone made weight quantization worse (issue 33)."""
    gamma = bool(rotate) if gamma_into_readers is None else gamma_into_readers
    if rotate and not gamma:
        raise LnfoldError("a rotation needs the norms' weights in their readers (gamma_into_readers=True)")
    if not fold and (rotate or gamma):
        raise LnfoldError("rotation and γ into the readers are part of the fold: they need fold=True")
    notes, result = [], None
    work = model
    if fold:
        def run(gamma, rotate):  # (verified below, with the Gemm rewrite: what the quantizer gets)
            return fold_model(model, target="ort", inputs=inputs, dims=dims, gamma_into_readers=gamma,
                              rotate=rotate, seed=seed, verify=False)
        try:
            result = run(gamma, rotate)
            if rotate and gamma_into_readers is None and not rotated_streams(result):
                notes.append(f"--rotate {rotate} rotated no stream ({_rotation_summary(result)}): γ left in the "
                             "norms (moved alone it makes weight quantization worse)")
                gamma, result = False, run(False, None)
            work = result.model
        except NothingToFold as e:
            if rotate or gamma:
                raise LnfoldError(f"cannot rotate: {e}") from None
            notes.append(f"nothing folded ({e}); quantized as given")
    work = copy.deepcopy(work)
    name_nodes(work)
    resolved, float_kept = constant_weights(work)
    if resolved:
        notes.append(f"{resolved} linear layer weight(s) read through {'/'.join(WEIGHT_VIEWS)} of an initializer "
                     "handed to the quantizer as the constant weight they are (the same values; an alias reads its "
                     "initializer itself)")
    notes += [f"kept float: {k}" for k in float_kept]
    rewritten, kept = gemm_to_matmul(work)
    if rewritten:
        notes.append(f"{rewritten} Gemm(s) rewritten as MatMul + Add (exact) so that the quantizer sees them")
    notes += [f"Gemm kept float: {k}" for k in kept]
    prepared = Prepared(work, result, notes, bool(result) and gamma, resolved + rewritten)
    if verify:
        check_exact_steps(model, prepared, inputs, dims)
    return prepared


def check_exact_steps(model: onnx.ModelProto, prepared: Prepared, inputs, dims) -> None:
    """The fold's gate (passes/gate.py) on the model handed to the quantizer: fold, γ, rotation,
    constant weights and Gemm rewrite in one run; its verdict is the fold result's. Where nothing
    folded, the rewrites alone (if any) are checked the same way. None over protobuf's 2 GB in
    memory (as fold_model)."""
    if is_large(prepared.model):
        return
    if prepared.fold is not None:
        record(prepared.fold, check_equivalent(model, prepared.model, inputs=inputs, dims=dims))
    elif prepared.rewritten:
        check_equivalent(model, prepared.model, inputs=inputs, dims=dims)


def _calibration_reader(rows: Rows):
    """onnxruntime's CalibrationDataReader over the user's rows, in the model's batch size."""
    from onnxruntime.quantization import CalibrationDataReader

    batches = rows.runs()

    class NpzReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(batches)

        def get_next(self):
            return next(self.left, None)

    return NpzReader()


def run_quantizer(prepared: onnx.ModelProto, weights: str, activations: Optional[str], *,
                  calibration: Optional[Rows] = None, block_size: int = 128,
                  per_channel: bool = False, quantize_basis_changes: bool = False) -> onnx.ModelProto:
    """onnxruntime's quantizer for the scheme, on the linear layers of `prepared` (not edited).
    `calibration`: Rows (or a dict of arrays, fed as `Rows.runs` feeds them). The fold's
    basis changes stay float (`quantize_basis_changes`: quantized too, only to measure what that
    costs)."""
    if calibration is not None and not isinstance(calibration, Rows):
        calibration = Rows(dict(calibration))
    nodes = linear_layers(prepared, with_basis_changes=quantize_basis_changes)
    if not nodes:
        branches = any(a.type == onnx.AttributeProto.GRAPH for n in prepared.graph.node for a in n.attribute)
        raise LnfoldError("no linear layer to quantize in the main graph" + (
            " (its layers are inside If/Loop branches, as in a merged decoder: quantize the decoder files "
            "before merging)" if branches else " (no MatMul or Gemm with a constant 2-D weight)"))
    keep_float = [] if quantize_basis_changes else list(basis_changes(prepared))
    with _quiet_quantizers():
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

        # onnx's type inference stops at contrib ops (onnxruntime's optimizer fuses them in): the
        # quantizer's own remedy, the type of untyped tensors, is the linear layers' weights' type
        inits = {t.name: t for t in prepared.graph.initializer}
        by_name = {n.name: n for n in prepared.graph.node}
        extra = {"DefaultTensorType": inits[by_name[nodes[0]].input[1]].data_type}
        if weights == "int4":
            with _root_logger_kept():  # importing the module calls logging.basicConfig(INFO)
                from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
            # nodes_to_include adds to the MatMuls it quantizes anyway (onnxruntime 1.32): the others
            # (keep_float among them) are excluded
            others = [n.name for n in prepared.graph.node if n.op_type == "MatMul" and n.name not in set(nodes)]
            q = MatMulNBitsQuantizer(copy.deepcopy(prepared), bits=4, block_size=block_size, is_symmetric=True,
                                     nodes_to_include=nodes, nodes_to_exclude=others)
            q.process()
            return q.model.model
        with tempfile.TemporaryDirectory(prefix="lnfold-quantize-") as tmp:
            out = Path(tmp) / "quantized.onnx"
            if activations is None:
                quantize_dynamic(copy.deepcopy(prepared), out, weight_type=QuantType.QInt8, per_channel=per_channel,
                                 nodes_to_quantize=nodes, nodes_to_exclude=keep_float, extra_options=extra)
            else:
                quantize_static(copy.deepcopy(prepared), out, _calibration_reader(calibration),
                                quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, per_channel=per_channel,
                                nodes_to_quantize=nodes, nodes_to_exclude=keep_float, extra_options=extra)
            return onnx.load(str(out))


def run_plain(model: onnx.ModelProto, weights: str, activations: Optional[str], *,
              calibration: Optional[Rows] = None, block_size: int = 128, per_channel: bool = False) -> onnx.ModelProto:
    """Plain onnxruntime: its quantizer for the scheme on the model as given, with no node
    selection and nothing prepared (`scheme_name(..., plain=True)` says the call): the reference --rotate auto
    reports beside its candidates."""
    with _quiet_quantizers():
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

        if weights == "int4":
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            q = MatMulNBitsQuantizer(copy.deepcopy(model), bits=4, block_size=block_size, is_symmetric=True)
            q.process()
            return q.model.model
        with tempfile.TemporaryDirectory(prefix="lnfold-quantize-") as tmp:
            out = Path(tmp) / "plain.onnx"
            if activations is None:
                quantize_dynamic(copy.deepcopy(model), out, weight_type=QuantType.QInt8, per_channel=per_channel)
            else:
                quantize_static(copy.deepcopy(model), out, _calibration_reader(calibration),
                                quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, per_channel=per_channel)
            return onnx.load(str(out))


@contextlib.contextmanager
def _quiet_quantizers():
    """onnxruntime's quantizers log every node at INFO and advice at WARNING (a bare
    `logging.warning`, which installs a handler on the root logger): errors only while they run
    for lnfold, and the caller's logging as it was after."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with _root_logger_kept():
            yield
    finally:
        logging.disable(disabled)


@contextlib.contextmanager
def _root_logger_kept():
    """The root logger's handlers and level put back after the block (a handler it added removed)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)


def parameters(model: onnx.ModelProto) -> int:
    """The elements of the model's initializers (main graph)."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _is_scores(output: str) -> bool:
    """An output whose last axis scores classes (top-1 agreement means something there)."""
    low = output.lower()
    return "logit" in low or "prob" in low or "score" in low or low == "output"


def measure(original: onnx.ModelProto, quantized: onnx.ModelProto, rows: Rows,
            reference: Optional[tuple] = None) -> dict:
    """Per float output of the original: passes/metric's relative RMS and max relative error of the
    quantized model against it on `rows` (positions where the float model itself is not finite left
    out and counted), and, for outputs that score classes (logits), the share of rows whose argmax
    agrees. `reference`: the original's (names, outputs), if already run."""
    names, ref = reference or approx_io.named_outputs(original, rows.runs())
    _, got = approx_io.named_outputs(quantized, rows.runs())
    errors = {}
    for name, a, b, e in zip(names, ref, got, metric.compare_outputs(ref, got)):
        if e is None:  # (not a float output)
            continue
        entry = {"max_rel_err": e.max_rel, "rel_rms": e.rel_rms}
        if e.nonfinite_ref:
            entry["nonfinite_ref"] = e.nonfinite_ref
        a, b = np.asarray(a), np.asarray(b)
        if _is_scores(name) and a.ndim >= 2 and a.shape[-1] > 1 and a.shape == b.shape:
            rows_ok = np.isfinite(a).all(axis=-1)  # (rows where the float model is not finite: left out)
            if rows_ok.any():
                entry["top1_agreement"] = float((a.argmax(-1) == b.argmax(-1))[rows_ok].mean())
        errors[name] = entry
    return errors


def made_up_rows(original: onnx.ModelProto, dims=None) -> Rows:
    """Inputs the verification makes up (verify.original_run), as Rows."""
    _, feeds, _ = verify.original_run(original, dims=dims)
    return Rows(feeds)


def score(errors: dict) -> float:
    """What --rotate auto minimizes: the worst output's relative RMS error (passes/metric: never NaN)."""
    return max((e["rel_rms"] for e in errors.values()), default=0.0)


@dataclass
class Measured:
    """The rows the error is measured on (and --rotate auto chooses by), the rows that calibrate,
    and the rows the fold is verified on (None: made-up ones)."""

    rows: Rows
    described: str
    calibration: Optional[Rows]
    verification: Optional[dict]
    all_calibration: Optional[Rows] = None  # every --calibrate row (the written model's calibration)


def measurement_rows(model: onnx.ModelProto, inputs, calibrate, activations: Optional[str], dims) -> Measured:
    """--inputs when given; else the --calibrate rows (static activations: held out of calibration
    by the one rule, passes/calibration.Rows.split); else made-up inputs, said to be."""
    calibration = synth.load_rows(calibrate, model, "calibration inputs") if calibrate is not None else None
    if inputs is not None:
        rows = synth.load_rows(inputs, model, "inputs")
        return Measured(rows, f"your inputs ({rows.describe()})", calibration, rows.runs()[0])
    if calibration is None:
        rows = made_up_rows(model, dims)
        return Measured(rows, f"made-up inputs ({rows.describe()}) — NOT your data: the error on real inputs can be "
                        "far larger; give --inputs or --calibrate", None, None)
    if activations is None:  # nothing calibrates: every row measures
        return Measured(calibration, f"your --calibrate rows ({calibration.describe()})", None, calibration.runs()[0])
    fit, held = calibration.split()
    if held is None:
        return Measured(calibration, f"the calibration rows themselves ({calibration.describe()}; too few to hold "
                        "any out: give --inputs for an independent figure)", calibration, calibration.runs()[0])
    return Measured(held, f"{held.count} held-out --calibrate rows ({held.describe()}), not used to calibrate; "
                    f"calibrated on the other {fit.count}", fit, held.runs()[0], calibration)


def quantize_model(model, *, weights: str = "int8", activations: Optional[str] = None, calibrate=None,
                   rotate: Optional[str] = None, seed: int = 0, block_size: int = 128, per_channel: bool = False,
                   fold: bool = True, gamma_into_readers: Optional[bool] = None, inputs=None,
                   dims: Optional[dict] = None, verify: bool = True) -> QuantizeResult:
    """Fold `model` exactly, then quantize it with onnxruntime's quantizer; NOT exact.

    `weights` "int8" (with `activations=None`: onnxruntime's quantize_dynamic) or "int4"
    (MatMulNBitsQuantizer, weight-only, `block_size` along K); `activations="int8"` with
    int8 weights: quantize_static, QDQ, calibrated on `calibrate` (an .npz path or a dict
    name -> array; rows along the first axis, fed in the model's batch size; the second half is
    held out to measure the error unless `inputs` are given: passes/calibration's one rule). `per_channel`: onnxruntime's
    per-channel int8 weights. `rotate` ("hadamard", "orthogonal", their "-keep-ln" variants,
    seeded by `seed`) rotates each folded stream after moving the norms' γ into their readers
    (`gamma_into_readers`, default: with a rotation that rotates a stream); `rotate="auto"` tries
    AUTO_CANDIDATES (the model as given, the fold, γ moved, each rotation) and keeps the one with
    the lowest relative RMS error on the measurement rows. `fold=False` hands the model to the
    quantizer as given (plain onnxruntime, with the same Gemm rewrite and settings: the baseline).
    `inputs` / `dims`: the measurement inputs (as for fold_onnx; `--calibrate` rows or made-up
    ones otherwise). `verify=False` skips the fold's float64 verification.

    Returns QuantizeResult(model, report, fold); report.exact is False.
    """
    t0 = time.perf_counter()
    check_options(weights, activations, calibrate, rotate, block_size, seed)
    if rotate == AUTO and (gamma_into_readers is not None or not fold):
        raise LnfoldError("--rotate auto chooses the fold, γ's place and the rotation itself: "
                          "drop fold=False / gamma_into_readers")
    model = as_model(model)
    dims = check_verify_args(model, None, dims)[1]
    m = measurement_rows(model, inputs, calibrate, activations, dims)
    reference = approx_io.named_outputs(model, m.rows.runs())
    scheme = dict(weights=weights, activations=activations, calibration=m.calibration, block_size=block_size,
                  per_channel=per_channel)
    trials: list[dict] = []
    if rotate == AUTO:
        prepared, quantized, errors, trials = _choose(model, scheme, m, reference, dims, seed, verify)
    else:
        prepared = prepare(model, fold=fold, rotate=rotate, seed=seed, gamma_into_readers=gamma_into_readers,
                           inputs=m.verification, dims=dims, verify=verify)
        quantized = run_quantizer(prepared.model, **scheme)
        errors = measure(model, quantized, m.rows, reference)
    if m.all_calibration is not None:  # measured held out; the model written: calibrated on every row
        quantized = run_quantizer(prepared.model, **{**scheme, "calibration": m.all_calibration})
        prepared.notes.append(f"the error was measured calibrated on {m.calibration.count} rows; the model written is "
                              f"calibrated on all {m.all_calibration.count}")
    t1 = time.perf_counter()
    f = prepared.fold
    chosen = next((t for t in trials if t.get("chosen")), None)
    rotated = chosen["rotate"] if chosen else rotate
    report = QuantizeReport(
        scheme=scheme_name(weights, activations, block_size, per_channel), weights=weights, activations=activations,
        block_size=block_size if weights == "int4" else None, per_channel=per_channel,
        folded=f.report.folded if f else 0, kept=f.report.kept if f else 0,
        fold_verified=f.criterion if f else None, fold_max_rel_err=f.max_rel_err if f else None,
        gamma_into_readers=prepared.gamma_into_readers,
        rotate=rotated, seed=seed if rotated else None, rotation=_rotation_summary(f),
        rotated_streams=rotated_streams(f), linear_layers=len(linear_layers(prepared.model)),
        basis_changes=basis_changes(prepared.model), parameters=parameters(prepared.model),
        ops_before=dict(op_counts(prepared.model)), ops_after=dict(op_counts(quantized)),
        bytes_before=model.ByteSize(), bytes_after=quantized.ByteSize(), errors=errors, error_inputs=m.described,
        notes=prepared.notes, timings={"total": t1 - t0}, candidates=trials,
        chosen=chosen["why"] if chosen else None)
    stamp(quantized, METADATA_KEY, report.metadata())  # the model says what was done to it: not exact
    return QuantizeResult(quantized, report, f)


def _choose(model, scheme: dict, m: Measured, reference, dims, seed: int, verify: bool):
    """--rotate auto: each candidate prepared (unverified), quantized and measured on m.rows; the
    best by passes/search.best_of (lowest `score`, simpler ones kept unless beaten by AUTO_MARGIN;
    a NaN never chosen) kept, its fold then verified. Returns (prepared, quantized, errors, trials)."""
    made: dict[int, tuple] = {}  # candidate -> (prepared, quantized, errors)

    def scored(k: int) -> float:
        label, opts = AUTO_CANDIDATES[k]
        try:
            prepared = prepare(model, seed=seed, dims=dims, verify=False, **opts)
        except LnfoldError as e:
            raise search.Skip(str(e)[:160]) from None
        if opts.get("rotate") and not rotated_streams(prepared.fold):
            raise search.Skip("rotates no stream (the same as the fold)")
        if opts.get("gamma_into_readers") and not moved_gamma(prepared.fold):
            raise search.Skip("no γ can move (the same as the fold)")
        quantized = run_quantizer(prepared.model, **scheme)
        made[k] = (prepared, quantized, measure(model, quantized, m.rows, reference))
        return score(made[k][2])

    best = search.best_of(range(len(AUTO_CANDIDATES)), scored, AUTO_MARGIN)
    trials = []
    for t in best.trials:
        trial = {"candidate": AUTO_CANDIDATES[t.index][0], "rotate": AUTO_CANDIDATES[t.index][1].get("rotate")}
        if t.skipped is not None:
            trial["skipped"] = t.skipped
        else:
            trial.update(score=t.score, max_rel_err=max((e["max_rel_err"] for e in made[t.index][2].values()),
                                                        default=0.0))
        if t.skipped is None:
            trial.update(ops=dict(op_counts(made[t.index][1])), bytes=made[t.index][1].ByteSize())
        trials.append(trial)
    trial = trials[best.index]  # (the first candidate, the model not folded, is never skipped)
    prepared, quantized, errors = made[best.index]
    trial["chosen"] = True
    base = trials[0].get("score")
    counted = sum('score' in t for t in trials)
    trials.append(_plain_trial(model, scheme, m, reference))
    plain = trials[-1].get("score")
    trial["why"] = (f"{trial['candidate']}: the lowest relative RMS error ({trial['score']:.3g}) of "
                    f"{counted} candidates on the measurement rows, simpler ones kept "
                    f"unless beaten by over {AUTO_MARGIN:.0%}"
                    + (f" (not folded: {base:.3g})" if base is not None and trial is not trials[0] else "")
                    + (f"; plain onnxruntime, for reference: {plain:.3g}" if plain is not None else ""))
    if verify:  # the chosen fold, verified like any fold
        check_exact_steps(model, prepared, m.verification, dims)
    return prepared, quantized, errors, trials


def _plain_trial(model: onnx.ModelProto, scheme: dict, m: Measured, reference) -> dict:
    """Plain onnxruntime's quantizer on the model as given, measured as the candidates are: a
    reference beside them (`plain`), never chosen."""
    trial = {"candidate": "plain onnxruntime: " + scheme_name(scheme["weights"], scheme["activations"],
                                                              scheme["block_size"], scheme["per_channel"], plain=True),
             "rotate": None, "plain": True}
    try:
        quantized = run_plain(model, **scheme)
        errors = measure(model, quantized, m.rows, reference)
    except Exception as e:  # (its failure is a finding about onnxruntime, not an error of the command)
        trial["skipped"] = f"onnxruntime failed: {first_line(e)[:160]}"
        return trial
    before, after = op_counts(model), op_counts(quantized)
    trial.update(score=score(errors), max_rel_err=max((e["max_rel_err"] for e in errors.values()), default=0.0),
                 ops=dict(after), bytes=quantized.ByteSize(),
                 changed_ops={k: [before.get(k, 0), after.get(k, 0)] for k in sorted(set(before) | set(after))
                              if before.get(k, 0) != after.get(k, 0)})
    return trial


def rotated_streams(fold: Optional[FoldResult]) -> int:
    """The streams the fold's plan rotated (its StreamBasis records)."""
    return sum(r.rotated for r in fold.plan.stream_bases) if fold else 0


def moved_gamma(fold: Optional[FoldResult]) -> bool:
    """Whether the fold's plan moved some norm's γ into its readers' weights (its GammaFold records)."""
    return fold is not None and any(g.moved and g.gamma is not None for g in fold.plan.gammas.values())


def _rotation_summary(fold: Optional[FoldResult]) -> Optional[str]:
    """The fold report's word on each folded stream's rotation (rotated by what, or its blocker)."""
    said = [f"stream {k}: {s.rotation}" for k, s in enumerate(fold.report.streams) if s.rotation] if fold else []
    return "; ".join(said) or None
