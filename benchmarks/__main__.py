"""python -m benchmarks run [--quick] [--device cpu|cuda] [--only ops,ort,torch,foldcost,demo,defer]
python -m benchmarks gpu [--smoke] [...]   (benchmarks/gpu.py: the GPU rows in one script, JSON lines)

Writes benchmarks/RESULTS.md and benchmarks/results.json (or the paths given with --out/--json).
"""
from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: the cores are shared, and a spinning pool inflates
# every other variant's time (and this process's CPU time). Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys
import time
import traceback

from . import models as M
from .common import HERE, THREADS, gpu, log, machine, now, versions


def cases(quick: bool, device: str):
    """(ORT cases, torch cases, ORT options by case label)."""
    if device == "cuda":
        batches = (1, 8, 64)
        ort = [M.Case(s, b) for s in (M.GPT2_SMALL, M.GPT2_MEDIUM, M.VIT_S16, M.VIT_B16) for b in batches]
        ort += [M.Case(M.decode(s), b) for s in (M.GPT2_SMALL, M.GPT2_MEDIUM) for b in batches]
        tc = [c for c in ort]
        if quick:
            ort = [M.Case(M.GPT2_SMALL, 8), M.Case(M.VIT_B16, 8), M.Case(M.decode(M.GPT2_SMALL), 8)]
            tc = list(ort)
        return ort, tc
    if quick:
        ort = [M.Case(M.GPT2_SMALL, 1), M.Case(M.decode(M.GPT2_SMALL), 1), M.Case(M.VIT_S16, 1)]
        tc = [M.Case(M.VIT_S16, 1)]
        return ort, tc
    ort = [M.Case(s, b) for s in (M.GPT2_SMALL, M.GPT2_MEDIUM, M.VIT_S16, M.VIT_B16) for b in (1, 8)]
    ort += [M.Case(M.decode(s), b) for s in (M.GPT2_SMALL, M.GPT2_MEDIUM) for b in (1, 8)]
    tc = [M.Case(M.GPT2_SMALL, 1), M.Case(M.GPT2_SMALL, 8), M.Case(M.decode(M.GPT2_SMALL), 1),
          M.Case(M.VIT_S16, 1), M.Case(M.VIT_S16, 8), M.Case(M.VIT_B16, 1), M.Case(M.VIT_B16, 8),
          M.Case(M.GPT2_MEDIUM, 1)]
    return ort, tc


