"""torch rows: eager, torch.compile of the original (inductor), torch.compile(backend="lnfold"),
and the two non-equivalent reference rows (every nn.LayerNorm an nn.RMSNorm without folding;
every nn.LayerNorm removed), compiled with inductor. Interleaved, fixed threads.

On CUDA the same rows run in float16 and bfloat16.
"""
from __future__ import annotations

import copy
import gc
import time


from . import models as M
from .common import THREADS, log, quiet, timed


def lnfold_backend_status() -> str | None:
    """None when torch.compile(backend="lnfold") is usable, else why not."""
    try:
        import torch._dynamo

        import lnfold.fx_rewrite  # noqa: F401  (registers the backend, once it exists)

        if "lnfold" not in torch._dynamo.list_backends(exclude_tags=()):
            return "torch.compile backend 'lnfold' is not registered yet (fx_rewrite has no backend)"
        from torch._dynamo.backends.registry import lookup_backend

        lookup_backend("lnfold")
    except Exception as e:
        return f"torch.compile backend 'lnfold' is not usable yet: {type(e).__name__}: {e}"
    return None


def swap_norms(module, to: str):
    """A deep copy with every nn.LayerNorm replaced: 'rms' -> nn.RMSNorm(γ), 'none' -> nn.Identity."""
    import torch
    from torch import nn

    m = copy.deepcopy(module)
    for parent in m.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                if to == "none":
                    setattr(parent, name, nn.Identity())
                else:
                    r = nn.RMSNorm(child.normalized_shape, eps=child.eps, elementwise_affine=child.weight is not None)
                    if child.weight is not None:
                        with torch.no_grad():
                            r.weight.copy_(child.weight)
                    setattr(parent, name, r)
    return m.eval()


def _inputs(spec: M.Spec, case: M.Case, device, dtype):
    import torch

    f = M.feeds(spec, case.batch, seq=case.seq, past=case.seq - 1)
    out = []
    for name in (["pixel_values"] if spec.kind == "vit" else ["input_ids"] + (["past"] if "past" in f else [])):
        t = torch.from_numpy(f[name]).to(device)
        if t.is_floating_point():
            t = t.to(dtype)
        out.append(t)
    return tuple(out)


def run_case(case: M.Case, *, rounds: int = 10, device: str = "cpu", dtype_name: str = "float32",
             headline_rounds: int = 0) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    dtype = getattr(torch, dtype_name)
    spec = case.spec
    result = {"case": case.label, "model": spec.name, "kind": spec.kind, "batch": case.batch, "seq": case.seq,
              "device": device, "dtype": dtype_name, "rows": {}, "notes": {}, "compile_s": {}}
    module, _, _ = M.torch_module(spec)
    module = module.to(device=device, dtype=dtype).eval()
    args = _inputs(spec, case, device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    candidates = {
        "eager": (module, None),
        "compile": (module, "inductor"),
        "lnfold": (module, "lnfold"),
        "ceiling": (swap_norms(module, "rms"), "inductor"),
        "no-norm": (swap_norms(module, "none"), "inductor"),
    }
    why = lnfold_backend_status()
    if why:
        result["notes"]["lnfold"] = {"skipped": why}
        log(f"{case.label}: torch lnfold row skipped: {why}")
        del candidates["lnfold"]
    fns = {}
    for name, (mod, backend) in candidates.items():
        try:
            fn = mod if backend is None else torch.compile(mod, backend=backend, dynamic=False)
        except Exception as e:
            result["notes"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue

        def call(fn=fn):
            with torch.inference_mode():
                out = fn(*args)
            sync()
            return out

        t0 = time.perf_counter()
        try:
            with quiet():
                ref = call()
        except Exception as e:
            msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            result["notes"][name] = {"error": msg}
            log(f"{case.label}: torch {name} failed: {msg}")
            continue
        result["compile_s"][name] = time.perf_counter() - t0
        if name == "lnfold" and "eager" in fns:
            result["notes"]["lnfold"] = {"max_rel_err_vs_eager": _rel_err(ref, fns["eager"]())}
        fns[name] = call
    log(f"{case.label}: timing torch {list(fns)} ({dtype_name}, {device}), {rounds} interleaved rounds")
    stats = timed(fns, rounds=rounds, warmup=2)
    result["rows"] = stats
    best = min((k for k in ("compile", "eager") if k in stats), key=lambda k: stats[k]["median"], default=None)
    result["picks"] = {"best peer": best} if best else {}
    if "lnfold" in stats:
        result["picks"]["lnfold"] = "lnfold"
    for k in ("ceiling", "no-norm"):
        if k in stats:
            result["picks"][k] = k
    s = {}
    for key, suffix in (("median", ""), ("cpu_median", " (CPU time)")):
        if not best:
            break
        peer = stats[best][key]
        if "lnfold" in stats:
            s[f"lnfold / best peer{suffix}"] = stats["lnfold"][key] / peer
            if "ceiling" in stats and peer > stats["ceiling"][key]:
                s[f"lnfold: share of ceiling gain{suffix}"] = (peer - stats["lnfold"][key]) / (peer - stats["ceiling"][key])
        for ref in ("ceiling", "no-norm"):
            if ref in stats:
                s[f"{ref} / best peer{suffix}"] = stats[ref][key] / peer
    result["summary"] = s
    del fns, candidates, module
    gc.collect()
    torch._dynamo.reset()
    return result


def _rel_err(a, b) -> float:
    import torch

    a = a[0] if isinstance(a, (tuple, list)) else a
    b = b[0] if isinstance(b, (tuple, list)) else b
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
