"""Why rotation hurts weight-only int4 on DINOv2 (issue 33): each hypothesis measured.

    python -m benchmarks.realmodels_int4 [--cache DIR] [--model dinov2|minilm] [--blocks 32 64 128]
        [--seeds 3] [--algos hqq gptq] [--sides]

On the real models of benchmarks/realmodels.py (DINOv2-small: 8 held-out images; MiniLM: 32
sentences; the error is the worst output's relative RMS error against the fp32 original, the
model's first task metric beside it):

1. the fold's basis changes (the un-rotation `· Qᵀ·diag γ` after the final norm; the projection
   after a recentered start) quantized with the real layers ("before", as lnfold did until
   2026-11-27) or kept float ("after", lnfold's default since: linear_layers.basis_changes),
   round-to-nearest, for no rotation, hadamard and orthogonal (--seeds seeds);
2. MatMulNBits blocking along K: the same at block 32 and 128;
3. the weight quantizer: round-to-nearest (lnfold's default, symmetric), HQQ and GPTQ
   (onnxruntime's MatMulNBitsQuantizer algo_config; GPTQ calibrated on the first --gptq-images
   calibration images), basis changes float;
4. γ into the readers alone, without rotation (the step every rotation needs);
5. (--sides, DINOv2) which side of the stream carries the loss: only the norms' readers
   (query/key/value, fc1) quantized, or only the stream's writers (attention output dense, fc2),
   fold vs hadamard;
6. (--sides, DINOv2) a model of the weight error that needs no quantizer: for every linear layer that reads a norm,
   with the norm's output taken as unit-variance and uncorrelated, the output error energy of
   round-to-nearest int4 is Σ_k a_k² ‖W_k − Ŵ_k‖² (a_k: channel k's activation scale). γ in the
   norm: a_k = γ_k, weights W; γ moved: a_k = 1, weights diag(γ)·W; rotated: a_k = 1, Qᵀ·diag(γ)·W.
   Printed relative to the first, summed over the layers.
7. (--writer-model, DINOv2) the same for the stream's writers (writer_error_model): their int4 error
   energy rotated / unrotated, per stream channel, weighted by what reads that channel later.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from lnfold.onnx_rewrite.linear_layers import float_parameters
from lnfold.onnx_rewrite import calibration as calibration_io
from lnfold.onnx_rewrite import quantize as q
from lnfold.passes import quantize as pq
from lnfold.passes import metric
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


@dataclass
class Norm:
    """A decomposed LayerNorm of the original graph (... Div -> Mul(γ) -> Add(β)): its place in the
    node order, γ, and the weights of the MatMuls that read its output."""

    position: int
    gamma: np.ndarray
    readers: list


def _array(t) -> np.ndarray:
    return numpy_helper.to_array(t).astype(np.float64)


def norms(model: onnx.ModelProto) -> list[Norm]:
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    consumers: dict = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out = []
    for k, add in enumerate(g.node):
        if add.op_type != "Add" or not add.name.endswith("/Add_1") or "norm" not in add.name:
            continue
        mul = producers.get(add.input[0])
        if mul is None or mul.op_type != "Mul" or mul.input[1] not in inits:
            continue
        readers = [_array(inits[r.input[1]]) for r in consumers.get(add.output[0], [])
                   if r.op_type == "MatMul" and r.input[1] in inits]
        out.append(Norm(k, _array(inits[mul.input[1]]), readers))
    return out


def weight_error_model(model: onnx.ModelProto, block: int, seed: int = 0) -> dict:
    """Σ over the linear layers that read a LayerNorm (through nothing but the norm's affine) of
    the three error energies (see the module doc), as ratios to 'γ in the norm'."""
    totals = {"γ in the norm": 0.0, "γ moved": 0.0, "hadamard": 0.0}
    layers, spreads = 0, []
    for norm in norms(model):
        gamma = norm.gamma
        spreads.append(np.abs(gamma).max() / max(np.abs(gamma).min(), 1e-12))
        q_mat = orthogonal.matrix("hadamard", gamma.size, seed)
        for w in norm.readers:
            layers += 1
            totals["γ in the norm"] += float(((gamma[:, None] * (w - rtn_int4(w, block))) ** 2).sum())
            wg = gamma[:, None] * w
            totals["γ moved"] += float(((wg - rtn_int4(wg, block)) ** 2).sum())
            wr = q_mat.T @ wg
            totals["hadamard"] += float(((wr - rtn_int4(wr, block)) ** 2).sum())
    base = totals["γ in the norm"]
    return {"layers": layers, "gamma max/min": (float(np.median(spreads)), float(max(spreads))) if spreads else None,
            **{k: v / base for k, v in totals.items()}}


WRITERS = ("/output/dense/", "/fc2/")  # DINOv2's layers that write the stream (attention output, fc2)


def writer_error_model(original: onnx.ModelProto, fold: onnx.ModelProto, rotated: onnx.ModelProto,
                       block: int) -> dict:
    """The stream writers' round-to-nearest int4 error, unrotated (the fold's weights W) and rotated
    (W·Q, its error taken back by Qᵀ to the stream's own channels), as the ratio rotated / unrotated
    of its energy weighted three ways per stream channel n: not at all (Q orthogonal: ~1); by the
    final norm's γ_n² (what the final-norm features see of a stream error); by Σ over the later norms
    of γ_n²·‖row n of their readers' weights‖² (what the later layers see). Q is recovered from the
    two models' writer weights (least squares)."""
    def writers(model):
        inits = {t.name: t for t in model.graph.initializer}
        return {n.name: _array(inits[n.input[1]]) for n in model.graph.node if n.op_type == "MatMul"
                and n.input[1] in inits and any(w in n.name for w in WRITERS)}

    position = {n.name: k for k, n in enumerate(original.graph.node)}
    plain, turned = writers(fold), writers(rotated)
    names = sorted(plain, key=position.__getitem__)
    q_mat = np.linalg.lstsq(np.concatenate([plain[n] for n in names]), np.concatenate([turned[n] for n in names]),
                            rcond=None)[0]
    every = norms(original)
    final = max(every, key=lambda m: m.position)
    totals = {"unweighted": np.zeros(2), "final γ²": np.zeros(2), "later readers": np.zeros(2)}
    for name in names:
        w, wq = plain[name], turned[name]
        per_channel = [((w - rtn_int4(w, block)) ** 2).sum(0), (((wq - rtn_int4(wq, block)) @ q_mat.T) ** 2).sum(0)]
        later = [m for m in every if m.position > position[name] and m.readers]
        weights = {"unweighted": 1.0, "final γ²": final.gamma ** 2,
                   "later readers": sum(m.gamma ** 2 * sum((w ** 2).sum(1) for w in m.readers) for m in later)}
        for key, s in weights.items():
            totals[key] += [float((e * s).sum()) for e in per_channel]
    return {"writers": len(names), **{k: v[1] / v[0] for k, v in totals.items()}}


def nbits(prepared: onnx.ModelProto, block: int, algo: str, calibration: dict, keep_float=(),
          quantize_basis_changes: bool = False) -> onnx.ModelProto:
    """onnxruntime's MatMulNBitsQuantizer on the linear layers but `keep_float`, with the algorithm
    asked for; the fold's basis changes quantized only with `quantize_basis_changes`."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        GPTQWeightOnlyQuantConfig, HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer)

    nodes = [n for n in q.linear_layers(prepared, with_basis_changes=quantize_basis_changes) if n not in keep_float]
    others = [n.name for n in prepared.graph.node if n.op_type == "MatMul" and n.name not in set(nodes)]
    config = None
    if algo == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=block, bits=4)
    elif algo == "gptq":
        config = GPTQWeightOnlyQuantConfig(calibration_data_reader=q._calibration_reader(q.Rows(calibration, None)),
                                           block_size=block)
    with q._quiet_quantizers():
        quantizer = MatMulNBitsQuantizer(copy.deepcopy(prepared), bits=4, block_size=block, is_symmetric=True,
                                         nodes_to_include=nodes, nodes_to_exclude=others, algo_config=config)
        quantizer.process()
    return quantizer.model.model


SIDES = {"readers (query, key, value, fc1)": ("/query/", "/key/", "/value/", "/fc1/"),
         "writers (attention output, fc2)": ("/output/dense/", "/fc2/")}


def variants(seeds: int) -> dict:
    """label -> quantize.prepare options: no rotation (as given, the fold, γ moved) and each rotation."""
    out = {"ORT alone": dict(fold=False), "fold": dict(), "γ→readers alone": dict(gamma_into_readers=True),
           "hadamard": dict(rotate="hadamard")}
    return out | {f"orthogonal s{k}": dict(rotate="orthogonal", seed=k) for k in range(seeds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache")
    p.add_argument("--model", default="dinov2", choices=list(realmodels.LOADERS))
    p.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--seeds", type=int, default=3, help="orthogonal rotations: seeds 0 .. N-1 (default 3)")
    p.add_argument("--algos", nargs="*", default=["hqq", "gptq"], choices=["hqq", "gptq"],
                   help="onnxruntime's other weight quantizers to measure (each: minutes per model on 2 cores)")
    p.add_argument("--only-algos", action="store_true", help="skip the round-to-nearest tables")
    p.add_argument("--algo-variants", nargs="+", default=["fold", "hadamard"],
                   help="the variants HQQ / GPTQ quantize (default: fold hadamard)")
    p.add_argument("--sides", action="store_true", help="DINOv2: the one-side and weight-error-model tables")
    p.add_argument("--writer-model", action="store_true", help="DINOv2: the writer-error model table (7)")
    p.add_argument("--gptq-images", type=int, default=16, help="calibration rows GPTQ sees (default 16)")
    args = p.parse_args(argv)
    t0 = time.time()
    rm = realmodels.LOADERS[args.model](realmodels.cache_dir(args.cache))
    rows = q.Rows(rm.heldout, None)
    reference = calibration_io.named_outputs(rm.model, rows.runs())
    preps = {label: q.prepare(rm.model, verify=False, **opts) for label, opts in variants(args.seeds).items()}
    first = rm.columns[0]
    print(f"{rm.name}, int4 weight-only; worst output's relative RMS error on {rows.count} held-out rows "
          f"({first} in brackets); `python -m benchmarks.realmodels_int4 "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    for label, prep in preps.items():
        kept = q.basis_changes(prep.model)
        if kept:
            print(f"- {label}: {len(kept)} basis change(s) ({sum(kept.values())} parameters, "
                  f"{sum(kept.values()) / float_parameters(prep.model):.2%} of the model's)")

    def cell(prep, block, algo, keep_float=(), quantize_basis_changes=False) -> str:
        quantized = nbits(prep.model, block, algo, rm.calibration, keep_float, quantize_basis_changes)
        got = calibration_io.named_outputs(quantized, rows.runs())[1]
        worst = metric.worst(metric.compare_outputs(reference[1], got))
        return f"{worst:.4f} ({rm.metric(reference[1], got)[first]:.4f})"

    print("\n| block | quantizer | variant | basis changes quantized (before) | basis changes float (after) |")
    print("| --- | --- | --- | --- | --- |")
    for block in ([] if args.only_algos else args.blocks):  # round-to-nearest, every variant, before / after
        for label, prep in preps.items():
            after = cell(prep, block, "rtn")
            before = cell(prep, block, "rtn", quantize_basis_changes=True) if q.basis_changes(prep.model) else "(none)"
            print(f"| {block} | rtn | {label} | {before} | {after} |", flush=True)
    if args.sides:
        sides(preps, args.blocks, cell, rm.model)
    if args.writer_model:
        print("\nWriter-error model (no quantizer; rotated / unrotated error energy of the stream's writers, "
              "weighted per stream channel):\n")
        print("| block | rotation | writers | unweighted | by the final norm's γ² | by the later norms' γ²·‖reader rows‖² |")
        print("| --- | --- | --- | --- | --- | --- |")
        for block in args.blocks:
            for label in [v for v in preps if preps[v].fold and pq.rotated_streams(preps[v].fold)]:
                w = writer_error_model(rm.model, preps["fold"].model, preps[label].model, block)
                print(f"| {block} | {label} | {w['writers']} | {w['unweighted']:.2f} | {w['final γ²']:.2f} | "
                      f"{w['later readers']:.2f} |", flush=True)
    print(f"\nonnxruntime's other weight quantizers (block {args.blocks[0]}, basis changes float):\n")
    print("| quantizer | " + " | ".join(args.algo_variants) + " |")
    print("| --- | " + " | ".join("---" for _ in args.algo_variants) + " |")
    rm.calibration = {k: v[:args.gptq_images] for k, v in rm.calibration.items()}
    for algo in args.algos:
        t1 = time.time()
        cells = [cell(preps[label], args.blocks[0], algo) for label in args.algo_variants]
        print(f"| {algo} | " + " | ".join(cells) + f" | ({time.time() - t1:.0f} s)", flush=True)
    print(f"\n(wall time {time.time() - t0:.0f} s)")
    return 0


def sides(preps: dict, blocks: list, cell, model: onnx.ModelProto) -> None:
    """DINOv2's one-side table (5) and the weight-error model (6)."""
    print("\nOne side of the stream quantized (round-to-nearest), the other float:\n")
    print("| block | layers quantized | fold | hadamard |")
    print("| --- | --- | --- | --- |")
    for block in blocks:
        for side, pattern in SIDES.items():
            cells = []
            for label in ("fold", "hadamard"):
                keep_float = [n for n in q.linear_layers(preps[label].model) if not any(p in n for p in pattern)]
                cells.append(cell(preps[label], block, "rtn", keep_float))
            print(f"| {block} | {side} | " + " | ".join(cells) + " |", flush=True)
    print("\nWeight-error model (no quantizer; ratio to 'γ in the norm', the norms' readers only):\n")
    print("| block | layers | γ max/min (median, max over norms) | γ in the norm | γ moved | hadamard |")
    print("| --- | --- | --- | --- | --- | --- |")
    for block in blocks:
        w = weight_error_model(model, block)
        print(f"| {block} | {w['layers']} | {w['gamma max/min'][0]:.0f}, {w['gamma max/min'][1]:.0f} | 1 | "
              f"{w['γ moved']:.2f} | {w['hadamard']:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
