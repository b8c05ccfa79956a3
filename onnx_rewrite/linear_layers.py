"""The linear layers of an ONNX graph as onnxruntime's quantizers want to see them.

onnxruntime's weight-only int4 quantizer (MatMulNBitsQuantizer) and its dynamic quantizer
(quantize_dynamic: MatMulInteger) take only MatMul nodes with a constant B: a Gemm (what torch's
exporter makes of GPT-2's Conv1D, `addmm`) stays float. `gemm_to_matmul` rewrites each Gemm whose
weight is an initializer, with alpha = beta = 1 and no transposed A, into MatMul (+ Add of C):
the same products and the same bias, so the same function (a transposed B is stored transposed;
the rounding is at most the summation order's), checked with the fold by its float64 gate
(quantize.check_exact_steps). Other Gemms are left as they are and counted.

`linear_layers` names the MatMul nodes with a constant 2-D float weight: what lnfold asks the
quantizers to quantize (attention's activation x activation MatMuls and embedding tables stay
float; see onnx_rewrite/quantize.py). Not among them: `basis_changes`, the MatMuls the fold itself
inserted to take a rotated stream out of (a readout's `· Qᵀ·diag γ`) or into (the projection after
a recentered start) its rotated basis. They are no layer of the model, and a readout's error lands
on the output unfiltered: quantized with the layers, they doubled the rotated error of the zoo's
Whisper encoder (benchmarks/RESULTS.md). The emitter names them (emit.BASIS_CHANGE).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .emit import BASIS_CHANGE

_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node of the main graph a unique name (the quantizers select nodes by name)."""
    seen: set[str] = set()
    for k, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{k}" if not node.name else f"{node.name}_{k}"
        seen.add(node.name)


def gemm_to_matmul(model: onnx.ModelProto) -> tuple[int, list[str]]:
    """Rewrite, in place, the main graph's Gemms with an initializer weight into MatMul (+ Add).
    Returns (how many were rewritten, [why each other Gemm was kept])."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    uses = Counter(i for n in g.node for i in n.input)
    rewritten, kept, nodes = 0, [], []
    for node in g.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        b = node.input[1]
        c = node.input[2] if len(node.input) > 2 and node.input[2] else None
        why = ("its weight is not an initializer" if b not in inits else
               "alpha is not 1" if a.get("alpha", 1.0) != 1.0 else
               "beta is not 1" if c is not None and a.get("beta", 1.0) != 1.0 else
               "A is transposed" if a.get("transA", 0) else None)
        if why:
            kept.append(f"{node.name}: {why}")
            nodes.append(node)
            continue
        if a.get("transB", 0):  # MatMul takes B as [K, N]: store the transposed weight
            w = numpy_helper.to_array(inits[b]).T.copy()
            new = numpy_helper.from_array(w, f"{b}__transposed")
            if uses[b] == 1:
                g.initializer.remove(inits[b])
            g.initializer.append(new)
            b = new.name
        out = node.output[0]
        mm_out = f"{out}__matmul" if c is not None else out
        nodes.append(helper.make_node("MatMul", [node.input[0], b], [mm_out], name=f"{node.name}__matmul"))
        if c is not None:
            nodes.append(helper.make_node("Add", [mm_out, c], [out], name=f"{node.name}__bias"))
        rewritten += 1
    if rewritten:
        del g.node[:]
        g.node.extend(nodes)
    return rewritten, kept


def linear_layers(model: onnx.ModelProto, *, with_basis_changes: bool = False) -> list[str]:
    """Names of the main graph's MatMul nodes whose B is a 2-D float initializer, but for the
    fold's `basis_changes` (`with_basis_changes`: those too)."""
    inits = {t.name: t for t in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2
            and n.input[1] in inits and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type in _FLOAT
            and (with_basis_changes or not is_basis_change(n))]


def is_basis_change(node: onnx.NodeProto) -> bool:
    return node.op_type == "MatMul" and node.name.startswith(BASIS_CHANGE)


def basis_changes(model: onnx.ModelProto) -> dict[str, int]:
    """The MatMuls the fold inserted to change a stream's basis (emit.BASIS_CHANGE): node name ->
    its constant matrix's parameter count."""
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    return {n.name: sum(sizes.get(i, 0) for i in n.input) for n in model.graph.node if is_basis_change(n)}
