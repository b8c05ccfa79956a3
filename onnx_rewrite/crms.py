"""Emit a CRMSNorm compression plan (passes/compress.py) into an ONNX graph: the shapes that spell
d, the CRMSNorm ops (standard ops for every target, benchmarks/RESULTS.md "CRMSNorm":
`z · 1/sqrt((ReduceSumSquare(z) + ReduceSum(z)²)/d + eps)`), the decompression where a reader needs
the d-vector, and biases for readers that had none (the constants are the plan's edits).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..passes.compress import CrmsNorm
from ..passes.edits import compute_new_bias
from ..passes.plan import Plan

from .norms import NormMatch, const_values, dtype_of


def resize_dims(em, plan: Plan) -> None:
    """Each Reshape/Expand that spells d on a narrowed stream gets a shape with the new width there
    (d-1 on a CRMS stream, k on a sliced one: `Plan.resized_dims`)."""
    by_slot: dict[tuple, dict[int, int]] = {}
    for ref, shrink in plan.resized_dims:
        by_slot.setdefault((ref.node, ref.slot), {})[ref.index] = shrink
    for (name, slot), shrinks in by_slot.items():
        node = em.nodes[name]
        shape = node.inputs[slot]
        v = const_values(shape)
        delta = np.zeros([len(v) if v is not None else em.info.shape(shape)[0]], np.int64)
        delta[list(shrinks)] = list(shrinks.values())
        if v is not None:
            node.inputs[slot] = em.const(f"{shape.name}/lnfold_resized", np.array(v, dtype=np.int64).reshape(-1) - delta)
            continue
        out = em.var(f"{shape.name}/lnfold_resized", np.int64)
        em.node("Sub", [shape, em.const(f"{shape.name}/lnfold_shrink", delta)], [out])
        node.inputs[slot] = out


def forget_shapes(em, plan: Plan) -> None:
    """The exporter's recorded shapes say d where the stream is now d-1 (or k): drop the inner ones
    (runtimes infer them again), keeping the graph's inputs and outputs."""
    if not any(cc.compressed for cc in plan.compressions) and not any(r.sliced for r in plan.stream_bases):
        return
    keep = {id(t) for t in list(em.graph.inputs) + list(em.graph.outputs)}
    for t in em.graph.tensors().values():
        if isinstance(t, gs.Variable) and id(t) not in keep:
            t.shape = None


def add_new_biases(plan: Plan, tensor, place) -> None:
    """`+ W β` after each linear reader that had no bias. `tensor(name)`: the original constant a plan
    name stands for; `place(view node)`: (the emitter of the graph that holds the node, the node)."""
    original = lambda name: const_values(tensor(name))  # noqa: E731
    for nb in plan.new_biases:
        em, node = place(plan.origin(nb.node))
        y = node.outputs[0]
        pre = em.var(f"{y.name}/lnfold_nobias", y.dtype)
        node.outputs[0] = pre
        em.node("Add", [pre, em.const(f"{node.name}/lnfold_bias", compute_new_bias(nb, original))], [y])


def swap(em, m: NormMatch, crms: CrmsNorm) -> None:
    """The LayerNorm `m` becomes CRMSNorm over its compressed input; its compressed readers read
    the unscaled result, and its own output (if still read) is γ ⊙ concat(n, -Σn) + β."""
    x, skip, bias = em.detach(m)
    axis = m.axis
    if skip is not None:
        x = em.residual_sum(x, skip, bias, m.sum_output, m.name)
    dt = np.dtype(dtype_of(x, m.gamma, m.nodes, em.dtypes))  # x.dtype is None where no value_info was written
    low = dt.itemsize < 4
    sd = np.float32 if low else dt
    xs = em.to_fp32(x, m.name) if low else x
    v = {k: em.var(f"{m.name}/lnfold_crms_{k}", sd) for k in ("ss", "s", "s2", "t", "ms", "mse", "rms", "inv")}
    em.reduce("ReduceSumSquare", xs, [axis], v["ss"])
    em.reduce("ReduceSum", xs, [axis], v["s"])
    em.node("Mul", [v["s"], v["s"]], [v["s2"]])
    em.node("Add", [v["ss"], v["s2"]], [v["t"]])
    em.node("Div", [v["t"], em.const(f"{m.name}/lnfold_d", np.array(crms.width, sd))], [v["ms"]])
    em.node("Add", [v["ms"], em.const(f"{m.name}/lnfold_eps", np.array(crms.epsilon, sd))], [v["mse"]])
    em.node("Sqrt", [v["mse"]], [v["rms"]])
    em.node("Reciprocal", [v["rms"]], [v["inv"]])
    n = em.var(f"{m.name}/lnfold_crms", dt)
    if low:
        n32 = em.var(f"{m.name}/lnfold_crms32", np.float32)
        em.node("Mul", [xs, v["inv"]], [n32])
        em.cast(n32, n, dt)
    else:
        em.node("Mul", [x, v["inv"]], [n])
    for reader, i in crms.compressed_readers:
        em.nodes[reader].inputs[i] = n
    if crms.decompress:
        _decompress(em, m, n, axis, dt)


def _decompress(em, m: NormMatch, n, axis: int, dt) -> None:
    rank = em.info.rank(m.x) or (axis + 1)
    steps = []
    for what, t, op in (("gamma", m.gamma, "Mul"), ("beta", m.beta, "Add")):
        if t is not None:
            shape = [1] * rank
            shape[axis] = -1
            steps.append((op, em.const(f"{m.name}/lnfold_{what}", np.asarray(const_values(t)).reshape(shape))))
    s, neg = (em.var(f"{m.name}/lnfold_dec_{k}", dt) for k in ("sum", "last"))
    em.reduce("ReduceSum", n, [axis], s)
    em.node("Neg", [s], [neg])
    # the norm's own output tensor keeps its name (a graph output, its other readers)
    y = m.output if not steps else em.var(f"{m.name}/lnfold_dec_full", dt)
    em.node("Concat", [n, neg], [y], axis=axis)
    for k, (op, c) in enumerate(steps):
        out = m.output if k == len(steps) - 1 else em.var(f"{m.name}/lnfold_dec_{op}", dt)
        em.node(op, [y, c], [out])
        y = out
