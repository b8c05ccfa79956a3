"""Issue 26: the geometry of the trained models' LayerNorm inputs, and the approximate swap on the
Post-LN encoder (metric vs latency vs budget, and a short fine-tune with the swap in place).

    .venv/bin/python -m benchmarks.trained.geometry_bench [--steps 150] [--out DIR]

1. Per norm, the angle between its input and 1 over held-out rows (passes/geometry.py), before and
   after the exact fold, for gpt2_stdlib (Pre-LN), vit_digits (Pre-LN) and bert_stdlib (Post-LN);
   the pictures go to docs/geometry_<model>.png.
2. bert_stdlib (ONNX, onnxruntime CPU): MLM accuracy and loss on the 64 held-out windows, and
   interleaved latency (onnx_rewrite/timing.py), for the original, the exact fold, the approximate
   swap at a few budgets (calibration: held-out rows 0-15, of which 8-15 only report), and every
   kept norm swapped (no budget: the MLM head's norm too).
3. The same "every norm swapped" BERT fine-tuned for --steps AdamW steps on the training text with
   the swap in place (RMSNorm + β in the eager model), against the original fine-tuned alike.
Prints markdown for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import lnfold
from lnfold import zoo
from lnfold.onnx_rewrite import timing
from lnfold.passes.geometry_plot import plot

from . import harness

DOCS = Path(__file__).resolve().parents[2] / "docs"
BUDGETS = (1e-4, 3e-4, 3e-3)
CALIB_ROWS = 16


def export(name: str) -> "onnx.ModelProto":  # noqa: F821
    return zoo.export_onnx(harness.logits_module(name), harness.example_args(name), [harness.INPUT[name]])


def angles(out: Path) -> list[str]:
    lines = ["| model | # | norm | verdict | before: mean ± sd (worst) | \\|μ\\|/rms | after the fold |",
             "|---|---|---|---|---|---|---|"]
    for name in ("gpt2_stdlib", "vit_digits", "bert_stdlib"):
        model = export(name)
        x = harness.heldout(name, CALIB_ROWS)[harness.INPUT[name]]
        g = lnfold.analyze_onnx(model, calibration={harness.INPUT[name]: x}).geometry
        plot(g, DOCS / f"geometry_{name}.png", f"{name} (held-out rows)")
        for k, n in enumerate(g.norms):
            b, a = n.before, n.after
            after = f"{a.mean_deg:.2f}° ± {a.std_deg:.2f}, \\|μ\\|/rms {a.mean_over_rms:.1e}" if a else "—"
            lines.append(f"| {name} | {k} | `{n.name}` | {n.verdict} | {b.mean_deg:.2f}° ± {b.std_deg:.2f} "
                         f"({b.worst_deg:.1f}°) | {b.mean_over_rms:.3f} | {after} |")
        (out / f"{name}.onnx").write_bytes(model.SerializeToString())
    return lines


def swap_eager(model: nn.Module, indices: set[int]) -> nn.Module:
    """Swap the LayerNorm modules at these positions (graph order = module order in BERT) with
    lnfold's training-time swap (fx_rewrite/approx_train.py)."""
    from lnfold.fx_rewrite.approx_train import swap_for_training

    lns = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    swap_for_training(model, [n for k, n in enumerate(lns) if k in indices])
    return model


def metric_row(label: str, runner, lat, note: str = "") -> str:
    m = harness.evaluate("bert_stdlib", runner)
    t = (f"{lat['median'] * 1e3:.1f} ms [{lat['q1'] * 1e3:.1f}, {lat['q3'] * 1e3:.1f}] | "
         f"{lat['cpu_median'] * 1e3:.1f} ms [{lat['cpu_q1'] * 1e3:.1f}, {lat['cpu_q3'] * 1e3:.1f}]") if lat else "— | —"
    return f"| {label} | {m.value:.4f} | {m.loss:.4f} | {t} | {note} |"


def bert_rows(out: Path, steps: int) -> list[str]:
    import onnxruntime as ort

    name = "bert_stdlib"
    src = out / f"{name}.onnx"
    original = lnfold.load_onnx(src)
    calib = {"input_ids": harness.heldout(name, CALIB_ROWS)["input_ids"]}
    variants = {"original": original, "exact fold": lnfold.fold_onnx(original).model}
    notes = {"original": "", "exact fold": "embedding norm only (exact, verified)"}
    for b in BUDGETS:
        r = lnfold.fold_onnx(original, mode="rms-approx", calibration=calib, budget=b)
        a = r.report.approx
        key = f"approx, budget {b:g}"
        variants[key] = r.model
        notes[key] = (f"{len(a.swapped)} of 9 kept norms swapped; calibration error {a.total:.2g}, "
                      f"held-out {a.heldout:.2g}")
    every = lnfold.fold_onnx(original, mode="rms-approx", calibration=calib, budget=1e9)  # all kept norms
    variants["every kept norm swapped"] = every.model
    notes["every kept norm swapped"] = f"no budget (1e9): calibration error {every.report.approx.total:.2g}"
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sessions = {k: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
                for k, m in variants.items()}
    feed = {"input_ids": harness.heldout(name, 8)["input_ids"]}
    lat = timing.interleaved({k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}, rounds=60)
    rows = ["| BERT (Post-LN) | MLM accuracy | loss | wall median [q1, q3] | CPU time median [q1, q3] | what |",
            "|---|---|---|---|---|---|"]
    for k, m in variants.items():
        rows.append(metric_row(k, harness.onnx_runner(m), lat[k], notes[k]))
    rows += finetune_rows(every, steps, lat["every kept norm swapped"])
    return rows


def finetune_rows(every, steps: int, lat) -> list[str]:
    """Fine-tune with every kept norm swapped (indices from the report: graph order), and the
    original alike (a control: more training alone may move the metric)."""
    from . import train

    kept = {k for k, n in enumerate(every.report.norms) if n.verdict == "approx"}
    text, _, _ = train.stdlib_bytes()
    rows = []
    for label, idx in (("original, fine-tuned alike (control)", set()), ("every kept norm swapped, fine-tuned", kept)):
        torch.manual_seed(0)
        model = swap_eager(harness.load_model("bert_stdlib"), idx).train()
        opt = train.optimizer(model, 1e-4)
        data = train.batches("bert_stdlib", text, 12, torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        for s in range(steps):
            for grp in opt.param_groups:
                grp["lr"] = train.schedule(s, steps, 1e-4)
            loss = model(**next(data)).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        secs = time.perf_counter() - t0
        module = zoo.Logits(model.eval(), "logits").eval()
        rows.append(metric_row(label, harness.torch_runner(module), lat if idx else None,
                               f"{steps} AdamW steps (lr 1e-4, batch 12), {secs:.0f} s CPU; eager torch"))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default="/tmp/geometry_bench")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    print(f"<!-- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"python -m benchmarks.trained.geometry_bench {' '.join(argv or sys.argv[1:])} -->")
    print("\n".join(angles(out)))
    print()
    print("\n".join(bert_rows(out, args.steps)))


if __name__ == "__main__":
    main()
