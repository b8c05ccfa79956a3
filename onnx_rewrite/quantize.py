"""`quantize_model` (lnfold.quantize_onnx, `lnfold quantize`): the exact fold in front of
onnxruntime's own quantizers, on the linear layers only (linear_layers.py says which, and why the
fold's basis changes stay float). lnfold quantizes nothing itself; every decision made from measured
numbers (candidates, choice, error, report) is passes/quantize.py's. This adapter prepares the float
model, runs onnxruntime's quantizer and runs the result.

Linear layers inside If branches (Optimum's merged decoder) are quantized where onnxruntime does it
(int8 dynamic with EnableSubgraph, int4); its static QDQ quantizer sees no branch, so W8A8 on such a
model is refused before any work (`check_branches`). The error is measured on the branch the rows
take (`branches_taken`); the exact steps are verified on every branch (`check_exact_steps`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from ..passes import FoldResult, LnfoldError
from ..passes.calibration import Rows
from ..passes.errors import first_line
from ..passes.options import MASSIVE, FoldOptions
from ..passes.pipeline import Progress, record, stage
from ..passes.quantize import (AUTO, Measured, QuantizeResult, Quantized, auto_candidates, bounded,
                               calibrates, changed_ops, check_rotation_options, check_scheme, choose,
                               fold_for_quantizer, measurement, report_of, streamed_errors, trial)
from . import calibration as calibration_io, inputs as synth, targets, verify
from .api import as_model, check_verify_args, fold_model, stamp, with_massive_channels
from .linear_layers import (WEIGHT_VIEWS, basis_changes, constant_weights, float_parameters, gemm_to_matmul,
                            graphs, layers_by_graph, linear_layers, name_nodes)
from .write import is_large

BLOCK_SIZES = (16, 32, 64, 128, 256)  # int4 (MLAS MlasQuantizeBlockwise: no other)
METADATA_KEY = "lnfold.quantize"


@dataclass
class Prepared:
    """The float model handed to the quantizer: folded (and rotated), Gemms rewritten."""

    model: onnx.ModelProto
    fold: Optional[FoldResult]
    notes: list[str]
    gamma_into_readers: bool = False
    rewritten: int = 0  # weights made constants and Gemms made MatMuls (constant_weights, gemm_to_matmul)


def check_options(weights: str, activations: Optional[str], calibrate, rotate: Optional[str],
                  block_size: int, seed: int) -> None:
    """Every option, checked before any work: one-line LnfoldErrors (passes/quantize's, then onnxruntime's)."""
    check_scheme(weights, activations, rotate, seed)
    if calibrates(weights, activations) and calibrate is None:
        raise LnfoldError("int8 activations (static, W8A8) need calibration inputs: --calibrate FILE.npz "
                          "(API: calibrate=), representative inputs, one array per model input")
    if block_size not in BLOCK_SIZES:  # MLAS refuses others (an internal error)
        sizes = ", ".join(map(str, BLOCK_SIZES))
        raise LnfoldError(f"block size {block_size}: a power of two from 16 to 256 ({sizes}: what onnxruntime's "
                          "MatMulNBits quantizer takes)")
    if block_size != 128 and weights != "int4":
        raise LnfoldError("--block-size is for int4 weights")


def check_branches(model: onnx.ModelProto, weights: str, activations: Optional[str]) -> None:
    """W8A8 refused on linear layers inside If/Loop branches: onnxruntime's static QDQ quantizer (1.32)
    recurses into no subgraph and its calibrator sees no branch's tensors, so its layers would be
    written float."""
    branches = [where for where in layers_by_graph(model) if where != "main graph"]
    if branches and calibrates(weights, activations):
        raise LnfoldError(
            f"W8A8 (onnxruntime's quantize_static, QDQ) cannot quantize this model: its linear layers are inside "
            f"{' and '.join(branches[:2])}{' ...' if len(branches) > 2 else ''} (a merged decoder), and onnxruntime's "
            "static quantizer and calibrator see only the main graph; use int8 dynamic (--weights int8 alone) or "
            "int4 (--weights int4, with or without --activations int8), or quantize the decoders before merging")


def prepare(model: onnx.ModelProto, *, fold: bool = True, rotate: Optional[str] = None, seed: int = 0,
            gamma_into_readers: Optional[bool] = None, gamma_in_float: bool = False,
            spare_channels: Optional[tuple] = None, online_hadamard: bool = False, inputs=None, dims=None,
            verify: bool = True) -> Prepared:
    """The exact steps: the fold (passes/quantize.fold_for_quantizer), constant weights and Gemm →
    MatMul; verified together unless verify=False."""
    def run(**options):  # (verified below, with the Gemm rewrite: what the quantizer gets)
        return fold_model(model, target="ort", inputs=inputs, dims=dims, seed=seed, verify=False, **options)

    result, moved, notes = fold_for_quantizer(run, fold=fold, rotate=rotate, gamma_into_readers=gamma_into_readers,
                                              gamma_in_float=gamma_in_float, spare_channels=spare_channels,
                                              online_hadamard=online_hadamard)
    # the fold's own model (made for this call) is edited in place: the fold result then holds the
    # model handed to the quantizer, which its verdict is about, and no second copy of a big model
    # is alive beside it; the model as given is never edited (it is the error's reference)
    work = result.model if result is not None and result.model is not model else copy.deepcopy(model)
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
    inside = {where: len(names) for where, names in layers_by_graph(work).items() if where != "main graph"}
    if inside:
        notes.append("linear layers inside branches, each quantized there: " + ", ".join(
            f"{n} in {where}" for where, n in inside.items()) + " (a weight the branches share stays one initializer)")
    prepared = Prepared(work, result, notes, moved, resolved + rewritten)
    if verify:
        check_exact_steps(model, prepared, inputs, dims)
    return prepared


def check_exact_steps(model: onnx.ModelProto, prepared: Prepared, inputs, dims) -> None:
    """The fold's gate on the model handed to the quantizer: fold and rewrites in one run, its verdict
    the fold result's. None over protobuf's 2 GB in memory (as fold_model). Every branch of an If a
    bool input decides is run: the rows take one, made-up inputs the others."""
    if is_large(prepared.model) or (prepared.fold is None and not prepared.rewritten):
        return
    verdict = verify.check(model, prepared.model, inputs=inputs, dims=dims, other_branches=True)
    if not verdict.ok:
        raise verdict.error()
    if prepared.fold is not None:
        record(prepared.fold, verdict)


def _calibration_reader(rows: Rows):
    """onnxruntime's CalibrationDataReader over the user's rows, in the model's batch size."""
    from onnxruntime.quantization import CalibrationDataReader

    class NpzReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(rows.runs())

        def get_next(self):
            return next(self.left, None)

    return NpzReader()


