"""The approximate swap's cost per call (ONNX views, shape inferences and applies; torch exports,
classifications and applies) and its choice, on the trained BERT (benchmarks/trained/bert_stdlib,
9 kept norms), budgets 3e-4 and 3e-3, both IRs (issue 31). Run from a checkout's root:

    python -m benchmarks.trained.approx_cost OUT.json
"""
import collections
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.getcwd())  # the checkout this runs in (to compare two of them)
warnings.simplefilter("ignore")

import torch  # noqa: E402

import lnfold  # noqa: E402
import lnfold.fx_rewrite.api as fapi  # noqa: E402
import lnfold.onnx_rewrite.api as oapi  # noqa: E402
from benchmarks.trained import harness  # noqa: E402
from benchmarks.trained.geometry_bench import export  # noqa: E402

counts = collections.Counter()
def counted(owner, name, key):
    f = getattr(owner, name)
    def g(*a, **k):
        counts[key] += 1
        return f(*a, **k)
    setattr(owner, name, g)
counted(oapi.OnnxFrontend, "view", "onnx view (import + classify)")
counted(oapi, "infer_shapes", "onnx shape inference")
counted(oapi.OnnxFrontend, "apply", "onnx apply")
counted(fapi, "export", "torch.export")
counted(fapi, "build_view", "torch classify")
counted(fapi.ExportFrontend, "apply", "torch apply")

name = "bert_stdlib"
calib = {"input_ids": harness.heldout(name, 16)["input_ids"]}
model = export(name)
out = {}
for budget in (3e-4, 3e-3):
    counts.clear(); t = time.perf_counter()
    r = lnfold.fold_onnx(model, mode="rms-approx", calibration=calib, budget=budget)
    out[f"onnx {budget:g}"] = {"selection": r.report.approx.to_dict(), "counts": dict(counts), "s": round(time.perf_counter() - t, 2)}
module = harness.logits_module(name)
x = torch.from_numpy(calib["input_ids"])
for budget in (3e-4, 3e-3):
    counts.clear(); t = time.perf_counter()
    r = lnfold.fold_module(module, (x[:2],), mode="rms-approx", calibration=(x,), budget=budget)
    out[f"torch {budget:g}"] = {"selection": r.report.approx.to_dict(), "counts": dict(counts), "s": round(time.perf_counter() - t, 2)}
json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
for k, v in out.items():
    print(k, v["counts"], v["s"], "s", "swapped", [s["name"] for s in v["selection"]["swapped"]], v["selection"]["total"], v["selection"]["heldout"])
