"""`lnfold bench ORIGINAL FOLDED` (and `lnfold demo`'s figures): what the fold buys on this machine,
from onnxruntime on CPU. The norm kernels' time and share of a run come from the profiler with one
thread (kernel times not split across a pool); end-to-end time from interleaved rounds of original,
folded and the original again (an A/A pair), claimed only as timing.compare_repeats allows.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from ..passes import LnfoldError
from ..passes.pipeline import stage
from ..passes.options import check_seconds, check_threads
from .api import check_verify_args
from .inputs import graph_inputs
from .progress import reporting
from .read import load
from .verify import original_run
from .timing import MARGIN, compare_repeats, describe_ratio, interleaved, ratio, summary

# Ops whose kernels compute a norm, before (LayerNormalization) and after (the RMS forms) the fold.
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "RMSNormalization")
PROFILED_RUNS = 30
_MIN_ROUNDS, _MAX_ROUNDS = 60, 1000  # (fewer than _MIN_ROUNDS where the budget allows no more: said)
PROFILE_SHARE = 0.25  # of the --seconds budget, for the two models' profiled runs


def timing_session(path: Path, threads: int, profile_prefix: Optional[str] = None):
    """A CPU session with `threads` intra-op threads (0: onnxruntime's default) that do not spin
    between runs (a spinning pool of an idle session would steal the timed one's cores)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3  # failures raise; its warnings are about its own graph optimizations
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise LnfoldError(f"{path}: onnxruntime cannot load it ({' '.join(str(e).split())[:200]})") from None


def norm_kernel_time(path: Path, feeds: dict, until: float) -> dict:
    """Median per run (seconds) of the norm kernels' time and of all kernels' time (the profiler's
    own overhead between kernels left out), from onnxruntime's profiler with one thread, and the
    norm ops that ran ({op: nodes}). Two runs are not counted (warm-up); the counted ones stop at
    PROFILED_RUNS, or at time.perf_counter() `until` after the first (`"runs"`: how many were counted)."""
    with tempfile.TemporaryDirectory(prefix="lnfold-profile-") as tmp:
        sess = timing_session(path, 1, profile_prefix=str(Path(tmp) / "profile"))
        for k in range(PROFILED_RUNS + 2):
            sess.run(None, feeds)
            if k >= 2 and time.perf_counter() >= until:
                break
        events = json.loads(Path(sess.end_profiling()).read_text())
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")
    norms, kernels = [0.0] * len(spans), [0.0] * len(spans)
    nodes: dict[str, set] = {}
    for e in events:  # each kernel belongs to the run whose time span holds it
        if not (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")):
            continue
        k = next((i for i, (t0, t1) in enumerate(spans) if t0 <= e["ts"] <= t1), None)
        if k is None:
            continue
        kernels[k] += e["dur"] * 1e-6
        op = e.get("args", {}).get("op_name")
        if op in NORM_OPS:
            norms[k] += e["dur"] * 1e-6
            nodes.setdefault(op, set()).add(e["name"])
    return {"norms": statistics.median(norms[2:] or [0.0]), "kernels": statistics.median(kernels[2:] or [0.0]),
            "ops": {op: len(v) for op, v in nodes.items()}, "runs": max(len(spans) - 2, 0)}


def measure(original: Path, folded: Path, feeds: dict, *, threads: int = 1, seconds: float = 8.0,
            repeats: int = 3, started: Optional[float] = None, progress=None) -> dict:
    """The profiler's norm-kernel figures for both models, and interleaved end-to-end timings in up
    to `repeats` blocks with sessions of their own. `seconds` bounds the whole measurement from
    `started` (time.perf_counter(); default: now): the profiler gets PROFILE_SHARE of it, each block
    an equal share of the rest (one round and one block at least: a model slower than the budget
    overruns it by that much). `progress` hears of each phase between timed runs, never inside them."""
    t0 = time.perf_counter() if started is None else started
    deadline = t0 + seconds
    share = (deadline - time.perf_counter()) * PROFILE_SHARE / 2
    kernels = {}
    for name, path in (("original", original), ("folded", folded)):
        stage(progress, f"profiling the {name} model's norm kernels")
        kernels[name] = norm_kernel_time(path, feeds, until=time.perf_counter() + share)
    blocks, rounds, planned = [], 0, 0
    for k in range(repeats):
        if blocks and time.perf_counter() >= deadline:
            break
        stage(progress, f"timing end to end: repeat {k + 1} of {repeats}, fresh sessions")
        a, a2, b = (timing_session(p, threads) for p in (original, original, folded))
        if not planned:  # from one run's time: about `seconds` over all blocks and variants
            a.run(None, feeds)
            t = time.perf_counter()
            a.run(None, feeds)
            one = time.perf_counter() - t
            planned = int(min(_MAX_ROUNDS, max(_MIN_ROUNDS, seconds / 3 / repeats / max(one, 1e-5))))
            # the bootstrap after the rounds grows with them (~5 ms a round of each block here): the
            # rounds, run and analyzed, fit in what is left of the budget
            per_round = analysis_per_round(repeats)
            left = deadline - time.perf_counter()
            planned = max(1, min(planned, int(left / (per_round + 3 * repeats * one))))
        reserve = per_round * planned * (repeats - k)  # (this block's and the later ones' share of the analysis)
        until = time.perf_counter() + max(deadline - reserve - time.perf_counter(), 0.0) / (repeats - k)
        blocks.append(interleaved({"original": lambda: a.run(None, feeds), "original again": lambda: a2.run(None, feeds),
                                   "folded": lambda: b.run(None, feeds)}, rounds=planned, warmup=5, until=until))
        rounds += blocks[-1]["original"]["n"]
        del a, a2, b
    pooled = {name: {k: [x for blk in blocks for x in blk[name][k]] for k in ("samples", "cpu_samples")}
              for name in blocks[0]}
    return {"kernels": kernels, "stats": {name: summary(v["samples"], v["cpu_samples"]) for name, v in pooled.items()},
            "rounds": rounds, "repeats": len(blocks), "threads": threads, "budget": seconds,
            "planned": planned * repeats, "took": time.perf_counter() - t0,
            "wall": compare_repeats(blocks, "folded", "original", "original again"),
            "cpu": compare_repeats(blocks, "folded", "original", "original again", key="cpu_samples")}


def analysis_per_round(repeats: int) -> float:
    """Seconds timing.compare_repeats takes per round of each of `repeats` blocks (wall and CPU),
    timed here on 64 made-up rounds: it is linear in the rounds."""
    rng = np.random.default_rng(0)
    stats = {k: {"samples": list(1 + 0.01 * rng.standard_normal(64))} for k in ("a", "b")}
    t = time.perf_counter()
    ratio(stats, "a", "b")
    one = (time.perf_counter() - t) / 64  # one ratio() per round
    return one * 2 * 2 * (repeats + repeats)  # 2 keys x (num, A/A) x (pooled over the blocks + each block)


def describe(m: dict) -> list[str]:
    """The measurement as the lines `lnfold bench` and `lnfold demo` print."""
    ko, kf = m["kernels"]["original"], m["kernels"]["folded"]
    out = ["norm kernels (onnxruntime profiler, 1 thread, median per run):"]
    for label, k in (("original", ko), ("folded", kf)):
        ops = ", ".join(f"{n} {op}" for op, n in sorted(k["ops"].items())) or "no norm kernels"
        share = f"{k['norms'] / k['kernels'] * 100:.1f}% of all kernels' time" if k["kernels"] else "no kernel times"
        out.append(f"  {label + ':':<10}{k['norms'] * 1e6:8.1f} µs per run, {share} ({ops})")
    if ko["norms"]:
        out.append(f"  folded/original norm kernel time: {kf['norms'] / ko['norms']:.2f}x")
    threads = "onnxruntime's default threads" if m["threads"] == 0 else \
        f"{m['threads']} intra-op thread{'s' if m['threads'] != 1 else ''}"
    out.append(f"end to end, {m['rounds']} interleaved rounds in {m['repeats']} repeats with fresh sessions, {threads} "
               "(median [IQR]; \"original again\" is a second session of the original: the A/A spread):")
    if m["rounds"] < _MIN_ROUNDS * 3:
        runs = min(k["runs"] for k in m["kernels"].values())
        out.insert(0, f"budget: --seconds {m['budget']:g} allowed {m['rounds']} interleaved round(s) in {m['repeats']} "
                      f"repeat(s) and {runs} profiled run(s) per model (took {m['took']:.1f} s; a steady figure "
                      f"wants {_MIN_ROUNDS * 3} rounds: raise --seconds for one)")
    scale, unit = (1e6, "µs") if m["stats"]["original"]["median"] < 1e-3 else (1e3, "ms")
    for label, s in m["stats"].items():
        out.append(f"  {label:<15} wall {s['median'] * scale:8.3f} {unit} [{(s['q3'] - s['q1']) * scale:.3f}]   "
                   f"CPU {s['cpu_median'] * scale:8.3f} {unit} [{(s['cpu_q3'] - s['cpu_q1']) * scale:.3f}]")
    out.append(f"  folded/original (ratio of the medians above; claimed only beyond {MARGIN:g}x the A/A spread, "
               "in every repeat):")
    out.append(f"    wall: {describe_ratio(m['wall'])}")
    out.append(f"    CPU:  {describe_ratio(m['cpu'], what='CPU time')}")
    return out


def _signature(model) -> list[tuple]:
    return [(s.name, s.elem, tuple(s.dims)) for s in graph_inputs(model)]


def run_bench(original: str, folded: str, *, threads: int = 1, seconds: float = 8.0, inputs=None,
              dims: Optional[dict] = None) -> int:
    """`lnfold bench`: both models must take the same inputs; they run on the user's (`inputs`,
    an .npz path) or on made-up ones (`dims` fixes symbolic sizes), as verification makes them."""
    started = time.perf_counter()  # (--seconds bounds the whole command from here)
    check_threads(threads)  # (the command line checked them as it read them: passes/options.py)
    check_seconds(seconds)
    a, b = load(original, lazy=True), load(folded, lazy=True)
    if _signature(a) != _signature(b):
        raise LnfoldError(f"{original} and {folded} take different inputs ({_describe_inputs(a)} vs "
                          f"{_describe_inputs(b)}): bench compares a model with its folded copy")
    feeds, dims = check_verify_args(a, inputs, dims)
    del a, b
    _, feeds, _ = original_run(original, inputs=feeds, dims=dims)
    made = "given" if inputs is not None else "made up; --inputs FILE.npz or --dim NAME=SIZE to change"
    print(f"lnfold bench: {original} (original) vs {folded} (folded), onnxruntime {ort.__version__} CPU")
    shapes = ", ".join(f"{k} {v.dtype} {list(v.shape)}" for k, v in feeds.items())
    print(f"inputs: {shapes} ({made})")
    with reporting(Path(original)) as progress:  # a status line on a terminal, erased before the figures
        measured = measure(Path(original), Path(folded), feeds, threads=threads, seconds=seconds, started=started,
                           progress=progress)
    print("\n".join(describe(measured)))
    return 0


def _describe_inputs(model) -> str:
    return ", ".join(f"{name} {TensorProto.DataType.Name(elem).lower()} {[d if d else '?' for d in dims]}"
                     for name, elem, dims in _signature(model)) or "none"