def run_quantizer(prepared: onnx.ModelProto, weights: str, activations: Optional[str], *,
                  calibration: Optional[Rows] = None, block_size: int = 128,
                  per_channel: bool = False, quantize_basis_changes: bool = False) -> onnx.ModelProto:
    """onnxruntime's quantizer for the scheme, on the linear layers of `prepared` (not edited).
    `calibration`: Rows, or a dict of arrays. The fold's basis changes stay float
    (`quantize_basis_changes`: quantized too, only to measure what that costs)."""
    if calibration is not None and not isinstance(calibration, Rows):
        calibration = Rows(dict(calibration))
    check_branches(prepared, weights, activations)
    nodes = linear_layers(prepared, with_basis_changes=quantize_basis_changes)
    if not nodes:
        branches = " or its branches" if len(graphs(prepared)) > 1 else ""
        raise LnfoldError(f"no linear layer to quantize in the main graph{branches} (no MatMul or Gemm with a "
                          "constant 2-D weight)")
    keep_float = [] if quantize_basis_changes else list(basis_changes(prepared))
    # (node names are unique across the main graph and its branches: name_nodes; the quantizers
    # select by name in a branch too)
    if weights == "int4":
        # nodes_to_include adds to the MatMuls it quantizes anyway (onnxruntime 1.32): the others
        # (keep_float among them) are excluded
        others = [n.name for _, g, _ in graphs(prepared) for n in g.node
                  if n.op_type == "MatMul" and n.name not in set(nodes)]
        return _onnxruntime(prepared, weights, activations, calibration, block_size, per_channel,
                            dict(nodes_to_include=nodes, nodes_to_exclude=others))
    # onnx's type inference stops at contrib ops (onnxruntime's optimizer fuses them in): the
    # quantizer's own remedy, the type of untyped tensors, is the linear layers' weights' type
    dtype = next(inits[n.input[1]].data_type for _, g, inits in graphs(prepared) for n in g.node if n.name == nodes[0])
    return _onnxruntime(prepared, weights, activations, calibration, block_size, per_channel,
                        dict(nodes_to_quantize=nodes, nodes_to_exclude=keep_float,
                             extra_options={"DefaultTensorType": dtype}))


