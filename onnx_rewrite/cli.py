"""The `lnfold` command: fold, report, quantize, bench, demo.

Exit codes: 0 done; 1 the folded model failed verification (nothing written); 2 bad input or
nothing to fold (one line on stderr, input untouched, nothing written); 3 an internal error
(a bug: one line, and the traceback with LNFOLD_DEBUG=1); 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from ..passes import LnfoldError, NothingToFold, pipeline
from ..passes.options import (APPROX_MODE, MODE_HELP, OPTIONS, PLAN_MODES, as_argument, check_output,
                               check_seconds, check_threads, options_from)
from .targets import DEVICE, TARGET

_HINT = "lnfold: give a command: fold, report, quantize, bench or demo (`lnfold demo` folds a small GPT-2 end to end)"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit code 2), like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"lnfold: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="lnfold", description="Fold the LayerNorms of a model into RMSNorms, exactly.")
    p.add_argument("--version", action="version", version=f"lnfold {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands",
                           help="`lnfold COMMAND --help` lists a command's options")

    f = sub.add_parser("fold", help="fold an ONNX model and write the result")
    f.add_argument("input", help="the ONNX model to fold (external data beside it is read too), or an exporter's "
                                 "folder (Optimum's encoder/decoder files: each ONNX file folded, the rest copied), or a "
                                 "transformers checkpoint folder (config.json + safetensors shards: folded shard by "
                                 "shard, for the stock class; needs torch)")
    f.add_argument("-o", "--output", type=as_argument(check_output),
                   help="where to write the folded model (default: X.folded.onnx beside X.onnx; for a folder "
                        "DIR, DIR.folded); a model with external data comes back with its data file")
    OPTIONS["mode"].add_to(f)
    f.add_argument("--calibrate", metavar="FILE.npz",
                   help=f"--mode {APPROX_MODE}: the inputs the budget is measured on (its batch's second half, or "
                        "--heldout, only reports)")
    f.add_argument("--budget", type=float, metavar="B",
                   help=f"--mode {APPROX_MODE}: the largest relative output error allowed (0: exact folds only)")
    f.add_argument("--heldout", metavar="FILE.npz", help=f"--mode {APPROX_MODE}: held-out inputs the error is reported on")
    for option in (TARGET, DEVICE, OPTIONS["defer"], OPTIONS["gamma_into_readers"], OPTIONS["rotate"],
                   OPTIONS["gamma_in_float"], OPTIONS["spare_channels"], OPTIONS["online_hadamard"], OPTIONS["seed"],
                   OPTIONS["verify"]):
        option.add_to(f)
    f.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="a transformers checkpoint folder: fold N shards at a time, in threads (default: 2 where "
                        "the machine has 2 cores; each adds about a shard's largest tensor to the memory)")
    f.add_argument("--json", action="store_true",
                   help="print one JSON object (report, verification, output, timings) instead of the table")
    f.add_argument("--inputs", metavar="FILE.npz",
                   help="verify on these inputs (an .npz with one array per model input) instead of made-up ones")
    f.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of a symbolic input dim for the made-up inputs (repeatable)")

    r = sub.add_parser("report", help="print every LayerNorm with its verdict and reason")
    r.add_argument("input", help="the ONNX model to analyze (nothing is written)")
    r.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    OPTIONS["mode"].add_to(r, help=MODE_HELP, choices=PLAN_MODES)
    r.add_argument("--calibrate", metavar="FILE.npz",
                   help="measure each norm's input on these inputs (an .npz, one array per model input): its angle "
                        "to the uniform vector 1 (mean, spread, worst) and |mean|/rms, before and after the fold")
    r.add_argument("--angles", action="store_true",
                   help="the same angles on made-up inputs when there is no --calibrate (they then mean little)")
    r.add_argument("--plot", metavar="FILE.svg|png",
                   help="draw the angles per norm, before and after the fold (needs matplotlib: lnfold[plot])")

    b = sub.add_parser("bench", help="time a model against its folded copy in onnxruntime (CPU)")
    b.add_argument("original", help="the ONNX model before the fold")
    b.add_argument("folded", help="the folded model (`lnfold fold`'s output); it must take the same inputs")
    b.add_argument("--threads", type=as_argument(check_threads, int), default=1,
                   help="onnxruntime intra-op threads for the end-to-end timing (default 1, the steadiest figure; "
                        "0: onnxruntime's default); the profiled norm kernels always run on 1")
    b.add_argument("--seconds", type=as_argument(check_seconds, float), default=8.0,
                   help="the whole command's time budget: profiling and end-to-end rounds stop at it, and the "
                        "rounds it allowed are printed (default 8; a model slower than the budget still runs "
                        "once per variant)")
    b.add_argument("--inputs", metavar="FILE.npz", help="run on these inputs instead of made-up ones")
    b.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of a symbolic input dim for the made-up inputs (repeatable)")

    c = sub.add_parser("check", help="judge any transformed ONNX model against its original: the fold's gate, "
                                     "the error per output, the first shared tensor where they part")
    c.add_argument("original", help="the ONNX model before the transform")
    c.add_argument("other", help="the transformed model (anyone's: a fold, an optimizer's output, an fp16 or "
                                 "quantized copy); it must have the same input and output names")
    c.add_argument("--inputs", metavar="FILE.npz", help="run on these inputs instead of made-up ones")
    c.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of a symbolic input dim for the made-up inputs (repeatable)")
    c.add_argument("--json", action="store_true", help="print one JSON object (verdict, per-output errors, "
                                                       "first divergence) instead of the lines")

    from . import quantize_cli, slice_cli

    quantize_cli.add_parser(sub)
    slice_cli.add_parser(sub)

    d = sub.add_parser("demo", help="fold a small random GPT-2 end to end and time it in onnxruntime")
    d.add_argument("--layers", type=int, default=4, help="transformer blocks of the GPT-2 (default 4)")
    d.add_argument("--hidden", type=int, default=256,
                   help="its width; one attention head per 64 features (default 256)")
    d.add_argument("--keep", metavar="DIR", help="write the original and folded models into DIR")
    d.add_argument("--seconds", type=as_argument(check_seconds, float), default=8.0,
                   help="about how long the timing rounds run (default 8)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line as a Namespace; bare `lnfold` prints the help and a hint, and exits 2."""
    p = _parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help(sys.stderr)
        p.exit(2, f"\n{_HINT}\n")
    return args


