"""`lnfold quantize IN -o OUT --weights int8|int4 ...`: the command line of onnx_rewrite/quantize.py.

cli.py adds the subcommand (`add_parser`) and runs it (`run`); its error handling (one line,
exit 2 for bad input, nothing written) is the fold's.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..passes import LnfoldError
from ..passes.options import OPTIONS, as_argument, check_output
from ..passes.plots import candidates_chart, check_path
from ..passes.quantize import ACTIVATIONS, AUTO, WEIGHTS

_DESCRIPTION = ("Fold the LayerNorms exactly (verified), optionally move their weights into the readers and "
                "rotate the residual stream (exact, verified), then quantize the linear layers with "
                "onnxruntime's own quantizer. The quantized model is NOT exact: the command prints its error "
                "against the float model on the verification inputs.")


def add_parser(sub) -> argparse.ArgumentParser:
    q = file_command(sub, "quantize", "quantized", "fold exactly, then quantize with onnxruntime's quantizers (not exact)",
                     _DESCRIPTION)
    q.add_argument("--weights", choices=WEIGHTS, required=True,
                   help="int8: onnxruntime quantize_dynamic (activations quantized at run time) or, with "
                        "--activations int8, quantize_static (QDQ); int4: MatMulNBitsQuantizer, weight-only")
    q.add_argument("--activations", choices=ACTIVATIONS,
                   help="int8: with --weights int8, static int8 activations (W8A8, QDQ), calibrated on --calibrate; "
                        "with --weights int4, int8 activations quantized at run time by the CPU kernel (W4A8: "
                        "MatMulNBits accuracy_level=4, no calibration)")
    q.add_argument("--calibrate", metavar="FILE.npz|DIR",
                   help="your representative inputs: one array per model input, rows along the first axis (fed "
                        "in the model's batch size), or a folder of such .npz files (rows of different lengths: each "
                        "file fed on its own). With --activations int8 they calibrate and the second half is "
                        "held out to measure the error; otherwise the error (and --rotate auto's choice) is measured "
                        "on them")
    OPTIONS["rotate"].add_to(q, choices=OPTIONS["rotate"].choices + (AUTO,),
                             help=OPTIONS["rotate"].help + "; spreads outlier channels before quantization. auto: "
                             "try the model as given, the fold, γ moved, and each rotation, quantize each, keep the "
                             "lowest error on your rows (--inputs or --calibrate)")
    OPTIONS["gamma_in_float"].add_to(q)
    OPTIONS["spare_channels"].add_to(q)
    OPTIONS["online_hadamard"].add_to(q)
    OPTIONS["seed"].add_to(q)
    q.add_argument("--block-size", type=int, default=128,
                   help="int4: weights per quantization block along K (16, 32, 64, 128 or 256; default 128, "
                        "onnxruntime's)")
    q.add_argument("--per-channel", action="store_true",
                   help="int8: one weight scale per output channel (onnxruntime's per_channel)")
    q.add_argument("--inputs", metavar="FILE.npz",
                   help="verify the fold and measure the quantized model's error (and choose, with --rotate "
                        "auto) on these inputs instead of --calibrate rows or made-up ones")
    q.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of a symbolic input dim for the made-up inputs (repeatable)")
    q.add_argument("--plot", metavar="FILE.svg|png",
                   help="with --rotate auto: draw the candidates (each one's error and size, the one chosen, plain "
                        "onnxruntime for reference); needs matplotlib (lnfold[plot])")
    q.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return q


def file_paths(args) -> tuple[Path, Path]:
    """(input, output) of a command that reads one ONNX file and writes another (quantize, slice),
    checked before any work: a bad one is a one-line error."""
    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        raise LnfoldError(f"{src}: no such ONNX file")
    if dst.is_dir():
        raise LnfoldError(f"{dst}: is a directory; give a file name for the output")
    if dst.exists() and os.path.samefile(src, dst):
        raise LnfoldError(f"{dst}: output would overwrite the input; choose another path")
    if not dst.parent.is_dir():
        raise LnfoldError(f"{dst.parent}: output directory does not exist")
    return src, dst


def run(args) -> int:
    from .inputs import parse_dims
    from .progress import reporting
    from .quantize import quantize_model

    src, dst = file_paths(args)
    if args.plot is not None:  # (the user's mistakes before any work)
        if args.rotate != AUTO:
            raise LnfoldError("--plot draws --rotate auto's candidates: give --rotate auto")
        check_path(args.plot)
    t0 = time.perf_counter()
    with reporting(src, json=args.json) as progress:  # (auto: one stage per candidate)
        result = quantize_model(src, weights=args.weights, activations=args.activations, calibrate=args.calibrate,
                                rotate=args.rotate, seed=args.seed, gamma_in_float=args.gamma_in_float,
                                spare_channels=args.spare_channels, online_hadamard=args.online_hadamard,
                                block_size=args.block_size, per_channel=args.per_channel, inputs=args.inputs,
                                dims=parse_dims(args.dim), progress=progress)
    code = write_and_report(result, dst, t0, args.json, "quantized")
    if args.plot is not None and code == 0:
        candidates_chart(result.report, args.plot, f"lnfold quantize --rotate auto: {src.name} (NOT exact)")
    return code


def file_command(sub, name: str, made: str, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand from one ONNX file to another (quantize, slice): its input and -o arguments."""
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("input", help="the float ONNX model")
    p.add_argument("-o", "--output", required=True, type=as_argument(check_output),
                   help=f"where to write the {made} model")
    return p


def write_and_report(result, dst: Path, t0: float, as_json: bool, what: str) -> int:
    """Save `result.model` to `dst` (temp file + rename: nothing half-written) and print its report,
    which says the model is NOT exact."""
    from .write import save

    save(result.model, dst)
    elapsed = time.perf_counter() - t0
    if as_json:
        print(json.dumps({"output": str(dst), "seconds": elapsed, **result.report.as_dict()}, indent=2))
        return 0
    print(result.report.table())
    print(f"lnfold: wrote {dst} in {elapsed:.2f} s ({what}: NOT exact; error above)")
    return 0
