"""What the pass itself costs: fold time and peak memory (ru_maxrss of a fresh subprocess per
measurement, via os.wait4), for GPT-2 shapes of growing depth and for a ≥1.5 B-parameter model
saved with external data, next to onnxruntime's transformer optimizer on the same file.

The models are written directly with onnx.helper, mimicking torch.onnx's GPT-2 export (Gather
embeddings + position table, LayerNormalization, Reshape/Gemm linears with biases, Split
attention with a causal mask, tanh-GELU, Add residuals, tied lm_head via Transpose + MatMul):
exporting a 1.5 B model from torch would need several times its 6 GB on this 24 GB machine.
Weights are random with large per-row means (what the fold has to center), streamed straight
into the external-data file, so building never holds the model in memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from .common import ROOT, log
from .models import CACHE

F = TensorProto.FLOAT
I64 = TensorProto.INT64


class _Writer:
    """Initializers whose bytes go straight into one external-data file."""

    def __init__(self, data_path: Path, seed: int = 0):
        self.data_path = data_path
        self.f = open(data_path, "wb")
        self.offset = 0
        self.inits: list[TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.params = 0

    def add(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        if arr.nbytes < 1024:
            self.inits.append(onnx.numpy_helper.from_array(arr, name))
            return name
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=arr.shape)
        t.data_location = TensorProto.EXTERNAL
        pad = (-self.offset) % 64  # keep every tensor aligned (onnxruntime may mmap it)
        if pad:
            self.f.write(b"\0" * pad)
            self.offset += pad
        self.f.write(arr.tobytes())
        for k, v in (("location", self.data_path.name), ("offset", str(self.offset)), ("length", str(arr.nbytes))):
            t.external_data.add(key=k, value=v)
        self.offset += arr.nbytes
        self.inits.append(t)
        if arr.dtype == np.float32:
            self.params += arr.size
        return name

    def weight(self, name: str, shape, *, std: float, row_mean_axis: int | None = None) -> str:
        w = self.rng.standard_normal(shape, dtype=np.float32)
        w *= std
        if row_mean_axis is not None:  # a large per-row shift, constant along row_mean_axis (the output axis)
            mshape = [1] * len(shape)
            mshape[1 - row_mean_axis] = shape[1 - row_mean_axis]
            w += (3 * std) * self.rng.standard_normal(mshape, dtype=np.float32)
        return self.add(name, w)

    def close(self):
        self.f.close()


def build_gpt2(path: Path, *, layers: int, hidden: int, heads: int, vocab: int = 50257, positions: int = 1024,
               seed: int = 0) -> dict:
    """Write a GPT-2-shaped ONNX model (opset 18) with its weights in `path`.data; returns facts."""
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    w = _Writer(path.with_name(path.name + ".data"), seed)
    D, H, hd = hidden, heads, hidden // heads
    nodes: list = []
    k = [0]

    def n(op, ins, outs=None, **attrs):
        k[0] += 1
        outs = outs or [f"{op.lower()}_{k[0]}"]
        nodes.append(helper.make_node(op, ins, outs, name=f"/{op}_{k[0]}", **attrs))
        return outs[0] if len(outs) == 1 else outs

    consts: set[str] = set()

    def c(name, vals, dt=np.int64):
        if name not in consts:
            consts.add(name)
            w.add(name, np.asarray(vals, dt))
        return name

    std = 0.02
    # token table with a per-row mean, tied with lm_head (read through a Transpose, as exported)
    wte = w.weight("wte", (vocab, D), std=std, row_mean_axis=1)
    wpe = w.weight("wpe", (positions, D), std=0.01, row_mean_axis=1)
    # shapes
    shp = n("Shape", ["input_ids"])
    bs = n("Slice", [shp, c("c_0", [0]), c("c_2", [2])])
    seq = n("Gather", [shp, c("c_1s", 1)], axis=0)
    shape3 = {m: n("Concat", [bs, c(f"c_{m}", [m])], axis=0) for m in (D, 3 * D, 4 * D)}
    shape4 = n("Concat", [bs, c("c_hhd", [H, hd])], axis=0)
    flat = c("c_flat", [-1, D])
    flat4 = c("c_flat4", [-1, 4 * D])
    emb = n("Gather", [wte, "input_ids"], axis=0)
    pos = n("Range", [c("c_zero", 0), seq, c("c_one", 1)])
    pemb = n("Gather", [wpe, pos], axis=0)
    h = n("Add", [emb, pemb])
    # causal mask [S, S]: 0 on and below the diagonal, -inf-ish above
    rng_row = n("Unsqueeze", [pos, c("c_ax1", [1])])
    rng_col = n("Unsqueeze", [pos, c("c_ax0", [0])])
    allowed = n("LessOrEqual", [rng_col, rng_row])
    mask = n("Where", [allowed, c("c_zf", np.float32(0), np.float32), c("c_neg", np.float32(-3.4e38), np.float32)])
    scale = c("c_scale", np.float32(1 / np.sqrt(hd)), np.float32)

    def ln(x, name):
        g = w.add(f"{name}.weight", (1 + 0.5 * w.rng.standard_normal(D)).astype(np.float32))
        b = w.add(f"{name}.bias", (0.5 * w.rng.standard_normal(D)).astype(np.float32))
        return n("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-5, stash_type=1)

    def linear(x2d, name, din, dout, out_shape):
        wt = w.weight(f"{name}.weight", (din, dout), std=std, row_mean_axis=1)
        b = w.add(f"{name}.bias", (0.2 * w.rng.standard_normal(dout) + 0.3).astype(np.float32))
        y = n("Gemm", [x2d, wt, b], alpha=1.0, beta=1.0, transA=0, transB=0)
        return n("Reshape", [y, out_shape], allowzero=1)

    for i in range(layers):
        p = f"h.{i}"
        a = ln(h, f"{p}.ln_1")
        qkv = linear(n("Reshape", [a, flat], allowzero=1), f"{p}.attn.c_attn", D, 3 * D, shape3[3 * D])
        q, kk, v = n("Split", [qkv], [f"{p}.q", f"{p}.k", f"{p}.v"], axis=2, num_outputs=3)
        q = n("Transpose", [n("Reshape", [q, shape4], allowzero=1)], perm=[0, 2, 1, 3])
        kk = n("Transpose", [n("Reshape", [kk, shape4], allowzero=1)], perm=[0, 2, 3, 1])
        v = n("Transpose", [n("Reshape", [v, shape4], allowzero=1)], perm=[0, 2, 1, 3])
        s = n("Add", [n("Mul", [n("MatMul", [q, kk]), scale]), mask])
        o = n("MatMul", [n("Softmax", [s], axis=-1), v])
        o = n("Reshape", [n("Transpose", [o], perm=[0, 2, 1, 3]), flat])
        h = n("Add", [linear(o, f"{p}.attn.c_proj", D, D, shape3[D]), h])
        m = ln(h, f"{p}.ln_2")
        f = linear(n("Reshape", [m, flat], allowzero=1), f"{p}.mlp.c_fc", D, 4 * D, shape3[4 * D])
        # tanh GELU as the exporter writes it
        inner = n("Mul", [n("Add", [f, n("Mul", [n("Pow", [f, c("c_3", np.float32(3), np.float32)]),
                                                 c("c_044", np.float32(0.044715), np.float32)])]),
                          c("c_s2p", np.float32(np.sqrt(2 / np.pi)), np.float32)])
        g = n("Mul", [n("Mul", [f, c("c_half", np.float32(0.5), np.float32)]),
                      n("Add", [n("Tanh", [inner]), c("c_onef", np.float32(1), np.float32)])])
        h = n("Add", [h, linear(n("Reshape", [g, flat4], allowzero=1), f"{p}.mlp.c_proj", 4 * D, D, shape3[D])])
    hf = ln(h, "ln_f")
    wteT = n("Transpose", [wte], perm=[1, 0])
    n("MatMul", [hf, wteT], ["logits"])
    w.close()
    graph = helper.make_graph(
        nodes, f"gpt2-{layers}x{D}", [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", F, ["batch", "seq", vocab])], initializer=w.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch")
    model.ir_version = 9
    onnx.save_model(model, str(path))
    size = path.stat().st_size + w.data_path.stat().st_size
    return {"layers": layers, "hidden": D, "heads": H, "vocab": vocab, "params": w.params, "bytes": size,
            "build_s": time.perf_counter() - t0}


# --- measuring one command in a fresh subprocess ------------------------------------------------
def measure(cmd: list[str], *, rss_limit: int | None = None, timeout: float = 1800) -> dict:
    """Wall time, peak RSS (ru_maxrss of this child, from os.wait4), and stderr lines stamped with
    the time they arrived (lnfold prints its stages there for big models)."""
    t0 = time.perf_counter()
    # Linux keeps a process's peak RSS across exec, and a forked child starts with its parent's
    # pages: launched straight from this (possibly large) process, the child would report our RSS.
    # So a tiny launcher (/bin/sh, a few MB) forks the measured command, and its own peak is ours.
    rss_file = ROOT / "benchmarks" / ".cache" / f"rss-{os.getpid()}-{time.monotonic_ns()}.txt"
    rss_file.parent.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable, "-S", "-c", _LAUNCHER, str(rss_file)] + cmd
    proc = subprocess.Popen(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    stamped: list[tuple[float, str]] = []
    out_lines: list[str] = []
    killed = []

    def read_err():
        for line in proc.stderr:
            stamped.append((time.perf_counter() - t0, line.rstrip()))

    def read_out():
        for line in proc.stdout:
            out_lines.append(line.rstrip())

    def watch():
        while proc.poll() is None:
            try:
                rss = int(open(f"/proc/{proc.pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                break
            try:
                kids = [int(x) for x in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
                rss = max([rss] + [int(open(f"/proc/{k}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                                   for k in kids])
            except (OSError, ValueError):
                pass
            if (rss_limit and rss > rss_limit) or time.perf_counter() - t0 > timeout:
                killed.append(f"killed at {rss / 2**30:.1f} GiB RSS after {time.perf_counter() - t0:.0f} s")
                os.killpg(proc.pid, 9)  # the launcher's session: the launcher and the command
                break
            time.sleep(0.2)

    threads = [threading.Thread(target=f, daemon=True) for f in (read_err, read_out, watch)]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in threads[:2]:
        t.join(timeout=5)
    try:
        child_maxrss = int(rss_file.read_text().split()[0]) * 1024
        rss_file.unlink()
    except (OSError, ValueError, IndexError):
        child_maxrss = None
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "wall_s": time.perf_counter() - t0,
            "peak_rss_bytes": child_maxrss, "launcher_maxrss_bytes": usage.ru_maxrss * 1024,
            "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "stderr": stamped[-40:], "stdout": out_lines[-20:], "killed": killed[0] if killed else None}


# Runs argv[2:] as a child and writes that child's ru_maxrss (KiB) to argv[1]; exits with its code.
_LAUNCHER = """
import os, resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
"""

ORT_OPT_SNIPPET = """
import sys, time
t0 = time.perf_counter()
from onnxruntime.transformers.optimizer import optimize_model
src, dst, heads, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = optimize_model(src, model_type="gpt2", num_heads=heads, hidden_size=hidden)
t1 = time.perf_counter()
print(f"optimize_model {t1 - t0:.2f} s", file=sys.stderr, flush=True)
m.save_model_to_file(dst, use_external_data_format=True, all_tensors_to_one_file=True)
print(f"save {time.perf_counter() - t1:.2f} s", file=sys.stderr, flush=True)
"""

PROFILE_SNIPPET = """
import cProfile, pstats, sys, io
from lnfold.onnx_rewrite.cli import main
pr = cProfile.Profile()
pr.enable()
rc = main(sys.argv[2:])
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
open(sys.argv[1], "w").write(s.getvalue())
sys.exit(rc)
"""


def lnfold_cmd(src: Path, dst: Path, *, verify: bool, target: str = "ort") -> list[str]:
    return [sys.executable, "-m", "lnfold", "fold", str(src), "-o", str(dst), "--target", target] + (
        [] if verify else ["--no-verify"])


def _model_bytes(p: Path) -> int:
    return p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.name + ".data"))


def _stages(stamped: list) -> list[tuple[float, str]]:
    return [(round(t, 2), line) for t, line in stamped if line.startswith("lnfold:")]


def run(*, quick: bool, big: bool = True, keep: bool = False) -> dict:
    root = CACHE / "foldcost"
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"depth": [], "big": None, "profile_top": None}
    depths = (12,) if quick else (12, 24, 48)
    for L in depths:
        src = root / f"gpt2-{L}x768.onnx"
        facts = build_gpt2(src, layers=L, hidden=768, heads=12)
        log(f"foldcost: GPT-2 {L}x768 ({facts['params'] / 1e6:.0f} M params, {facts['bytes'] / 2**20:.0f} MiB)")
        row = {**facts, "runs": {}}
        for verify in ((False, True) if L == 12 else (False,)):
            dst = root / f"gpt2-{L}x768.folded.onnx"
            r = measure(lnfold_cmd(src, dst, verify=verify), rss_limit=RSS_LIMIT)
            r["stages"] = _stages(r.pop("stderr"))
            row["runs"]["lnfold fold" + ("" if verify else " --no-verify")] = r
            _rm(dst)
        dst = root / f"gpt2-{L}x768.ortopt.onnx"
        r = measure([sys.executable, "-c", ORT_OPT_SNIPPET, str(src), str(dst), "12", "768"], rss_limit=RSS_LIMIT)
        r["stderr"] = r["stderr"][-3:]
        row["runs"]["onnxruntime optimizer"] = r
        _rm(dst)
        if L == (24 if 24 in depths else depths[-1]):
            out["profile_top"] = profile_fold(src, root, label=f"GPT-2 {L}x768")
        out["depth"].append(row)
        _rm(src)
    if big:
        out["big"] = run_big(root, keep=keep)
    return out


# Kill a measured process past this RSS: the machine has 24 GB, shared with other work.
RSS_LIMIT = 17 * 2**30


def profile_fold(src: Path, root: Path, label: str) -> dict:
    dst = root / "profiled.folded.onnx"
    prof = root / "fold-profile.txt"
    r = measure([sys.executable, "-c", PROFILE_SNIPPET, str(prof), "fold", str(src), "-o", str(dst), "--no-verify"],
                rss_limit=RSS_LIMIT)
    _rm(dst)
    return {"model": label, "rc": r["rc"], "wall_s": r["wall_s"], "text": prof.read_text() if prof.exists() else None}


def run_big(root: Path, *, keep: bool = False) -> dict:
    src = root / "gpt2-xl-48x1600.onnx"
    facts = build_gpt2(src, layers=48, hidden=1600, heads=25)
    log(f"foldcost: GPT-2-XL-like ({facts['params'] / 1e9:.2f} B params, {facts['bytes'] / 2**30:.2f} GiB) "
        f"built in {facts['build_s']:.0f} s")
    row = {**facts, "runs": {}}
    dst = root / "gpt2-xl.folded.onnx"
    # the fold alone, then with the CLI's verification (onnxruntime loads and runs both models:
    # that needs the memory to run them, which the fold's own target does not cover)
    for verify in (False, True):
        r = measure(lnfold_cmd(src, dst, verify=verify), rss_limit=RSS_LIMIT)
        r["stages"] = _stages(r.pop("stderr"))
        r["out_bytes"] = _model_bytes(dst) if dst.exists() else None
        row["runs"]["lnfold fold" + ("" if verify else " --no-verify")] = r
        _rm(dst)
    dst = root / "gpt2-xl.ortopt.onnx"
    r = measure([sys.executable, "-c", ORT_OPT_SNIPPET, str(src), str(dst), "25", "1600"], rss_limit=RSS_LIMIT)
    r["stderr"] = r["stderr"][-3:]
    row["runs"]["onnxruntime optimizer"] = r
    _rm(dst)
    if not keep:
        _rm(src)
    return row


def _rm(p: Path) -> None:
    for f in (p, p.with_name(p.name + ".data")):
        try:
            f.unlink()
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv, big="--no-big" not in sys.argv), indent=1, default=str))
