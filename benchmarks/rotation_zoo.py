"""Rotation across the zoo (issue 22's done-when): every lnfold.zoo architecture folded with
`rotate="hadamard"` in both frontends, each fold verified against float64 like any other. Per
architecture: how many streams each frontend rotated (and un-rotated at a read-out), whether the
two frontends' rotation reports agree (node names aside), and the first reason a stream was not
rotated.

    python -m benchmarks.rotation_zoo [--only gpt2,opt] [--json FILE]

Not a test: ~40 architectures × two verified folds take minutes (the suite runs the slow
per-architecture test on gpt2, OPT, ViT, bare ViT, Whisper and StableLM instead).
"""
from __future__ import annotations

import argparse
import json
import re
import time
import warnings

from lnfold import zoo
from lnfold.fx_rewrite import fold_module
from lnfold.onnx_rewrite import fold_model
from lnfold.passes import LnfoldError

SEQ2SEQ_INPUTS = ["x", "decoder_input_ids"]
STATIC_EXPORT = {"swin"}  # as tests/test_differential.py: its dynamic-batch export takes a minute


def _rotations(report) -> list[str]:
    """Each stream's rotation as both frontends must agree on it: node names, op names and the
    count of writer constants are each IR's own (an IR may split or share a constant)."""
    out = []
    for s in report.streams:
        r = re.sub(r"\S+ `[^`]*`", "·", s.rotation)
        out.append(re.sub(r"\d+ writer constant", "N writer constant", r))
    return out


def _summary(report) -> dict:
    rot = [s.rotation for s in report.streams]
    return {"streams": len(rot), "rotated": sum(r.startswith("rotated") for r in rot),
            "unrotated_readouts": sum("un-rotated after" in r for r in rot),
            "first_reason": next((r for r in rot if not r.startswith("rotated")), "")}


def survey(name: str) -> dict:
    module, args = zoo.MODELS[name]()
    row: dict = {"name": name}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for frontend in ("torch", "onnx"):
            t0 = time.perf_counter()
            try:
                if frontend == "torch":
                    res = fold_module(module, args, rotate="hadamard", dynamic=name not in STATIC_EXPORT)
                else:
                    res = fold_model(zoo.export_onnx(module, args, SEQ2SEQ_INPUTS[:len(args)]), rotate="hadamard")
            except LnfoldError as e:  # NothingToFold, or a refused (unverifiable) fold: say which
                row[frontend] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                continue
            row[frontend] = dict(_summary(res.report), criterion=res.criterion,
                                 err=res.exact_err, original_err=res.original_exact_err,
                                 seconds=round(time.perf_counter() - t0, 1), rotations=_rotations(res.report))
    t, o = row.get("torch", {}), row.get("onnx", {})
    row["agree"] = "rotations" in t and "rotations" in o and t["rotations"] == o["rotations"]
    return row


def _e(x) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated zoo names (default: all)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else sorted(zoo.MODELS)
    rows = []
    print("| architecture | torch: rotated / streams (read-outs) | onnx: rotated / streams (read-outs) | "
          "agree | verified (torch, onnx: err vs original's) | first reason a stream is not rotated |")
    print("|---|---|---|---|---|---|")
    for name in names:
        r = survey(name)
        rows.append(r)
        cells = []
        for f in ("torch", "onnx"):
            x = r[f]
            cells.append(x["error"] if "error" in x else f"{x['rotated']} / {x['streams']} ({x['unrotated_readouts']})")
        ver = ", ".join("—" if "error" in r[f] else f"{r[f]['criterion']} {_e(r[f]['err'])} vs {_e(r[f]['original_err'])}"
                        for f in ("torch", "onnx"))
        reason = next((r[f]["first_reason"] for f in ("torch", "onnx") if r[f].get("first_reason")), "")
        print(f"| {name} | {cells[0]} | {cells[1]} | {'yes' if r['agree'] else 'NO'} | {ver} | {reason[:140]} |",
              flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
