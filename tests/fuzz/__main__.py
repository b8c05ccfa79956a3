"""The fuzzer's command: `python -m tests.fuzz --help` (the package docstring has examples)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import torch

from . import __doc__ as package_doc
from .gen import DTYPES, from_draws, from_seed
from .properties import FP32_RTOL, check, failures
from .shrink import shrink


def _kinds(fails: list[str]) -> set[str]:
    return {f.split(":", 1)[0] for f in fails}


def run_many(count: int, seed: int, paths, *, gen_kw: Optional[dict] = None, log=None, stop_after: int = 0,
             progress_every: int = 100, time_limit: float = 0.0, json_path: Optional[str] = None) -> dict:
    """The properties over seeds `seed .. seed+count-1`; stops early after `stop_after` failing
    models or `time_limit` seconds (the summary says how many ran). Writes `json_path` as it goes."""
    gen_kw = gen_kw or {}
    stats = {"models": 0, "first_seed": seed, "requested": count, "norms": 0, "expected_folds": 0,
             "failed": 0, "skipped": 0, "by_kind": {}, "failing_seeds": [], "skip_reasons": {}, "seconds": 0.0,
             "paths": list(paths), "generator": {k: str(v) for k, v in gen_kw.items()},
             "exporters": {}, "dtypes": {}, "targets": {}, "stopped": "done"}
    t0 = time.perf_counter()
    for s in range(seed, seed + count):
        case = None
        try:
            case = from_seed(s, **gen_kw)
        except Exception as e:
            fails = [f"generator: {type(e).__name__}: {e}"]
            outs = []
        else:
            outs = check(case, paths)
            fails = failures(outs)
            stats["norms"] += len(case.calls)
            stats["expected_folds"] += case.expected.count("fold")
            stats["exporters"][case.exporter] = stats["exporters"].get(case.exporter, 0) + 1
            d = str(case.dtype).replace("torch.", "")
            stats["dtypes"][d] = stats["dtypes"].get(d, 0) + 1
            stats["targets"][case.target] = stats["targets"].get(case.target, 0) + 1
        stats["models"] += 1
        for o in outs:
            if o.skipped:
                stats["skipped"] += 1
                key = o.skipped[:100]
                stats["skip_reasons"][key] = stats["skip_reasons"].get(key, 0) + 1
                stats.setdefault("skipped_seeds", []).append(s)
            if o.err is not None and o.err > FP32_RTOL and not o.failures and case.dtype == torch.float32:
                stats["fp32_within_own_rounding"] = stats.get("fp32_within_own_rounding", 0) + 1
        if fails:
            stats["failed"] += 1
            stats["failing_seeds"].append(s)
            for k in _kinds(fails):
                stats["by_kind"][k] = stats["by_kind"].get(k, 0) + 1
            if log:
                log(f"FAIL seed={s}: " + "\n    ".join(fails))
            if stop_after and stats["failed"] >= stop_after:
                break
        stats["seconds"] = round(time.perf_counter() - t0, 1)
        if progress_every and stats["models"] % progress_every == 0:
            if log:
                log(f"... {stats['models']} models, {stats['failed']} failing, {stats['seconds']:.0f}s")
            if json_path:
                _write_json(json_path, stats)
        if time_limit and time.perf_counter() - t0 > time_limit:
            stats["stopped"] = f"time limit ({time_limit:.0f}s)"
            break
    if stop_after and stats["failed"] >= stop_after:
        stats["stopped"] = f"after {stop_after} failing model(s)"
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    if json_path:
        _write_json(json_path, stats)
    return stats


def _write_json(path: str, stats: dict) -> None:
    import os

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(stats, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=package_doc.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", action="store_true",
                    help="10,000 small models through the ONNX path (TorchScript exporter unless --exporter)")
    ap.add_argument("--small", action="store_true", help="smaller models (at most 2 streams of 3 steps)")
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds")
    ap.add_argument("--paths", default="onnx", help="comma-separated: onnx, fx")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="force a dtype (default: drawn)")
    ap.add_argument("--exporter", choices=["torchscript", "dynamo"], help="force an exporter (default: drawn)")
    ap.add_argument("--show", type=int, metavar="SEED", help="print one model and its ground truth")
    ap.add_argument("--shrink", action="store_true", help="shrink the first failing model")
    ap.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    ap.add_argument("--stop-after", type=int, default=0, help="stop after this many failing models")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only contend (the machine is shared)
    paths = tuple(p.strip() for p in a.paths.split(",") if p.strip())
    dtype = DTYPES[a.dtype] if a.dtype else None
    if a.long:
        a.count = 10_000 if a.count == 100 else a.count
        a.small = True
        a.exporter = a.exporter or "torchscript"
    gen_kw = {k: v for k, v in dict(dtype=dtype, exporter=a.exporter, small=a.small).items() if v}

    def log(msg):
        print(msg, flush=True)

    if a.show is not None:
        case = from_seed(a.show, **gen_kw)
        print(case.describe())
        for o in check(case, paths):
            print(f"{o.path}: verdicts={o.verdicts} err={o.err} skipped={o.skipped}")
            for f in o.failures:
                print("  " + f)
        return 0
    stats = run_many(a.count, a.seed, paths, gen_kw=gen_kw, log=log, time_limit=a.time_limit,
                     stop_after=a.stop_after or (1 if a.shrink else 0), json_path=a.json)
    print(json.dumps({k: v for k, v in stats.items() if k not in ("failing_seeds", "skipped_seeds")}, indent=1))
    if stats.get("skipped_seeds"):
        print(f"skipped seeds: {stats['skipped_seeds'][:50]}")
    print(f"failing seeds: {stats['failing_seeds'][:50]}{' ...' if len(stats['failing_seeds']) > 50 else ''}")
    if a.shrink and stats["failing_seeds"]:
        s = stats["failing_seeds"][0]
        case = from_seed(s, **gen_kw)
        kinds = _kinds(failures(check(case, paths)))
        kw = dict(dtype=case.dtype, exporter=case.exporter, opset=case.opset, target=case.target, small=a.small)

        def still(d):
            try:
                c = from_draws(d, **kw)
            except Exception:
                return False
            return bool(_kinds(failures(check(c, paths))) & kinds)

        small = shrink(case.draws, still)
        c = from_draws(small, **kw)
        print(f"\nshrunk seed {s} from {len(case.draws)} to {len(small)} draws; replay with "
              f"tests.fuzz.gen.from_draws({small}, dtype={kw['dtype']}, exporter={kw['exporter']!r}, opset={kw['opset']}, target={kw['target']!r})")
        print(c.describe())
        for f in failures(check(c, paths)):
            print("  " + f)
    return 1 if stats["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
