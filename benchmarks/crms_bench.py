"""CRMSNorm against RMSNorm and the original, in onnxruntime and torch.compile (CPU).

    python -m benchmarks.crms_bench [--rounds N] [--torch-rounds N] [--no-torch]

Interleaved timing (A B C C B A ...), medians and the interquartile range; plus what compression
saves in memory: weight bytes of the folded models, and the stream's width.
"""
from __future__ import annotations

import argparse
import json

from . import models as M
from .common import bound_runner, iqr, log, ms, ort_session, quiet, timed


def _bytes(model) -> int:
    """Bytes of the model's initializers (the weights a session holds)."""
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def ort_rows(spec: M.Spec, batch: int, rounds: int) -> dict:
    from lnfold.onnx_rewrite import fold_model

    original = M.load(M.export(spec, 18))
    folded = {"original": original}
    reports = {}
    for mode in ("rms", "crms"):
        res = fold_model(original, mode=mode, target="ort")
        folded[mode] = res.model
        reports[mode] = dict(err=res.max_rel_err, compressed=res.report.compressed, folded=res.report.folded,
                             compression=[c.verdict + (f": {c.reason}" if c.reason else "")
                                          for c in res.report.compression])
    feeds = M.feeds(spec, batch)
    runs = {k: bound_runner(ort_session(m), feeds) for k, m in folded.items()}
    stats = timed(runs, rounds=rounds)
    sizes = {k: _bytes(m) for k, m in folded.items()}
    return dict(stats=stats, reports=reports, weight_bytes=sizes)


def torch_rows(spec: M.Spec, batch: int, rounds: int) -> dict:
    import copy

    import torch

    from lnfold.fx_rewrite import lnfold_backend_with

    torch.set_num_threads(2)
    m, args, _ = M.torch_module(spec)
    feeds = M.feeds(spec, batch)
    x = torch.from_numpy(next(iter(feeds.values())))
    fns = {}
    with torch.no_grad(), quiet():
        for name, backend in (("original", "inductor"), ("rms", lnfold_backend_with(mode="rms")),
                              ("crms", lnfold_backend_with(mode="crms"))):
            log(f"compiling {spec.name} ({name})")
            c = torch.compile(copy.deepcopy(m), backend=backend, dynamic=False)
            c(x)
            fns[name] = (lambda c=c: c(x))
        ref = fns["original"]()
        errs = {k: float((f() - ref).abs().max() / ref.abs().max()) for k, f in fns.items()}
        stats = timed(fns, rounds=rounds)
    return dict(stats=stats, rel_err_vs_original=errs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--torch-rounds", type=int, default=8)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-ort", action="store_true")
    p.add_argument("--json", help="also write the raw numbers here")
    a = p.parse_args(argv)
    out = {}
    for spec, batch in ((M.GPT2_SMALL, 1), (M.VIT_S16, 4)):
        if not a.no_ort:
            log(f"onnxruntime: {spec.name}")
            out[f"ort {spec.name} b{batch}"] = ort_rows(spec, batch, a.rounds)
        if not a.no_torch:
            out[f"torch {spec.name} b{batch}"] = torch_rows(spec, batch, a.torch_rounds)
    for key, r in out.items():
        base = r["stats"]["original"]["median"]
        cells = [f"{k} {ms(s['median'])} (IQR {ms(iqr(s))}, {s['median'] / base:.3f}x)" for k, s in r["stats"].items()]
        print(f"{key}: " + "; ".join(cells))
        if "weight_bytes" in r:
            print(f"  weight bytes: {r['weight_bytes']}  reports: {r['reports']}")
        if "rel_err_vs_original" in r:
            print(f"  rel err vs original: {r['rel_err_vs_original']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, default=str, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
