"""RMSNorm streams as given across the transformers zoo (issue 47's first done-when): LlamaForCausalLM,
Qwen2ForCausalLM, MistralForCausalLM, Phi3ForCausalLM, GemmaForCausalLM and Qwen3ForCausalLM (per-head
q/k RMSNorms, which stay unrotated with their reason; 2 layers, hidden 64,
lnfold.zoo.adversarial sources and random signed γ: tests/test_rms_torch.zoo_model) rotated by a
Hadamard in both frontends (fold_module; fold_onnx on torch.onnx.export(dynamo=True)), each fold
verified against float64; whether the two frontends' rotation reports agree (node names aside), and
slicing at F → 0 (the exact fold: the error against it) and at F = 0.25 (error, parameters).

    python -m benchmarks.rms_zoo [--only llama,gemma]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.getcwd())  # tests/ of the checkout this runs in

ARCHS = ("llama", "qwen2", "mistral", "phi3", "gemma", "qwen3")


def _others(report) -> str:
    """The streams after the residual one, counted by why they stay as they are."""
    rest = [s.rotation.split(": ", 1)[-1] for s in report.streams[1:]]
    return "".join(f"; {rest.count(w)} stream(s) not rotated: {w}" for w in dict.fromkeys(rest))


def survey(arch: str) -> dict:
    import numpy as np
    import onnx
    import torch

    import lnfold
    from benchmarks.rotation_zoo import _rotations
    from lnfold.fx_rewrite.api import export
    from tests.test_rms_torch import _ids, zoo_model

    row: dict = {"arch": arch}
    m, ids = zoo_model(arch), _ids(2, vocab=96, tokens=8)
    t0 = time.perf_counter()
    t = lnfold.fold_module(m, (ids,), rotate="hadamard")
    row["torch"] = (t.report.streams[0].rotation.split(":")[0] + _others(t.report), t.exact_err, t.original_exact_err,
                    time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        torch.onnx.export(m, (ids[:1],), path, dynamo=True, input_names=["input_ids"], output_names=["logits"],
                          verbose=False)
        model = onnx.load(path)
    t0 = time.perf_counter()
    o = lnfold.fold_onnx(model, rotate="hadamard")
    row["onnx"] = (o.report.streams[0].rotation.split(":")[0] + _others(o.report), o.exact_err, o.original_exact_err,
                   time.perf_counter() - t0)
    row["agree"] = _rotations(t.report) == _rotations(o.report)
    double, cal = m.double(), _ids(16, seed=3, vocab=96, tokens=8)
    program = export(double, (cal,))
    row["slice0"] = lnfold.slice_module(program, (cal,), fraction=0.001).report.error
    s = lnfold.slice_module(m, (cal,), fraction=0.25)
    row["slice25"] = (s.report.error, s.report.params_after / s.report.params_before)
    rows = {"input_ids": cal.numpy()}  # (the export takes batch 1: slice_onnx feeds a row at a time)
    row["onnx_slice0"] = lnfold.slice_onnx(model, rows, fraction=0.001).report.error
    assert np.isfinite(row["slice0"])
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated architectures (default: all five)")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    from lnfold import zoo
    zoo.quiet_onnx_logs()
    print("| architecture | torch: rotation, err vs original's (s) | onnx (dynamo): rotation, err vs original's (s) | "
          "agree | slice F→0 vs exact fold (torch f64 / onnx f32) | slice F=0.25 (torch): error, parameters |")
    print("|---|---|---|---|---|---|")
    for arch in (a.only.split(",") if a.only else ARCHS):
        r = survey(arch)
        cell = lambda x: f"{x[0]}, {x[1]:.1e} vs {x[2]:.1e} ({x[3]:.1f})"  # noqa: E731
        print(f"| {arch} | {cell(r['torch'])} | {cell(r['onnx'])} | {'yes' if r['agree'] else 'NO'} | "
              f"{r['slice0']:.1e} / {r['onnx_slice0']:.1e} | {r['slice25'][0]:.3f}, {r['slice25'][1]:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
