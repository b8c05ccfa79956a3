"""onnxruntime rows: the original (plain and after onnxruntime's transformer optimizer, from the
opset-18 and opset-23 exports) against lnfold's output from the same exports, and the two
non-equivalent reference rows.

Variants of one export are timed together, interleaved (A B C ... C B A ...); then a second,
shorter interleaved run times the best original ("best peer"), the best lnfold output and the
best ceiling side by side, which gives the headline ratio without cross-run drift.
"""
from __future__ import annotations

import collections
import gc
import os
import tempfile

import onnx


from . import models as M
from .common import bound_runner, log, ort_session, timed
from .ops import kernel_times

PEERS = ("plain", "ortopt")
LNFOLD = ("lnfold-ort", "lnfold-onnx", "lnfold-ort-unfused")
REFS = ("ceiling", "no-norm")
DESC = {
    "plain": "original export, onnxruntime's own graph optimizations (ORT_ENABLE_ALL)",
    "ortopt": "original after onnxruntime.transformers.optimizer.optimize_model (defaults for the model type)",
    "lnfold-ort": "lnfold fold --target ort",
    "lnfold-onnx": "lnfold fold --target onnx (RMSNormalization, opset 23)",
    "lnfold-ort-unfused": "lnfold --target ort with each SkipSimplifiedLayerNormalization split into "
                          "Add + SimplifiedLayerNormalization (the emission recommended below)",
    "ceiling": "NOT equivalent: every LayerNorm -> SimplifiedLayerNormalization, β dropped, no folding",
    "no-norm": "NOT equivalent: every LayerNorm removed",
}


