"""Why rotation hurts weight-only int4 on DINOv2 (issue 33): each hypothesis measured.

    python -m benchmarks.realmodels_int4 [--cache DIR] [--blocks 32 128]

On the DINOv2-small of benchmarks/realmodels.py (8 held-out images; the error is the worst
output's relative RMS error, saliency map or final-norm features, against the fp32 original):

1. the un-rotation MatMul (`· Qᵀ·diag γ` after the final norm) quantized with the real layers:
   the rotated model quantized with that node excluded;
2. MatMulNBits blocking along K: the same at block 32 and 128;
3. the weight quantizer: round-to-nearest (lnfold's default, symmetric), HQQ and GPTQ
   (onnxruntime's MatMulNBitsQuantizer algo_config; GPTQ calibrated on the first --gptq-images
   calibration images);
4. γ into the readers alone, without rotation (the step every rotation needs);
5. which side of the stream carries the loss: only the norms' readers (query/key/value, fc1)
   quantized, or only the stream's writers (attention output dense, fc2), fold vs hadamard;
6. a model of the weight error that needs no quantizer: for every linear layer that reads a norm,
   with the norm's output taken as unit-variance and uncorrelated, the output error energy of
   round-to-nearest int4 is Σ_k a_k² ‖W_k − Ŵ_k‖² (a_k: channel k's activation scale). γ in the
   norm: a_k = γ_k, weights W; γ moved: a_k = 1, weights diag(γ)·W; rotated: a_k = 1, Qᵀ·diag(γ)·W.
   Printed relative to the first, summed over the layers.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnx
from onnx import numpy_helper

from lnfold.onnx_rewrite import quantize as q
from lnfold.passes import orthogonal

from . import realmodels


def rtn_int4(w: np.ndarray, block: int) -> np.ndarray:
    """Symmetric round-to-nearest int4 of w [K, N], blocks of `block` along K (MatMulNBits' layout)."""
    k, n = w.shape
    pad = (-k) % block
    b = np.pad(w, ((0, pad), (0, 0))).reshape(-1, block, n)
    scale = np.abs(b).max(1, keepdims=True) / 7.0
    scale[scale == 0] = 1.0
    return (np.clip(np.round(b / scale), -8, 7) * scale).reshape(-1, n)[:k]


def weight_error_model(model: onnx.ModelProto, block: int, seed: int = 0) -> dict:
    """Σ over the linear layers that read a LayerNorm (through nothing but the norm's affine) of
    the three error energies (see the module doc), as ratios to 'γ in the norm'."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    consumers: dict = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    totals = {"γ in the norm": 0.0, "γ moved": 0.0, "hadamard": 0.0}
    layers, spreads = 0, []
    for add in g.node:  # decomposed LayerNorm: ... Div -> Mul(γ) -> Add(β) -> MatMul readers
        if add.op_type != "Add" or not add.name.endswith("/Add_1") or "norm" not in add.name:
            continue
        mul = producers.get(add.input[0])
        if mul is None or mul.op_type != "Mul" or mul.input[1] not in inits:
            continue
        gamma = numpy_helper.to_array(inits[mul.input[1]]).astype(np.float64)
        spreads.append(np.abs(gamma).max() / max(np.abs(gamma).min(), 1e-12))
        q_mat = orthogonal.matrix("hadamard", gamma.size, seed)
        for r in consumers.get(add.output[0], []):
            if r.op_type != "MatMul" or r.input[1] not in inits:
                continue
            w = numpy_helper.to_array(inits[r.input[1]]).astype(np.float64)
            layers += 1
            totals["γ in the norm"] += float(((gamma[:, None] * (w - rtn_int4(w, block))) ** 2).sum())
            wg = gamma[:, None] * w
            totals["γ moved"] += float(((wg - rtn_int4(wg, block)) ** 2).sum())
            wr = q_mat.T @ wg
            totals["hadamard"] += float(((wr - rtn_int4(wr, block)) ** 2).sum())
    base = totals["γ in the norm"]
    return {"layers": layers, "gamma max/min": (float(np.median(spreads)), float(max(spreads))) if spreads else None,
            **{k: v / base for k, v in totals.items()}}


def nbits(prepared: onnx.ModelProto, block: int, algo: str, calibration: dict, exclude=()) -> onnx.ModelProto:
    """onnxruntime's MatMulNBitsQuantizer on the linear layers, with the algorithm asked for."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        GPTQWeightOnlyQuantConfig, HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer)

    nodes = [n for n in q.linear_layers(prepared) if n not in exclude]
    config = None
    if algo == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=block, bits=4)
    elif algo == "gptq":
        config = GPTQWeightOnlyQuantConfig(calibration_data_reader=q._calibration_reader(q.Rows(calibration, None)),
                                           block_size=block)
    with q._quiet_quantizers():
        quantizer = MatMulNBitsQuantizer(q._copy(prepared), bits=4, block_size=block, is_symmetric=True,
                                         nodes_to_include=nodes, nodes_to_exclude=list(exclude), algo_config=config)
        quantizer.process()
    return quantizer.model.model


