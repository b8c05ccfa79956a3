"""`lnfold slice MODEL -o OUT (--fraction F | --budget B) --calibrate CAL.npz [--per-block [--full-width-head] [--center-embeddings]] [--target T]
[--device D] [--json]`:
the command line of onnx_rewrite/slice.py (NOT exact), built and run as quantize_cli.py's.
"""
from __future__ import annotations

import argparse
import time

from .quantize_cli import file_command, file_paths, write_and_report
from .targets import DEVICE, TARGET
from ..passes import LnfoldError
from ..passes.options import SLICE_OPTIONS
from ..passes.plots import budget_curve, check_path

_DESCRIPTION = ("Fold the LayerNorms exactly with their weights in the readers (verified), then carry each "
                "residual stream that can be rotated in its first k = d - round(F*d) principal directions on "
                "your calibration rows (SliceGPT): every writer and reader of the stream shrinks. NOT exact: the "
                "command prints the error against the exact fold on held-out rows.")


def add_parser(sub) -> argparse.ArgumentParser:
    s = file_command(sub, "slice", "sliced", "fold exactly, then delete each stream's least-used directions "
                     "(not exact)", _DESCRIPTION)
    width = s.add_mutually_exclusive_group(required=True)
    width.add_argument("--fraction", type=float, metavar="F",
                       help="the share of each sliced stream's width deleted, in (0, 1)")
    width.add_argument("--budget", type=float, metavar="B",
                       help="instead of F: the largest F (0.025, 0.05, ..., 0.975) whose relative error against "
                            "the exact fold on the held-out rows is <= B")
    s.add_argument("--calibrate", metavar="FILE.npz|DIR",
                   help="your representative inputs: one array per model input, rows along the first axis (fed in "
                        "the model's batch size), or a folder of such .npz files (rows of different lengths: each "
                        "file fed on its own); the first half (rounded up) calibrates, the rest measures the error")
    for option in SLICE_OPTIONS.values():
        option.add_to(s)
    s.add_argument("--plot", metavar="FILE.svg|png",
                   help="with --budget: draw the search (the error at each fraction tried, the budget, the one "
                        "chosen, the parameters kept); needs matplotlib (lnfold[plot])")
    TARGET.add_to(s)
    DEVICE.add_to(s)
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return s


def run(args) -> int:
    from .progress import reporting
    from .slice import slice_model

    src, dst = file_paths(args)
    if args.plot is not None:  # (the user's mistakes before any work)
        if args.budget is None:
            raise LnfoldError("--plot draws a --budget search: give --budget B (a fraction searches nothing)")
        check_path(args.plot)
    t0 = time.perf_counter()
    with reporting(src, json=args.json) as progress:  # each fold's stages: many with --per-block or --budget
        result = slice_model(src, args.calibrate, fraction=args.fraction, budget=args.budget,
                             **{name: o.value_in(args) for name, o in SLICE_OPTIONS.items()}, target=args.target,
                             device=args.device, progress=progress)
    code = write_and_report(result, dst, t0, args.json, "sliced")
    if args.plot is not None and code == 0:
        budget_curve(result.report, args.plot, f"lnfold slice --budget {args.budget:g}: {src.name} (NOT exact)")
    return code
