"""Issue 32: `lnfold.slice_onnx` on the trained checkpoints — held-out metric, parameters and
onnxruntime latency (interleaved, with an A/A control) at fractions 0.1 / 0.2 / 0.3. NOT exact.

Calibration rows and scored rows are disjoint: the second half of each committed held-out split
calibrates (and measures the slice's error against the exact fold on its own held-out half), the
first half is scored (the metric of `harness`).

    python -m benchmarks.trained.slice_metric [--models gpt2_stdlib vit_digits bert_stdlib] [--rounds 20]

Each model's norms that the exact fold keeps are listed with the reason (Post-LN BERT: all but the
embeddings' norm), since only folded streams can be sliced.
"""
from __future__ import annotations

import argparse
import warnings

import numpy as np

import lnfold
from lnfold import zoo
from lnfold.onnx_rewrite import timing
from lnfold.onnx_rewrite.linear_layers import float_parameters as parameters
from lnfold.passes import LnfoldError

from . import harness

FRACTIONS = (0.1, 0.2, 0.3)
TIMED_ROWS = {"gpt2_stdlib": 4, "vit_digits": 64, "bert_stdlib": 4}


def session(model):
    """An onnxruntime CPU session on one thread (the harness's setting: the machine is shared)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=["gpt2_stdlib", "vit_digits", "bert_stdlib"])
    p.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    p.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    for name in args.models:
        key = harness.INPUT[name]
        rows = harness.heldout(name)[key]
        half = len(rows) // 2
        calibration = {key: rows[half:]}
        module = harness.logits_module(name)
        model = zoo.export_onnx(module, harness.example_args(name), [key])
        variants = {"original": model}
        reports, refused, exact = {}, {}, None
        for f in args.fractions:
            try:
                r = lnfold.slice_onnx(model, calibration, fraction=f)
            except LnfoldError as e:  # e.g. every stream would grow (Post-LN BERT's readout): nothing to time
                refused[f"slice F={f:g}"] = str(e)
                continue
            variants.setdefault("exact fold", r.exact.model)
            exact = r.exact
            variants[f"slice F={f:g}"] = r.model
            reports[f"slice F={f:g}"] = r.report
        print(f"{name}: scored on held-out rows [0, {half}), calibrated on [{half}, {len(rows)})")
        for v in exact.report.norms if exact else ():
            if v.verdict != "fold":
                print(f"  kept by the exact fold (not sliceable): {v.name}: {v.reason}")
        for label, why in refused.items():
            print(f"  {label:<14} refused: {why}")
        for label, m in variants.items():
            metric = harness.evaluate(name, harness.onnx_runner(m), limit=half)
            print(f"  {label:<14} {metric}  parameters {parameters(m):,}")
            if label in reports:
                for line in reports[label].table().splitlines()[1:]:
                    print(f"      {line.strip()}")
        x = {key: rows[:TIMED_ROWS[name]]}
        sessions = {label: session(m) for label, m in variants.items()}
        sessions["original (A/A)"] = session(model)
        stats = timing.interleaved({label: (lambda s=s: s.run(None, x)) for label, s in sessions.items()},
                                   rounds=args.rounds)
        base = stats["original"]["median"]
        print(f"  onnxruntime CPU latency, {TIMED_ROWS[name]} rows, {args.rounds} interleaved rounds (median, "
              "ratio to the original):")
        for label, s in stats.items():
            print(f"    {label:<14} {s['median'] * 1e3:8.2f} ms  {s['median'] / base:5.3f}x")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
