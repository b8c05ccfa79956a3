"""Every lnfold entry point on the trained models, judged by their held-out metric.

    python -m benchmarks.trained.bench                 # all models, entry points, dtypes (~15 min here)
    python -m benchmarks.trained.bench --models vit_digits --no-compile

Per model x entry point x dtype: norms folded / kept, the held-out metric of the original and of
the folded model (each in the same runtime and dtype) and their difference, each one's max
relative logit error against an eager float64 run of the original, and the fold's time. The
metric's own noise is the first rows' "eager" entry: the original in that dtype against float64.
Entry points: `lnfold fold` (the command line, on a dynamo ONNX export; targets ort / onnx /
portable, `--mode crms`, `--defer on`), `fold_module`, `torch.compile(backend="lnfold")` and
`fold_for_training` (its metric in eval mode, and a few AdamW steps of continued training
against the unfolded model's). Then the outlier-channel measurement per model (outliers.py).
Prints markdown for benchmarks/RESULTS.md; `--json FILE` keeps the rows.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import harness
from .outliers import outlier_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# held-out rows scored per model: a multiple of harness.logits' batch (no odd last batch to recompile)
LIMIT = {"gpt2_stdlib": 16, "bert_stdlib": 16, "vit_digits": 352}
CLI_VARIANTS = [("fp32", ["--target", "ort"]), ("fp32", ["--target", "onnx"]), ("fp32", ["--target", "portable"]),
                ("fp32", ["--target", "ort", "--mode", "crms"]), ("fp32", ["--target", "ort", "--defer", "on"]),
                ("fp16", ["--target", "ort"]), ("bf16", ["--target", "ort"])]


@dataclass
class Row:
    model: str
    entry: str
    dtype: str
    folded: Optional[int] = None
    kept: Optional[int] = None
    before: Optional[float] = None
    after: Optional[float] = None
    err_original: Optional[float] = None  # max relative logit error vs float64, original
    err_folded: Optional[float] = None  # the same for the folded model
    fold_s: Optional[float] = None
    note: str = ""

    def markdown(self) -> str:
        def f(x, spec):
            return "—" if x is None else format(x, spec)
        diff = None if self.before is None or self.after is None else self.after - self.before
        return (f"| {self.model} | {self.entry} | {self.dtype} | {f(self.folded, 'd')} / {f(self.kept, 'd')} | "
                f"{f(self.before, '.6f')} | {f(self.after, '.6f')} | {f(diff, '+.1e')} | {f(self.err_original, '.1e')} | "
                f"{f(self.err_folded, '.1e')} | {f(self.fold_s, '.2f')} | {self.note} |")


HEADER = ("| model | entry point | dtype | norms folded / kept | metric, original | metric, folded | difference | "
          "rel. err. vs fp64, original | rel. err. vs fp64, folded | fold s | note |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


class Model:
    """One trained model's held-out rows, its float64 reference logits and its originals per dtype."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self.ref = self.logits(harness.torch_runner(harness.logits_module(name, torch.float64)))
        self.originals: dict[str, tuple[float, float]] = {}

    def logits(self, runner) -> np.ndarray:
        return harness.logits(self.name, runner, self.limit)

    def judge(self, runner) -> tuple[float, float]:
        """(metric value, max relative error against float64) of a runner."""
        out = self.logits(runner)
        return harness.score(self.name, out, self.limit).value, harness.max_rel_err(out, self.ref)

    def original(self, key: str, runner) -> tuple[float, float]:
        if key not in self.originals:
            self.originals[key] = self.judge(runner)
        return self.originals[key]

    def args(self, dtype):
        (x,) = harness.example_args(self.name)
        return (x.to(dtype) if x.is_floating_point() else x,)


def eager_rows(m: Model, compile_: bool) -> list[Row]:
    import lnfold

    rows = []
    for dname, dtype in DTYPES.items():
        module = harness.logits_module(m.name, dtype)
        before, err0 = m.original(f"eager-{dname}", harness.torch_runner(module))
        rows.append(Row(m.name, "eager (noise: vs float64)", dname, before=before, after=harness.score(
            m.name, m.ref, m.limit).value, err_original=err0, note="'folded' column: the float64 original"))

        t0 = time.perf_counter()
        res = lnfold.fold_module(module, m.args(dtype))
        fold_s = time.perf_counter() - t0
        after, err = m.judge(harness.torch_runner(res.module, dtype))
        rows.append(Row(m.name, "fold_module", dname, res.report.folded, res.report.kept, before, after, err0, err,
                        fold_s, f"verified, max rel. diff {res.max_rel_err:.1e}"))

        twin = copy.deepcopy(module)
        t0 = time.perf_counter()
        trained = lnfold.fold_for_training(twin, m.args(dtype))
        fold_s = time.perf_counter() - t0
        after, err = m.judge(harness.torch_runner(twin, dtype))
        rows.append(Row(m.name, "fold_for_training (eval)", dname, trained.report.folded, trained.report.kept,
                        before, after, err0, err, fold_s))

        if compile_:
            reports = []
            compiled = torch.compile(module, backend="lnfold", options={"lnfold.on_report": reports.append})
            t0 = time.perf_counter()
            with torch.no_grad():
                compiled(*m.args(dtype))
            fold_s = time.perf_counter() - t0
            after, err = m.judge(harness.torch_runner(compiled, dtype))
            folded = sum(r.folded for r in reports[:1])
            kept = sum(r.kept for r in reports[:1])
            rows.append(Row(m.name, 'torch.compile(backend="lnfold")', dname, folded, kept, before, after, err0, err,
                            fold_s, f"fold s: first call (export of the graph, fold, Inductor); {len(reports)} graph(s)"))
            torch._dynamo.reset()
    return rows


