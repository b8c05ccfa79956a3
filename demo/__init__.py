"""`lnfold demo`: a small random GPT-2, exported, folded, verified, and measured honestly.

What it shows, in order: the report (each norm's verdict; for the folded stream, which sources
were centered, which tied tensors were cloned and where each β went), the verification against
the original, then two measurements of the folded model in onnxruntime on this machine:
- the norm kernels' own time, from onnxruntime's profiler: the part of the run the fold changes;
- end-to-end time over interleaved rounds, wall and CPU time, with a bootstrap interval on the
  ratio: a model of a few milliseconds on a shared machine is mostly noise, so the demo says
  "within noise" when the interval holds 1 rather than print a speed-up it cannot support.
Building the GPT-2 needs torch and transformers (`pip install 'lnfold[demo]'`, lnfold.zoo); folding
does not. The timing statistics (demo/timing.py) are the benchmarks' too: they live here, installed,
because `lnfold demo` is their one user in the product, and the core (passes/) measures nothing.
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..passes import LnfoldError
from .timing import describe_ratio, interleaved, ratio

# Ops whose kernels compute a norm, before (LayerNormalization) and after (the RMS forms) the fold.
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "RMSNormalization")


def _export_gpt2(layers: int, hidden: int):
    try:
        from .. import zoo
    except ImportError as e:
        raise LnfoldError(f"lnfold demo builds a GPT-2 with torch and transformers, which are not installed "
                          f"({e.name}): pip install 'lnfold[demo]'") from None
    module, args = zoo.gpt2(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab=1000, positions=128)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zoo.export_onnx(module, args, ["input_ids"], opset=18)


def norm_kernel_time(path: Path, feeds: dict, runs: int) -> tuple[float, int]:
    """Median per-run time (seconds) of the norm kernels, from onnxruntime's profiler, and how many
    norm nodes ran per run."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.intra_op_num_threads = 1  # one thread: kernel times are not split across a pool
    so.profile_file_prefix = str(path.with_suffix("")) + "-profile"
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(runs + 2):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    runs_ = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")
    per_run = [0.0] * len(runs_)
    nodes: set[str] = set()
    for e in events:  # each kernel belongs to the run whose time span holds it
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                and e.get("args", {}).get("op_name") in NORM_OPS):
            k = next((i for i, (t0, t1) in enumerate(runs_) if t0 <= e["ts"] <= t1), None)
            if k is not None:
                per_run[k] += e["dur"] * 1e-6
                nodes.add(e["name"])
    return statistics.median(per_run[2:] or [0.0]), len(nodes)


def run_demo(layers: int = 4, hidden: int = 256, keep: str | None = None, seconds: float = 6.0) -> int:
    from ..onnx_rewrite.api import fold_model
    from ..onnx_rewrite.verify import session
    from ..onnx_rewrite.write import save

    t0 = time.perf_counter()
    print(f"lnfold demo: GPT-2 with {layers} layers, width {hidden}, random weights made adversarial "
          "(randomized γ/β, large-mean embeddings and biases, so that a missed centering would show)")
    model = _export_gpt2(layers, hidden)
    print(f"exported to ONNX (opset 18) in {time.perf_counter() - t0:.1f} s\n")

    result = fold_model(model)  # verifies by default
    print(result.report.table())
    print(f"\nfolded in {sum(v for k, v in result.timings.items() if k != 'verification'):.2f} s; "
          f"verified in onnxruntime on random token ids: max relative output difference {result.max_rel_err:.1e}")
    if result.exact_err is not None and result.original_exact_err is not None:
        print(f"error against a float64 run of the original: folded {result.exact_err:.1e}, "
              f"original {result.original_exact_err:.1e} ({result.criterion})")

    out_dir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="lnfold-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    orig_path, fold_path = out_dir / "gpt2.onnx", out_dir / "gpt2.folded.onnx"
    save(model, orig_path)
    save(result.model, fold_path)

    feeds = {"input_ids": np.random.default_rng(0).integers(0, 1000, size=(1, 128)).astype(np.int64)}
    print("\nwhat the fold changes: the norm kernels (onnxruntime profiler, 1 thread, median per run)")
    k_orig, n_orig = norm_kernel_time(orig_path, feeds, runs=30)
    k_fold, n_fold = norm_kernel_time(fold_path, feeds, runs=30)
    print(f"  original: {n_orig} LayerNormalization kernels, {k_orig * 1e6:8.1f} µs per run")
    print(f"  folded:   {n_fold} RMSNorm kernels,            {k_fold * 1e6:8.1f} µs per run "
          f"({k_fold / k_orig:.2f}x)" if k_orig else "")

    a, b = session(orig_path), session(fold_path)
    a.run(None, feeds)
    one = time.perf_counter()
    a.run(None, feeds)
    rounds = int(min(400, max(40, seconds / 2 / max(time.perf_counter() - one, 1e-4))))
    stats = interleaved({"original": lambda: a.run(None, feeds), "folded": lambda: b.run(None, feeds)},
                        rounds=rounds, warmup=5)
    o, f = stats["original"], stats["folded"]
    print(f"\nend to end, onnxruntime CPU, batch 1 x 128 tokens, {rounds} interleaved rounds (median [IQR]):")
    for label, s in (("original", o), ("folded", f)):
        print(f"  {label:<8}  wall {s['median'] * 1e3:6.2f} ms [{(s['q3'] - s['q1']) * 1e3:.2f}]   "
              f"CPU {s['cpu_median'] * 1e3:6.2f} ms [{(s['cpu_q3'] - s['cpu_q1']) * 1e3:.2f}]")
    print(f"  folded/original, wall: {describe_ratio(ratio(stats, 'folded', 'original'))}")
    print(f"  folded/original, CPU:  {describe_ratio(ratio(stats, 'folded', 'original', key='cpu_samples'), what='CPU time')}")
    print("  (norms are a few % of this model's time: an end-to-end difference smaller than the spread "
          "is not a result; `python -m benchmarks run` measures properly)")
    print(f"\nmodels in {out_dir}; demo took {time.perf_counter() - t0:.1f} s")
    return 0