def run_plain(model: onnx.ModelProto, weights: str, activations: Optional[str], *,
              calibration: Optional[Rows] = None, block_size: int = 128, per_channel: bool = False) -> onnx.ModelProto:
    """Plain onnxruntime: its quantizer for the scheme on the model as given, no node selection (the
    call `scheme_name(..., plain=True)` says): the reference --rotate auto reports."""
    return _onnxruntime(model, weights, activations, calibration, block_size, per_channel, {})


def _onnxruntime(model: onnx.ModelProto, weights: str, activations: Optional[str], calibration: Optional[Rows],
                 block_size: int, per_channel: bool, selection: dict) -> onnx.ModelProto:
    """onnxruntime's quantizer for the scheme on a copy of `model`, with `selection` (its node
    keywords) as given: MatMulNBitsQuantizer (int4), quantize_dynamic or quantize_static (QDQ)."""
    with _quiet_quantizers():
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

        if weights == "int4":
            with _root_logger_kept():  # importing the module calls logging.basicConfig(INFO)
                from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
            # accuracy_level 4: the CPU kernel quantizes each activation block to int8 at run time (W4A8)
            q = MatMulNBitsQuantizer(copy.deepcopy(model), bits=4, block_size=block_size, is_symmetric=True,
                                     accuracy_level=4 if activations == "int8" else None, **selection)
            q.process()
            return q.model.model
        with tempfile.TemporaryDirectory(prefix="lnfold-quantize-") as tmp:
            out = Path(tmp) / "quantized.onnx"
            if activations is None:
                if len(graphs(model)) > 1:  # (its branches too: off by default)
                    selection = {**selection, "extra_options": {**selection.get("extra_options", {}),
                                                                "EnableSubgraph": True}}
                quantize_dynamic(copy.deepcopy(model), out, weight_type=QuantType.QInt8, per_channel=per_channel,
                                 **selection)
            else:
                quantize_static(copy.deepcopy(model), out, _calibration_reader(calibration),
                                quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, per_channel=per_channel, **selection)
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


def op_counts(model: onnx.ModelProto) -> dict:
    """Op kind -> count over the main graph and its branches."""
    return dict(Counter(n.op_type for _, g, _ in graphs(model) for n in g.node))


def measure(original: onnx.ModelProto, quantized: onnx.ModelProto, rows: Rows, original_file=None) -> dict:
    """passes/quantize.streamed_errors of the quantized model against the original on `rows`: both
    run run by run, in lockstep, one run's outputs alive at a time (a model's outputs over every row,
    an LM's logits, are never held). `original_file`: the file `original` was read from, which its
    session then reads (no serialized copy of the model in memory)."""
    names = [o.name for o in original.graph.output]
    return streamed_errors(names, calibration_io.paired_runs(original_file or original, quantized, rows.runs()))


def branches_taken(model: onnx.ModelProto, rows: Rows) -> Optional[str]:
    """Which branch of each top-level If whose condition is a model input (Optimum's merged decoder:
    `use_cache_branch`) the rows take, in words: the error is measured there only, where every row
    takes one branch. None for a model without such an If."""
    said = []
    for node in model.graph.node:
        if node.op_type != "If" or node.input[0] not in {i.name for i in model.graph.input}:
            continue
        taken = {bool(v) for feeds in rows.runs() if node.input[0] in feeds
                 for v in np.asarray(feeds[node.input[0]]).reshape(-1)}
        if taken == {True, False}:
            said.append(f"the rows take both branches of If `{node.name}` (`{node.input[0]}` True and False)")
        elif taken:
            (value,) = taken
            branch, other = ("then_branch", "else_branch") if value else ("else_branch", "then_branch")
            said.append(f"every row takes the {branch} of If `{node.name}` (`{node.input[0]}` = {value}): the error "
                        f"is measured on that branch only; the {other}, quantized the same way, is not measured "
                        f"(rows with `{node.input[0]}` = {not value} measure it)")
    return "; ".join(said) or None


