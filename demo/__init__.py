"""`lnfold demo`: a small random GPT-2, exported, folded, verified, and measured honestly.

What it shows, in order: the report (each norm's verdict; for the folded stream, which sources
were centered, which tied tensors were cloned and where each β went), the verification against
the original (each model's error against a float64 run first), then what `lnfold bench` measures
(onnx_rewrite/bench.py): the norm kernels' own time from onnxruntime's profiler, and end-to-end
time over interleaved rounds with an A/A pair: a model of a few milliseconds on a shared machine
is mostly noise, so the demo says "within noise" unless the ratio's interval lies outside the
A/A spread, rather than print a speed-up that the next run would contradict. It leaves no files
behind unless `--keep DIR` asks for them.
Building the GPT-2 needs torch and transformers (`pip install 'lnfold[demo]'`); folding does not.
"""
from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np

from ..passes import LnfoldError


def _export_gpt2(layers: int, hidden: int):
    try:
        from .. import zoo
    except ImportError as e:
        raise LnfoldError(f"lnfold demo builds a GPT-2 with torch and transformers, which are not installed "
                          f"({e.name}): pip install 'lnfold[demo]'") from None
    module, args = zoo.gpt2(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab=1000, positions=128)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zoo.export_onnx(module, args, ["input_ids"], opset=18)


def verification_line(result) -> str:
    """The fold's error and the original's, both against a float64 run of the original: the
    fold is often the closer of the two, which 'folded vs original' alone would hide."""
    if result.exact_err is not None and result.original_exact_err is not None:
        return (f"error against a float64 run of the original: folded {result.exact_err:.1e}, original "
                f"{result.original_exact_err:.1e} (folded vs original {result.max_rel_err:.1e}; {result.criterion})")
    return f"no float64 run: folded vs original {result.max_rel_err:.1e} (criterion: {result.criterion})"


def run_demo(layers: int = 4, hidden: int = 256, keep: str | None = None, seconds: float = 8.0) -> int:
    from ..onnx_rewrite.api import fold_model
    from ..onnx_rewrite.bench import describe, measure
    from ..onnx_rewrite.write import save
    from ..passes.options import check_seconds

    check_seconds(seconds)  # before the export (the command line checked it as it read it)
    t0 = time.perf_counter()
    print(f"lnfold demo: GPT-2 with {layers} layers, width {hidden}, random weights made adversarial "
          "(randomized γ/β, large-mean embeddings and biases, so that a missed centering would show)")
    model = _export_gpt2(layers, hidden)
    print(f"exported to ONNX (opset 18) in {time.perf_counter() - t0:.1f} s\n")

    result = fold_model(model)  # verifies by default
    print(result.report.table())
    print(f"\nfolded in {sum(v for k, v in result.timings.items() if k != 'verification'):.2f} s; "
          f"verified in onnxruntime on random token ids: {verification_line(result)}")

    with contextlib.ExitStack() as stack:
        if keep:
            out_dir = Path(keep)
            out_dir.mkdir(parents=True, exist_ok=True)
        else:  # removed when the demo ends, however it ends
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lnfold-demo-")))
        orig_path, fold_path = out_dir / "gpt2.onnx", out_dir / "gpt2.folded.onnx"
        save(model, orig_path)
        save(result.model, fold_path)
        feeds = {"input_ids": np.random.default_rng(0).integers(0, 1000, size=(1, 128)).astype(np.int64)}
        print("\nwhat the fold changes, onnxruntime CPU, batch 1 x 128 tokens (`lnfold bench` measures your own model):")
        for line in describe(measure(orig_path, fold_path, feeds, threads=1, seconds=seconds)):
            print(f"  {line}")
    print("  (the norms' share of the kernel time, above, bounds what the fold can change end to end; "
          "`python -m benchmarks run` measures bigger models)")
    where = f"models in {out_dir}; " if keep else ""
    print(f"\n{where}demo took {time.perf_counter() - t0:.1f} s")
    return 0
