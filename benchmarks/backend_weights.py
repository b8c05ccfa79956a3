"""What the torch.compile backend's per-call weight edits cost at inference (issue 43, item 2).

    python -m benchmarks.backend_weights [--layers 4 --width 768 --heads 12 --vocab 50257]
                                         [--shapes 1x16,1x128,4x256] [--rounds 15]

The backend computes `W - mean(W)` (and a deferred bias) from the parameters at every call, so
that no weight change goes unseen (it used to cache copies keyed on tensor versions, which a write
through `p.data` or an inference-mode tensor defeats). Rows, one GPT-2-shaped model (zoo.gpt2:
random weights, the timing does not depend on them), all compiled by Inductor, interleaved, medians:

- `inductor`: torch.compile of the original (what a user has without lnfold);
- `lnfold`: torch.compile(backend="lnfold"), the edits per call;
- `folded once`: `fold_module` (edits computed once, float64), then torch.compile: the speed the old
  cache had, and what a user with fixed weights gets;
- `inductor, frozen` / `lnfold, frozen`: with Inductor's `freezing` config on (with torch 2.13 here
  both compiled models still saw a later write to a weight: the parameters stayed graph inputs, so
  these rows are not a "computed once" configuration).

Prints one JSON object (per shape: median wall and CPU ms per call, CPU ratios to `inductor`, and
the cost of the per-call edits: `lnfold` against `lnfold, frozen`).
"""
from __future__ import annotations

import argparse
import json
import platform

from .common import THREADS, log, timed


def main(argv=None) -> int:
    import torch
    from torch._inductor import config

    from lnfold import zoo
    from lnfold.fx_rewrite import fold_module

    p = argparse.ArgumentParser(prog="python -m benchmarks.backend_weights")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--shapes", default="1x16,1x128,4x256")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    m, _ = zoo.gpt2(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab=args.vocab, positions=1024)
    m = m.eval()
    out = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": THREADS,
           "model": vars(args), "shapes": {}}
    for shape in args.shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        ids = torch.randint(0, args.vocab, (batch, seq))
        fns = {}
        with torch.no_grad():
            folded = fold_module(m, (ids,)).module
            for name, mod, backend, frozen in [("inductor", m, "inductor", False), ("lnfold", m, "lnfold", False),
                                               ("folded once", folded, "inductor", False),
                                               ("inductor, frozen", m, "inductor", True),
                                               ("lnfold, frozen", m, "lnfold", True)]:
                torch._dynamo.reset()
                with config.patch(freezing=frozen):
                    c = torch.compile(mod, backend=backend, dynamic=False)
                    c(ids)
                log(f"{shape}: compiled {name}")

                def call(c=c, frozen=frozen):
                    with config.patch(freezing=frozen), torch.no_grad():
                        return c(ids)

                fns[name] = call
            stats = timed(fns, rounds=args.rounds)
        med = {k: s["median"] * 1e3 for k, s in stats.items()}
        cpu = {k: s["cpu_median"] * 1e3 for k, s in stats.items()}  # (other load on the machine counts less)
        out["shapes"][shape] = {"median_ms": {k: round(v, 2) for k, v in med.items()},
                                "cpu_median_ms": {k: round(v, 2) for k, v in cpu.items()},
                                "cpu_ratio_to_inductor": {k: round(v / cpu["inductor"], 3) for k, v in cpu.items()},
                                "edits per call / frozen (cpu)": round(cpu["lnfold"] / cpu["lnfold, frozen"], 3)}
        log(json.dumps(out["shapes"][shape]))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
