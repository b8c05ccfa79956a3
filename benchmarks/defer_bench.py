"""Deferred normalization (issue 14): does `r(x) · ((W·diag γ) x) + b` beat `W · RMSNorm(x) + b`?

- `kernels()`: one norm + its fused QKV reader at GPT-2 small's shape, both emissions, in
  onnxruntime (SimplifiedLayerNormalization + MatMul + Add against ReduceSumSquare… + MatMul + Mul
  + Add) and under Inductor (default, and max-autotune with the cpp GEMM template): interleaved
  times, and whether Inductor put the row scale into the GEMM's epilogue (its generated code).
- `ort_case` / `torch_case`: whole models, side by side in one interleaved run: original, best
  peer, lnfold RMS, lnfold deferred (forced on), the non-equivalent ceiling and no-norm rows.
"""
from __future__ import annotations

import gc
import re
import time

import numpy as np

from . import models as M
from .common import THREADS, log, ort_session, quiet, timed


# --- one norm and its reader ------------------------------------------------------------------------
def _ort_pair(rows: int, d: int, out: int):
    """Two ONNX graphs computing W·RMSNorm(x)·γ + b: the RMS op, and the deferred emission."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((d, out)) / np.sqrt(d)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, out])
    ms = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    rms = helper.make_graph([
        helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["n"], axis=-1, epsilon=1e-5, stash_type=1),
        helper.make_node("MatMul", ["n", "w"], ["p"]),
        helper.make_node("Add", ["p", "b"], ["y"]),
    ], "rms", [x], [y], [numpy_helper.from_array(a, k) for k, a in (("g", g), ("w", w), ("b", b))])
    wg = (w.astype(np.float64) * g[:, None]).astype(np.float32)
    consts = {"w": wg, "b": b, "axes": np.array([1], np.int64), "d": np.array(d, np.float32),
              "eps": np.array(1e-5, np.float32)}
    deferred = helper.make_graph([
        helper.make_node("ReduceSumSquare", ["x", "axes"], ["ss"], keepdims=1),
        helper.make_node("Div", ["ss", "d"], ["ms"]),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["r"]),
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("Mul", ["p", "r"], ["q"]),
        helper.make_node("Add", ["q", "b"], ["y"]),
    ], "deferred", [x], [y], [numpy_helper.from_array(a, k) for k, a in consts.items()])
    matmul_only = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["p"]),
                                     helper.make_node("Add", ["p", "b"], ["y"])], "linear", [x], [y],
                                    [numpy_helper.from_array(a, k) for k, a in (("w", w), ("b", b))])
    mk = lambda gr: helper.make_model(gr, opset_imports=ms, ir_version=9)  # noqa: E731
    return {"rms op + linear": mk(rms), "deferred": mk(deferred), "linear alone": mk(matmul_only)}, \
        rng.standard_normal((rows, d)).astype(np.float32) + 3.0


def kernels(rounds: int = 20) -> dict:
    """Interleaved times of the two emissions of one norm + reader; Inductor's generated code."""
    import torch

    torch.set_num_threads(THREADS)
    out: dict = {"ort": {}, "inductor": {}, "inductor_epilogue": {}}
    shapes = [("GPT-2 QKV, 128 tokens", 128, 768, 2304), ("GPT-2 QKV, 1 token", 1, 768, 2304),
              ("GPT-2 QKV, 1024 tokens", 1024, 768, 2304)]
    for label, rows, d, o in shapes:
        models, x = _ort_pair(rows, d, o)
        fns = {}
        for k, m in models.items():
            s = ort_session(m)
            fns[k] = (lambda s=s: s.run(None, {"x": x}))
        out["ort"][label] = timed(fns, rounds=rounds)
    for label, rows, d, o in shapes[:2]:
        out["inductor"][label] = _inductor_pair(rows, d, o, rounds)
    out["inductor_epilogue"] = _epilogue_check()
    return out


def _torch_pair(d: int, out: int):
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, d, generator=g) / d ** 0.5
    gamma = 1 + 0.5 * torch.randn(d, generator=g)
    b = torch.randn(out, generator=g)
    wg = (w.double() * gamma.double()).float()

    def rms(x):
        return torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (d,), gamma, 1e-5), w, b)

    def deferred(x):
        r = torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
        return torch.nn.functional.linear(x, wg) * r + b

    return rms, deferred


def _inductor_pair(rows, d, o, rounds):
    import torch

    rms, deferred = _torch_pair(d, o)
    x = torch.randn(rows, d) + 3.0
    fns = {}
    for mode in ("default", "max-autotune"):
        for name, f in (("rms op + linear", rms), ("deferred", deferred)):
            torch._dynamo.reset()
            opts = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if mode != "default" else {}
            c = torch.compile(f, dynamic=False, options=opts or None)
            with torch.inference_mode(), quiet():
                c(x)
            fns[f"{name} ({mode})"] = (lambda c=c: _no_grad(c, x))
    return timed(fns, rounds=rounds)


def _no_grad(fn, x):
    import torch

    with torch.inference_mode():
        return fn(x)


