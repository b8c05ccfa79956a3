"""Low precision: the folded model's error when the fold rounds a model that is already bf16/fp16.

    python -m benchmarks.lowprecision                            # every model and dtype (~15 min here)
    python -m benchmarks.lowprecision --models gpt2_stdlib --dtypes bf16 --no-compile

A fold edits weights (centers the writers of the stream, folds β into biases, γ into readers) in
float64 and stores each result in the model's dtype. A model that is already bf16 has had every
weight rounded once; folding it rounds every edited weight a second time. Folding the fp32 model
and casting afterwards rounds each weight once. Per model and dtype, against a float64 run of the
fp32 model, this measures:

- original: the fp32 model cast to the dtype (its own low-precision error, the yardstick);
- cast → fold_to_rmsnorm: the low-precision model folded (two roundings of each edited weight);
- fold_to_rmsnorm → cast: the remedy, the fp32 model folded, then cast (one rounding);
- with torch.compile (unless --no-compile): the cast original under Inductor (the compiled
  yardstick), the cast model under backend="lnfold" (two roundings), the remedy under Inductor.

Each row: the logits' relative RMS error ‖out − ref‖₂ / ‖ref‖₂ and max error max|out − ref| / max|ref|,
each also as a ratio to the original's in the same runtime (eager or compiled), and the model's
metric: the trained models' held-out metric (benchmarks/trained/harness.py), and for the random-
weight GPT-2-small (a real `transformers` GPT2LMHeadModel, default config, d 768, 12 layers) the
fraction of positions whose top-1 token is the float64 run's. "adversarial" is the same with
randomized γ/β and large-mean sources (zoo.adversarial), where centering moves weights the most.
Prints markdown for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

import lnfold
from lnfold import zoo

from .trained import harness

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RANDOM = ("gpt2_small_random", "gpt2_small_adversarial")
MODELS = harness.MODELS + RANDOM
# held-out rows scored per trained model: a multiple of harness.logits' batch (no odd last batch to recompile)
LIMIT = {"gpt2_stdlib": 16, "bert_stdlib": 16, "vit_digits": 352}
RANDOM_SHAPE = (4, 64)  # token ids of the random-weight GPT-2-small: rows x positions


@dataclass
class Case:
    """One model: its fp32 module, the example inputs the fold traces, and how to score logits."""
    name: str
    module: torch.nn.Module
    args: tuple
    logits: Callable[[harness.Runner], np.ndarray]  # a runner's logits on the scored inputs
    metric: Callable[[np.ndarray], tuple[str, float]]  # logits -> (metric name, value)


def trained_case(name: str) -> Case:
    limit = LIMIT[name]

    def metric(out):
        m = harness.score(name, out, limit)
        return m.name, m.value

    return Case(name, harness.logits_module(name), harness.example_args(name),
                lambda runner: harness.logits(name, runner, limit), metric)


def random_case(name: str) -> Case:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="eager")).eval()
    if name == "gpt2_small_adversarial":
        zoo.adversarial(model)
    module = zoo.Logits(model, "logits").eval()
    ids = torch.randint(0, model.config.vocab_size, RANDOM_SHAPE, generator=torch.Generator().manual_seed(0))
    top1 = harness.torch_runner(copy.deepcopy(module).double())(ids.numpy()).argmax(-1)
    return Case(name, module, (ids[:2],), lambda runner: runner(ids.numpy()),
                lambda out: ("top-1 = float64's", float((out.argmax(-1) == top1).mean())))


def make_case(name: str) -> Case:
    return random_case(name) if name in RANDOM else trained_case(name)


def relative_errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(relative RMS, max) error of `out` against the float64 reference `ref`."""
    diff = out - ref
    return float(np.sqrt((diff ** 2).sum() / (ref ** 2).sum())), harness.max_rel_err(out, ref)


def fold(module: torch.nn.Module, args: tuple) -> tuple[Optional[torch.nn.Module], str]:
    """fold_to_rmsnorm in place: (the module, a note), or (None, why) where the hand-off swaps no
    norm (a Post-LN encoder). A refusal by verification is noted and the fold redone unverified."""
    try:
        lnfold.fold_to_rmsnorm(module, args)
        return module, ""
    except lnfold.NothingToFold as e:
        return None, f"not measured: {str(e).split(';')[0]}"
    except lnfold.VerificationError as e:
        lnfold.fold_to_rmsnorm(module, args, verify=False)
        return module, f"verification refused it ({str(e)[:80]}…); measured unverified"


def compiled(module: torch.nn.Module, backend: str) -> torch.nn.Module:
    torch._dynamo.reset()  # each variant compiles from scratch (no sizes marked dynamic by the last)
    return torch.compile(module, backend=backend)  # (the lnfold one warns on stderr: what is measured here)


def variants(case: Case, dtype: torch.dtype, compile_too: bool):
    """(runtime, variant, module or None, note) per variant, built lazily: one model in memory at a time."""
    args = case.args
    cast = lambda m: m.to(dtype)  # noqa: E731
    fresh = lambda: copy.deepcopy(case.module)  # noqa: E731

    yield "eager", "original", cast(fresh()), ""
    yield ("eager", "cast → fold_to_rmsnorm") + fold(cast(fresh()), args)
    remedy, note = fold(fresh(), args)
    remedy = remedy and cast(remedy)
    yield "eager", "fold_to_rmsnorm → cast (remedy)", remedy, note
    if compile_too:
        yield "compile", "original, backend=inductor", compiled(cast(fresh()), "inductor"), ""
        yield "compile", 'cast → backend="lnfold"', compiled(cast(fresh()), "lnfold"), ""
        yield ("compile", "fold_to_rmsnorm → cast (remedy), backend=inductor",
               remedy and compiled(remedy, "inductor"), note)


def measure(case: Case, dtype_name: str, compile_too: bool) -> list[dict]:
    ref = case.logits(harness.torch_runner(copy.deepcopy(case.module).double()))
    rows, yardstick = [], {}
    for runtime, variant, module, note in variants(case, DTYPES[dtype_name], compile_too):
        row = dict(model=case.name, dtype=dtype_name, variant=variant, note=note)
        rows.append(row)
        if module is None:
            continue
        t = time.perf_counter()
        out = case.logits(harness.torch_runner(module))
        seconds = time.perf_counter() - t
        rms, peak = relative_errors(out, ref)
        yardstick.setdefault(runtime, (rms, peak))  # each runtime's first row is its original
        metric_name, metric = case.metric(out)
        row.update(rms=rms, max=peak, rms_ratio=rms / yardstick[runtime][0], max_ratio=peak / yardstick[runtime][1],
                   metric=f"{metric_name} {metric:.6g}")
        print(f"  {case.name} {dtype_name} {variant}: rms {rms:.3g} max {peak:.3g} {row['metric']} ({seconds:.1f} s)",
              file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    def cell(r, key, spec):
        return format(r[key], spec) if key in r else "—"

    lines = ["| model | dtype | variant | logits rel. RMS err | × original's | logits max rel. err | × original's "
             "| metric | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['variant']} | {cell(r, 'rms', '.2e')} "
                     f"| {cell(r, 'rms_ratio', '.2f')} | {cell(r, 'max', '.2e')} | {cell(r, 'max_ratio', '.2f')} "
                     f"| {r.get('metric', '—')} | {r['note']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--no-compile", action="store_true", help="eager rows only (no torch.compile)")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    start = time.time()
    rows = []
    for name in a.models:
        case = make_case(name)
        for dtype_name in a.dtypes:
            rows += measure(case, dtype_name, compile_too=not a.no_compile)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"{time.time() - start:.0f} s\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