def quantize_model(model, *, weights: str = "int8", activations: Optional[str] = None, calibrate=None,
                   rotate: Optional[str] = None, seed: int = 0, block_size: int = 128, per_channel: bool = False,
                   fold: bool = True, gamma_into_readers: Optional[bool] = None, gamma_in_float: bool = False,
                   spare_channels=None, online_hadamard: bool = False, inputs=None, dims: Optional[dict] = None,
                   verify: bool = True, progress: Progress = None) -> QuantizeResult:
    """Fold `model` exactly, then quantize it with onnxruntime's quantizer; NOT exact.

    `weights` "int8" (with `activations=None`: quantize_dynamic) or "int4" (MatMulNBitsQuantizer,
    weight-only, `block_size` along K); `activations="int8"` with int8 weights: quantize_static, QDQ,
    calibrated on `calibrate` (an .npz path or a dict name -> array, rows along the first axis; the
    second half held out to measure the error unless `inputs` are given); with int4 weights, W4A8:
    MatMulNBits accuracy_level=4, whose CPU kernel quantizes the activations at run time.
    `per_channel`: onnxruntime's per-channel int8 weights. `rotate`, `seed`, `gamma_into_readers`
    (default: with a rotation that rotates a stream), `gamma_in_float`, `spare_channels` and
    `online_hadamard` are the fold's options (passes/options.OPTIONS); `rotate="auto"` quantizes each
    candidate (passes/quantize.auto_candidates) and keeps the lowest error on the measurement rows.
    `fold=False` hands the model to the quantizer as given (the baseline). `inputs` / `dims`: the
    measurement inputs (as for fold_onnx; else `calibrate` rows or made-up ones). `verify=False`
    skips the fold's float64 verification.

    Returns QuantizeResult(model, report, fold); report.exact is False.
    """
    t0 = time.perf_counter()
    check_options(weights, activations, calibrate, rotate, block_size, seed)
    check_rotation_options(rotate, fold, gamma_into_readers, gamma_in_float, spare_channels, online_hadamard)
    given = model if isinstance(model, (str, os.PathLike)) else None  # (its sessions read the file)
    model = as_model(model)
    check_branches(model, weights, activations)
    dims = check_verify_args(model, None, dims)[1]
    load = lambda f, what: synth.load_rows(f, model, what) if f is not None else None  # noqa: E731
    m = measurement(load(inputs, "inputs"), load(calibrate, "calibration inputs"), calibrates(weights, activations),
                    lambda: calibration_io.rows_for(model, None, dims)[0])
    if (taken := branches_taken(model, m.rows)) is not None:
        m = replace(m, described=f"{m.described}; {taken}")
    m = bounded(m, calibration_io.row_output_bytes(given or model, m.rows))  # (an LM's logits: a row per run)
    if spare_channels == MASSIVE:  # found once, on every calibration row (else the measurement rows)
        spare_channels = with_massive_channels(model, FoldOptions(rotate="orthogonal", spare_channels=MASSIVE),
                                               targets.resolve("ort", "cpu"), m.all_calibration or m.rows,
                                               dims).spare_channels
    scheme = dict(weights=weights, activations=activations, calibration=m.calibration, block_size=block_size,
                  per_channel=per_channel)

    def prepare_with(opts: dict, verified: bool = False) -> Prepared:
        return prepare(model, seed=seed, dims=dims, inputs=m.verification if verified else None,
                       verify=verified, **opts)

    def quantize_prepared(prepared: Prepared, measured: bool = True, kept: bool = True) -> Quantized:
        quantized = run_quantizer(prepared.model, **scheme)
        if not kept:  # a --rotate auto trial: its float model (the fold result's) dropped before its runs
            prepared.model = None
            if prepared.fold is not None:
                prepared.fold.model = None
        return Quantized(prepared, quantized, prepared.fold, measure(model, quantized, m.rows, given) if measured
                         else {}, op_counts(quantized), quantized.ByteSize())

    trials: list[dict] = []
    if rotate == AUTO:
        q, trials = choose(prepare_with, lambda prepared: quantize_prepared(prepared, kept=False),
                           lambda: _plain_trial(model, scheme, m, given), progress=progress,
                           candidates=auto_candidates("onnxruntime", spare_channels),
                           unmeasured=lambda prepared: quantize_prepared(prepared, measured=False))
        if verify:  # the chosen fold, verified like any fold
            check_exact_steps(model, q.prepared, m.verification, dims)
    else:
        stage(progress, "folding (verified)" if verify else "folding")
        prepared = prepare_with(dict(fold=fold, rotate=rotate, gamma_into_readers=gamma_into_readers,
                                     gamma_in_float=gamma_in_float, spare_channels=spare_channels,
                                     online_hadamard=online_hadamard), verify)
        stage(progress, f"quantizing ({scheme_name(weights, activations, block_size, per_channel, plain=True)}) and "
                        f"measuring on {m.rows.count} row(s)")
        q = quantize_prepared(prepared)
    prepared = q.prepared
    if m.all_calibration is not None:  # measured held out; the model written: calibrated on every row
        stage(progress, f"calibrating the model written on all {m.all_calibration.count} row(s)")
        q.quantized = run_quantizer(prepared.model, **{**scheme, "calibration": m.all_calibration})
        q.ops, q.bytes = op_counts(q.quantized), q.quantized.ByteSize()
        prepared.notes.append(f"the error was measured calibrated on {m.calibration.count} rows; the model written is "
                              f"calibrated on all {m.all_calibration.count}")
    report = report_of(
        scheme_name(weights, activations, block_size, per_channel), q, weights=weights, activations=activations,
        block_size=block_size if weights == "int4" else None, per_channel=per_channel, rotate=rotate, seed=seed,
        gamma_into_readers=prepared.gamma_into_readers, linear_layers=len(linear_layers(prepared.model)),
        basis_changes=basis_changes(prepared.model), parameters=float_parameters(prepared.model),
        ops_before=op_counts(prepared.model), bytes_before=model.ByteSize(), error_inputs=m.described,
        notes=prepared.notes, seconds=time.perf_counter() - t0, trials=trials)
    stamp(q.quantized, METADATA_KEY, report.metadata())  # the model says what was done to it: not exact
    return QuantizeResult(report, model=q.quantized, fold=q.fold)