def cmd_fold(args) -> int:
    src = Path(args.input)
    if src.is_dir():  # an exporter's folder: every ONNX file in it, one report (folders.py)
        from .folders import fold_checkpoint_folder, fold_folder, is_transformers_checkpoint

        out = Path(args.output) if args.output else None
        if is_transformers_checkpoint(src):  # shard by shard
            return fold_checkpoint_folder(src, out, args)
        return fold_folder(src, out, args, fold_file)
    from .folders import default_output, fold_summary, verification_line

    dst = Path(args.output) if args.output else default_output(src)
    if dst.is_dir():
        raise LnfoldError(f"{dst}: is a directory; give a file name for the output")
    if src.resolve() == dst.resolve() or (src.exists() and dst.exists() and os.path.samefile(src, dst)):
        raise LnfoldError(f"{dst}: output would overwrite the input; choose another path")
    if dst.parent.exists() and not dst.parent.is_dir():
        raise LnfoldError(f"{dst.parent}: not a directory, cannot write {dst.name} into it")
    if not dst.parent.is_dir():
        raise LnfoldError(f"{dst.parent}: output directory does not exist")
    t0 = time.perf_counter()
    result = fold_file(src, dst, args)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"output": str(dst), **fold_summary(result, args, elapsed)}, indent=2))
        return 0
    print(result.report.table())
    print(f"\nlnfold: verification: {verification_line(result, args)}")
    print(f"lnfold: wrote {dst} (target {args.target}) in {elapsed:.2f} s")
    return 0


def fold_file(src: Path, dst: Path, args):
    """Fold the ONNX file `src` into `dst`, its weights in the input's layout (write.data_layout);
    the written files are verified before they are renamed into place."""
    from .progress import reporting

    with reporting(src, json=args.json) as progress:  # a status line on a terminal, erased before the report
        return _fold_file(src, dst, args, progress)


def _fold_file(src: Path, dst: Path, args, progress):
    import onnx

    from .api import fold_approx, fold_file as fold_to_file
    from .inputs import parse_dims
    from .read import load
    from .write import data_layout

    pipeline.stage(progress, f"loading {src}")
    inputs = {src.resolve()}
    t0 = time.perf_counter()
    # big weights stay in the input's data file: read where the fold edits them, copied on save
    model = load(src, data_files=inputs, lazy=True)
    # (a file without external data is not parsed a second time: a second of a 500 MB GPT-2's fold)
    layout = data_layout(onnx.load(str(src), load_external_data=False), src, dst) if inputs != {src.resolve()} \
        else None
    loading = time.perf_counter() - t0
    data_out = dst.parent / (layout.location if layout is not None else dst.name + ".data")
    for out in (dst, data_out):
        if out.resolve() in inputs:
            raise LnfoldError(f"{dst}: writing it would overwrite {out}, which the input model reads; "
                              "choose another path")
    opts = options_from(args)
    if opts.mode == APPROX_MODE or args.budget is not None or args.calibrate:
        if opts.mode != APPROX_MODE:
            raise LnfoldError(f"--calibrate and --budget belong to --mode {APPROX_MODE}")
        result = fold_approx(model, opts, calibration=args.calibrate, budget=args.budget, heldout=args.heldout,
                             target=args.target, device=args.device, progress=progress, output=dst, source=src,
                             layout=layout)
    else:
        result = fold_to_file(src, model, dst, opts, target=args.target, device=args.device, inputs=args.inputs,
                              dims=parse_dims(args.dim), progress=progress, layout=layout)
    result.timings = {"loading": loading, **result.timings}  # (the stages in the order they ran)
    return result