DEMO = M.Spec("demo GPT-2 (4 layers, width 256, vocab 1000)", "gpt2", 4, 256, 4, vocab=1000, positions=128)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # its own options (benchmarks/gpu.py)
        from . import gpu as G

        return G.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("gpu", help="the GPU rows in one script (python -m benchmarks gpu --help)")
    r = sub.add_parser("run", help="run the benchmarks and write RESULTS.md / results.json")
    r.add_argument("--quick", action="store_true", help="fewer, smaller cases (a few minutes on 2 cores)")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    r.add_argument("--only", default="ops,demo,ort,torch,foldcost",
                   help="comma-separated sections: ops, demo, ort, torch, foldcost, defer (deferred "
                        "normalization; not in the default set: run it with --only defer)")
    r.add_argument("--no-big", action="store_true", help="foldcost: skip the 1.5 B-parameter model")
    r.add_argument("--out", default=str(HERE / "RESULTS.md"))
    r.add_argument("--json", default=str(HERE / "results.json"))
    r.add_argument("--rounds", type=int, default=0, help="interleaved rounds per variant (default by mode)")
    r.add_argument("--cases", default="",
                   help="only the inference cases whose label contains one of these comma-separated strings "
                        "(e.g. 'GPT-2 small b8,ViT-B/16 b8')")
    r.add_argument("--merge", action="store_true",
                   help="keep the other sections of an existing results.json (each section records its own command)")
    rp = sub.add_parser("report", help="rewrite RESULTS.md from a results.json")
    rp.add_argument("--json", default=str(HERE / "results.json"))
    rp.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = p.parse_args(argv)

    from .report import write_markdown

    if args.cmd == "report":
        res = json.load(open(args.json))
        write_markdown(res, args.out)
        return 0

    only = set(args.only.split(","))
    quick, device = args.quick, args.device
    wanted = [w.strip() for w in args.cases.split(",") if w.strip()]

    def pick(cs):
        return [c for c in cs if not wanted or any(w in c.label for w in wanted)]
    if device == "cuda" and not gpu():
        print("benchmarks: --device cuda asked but torch sees no CUDA device", file=sys.stderr)
        return 2
    rounds = args.rounds or (8 if quick else 12)
    res: dict = {
        "date": now(), "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "mode": "quick" if quick else "full", "device": device, "machine": machine(), "gpu": gpu(),
        "versions": versions(), "threads": {"onnxruntime intra_op_num_threads": THREADS,
                                            "onnxruntime inter_op_num_threads": 1,
                                            "onnxruntime allow_spinning": 0, "torch.set_num_threads": THREADS,
                                            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        "rounds": rounds, "sections": {}, "errors": {}, "timing_s": {},
    }
    json_path, md_path = args.json, args.out
    if args.merge and os.path.exists(json_path):
        old = json.load(open(json_path))
        # sections run now replace the old ones, except that --cases keeps the other cases' rows
        res["sections"] = {k: v for k, v in old.get("sections", {}).items() if k not in only or (wanted and k in ("ort", "torch"))}
        res["section_meta"] = {k: v for k, v in old.get("section_meta", {}).items() if k not in only}
        res["errors"] = {k: v for k, v in old.get("errors", {}).items() if k not in only}
    res.setdefault("section_meta", {})

    def save():
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        write_markdown(res, md_path)

    def section(name, fn):
        if name not in only:
            return
        t0 = time.perf_counter()
        res["section_meta"][name] = {"command": res["command"], "date": now(), "mode": res["mode"], "rounds": rounds}
        log(f"=== {name} ===")
        try:
            fn()
        except Exception as e:  # keep going: one broken section must not lose the others
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        res["timing_s"][name] = time.perf_counter() - t0
        save()

    def ops():
        from . import ops as O

        res["sections"]["ops"] = O.run(rounds=15 if quick else 30)

    def demo():
        from . import ort_bench as OB

        res["sections"]["demo"] = OB.run_case(M.Case(DEMO, 1), rounds=20 if quick else 40,
                                              headline_rounds=30 if quick else 60, do_profile=True)

    def ort_rows():
        from . import ort_bench as OB

        out = [r for r in res["sections"].get("ort", []) if r.get("case") not in {c.label for c in pick(cases(quick, device)[0])}]
        res["sections"]["ort"] = out
        ort_cases, _ = cases(quick, device)
        for c in pick(ort_cases):
            big = c.spec.hidden >= 1024
            try:
                out.append(OB.run_case(c, rounds=rounds, headline_rounds=2 * rounds, device=device,
                                       do_profile=(device == "cpu" and c.batch == 1 and not big),
                                       max_sessions=5 if big else 0))
            except Exception as e:
                out.append({"case": c.label, "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
            out[-1]["run"] = {"mode": res["mode"], "rounds": rounds, "date": now()}
            save()

    def torch_rows():
        from . import torch_bench as TB

        out = [r for r in res["sections"].get("torch", []) if r.get("case") not in {c.label for c in pick(cases(quick, device)[1])}]
        res["sections"]["torch"] = out
        _, tcases = cases(quick, device)
        dtypes = ("float16", "bfloat16") if device == "cuda" else ("float32",)
        for c in pick(tcases):
            for dt in dtypes:
                try:
                    out.append(TB.run_case(c, rounds=rounds, device=device, dtype_name=dt))
                except Exception as e:
                    out.append({"case": c.label, "dtype": dt, "error": f"{type(e).__name__}: {e}"})
                    traceback.print_exc()
                out[-1]["run"] = {"mode": res["mode"], "rounds": rounds, "date": now()}
                save()

    def foldcost():
        from . import foldcost as FC

        res["sections"]["foldcost"] = FC.run(quick=quick, big=not (quick or args.no_big))

    def defer():
        from . import defer_bench as DB

        res["sections"]["defer"] = DB.run(rounds=args.rounds or 6)

    section("ops", ops)
    section("demo", demo)
    section("ort", ort_rows)
    section("torch", torch_rows)
    section("foldcost", foldcost)
    section("defer", defer)
    save()
    log(f"wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