def build_variants(spec: M.Spec, opset: int, *, lnfold_targets=("ort", "onnx")) -> tuple[dict, dict]:
    """variant name -> ONNX path, and notes (errors, fold reports) by variant."""
    paths, notes = {}, {}
    src = M.export(spec, opset)
    paths["plain"] = src
    steps = [("ortopt", lambda: M.ort_optimized(src, spec))]
    for t in lnfold_targets:
        steps.append((f"lnfold-{t}", lambda t=t: M.lnfold(src, t)))
    steps += [("ceiling", lambda: M.ceiling(src)), ("no-norm", lambda: M.no_norm(src))]
    for name, make in steps:
        try:
            got = make()
        except Exception as e:  # a variant that cannot be built is reported, not fatal
            notes[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            log(f"  {name} op{opset}: {notes[name]['error']}")
            continue
        if isinstance(got, tuple):
            got, info = got
            notes[name] = info
        paths[name] = got
    if "lnfold-ort" in paths:
        paths["lnfold-ort-unfused"] = M.unfuse_skip(paths["lnfold-ort"])
    return paths, notes


def time_paths(paths: dict, feeds: dict, *, rounds: int, device: str = "cpu", max_sessions: int = 0) -> dict:
    """Interleaved timing of every path; with max_sessions, in chunks that each include the first
    path (the anchor: "plain"), so big models never hold more than max_sessions sessions."""
    names = list(paths)
    if max_sessions and len(names) > max_sessions:
        anchor, rest = names[0], names[1:]
        step = max_sessions - 1
        out = {}
        for i in range(0, len(rest), step):
            chunk = {anchor: paths[anchor], **{k: paths[k] for k in rest[i:i + step]}}
            got = time_paths(chunk, feeds, rounds=rounds, device=device)
            if anchor in out:  # keep the anchor's first measurement; note the chunk's own anchor
                got = {k: {**v, "anchor_median": got[anchor]["median"]} for k, v in got.items() if k != anchor}
            out.update(got)
        return out
    sessions = {}
    for name, p in paths.items():
        sessions[name] = _session(p, device)
    fns = {name: bound_runner(s, feeds, device) for name, s in sessions.items()}
    stats = timed(fns, rounds=rounds, warmup=2)
    del fns, sessions
    gc.collect()
    return stats


def _session(path, device: str):
    if device == "cuda":
        return ort_session(path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    return ort_session(path)


def profile(path, feeds: dict, runs: int = 5) -> dict:
    """Kernel time per run by op type, and the op counts onnxruntime runs after its fusions."""
    with tempfile.TemporaryDirectory() as d:
        opt = os.path.join(d, "opt.onnx")
        sess = ort_session(path, profile=os.path.join(d, "prof"), optimized_path=opt)
        for _ in range(runs + 1):
            sess.run(None, feeds)
        import json

        events = json.load(open(sess.end_profiling()))
        counts = collections.Counter(n.op_type for n in onnx.load(opt, load_external_data=False).graph.node)
    by_op = kernel_times(events, runs + 1)
    return {"kernel_s_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])), "op_counts": dict(counts),
            "kernel_s": sum(by_op.values())}


def run_case(case: M.Case, *, opsets=(18, 23), rounds: int = 10, headline_rounds: int = 20,
             device: str = "cpu", do_profile: bool = False, max_sessions: int = 0) -> dict:
    spec = case.spec
    f = M.feeds(spec, case.batch, seq=case.seq, past=case.seq - 1)
    result = {"case": case.label, "model": spec.name, "kind": spec.kind, "batch": case.batch, "seq": case.seq,
              "device": device, "rows": {}, "notes": {}}
    all_paths = {}
    for opset in opsets:
        try:
            paths, notes = build_variants(spec, opset)
        except Exception as e:
            result["notes"][f"op{opset}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            log(f"{case.label}: opset {opset} export failed: {e}")
            continue
        for k, v in notes.items():
            result["notes"][f"{k} op{opset}"] = v
        log(f"{case.label}: timing {len(paths)} variants of the opset-{opset} export, {rounds} interleaved rounds")
        stats = time_paths(paths, f, rounds=rounds, device=device, max_sessions=max_sessions)
        for k, s in stats.items():
            result["rows"][f"{k} op{opset}"] = s
            all_paths[f"{k} op{opset}"] = paths[k]
    rows = result["rows"]
    if not rows:
        return result

    def best(prefixes):
        cands = [k for k in rows if k.rsplit(" ", 1)[0] in prefixes]
        return min(cands, key=lambda k: rows[k]["median"]) if cands else None

    picks = {"best peer": best(PEERS), "lnfold": best(("lnfold-ort", "lnfold-onnx")),
             "lnfold (proposed emission)": best(("lnfold-ort-unfused",)), "ceiling": best(("ceiling",))}
    picks = {k: v for k, v in picks.items() if v}
    if picks.get("ceiling") and f"no-norm {picks['ceiling'].rsplit(' ', 1)[1]}" in rows:
        picks["no-norm"] = f"no-norm {picks['ceiling'].rsplit(' ', 1)[1]}"
    result["picks"] = picks
    if headline_rounds and len(set(picks.values())) > 1:
        uniq = {v: all_paths[v] for v in dict.fromkeys(picks.values())}
        log(f"{case.label}: headline run {list(uniq)}, {headline_rounds} interleaved rounds")
        result["headline"] = time_paths(uniq, f, rounds=headline_rounds, device=device,
                                        max_sessions=max(max_sessions, len(uniq)) if max_sessions else 0)
    if do_profile:
        result["profile"] = {}
        for k in dict.fromkeys(list(picks.values()) + [k for k in rows if k.startswith(("plain", "lnfold-ort "))]):
            try:
                runs = max(5, min(30, int(3.0 / max(rows[k]["median"], 1e-3))))  # about 3 s of runs each
                result["profile"][k] = profile(all_paths[k], f, runs=runs)
            except Exception as e:
                result["profile"][k] = {"error": str(e)[:200]}
    summarize(result)
    return result


def summarize(result: dict) -> None:
    """Ratios within one interleaved run: the headline run when there is one, else the screening
    rows of one export (never medians of different runs against each other)."""
    picks = result.get("picks", {})
    src = result.get("headline")
    if not src:
        return
    s = {}
    for key, suffix in (("median", ""), ("cpu_median", " (CPU time)")):
        med = {role: src[k][key] for role, k in picks.items() if k in src and key in src[k]}
        peer = med.get("best peer")
        for who in ("lnfold", "lnfold (proposed emission)"):
            if peer and who in med:
                s[f"{who} / best peer{suffix}"] = med[who] / peer
                if "ceiling" in med and peer - med["ceiling"] > 0:
                    s[f"{who}: share of ceiling gain{suffix}"] = (peer - med[who]) / (peer - med["ceiling"])
        for ref in ("ceiling", "no-norm"):
            if peer and ref in med:
                s[f"{ref} / best peer{suffix}"] = med[ref] / peer
    prof = result.get("profile") or {}
    if picks.get("best peer") in prof and "kernel_s" in prof[picks["best peer"]]:
        p = prof[picks["best peer"]]
        norm = sum(v for k, v in p["kernel_s_by_op"].items() if k in NORM_OPS)
        s["norm ops share of peer's kernel time"] = norm / p["kernel_s"] if p["kernel_s"] else None
    result["summary"] = s


NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "RMSNormalization")
