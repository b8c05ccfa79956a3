"""Emit a deferred norm in ONNX (passes/defer.py decides which): no normalized tensor is written.

    r = Reciprocal(Sqrt(ReduceSumSquare(x) / d + eps))        per row, [..., 1]
    reader: MatMul(x, W·diag γ) -> Mul r -> Add (W β + b)      the row scale before the bias

The γ-scaled weights are the plan's constant edits; here the readers read the stream itself and
each product gets its row scale. ReduceSumSquare reads x once without writing x² (a d-wide tensor:
the very pass this emission removes). fp16/bf16 statistics are computed in fp32.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs

from ..passes.defer import Deferral

from .norms import NormMatch, dtype_of, given, replace_input


def emit(em, m: NormMatch, d: Deferral, biases: dict) -> None:
    """`em` is the onnx_rewrite.emit.Emitter applying the plan."""
    dtype = np.dtype(dtype_of(m.x, m.gamma, m.nodes, em.dtypes))
    x, skip, sk_bias = em.detach(m)
    if skip is not None:  # the fused residual Add stays: its sum is the stream
        x = em.residual_sum(x, skip, sk_bias, m.sum_output, m.name)
    shape = em.info.shape(m.x)  # (the stream as matched: recenters and residual sums keep its shape)
    rank = len(shape)
    r = _row_scale(em, x, dtype, shape, d.axis, d.epsilon, m.name)
    flat: Optional[gs.Tensor] = None
    for reader in list(m.output.outputs):  # layout ops and linear layers (checked by the plan)
        replace_input(reader, m.output, x)
    for rd in d.readers:
        scale = r
        if rd.rank != rank:  # behind a reshape that flattened the rows
            if flat is None:
                flat = em.var(f"{m.name}/lnfold_rowscale_2d", r.dtype)
                em.node("Reshape", [r, em.const("lnfold/rows", np.array([-1, 1], np.int64))], [flat])
            scale = flat
        _scale_product(em, em.nodes[rd.node], scale, biases.get((d.norm, rd.node)), rd)


def _row_scale(em, x: gs.Tensor, dt: np.dtype, shape, axis: int, eps: float, name: str) -> gs.Tensor:
    low = dt.itemsize < 4
    sd = np.float32 if low else dt
    xs = em.to_fp32(x, name) if low else x
    width = shape[axis] if shape is not None else None
    ms = em.var(f"{name}/lnfold_ms", sd)
    if isinstance(width, int):
        ss = em.var(f"{name}/lnfold_sumsq", sd)
        em.reduce("ReduceSumSquare", xs, [axis], ss)
        em.node("Div", [ss, em.const(f"{name}/lnfold_d", np.array(width, sd))], [ms])
    else:
        sq = em.var(f"{name}/lnfold_sq", sd)
        em.square(xs, sq)
        em.reduce("ReduceMean", sq, [axis], ms)
    mse, rms, inv = (em.var(f"{name}/lnfold_{k}", sd) for k in ("mse", "rms", "rowscale"))
    em.node("Add", [ms, em.const(f"{name}/lnfold_eps", np.array(eps, sd))], [mse])
    em.node("Sqrt", [mse], [rms])
    em.node("Reciprocal", [rms], [inv])
    if not low:
        return inv
    out = em.var(f"{name}/lnfold_rowscale_{dt.name}", dt)
    em.cast(inv, out, dt)
    return out


def _scale_product(em, node: gs.Node, scale: gs.Tensor, new_bias: Optional[np.ndarray], rd) -> None:
    """product -> Mul(row scale) -> bias, for a MatMul (its bias Add follows) or a Gemm."""
    out = node.outputs[0]
    prod = em.var(f"{node.name}/lnfold_product", out.dtype)
    gemm_c = None
    if node.op == "Gemm" and given(node.inputs, 2) is not None:
        gemm_c = node.inputs[2]
        del node.inputs[2]  # the bias goes after the row scale
    node.outputs[0] = prod
    bias_after = node.op == "MatMul" and rd.bias is not None  # its own Add follows and reads `out`
    add_here = gemm_c is not None or (new_bias is not None and not bias_after)
    scaled = em.var(f"{node.name}/lnfold_scaled", out.dtype) if add_here else out
    em.node("Mul", [prod, scale], [scaled])
    if add_here:
        c = gemm_c if new_bias is None else em.const(f"{node.name}/lnfold_bias", new_bias)
        em.node("Add", [scaled, c], [out])
    elif new_bias is not None:  # W β + b into the MatMul's own bias Add
        em.nodes[rd.bias.user].inputs[rd.bias.user_input] = em.const(f"{node.name}/lnfold_bias", new_bias)