def _epilogue_check() -> dict:
    """Inductor's generated code for the deferred reader: is the row scale in the GEMM kernel?"""
    import torch
    from torch._inductor.utils import run_and_get_code

    _, deferred = _torch_pair(768, 2304)
    x = torch.randn(128, 768)
    found = {}
    for mode in ("default", "max-autotune"):
        torch._dynamo.reset()
        opts = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if mode != "default" else None
        with torch.inference_mode(), quiet():
            _, codes = run_and_get_code(torch.compile(deferred, dynamic=False, options=opts), x)
        code = "\n".join(codes)
        calls = re.findall(r"^\s+((?:extern_kernels|torch\.ops)\.[\w.]+|cpp_fused\w+|kernel\w*)\(", code, re.M)
        found[mode] = {
            "calls in order": calls,
            "cpp GEMM template used": "cpp_CppMicroGemm" in code or "GemmTemplate" in code or "template" in code.lower()
                                      and "micro_gemm" in code,
            "row scale fused into the GEMM kernel": _mul_in_gemm(code),
        }
    torch._dynamo.reset()
    return found


def _mul_in_gemm(code: str) -> bool:
    """A cpp GEMM template kernel whose epilogue multiplies (the row scale) — else False."""
    for m in re.finditer(r'(cpp_fused\w*|kernel\w*) = async_compile\.cpp_pybinding\(.*?\'\'\'(.*?)\'\'\'', code, re.S):
        body = m.group(2)
        if "micro_gemm" in body and ("* " in body.split("micro_gemm", 1)[1] or "mul" in body.split("micro_gemm", 1)[1]):
            return True
    return False


# --- whole models: onnxruntime ------------------------------------------------------------------------
DESC = {
    "plain": "original export, onnxruntime ORT_ENABLE_ALL",
    "ortopt": "original after onnxruntime.transformers.optimizer (best peer)",
    "lnfold-ort": "lnfold fold (RMS emission: Add + SimplifiedLayerNormalization)",
    "lnfold-deferred": "lnfold fold, defer on (γ into the readers, row scale on each product)",
    "ceiling": "NOT equivalent: LayerNorm -> SimplifiedLayerNormalization, no folding",
    "no-norm": "NOT equivalent: every LayerNorm removed",
}


def _deferred_path(src):
    from lnfold.onnx_rewrite import fold_model

    out = M.derived(src, "lnfold-deferred")
    if not out.exists():
        res = fold_model(M.load(src), defer="on")
        M.save(res.model, out)
    return out


def ort_case(case: M.Case, rounds: int, do_profile: bool) -> dict:
    from .ort_bench import profile, time_paths

    spec = case.spec
    src = M.export(spec, 18)
    paths = {"plain": src, "ortopt": M.ort_optimized(src, spec), "lnfold-ort": M.lnfold(src, "ort")[0],
             "lnfold-deferred": _deferred_path(src), "ceiling": M.ceiling(src), "no-norm": M.no_norm(src)}
    f = M.feeds(spec, case.batch, seq=case.seq, past=case.seq - 1)
    log(f"defer/ort {case.label}: {rounds} interleaved rounds of {list(paths)}")
    res = {"case": case.label, "rows": time_paths(paths, f, rounds=rounds)}
    if do_profile:
        res["profile"] = {k: profile(paths[k], f, runs=5) for k in ("lnfold-ort", "lnfold-deferred")}
    return res


# --- whole models: torch.compile -------------------------------------------------------------------
def torch_case(case: M.Case, rounds: int) -> dict:
    import torch

    from lnfold.fx_rewrite import backend as B

    from .torch_bench import _inputs, swap_norms

    torch.set_num_threads(THREADS)
    spec = case.spec
    module, _, _ = M.torch_module(spec)
    module = module.eval()
    args = _inputs(spec, case, "cpu", torch.float32)
    variants = {
        "compile": (module, "inductor"),
        "lnfold": (module, B.lnfold_backend_with(defer="off")),
        "lnfold-deferred": (module, B.lnfold_backend_with(defer="on")),
        "ceiling": (swap_norms(module, "rms"), "inductor"),
        "no-norm": (swap_norms(module, "none"), "inductor"),
    }
    fns, compile_s, deferred = {}, {}, None
    for name, (mod, backend) in variants.items():
        torch._dynamo.reset()
        fn = torch.compile(mod, backend=backend, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode(), quiet():
            fn(*args)
        compile_s[name] = time.perf_counter() - t0
        if name == "lnfold-deferred":
            deferred = sum(n.deferred for n in B.reports[-1].norms)
        fns[name] = (lambda fn=fn: _call(fn, args))
    log(f"defer/torch {case.label}: {rounds} interleaved rounds of {list(fns)}")
    res = {"case": case.label, "rows": timed(fns, rounds=rounds), "compile_s": compile_s,
           "deferred_norms": deferred}
    del fns, variants
    gc.collect()
    torch._dynamo.reset()
    return res


def _call(fn, args):
    import torch

    with torch.inference_mode():
        return fn(*args)


def run(rounds: int = 6) -> dict:
    out = {"kernels": kernels(rounds=3 * rounds), "ort": [], "torch": []}
    gpt = M.GPT2_SMALL
    ort_cases = [M.Case(gpt, 1), M.Case(gpt, 8), M.Case(M.decode(gpt), 1), M.Case(M.decode(gpt), 8),
                 M.Case(M.VIT_S16, 1), M.Case(M.VIT_S16, 8)]
    for c in ort_cases:
        out["ort"].append(ort_case(c, rounds, do_profile=c.batch == 1))
    torch_cases = [M.Case(gpt, 1), M.Case(gpt, 1, seq=1), M.Case(M.VIT_S16, 1)]  # compiles are minutes each here
    for c in torch_cases:
        try:
            out["torch"].append(torch_case(c, rounds))
        except Exception as e:
            out["torch"].append({"case": c.label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return out