SIDES = {"readers (query, key, value, fc1)": ("/query/", "/key/", "/value/", "/fc1/"),
         "writers (attention output, fc2)": ("/output/dense/", "/fc2/")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache")
    p.add_argument("--blocks", nargs="+", type=int, default=[32, 128])
    p.add_argument("--algos", nargs="+", default=["hqq", "gptq"], choices=["hqq", "gptq"],
                   help="onnxruntime's other weight quantizers to measure (each: minutes per model on 2 cores)")
    p.add_argument("--only-algos", action="store_true", help="skip the round-to-nearest tables")
    p.add_argument("--gptq-images", type=int, default=16, help="calibration images GPTQ sees (default 16)")
    args = p.parse_args(argv)
    t0 = time.time()
    rm = realmodels.dinov2(realmodels.cache_dir(args.cache))
    rows = q.Rows(rm.heldout, None)
    reference = q._outputs(rm.model, rows)
    preps = {"ORT alone": q.prepare(rm.model, fold=False, verify=False),
             "fold": q.prepare(rm.model, verify=False),
             "γ→readers alone": q.prepare(rm.model, gamma_into_readers=True, verify=False),
             "hadamard": q.prepare(rm.model, rotate="hadamard", verify=False)}
    readouts = [n.name for n in preps["hadamard"].model.graph.node
                if n.op_type == "MatMul" and any(i.endswith("lnfold_unrotate") for i in n.input)]
    print(f"DINOv2-small, int4 weight-only; worst output's relative RMS error on {len(rm.heldout['input_image'])} "
          f"held-out images (saliency corr in brackets); `python -m benchmarks.realmodels_int4 "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    print("| block | quantizer | " + " | ".join(preps) + " | hadamard, un-rotation MatMul kept float |")
    print("| --- | --- | " + " | ".join("---" for _ in preps) + " | --- |")

    def cell(prep, block, algo, keep_float=()) -> str:
        quantized = nbits(prep.model, block, algo, rm.calibration, keep_float)
        got = q._outputs(quantized, rows)[1]
        worst = max(q.rel_rms(a, b) for a, b in zip(reference[1], got))
        return f"{worst:.4f} ({realmodels.dinov2_metric(reference[1], got)['saliency corr']:.4f})"

    for block in ([] if args.only_algos else args.blocks):  # round-to-nearest, every variant
        cells = [cell(prep, block, "rtn") for prep in preps.values()] + [cell(preps["hadamard"], block, "rtn", readouts)]
        print(f"| {block} | rtn | " + " | ".join(cells) + " |", flush=True)
    print("\nOne side of the stream quantized (round-to-nearest), the other float:\n")
    print("| block | layers quantized | fold | hadamard |")
    print("| --- | --- | --- | --- |")
    for block in ([] if args.only_algos else args.blocks):
        for side, pattern in SIDES.items():
            cells = []
            for label in ("fold", "hadamard"):
                model = preps[label].model
                keep_float = [n for n in q.linear_layers(model) if not any(p in n for p in pattern)]
                cells.append(cell(preps[label], block, "rtn", keep_float))
            print(f"| {block} | {side} | " + " | ".join(cells) + " |", flush=True)
    print("\nWeight-error model (no quantizer; ratio to 'γ in the norm', the norms' readers only):\n")
    print("| block | layers | γ max/min (median, max over norms) | γ in the norm | γ moved | hadamard |")
    print("| --- | --- | --- | --- | --- | --- |")
    for block in ([] if args.only_algos else args.blocks):
        w = weight_error_model(rm.model, block)
        print(f"| {block} | {w['layers']} | {w['gamma max/min'][0]:.0f}, {w['gamma max/min'][1]:.0f} | 1 | "
              f"{w['γ moved']:.2f} | {w['hadamard']:.2f} |", flush=True)
    print(f"\nonnxruntime's other weight quantizers (block {args.blocks[0]}):\n")
    print("| quantizer | fold | hadamard |")
    print("| --- | --- | --- |")
    rm.calibration = {k: v[:args.gptq_images] for k, v in rm.calibration.items()}
    for algo in args.algos:
        t1 = time.time()
        cells = [cell(preps[label], args.blocks[0], algo) for label in ("fold", "hadamard")]
        print(f"| {algo} | " + " | ".join(cells) + f" | ({time.time() - t1:.0f} s)", flush=True)
    print(f"\n(wall time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