def _plain_trial(model: onnx.ModelProto, scheme: dict, m: Measured, given=None) -> dict:
    """Plain onnxruntime's quantizer on the model as given, measured as the candidates are: a
    reference beside them (`plain`), never chosen."""
    label = "plain onnxruntime: " + scheme_name(scheme["weights"], scheme["activations"], scheme["block_size"],
                                                scheme["per_channel"], plain=True)
    if scheme["weights"] == "int8" and len(graphs(model)) > 1:  # (_onnxruntime: its branches too)
        label = label[:-1] + ", extra_options={'EnableSubgraph': True})"
    try:
        quantized = run_plain(model, **scheme)
        errors = measure(model, quantized, m.rows, given)
    except Exception as e:  # (its failure is a finding about onnxruntime, not an error of the command)
        return {"candidate": label, "rotate": None, "plain": True,
                "skipped": f"onnxruntime failed: {first_line(e)[:160]}"}
    before, after = op_counts(model), op_counts(quantized)
    return {**trial(label, Quantized(None, quantized, None, errors, after, quantized.ByteSize()),
                    rotate=None, plain=True),
            "changed_ops": {k: list(v) for k, v in changed_ops(before, after).items()}}


def scheme_name(weights: str, activations: Optional[str], block_size: int, per_channel: bool,
                plain: bool = False) -> str:
    """The scheme in words; `plain`: the call plain onnxruntime makes for it, as a user writes it."""
    channel = (", per_channel=True" if plain else ", per channel") if per_channel else ""
    if weights == "int4" and plain:
        level = ", accuracy_level=4" if activations == "int8" else ""
        return f"MatMulNBitsQuantizer(model, bits=4, block_size={block_size}, is_symmetric=True{level})"
    if weights == "int4":
        return (f"W4A8: int4 weights, blocks of {block_size}, int8 activations quantized at run time by the CPU "
                "kernel (onnxruntime MatMulNBitsQuantizer, symmetric, accuracy_level=4)" if activations == "int8" else
                f"int4 weight-only, blocks of {block_size} (onnxruntime MatMulNBitsQuantizer, symmetric)")
    if activations == "int8":
        return (f"quantize_static(model, rows, quant_format=QDQ, activation_type=QInt8, weight_type=QInt8{channel})"
                if plain else
                f"W8A8: int8 weights{channel}, static int8 activations (onnxruntime quantize_static, QDQ)")
    return (f"quantize_dynamic(model, weight_type=QInt8{channel})" if plain else
            f"int8 weights{channel}, dynamic int8 activations (onnxruntime quantize_dynamic)")
