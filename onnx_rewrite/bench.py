"""`lnfold bench ORIGINAL FOLDED`: what the fold buys on this machine, measured as `lnfold demo`
measures (the demo calls `measure` and `describe` too).

Two figures, each from onnxruntime on CPU:
- the norm kernels' own time and their share of a run, from onnxruntime's profiler (one thread,
  so that kernel times are not split across a pool): the part of the run the fold changes;
- end-to-end time over interleaved rounds (onnx_rewrite/timing.py): original, folded, and the original
  again in a second session (an A/A pair), wall and CPU time, in three repeats with fresh sessions;
  a difference is claimed only as timing.compare_repeats allows, so that a rerun does not contradict it.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional


from ..passes import LnfoldError
from ..passes.options import check_seconds, check_threads
from .timing import MARGIN, compare_repeats, describe_ratio, interleaved, summary

# Ops whose kernels compute a norm, before (LayerNormalization) and after (the RMS forms) the fold.
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "RMSNormalization")
PROFILED_RUNS = 30
_MIN_ROUNDS, _MAX_ROUNDS = 60, 1000


def timing_session(path: Path, threads: int, profile_prefix: Optional[str] = None):
    """A CPU session with `threads` intra-op threads (0: onnxruntime's default) that do not spin
    between runs (a spinning pool of an idle session would steal the timed one's cores)."""
    import onnxruntime as ort

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


def norm_kernel_time(path: Path, feeds: dict, runs: int = PROFILED_RUNS) -> dict:
    """Median per run (seconds) of the norm kernels' time and of all kernels' time (the profiler's
    own overhead between kernels left out), from onnxruntime's profiler with one thread, and the
    norm ops that ran ({op: nodes})."""
    with tempfile.TemporaryDirectory(prefix="lnfold-profile-") as tmp:
        sess = timing_session(path, 1, profile_prefix=str(Path(tmp) / "profile"))
        for _ in range(runs + 2):
            sess.run(None, feeds)
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
            "ops": {op: len(v) for op, v in nodes.items()}}


def measure(original: Path, folded: Path, feeds: dict, *, threads: int = 1, seconds: float = 8.0,
            repeats: int = 3) -> dict:
    """The profiler's norm-kernel figures for both models, and end-to-end timings of original,
    folded and original again (A/A), interleaved for about `seconds` in all, in `repeats` blocks
    with sessions of their own (timing.compare_repeats: a claim must hold in each)."""
    kernels = {"original": norm_kernel_time(original, feeds), "folded": norm_kernel_time(folded, feeds)}
    blocks, rounds = [], 0
    for _ in range(repeats):
        a, a2, b = (timing_session(p, threads) for p in (original, original, folded))
        if not rounds:  # from one run's time: about `seconds` over all blocks and variants
            a.run(None, feeds)
            t = time.perf_counter()
            a.run(None, feeds)
            one = time.perf_counter() - t
            rounds = int(min(_MAX_ROUNDS, max(_MIN_ROUNDS, seconds / 3 / repeats / max(one, 1e-5))))
        blocks.append(interleaved({"original": lambda: a.run(None, feeds), "original again": lambda: a2.run(None, feeds),
                                   "folded": lambda: b.run(None, feeds)}, rounds=rounds, warmup=5))
        del a, a2, b
    pooled = {name: {k: [x for blk in blocks for x in blk[name][k]] for k in ("samples", "cpu_samples")}
              for name in blocks[0]}
    return {"kernels": kernels, "stats": {name: summary(v["samples"], v["cpu_samples"]) for name, v in pooled.items()},
            "rounds": rounds * repeats, "repeats": repeats, "threads": threads,
            "wall": compare_repeats(blocks, "folded", "original", "original again"),
            "cpu": compare_repeats(blocks, "folded", "original", "original again", key="cpu_samples")}


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
    from .inputs import graph_inputs

    return [(s.name, s.elem, tuple(s.dims)) for s in graph_inputs(model)]


def run_bench(original: str, folded: str, *, threads: int = 1, seconds: float = 8.0, inputs=None,
              dims: Optional[dict] = None) -> int:
    """`lnfold bench`: both models must take the same inputs; they run on the user's (`inputs`,
    an .npz path) or on made-up ones (`dims` fixes symbolic sizes), as verification makes them."""
    import onnxruntime as ort

    from .api import check_verify_args
    from .read import load
    from .verify import original_run

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
    for line in describe(measure(Path(original), Path(folded), feeds, threads=threads, seconds=seconds)):
        print(line)
    return 0


def _describe_inputs(model) -> str:
    from onnx import TensorProto

    return ", ".join(f"{name} {TensorProto.DataType.Name(elem).lower()} {[d if d else '?' for d in dims]}"
                     for name, elem, dims in _signature(model)) or "none"