def export(m: Model, dtype, path: Path) -> None:
    from lnfold import zoo

    module = harness.logits_module(m.name, dtype)
    path.write_bytes(zoo.export_onnx(module, m.args(dtype), [harness.INPUT[m.name]]).SerializeToString())


def cli_rows(m: Model, tmp: Path) -> list[Row]:
    rows = []
    for dname, flags in CLI_VARIANTS:
        entry = "lnfold fold " + " ".join(flags)
        src = tmp / f"{m.name}.{dname}.onnx"
        try:
            if not src.exists():
                export(m, DTYPES[dname], src)
            before, err0 = m.original(f"ort-{dname}", harness.onnx_runner(src))
        except Exception as e:  # a dtype onnxruntime (or the exporter) cannot run: say so, go on
            rows.append(Row(m.name, entry, dname, note=f"original not runnable: {str(e).splitlines()[0][:100]}"))
            continue
        dst = tmp / f"{m.name}.{dname}.{'_'.join(flags).replace('-', '')}.onnx"
        done = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(src), "-o", str(dst), "--json", *flags],
                              capture_output=True, text=True)
        if done.returncode != 0:
            rows.append(Row(m.name, entry, dname, before=before, err_original=err0,
                            note=f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:160]}"))
            continue
        out = json.loads(done.stdout)
        after, err = m.judge(harness.onnx_runner(dst))
        note = f"verified ({out['criterion']}), max rel. diff {out['max_rel_err']:.1e}"
        rows.append(Row(m.name, entry, dname, out["report"]["folded"], out["report"]["kept"], before, after, err0,
                        err, out["seconds"], note))
    return rows


def training_rows(m: Model, steps: int = 5) -> list[str]:
    """A few AdamW steps of continued training, folded (fold_for_training) and not: the losses."""
    import lnfold

    out = []
    for dname in ("fp32", "bf16"):
        dtype = DTYPES[dname]
        plain = harness.logits_module(m.name, dtype).train()
        folded = copy.deepcopy(plain)
        lnfold.fold_for_training(folded, m.args(dtype))
        data = harness.heldout(m.name, 8 * steps)
        losses = {}
        for label, module in (("unfolded", plain), ("folded", folded)):
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
            losses[label] = []
            for s in range(steps):
                rows = {k: torch.from_numpy(v[8 * s:8 * s + 8]) for k, v in data.items()}
                loss = batch_loss(m.name, module, rows, dtype)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses[label].append(loss.item())
        rel = max(abs(a - b) / abs(a) for a, b in zip(losses["unfolded"], losses["folded"]))
        # after training: the two models' logits (what the loss sees), and their raw parameters. Adam
        # divides each gradient by its own RMS, so the rounding noise in the directions the loss
        # cannot see (each writer's mean, which the norms remove) becomes lr-sized steps: the raw
        # parameters drift apart there while the functions stay equal.
        x = m.args(dtype)
        with torch.no_grad():
            logit_rel = harness.max_rel_err(folded.eval()(*x).double().numpy(), plain.eval()(*x).double().numpy())
        p = {k: v.double() for k, v in plain.state_dict().items()}
        q = {k: v.double() for k, v in folded.state_dict().items()}
        par, key = max((((p[k] - q[k]).abs().max() / p[k].abs().max().clamp_min(1e-30)).item(), k) for k in p)
        out.append(f"| {m.name} | {dname} | {' '.join(f'{x:.5f}' for x in losses['unfolded'])} | "
                   f"{' '.join(f'{x:.5f}' for x in losses['folded'])} | {rel:.1e} | {logit_rel:.1e} | "
                   f"{par:.1e} (`{key}`) |")
    return out


def batch_loss(name: str, module, rows: dict, dtype) -> torch.Tensor:
    """The training loss of one batch of held-out rows, through the logits module."""
    x = rows[harness.INPUT[name]]
    logits = module(x.to(dtype) if x.is_floating_point() else x).float()
    ce = torch.nn.functional.cross_entropy
    if name == "gpt2_stdlib":
        return ce(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return ce(logits.reshape(-1, logits.shape[-1]), rows["labels"].reshape(-1), ignore_index=-100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(harness.MODELS), choices=harness.MODELS)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (Inductor compiles are slow)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows, train_lines, outlier_lines = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            m = Model(name, LIMIT[name])
            rows += eager_rows(m, not args.no_compile)
            rows += cli_rows(m, Path(tmp))
            train_lines += training_rows(m)
            outlier_lines += outlier_table(name)
            print(f"# {name} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"machine: {platform.machine()}, torch {torch.__version__}; {time.perf_counter() - t0:.0f} s\n")
    print(HEADER)
    print("\n".join(r.markdown() for r in rows))
    print("\n| model | dtype | loss per step, unfolded | loss per step, fold_for_training | max rel. loss diff | "
          "max rel. logit diff after | max rel. parameter diff after |\n| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(train_lines))
    print()
    print("\n".join(outlier_lines))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
