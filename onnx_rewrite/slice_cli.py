"""`lnfold slice MODEL -o OUT --fraction F --calibrate CAL.npz [--json]`: the command line of
onnx_rewrite/slice.py (NOT exact). cli.py adds the subcommand (`add_parser`) and runs it (`run`);
its error handling (one line, exit 2 for bad input, nothing written) is the fold's.
"""
from __future__ import annotations

import argparse
import json
import time

_DESCRIPTION = ("Fold the LayerNorms exactly with their weights in the readers (verified), then carry each "
                "residual stream that can be rotated in its first k = d - round(F*d) principal directions on "
                "your calibration rows (SliceGPT): every writer and reader of the stream shrinks. NOT exact: the "
                "command prints the error against the exact fold on held-out rows.")


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("slice", help="fold exactly, then delete each stream's least-used directions (not exact)",
                       description=_DESCRIPTION)
    s.add_argument("input", help="the float ONNX model")
    s.add_argument("-o", "--output", required=True, help="where to write the sliced model")
    s.add_argument("--fraction", type=float, required=True, metavar="F",
                   help="the share of each sliced stream's width deleted, in (0, 1)")
    s.add_argument("--calibrate", metavar="FILE.npz",
                   help="your representative inputs: one array per model input, rows along the first axis; the "
                        "first half (rounded up) calibrates, the rest measures the error")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return s


def run(args) -> int:
    from .quantize_cli import file_paths
    from .slice import slice_model
    from .write import save

    src, dst = file_paths(args)
    t0 = time.perf_counter()
    result = slice_model(src, args.calibrate, fraction=args.fraction)
    save(result.model, dst)  # temp file + rename: nothing half-written
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"output": str(dst), "seconds": elapsed, **result.report.as_dict()}, indent=2))
        return 0
    print(result.report.table())
    print(f"lnfold: wrote {dst} in {elapsed:.2f} s (sliced: NOT exact; error above)")
    return 0
