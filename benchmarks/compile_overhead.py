"""Compile-time overhead of backend="lnfold" against plain torch.compile (Inductor).

    python -m benchmarks.compile_overhead [--layers 12 --width 768 --heads 12 --vocab 50257] [--rounds 3]

Each measurement runs in a fresh process with Inductor's caches off (a cold compile): the time of
the first call (Dynamo + backend + first run; wall clock and the process's CPU time, which other
load on a shared machine disturbs less), then the median of later calls. Backends alternate
A B A B so machine drift hits both alike. The lnfold stages (analysis, graph edits, float64
centering, Inductor) come from lnfold.fx_rewrite.backend.timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = """
import json, sys, time, torch
from lnfold import zoo
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"]) if cfg["threads"] else None
m, (ids,) = zoo.gpt2(n_layer=cfg["layers"], n_embd=cfg["width"], n_head=cfg["heads"], vocab=cfg["vocab"],
                     positions=cfg["positions"])
ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
with torch.no_grad():
    c = torch.compile(m, backend=cfg["backend"])
    t, cpu = time.perf_counter(), time.process_time()
    c(ids)
    first, first_cpu = time.perf_counter() - t, time.process_time() - cpu
    runs = []
    for _ in range(5):
        t = time.perf_counter(); c(ids); runs.append(time.perf_counter() - t)
stages = {}
if cfg["backend"] == "lnfold":
    from lnfold.fx_rewrite.backend import timings
    stages = {k: sum(d[k] for d in timings) for k in timings[0]} if timings else {}
print(json.dumps({"first": first, "first_cpu": first_cpu, "steady": sorted(runs)[len(runs) // 2], "stages": stages}))
"""


def measure(backend: str, cfg: dict) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({**cfg, "backend": backend})],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k != "rounds"}
    got: dict[str, list] = {"inductor": [], "lnfold": []}
    for r in range(args.rounds):
        for b in (("inductor", "lnfold") if r % 2 == 0 else ("lnfold", "inductor")):
            got[b].append(measure(b, cfg))
            print(b, json.dumps(got[b][-1]), flush=True)
    med = {b: statistics.median(x["first"] for x in v) for b, v in got.items()}
    cpu = {b: statistics.median(x["first_cpu"] for x in v) for b, v in got.items()}
    steady = {b: statistics.median(x["steady"] for x in v) for b, v in got.items()}
    stages = {k: statistics.median(x["stages"][k] for x in got["lnfold"]) for k in got["lnfold"][0]["stages"]}
    print(f"first call (compile + run), median of {args.rounds}: inductor {med['inductor']:.1f} s, "
          f"lnfold {med['lnfold']:.1f} s, overhead {med['lnfold'] - med['inductor']:+.1f} s "
          f"({(med['lnfold'] / med['inductor'] - 1) * 100:+.0f}%)")
    print(f"first call, CPU time of the process (less sensitive to other load): inductor {cpu['inductor']:.1f} s, "
          f"lnfold {cpu['lnfold']:.1f} s, overhead {cpu['lnfold'] - cpu['inductor']:+.1f} s")
    print("lnfold stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    print(f"steady-state call: inductor {steady['inductor'] * 1e3:.1f} ms, lnfold {steady['lnfold'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
