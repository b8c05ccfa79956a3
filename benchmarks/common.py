"""Shared helpers: onnxruntime sessions with fixed threads, the machine description, statistics."""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Fixed thread counts for every measurement (stated in RESULTS.md).
THREADS = 2


def ort_session(model, *, threads: int = THREADS, opt_level: str = "all", profile: str | None = None,
                optimized_path: str | None = None, providers=None):
    """An InferenceSession with fixed intra-op threads, sequential execution and one inter-op thread."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    # Several sessions stay alive side by side for interleaved runs: spinning pool threads of an
    # idle session would steal the cores of the one being timed.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=providers or ["CPUExecutionProvider"])


def bound_runner(sess, feeds: dict, device: str = "cpu"):
    """A zero-argument callable running `sess` with inputs and outputs bound once (IOBinding)."""
    import onnxruntime as ort

    b = sess.io_binding()
    dev, dev_id = ("cuda", 0) if device == "cuda" else ("cpu", 0)
    for name, arr in feeds.items():
        b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, dev, dev_id))
    for o in sess.get_outputs():
        b.bind_output(o.name, dev, dev_id)
    sess.run_with_iobinding(b)  # allocate outputs once
    if device == "cuda":
        def run():
            sess.run_with_iobinding(b)
            b.synchronize_outputs()
        return run
    return lambda: sess.run_with_iobinding(b)


def machine() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        kv = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        info["cpu"] = kv.get("Model name", "?").strip()
        info["cpus"] = int(kv.get("CPU(s)", "0").strip() or 0)
        info["threads_per_core"] = kv.get("Thread(s) per core", "?").strip()
        info["flags_avx512"] = "avx512f" in kv.get("Flags", "")
    except Exception as e:  # pragma: no cover
        info["cpu"] = f"? ({e})"
    info["os.cpu_count"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def gpu() -> dict | None:
    try:
        import torch

        if torch.cuda.is_available():
            return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    except Exception:
        pass
    return None


def versions() -> dict:
    out = {}
    for mod in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx_graphsurgeon", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    try:
        out["lnfold_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True, timeout=10).stdout.strip()
    except Exception:
        pass
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_header(module: str, argv, *packages: str, extra: str = "") -> str:
    """The line a benchmark's output starts with: when (UTC), the machine, the versions of `packages`
    (with `extra`) and the command (`argv`: main's, None where it is the process's own)."""
    said = ", ".join(f"{p} {__import__(p).__version__}" for p in packages)
    args = " ".join(sys.argv[1:] if argv is None else argv)
    return f"Run {now()}, {platform.machine()}, {said}{extra}; `python -m {module}{' ' if args else ''}{args}`"


@contextlib.contextmanager
def quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def iqr(stat: dict) -> float:
    return stat["q3"] - stat["q1"]


def log(msg: str) -> None:
    print(f"[bench {datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fns: dict, *, rounds: int, warmup: int = 2) -> dict:
    """onnx_rewrite.timing.interleaved: wall and process CPU time (all threads of this process) per call.

    On a machine shared with other work, wall time also counts the time other processes hold the
    cores; CPU time counts only our own work, so its ratios survive contention much better.
    """
    from lnfold.onnx_rewrite.timing import interleaved

    return interleaved(fns, rounds=rounds, warmup=warmup)
