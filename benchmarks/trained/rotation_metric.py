"""Issue 22: the held-out metric of the trained checkpoints after γ into readers and each rotation,
in both frontends, with the float64 gate's numbers. Exactness, not speed:

    python -m benchmarks.trained.rotation_metric [--rows N]
"""
from __future__ import annotations

import argparse
import warnings

import lnfold
from lnfold import zoo

from . import harness

KINDS = (None, "hadamard", "orthogonal", "hadamard-keep-ln", "orthogonal-keep-ln")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=None, help="held-out rows scored (default: all)")
    p.add_argument("--models", nargs="+", default=["gpt2_stdlib", "vit_digits"])
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    for name in args.models:
        module = harness.logits_module(name)
        ex = harness.example_args(name)
        model = zoo.export_onnx(module, ex, [harness.INPUT[name]])
        before = harness.evaluate(name, harness.torch_runner(module), args.rows)
        print(f"{name}: original {before}")
        for kind in KINDS:
            extra = dict(rotate=kind) if kind else dict(gamma_into_readers=True)
            label = kind or "γ into readers"
            t = lnfold.fold_module(module, ex, **extra)
            o = lnfold.fold_onnx(model, **extra)
            for fe, res, run in (("torch", t, harness.torch_runner(t.module)), ("onnx", o, harness.onnx_runner(o.model))):
                m = harness.evaluate(name, run, args.rows)
                rot = "; ".join(s.rotation.split(":")[0] for s in res.report.streams if s.rotation) or "-"
                print(f"  {label:<20} {fe:<5} {m}  gate: {res.exact_err:.2e} vs original {res.original_exact_err:.2e}"
                      f"  [{rot}]")


if __name__ == "__main__":
    main()