def cmd_report(args) -> int:
    from .api import analyze_model
    from .read import load
    from .validate import no_norm_message

    if args.plot:
        from ..passes.plots import check_path

        check_path(args.plot)  # a bad path is the user's error before any work
    if Path(args.input).is_dir():  # every input `fold` takes: an exporter's folder, a checkpoint
        return _report_folder(Path(args.input), args)
    model = load(args.input, lazy=True)
    report = analyze_model(model, mode=args.mode, calibration=args.calibrate,
                           angles=bool(args.angles or args.plot))
    # a folded model's RMSNorms, or chains that almost are LayerNorms: something to report (exit 0)
    if not report.norms and not report.rms_norms and not report.near_misses:
        e = NothingToFold(no_norm_message(model))
        e.report = report  # (`--json`: printed with the reason)
        raise e
    if args.plot and report.geometry is not None:
        from ..passes.geometry_plot import plot

        plot(report.geometry, args.plot, Path(args.input).stem)
    print(report.to_json(indent=2) if args.json else report.table())
    return 0


def _report_folder(src: Path, args) -> int:
    """`lnfold report DIR`: a transformers checkpoint's plan (the torch frontend, from its structure:
    no weight read), or each ONNX file of an exporter's folder; anything else, the line `fold` says."""
    from .folders import check_onnx_folder, is_transformers_checkpoint

    if args.calibrate or args.angles or args.plot:
        raise LnfoldError(f"{src}: --calibrate, --angles and --plot measure one ONNX file's norms: give the file")
    if is_transformers_checkpoint(src):
        try:
            from ..fx_rewrite.checkpoint import plan_checkpoint, read_checkpoint
        except ImportError as e:
            raise LnfoldError(f"{src}: a transformers checkpoint: reporting on it needs torch and transformers "
                              f"(pip install 'lnfold[torch]' transformers accelerate): {e}") from None
        report = plan_checkpoint(read_checkpoint(src), args.mode).report
        print(report.to_json(indent=2) if args.json else report.table())
        return 0
    from .api import analyze_model
    from .read import load

    reports = {f.relative_to(src).as_posix(): analyze_model(load(f, lazy=True), mode=args.mode)
               for f in check_onnx_folder(src)}
    if args.json:
        print(json.dumps({name: r.to_dict() for name, r in reports.items()}, indent=2))
    else:
        print("\n\n".join(f"{name}:\n{r.table()}" for name, r in reports.items()))
    return 0


def cmd_check(args) -> int:
    """Exit code 0: equivalent (the gate passes); 1: not (the error report printed); 2: bad input."""
    from .check import check_onnx
    from .inputs import parse_dims

    result = check_onnx(args.original, args.other, inputs=args.inputs, dims=parse_dims(args.dim))
    print(json.dumps(result.to_dict(), indent=2) if args.json else "\n".join(result.lines()))
    return result.exit_code


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # NaN/Inf weights fold into NaN/Inf weights (verification compares them as equal): no
        # numpy warnings about them on the command line
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if args.cmd == "fold":
                return cmd_fold(args)
            if args.cmd == "report":
                return cmd_report(args)
            if args.cmd == "quantize":
                from . import quantize_cli

                return quantize_cli.run(args)
            if args.cmd == "slice":
                from . import slice_cli

                return slice_cli.run(args)
            if args.cmd == "check":
                return cmd_check(args)
            if args.cmd == "bench":
                from .bench import run_bench
                from .inputs import parse_dims

                return run_bench(args.original, args.folded, threads=args.threads, seconds=args.seconds,
                                 inputs=args.inputs, dims=parse_dims(args.dim))
        from ..demo import run_demo

        return run_demo(layers=args.layers, hidden=args.hidden, keep=args.keep, seconds=args.seconds)
    except LnfoldError as e:
        if isinstance(e, NothingToFold) and getattr(args, "json", False):  # the reason, and the report if made
            report = getattr(e, "report", None)
            print(json.dumps({"output": None, "written": False, "exit_code": e.exit_code, "reason": str(e),
                              "report": report.to_dict() if report is not None else None}, indent=2))
        print(f"lnfold: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("lnfold: interrupted; nothing written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lnfold report m.onnx | head -1`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # the file system said no (permissions, a full disk): the user's to fix
        where = f"{e.filename}: " if e.filename else ""
        print(f"lnfold: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug of ours: say so in one line, details on request
        if os.environ.get("LNFOLD_DEBUG"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"lnfold: internal error: {type(e).__name__}: {first} (set LNFOLD_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
