"""Random ops in verification: the same draws in the original, the folded model and the float64 copy.

A random node without a seed (a VITS voice's noise) draws new numbers on every run, so a correct
fold would differ from its original by the noise. Verification runs copies with a seed, derived
from the node's name, pinned on every random node (the written model keeps them as they were). The
float64 copy runs each random node in its original type between Casts: onnxruntime's double draws
are other numbers than its float draws with the same seed.
"""
from __future__ import annotations

import zlib
from typing import Optional

import onnx
from onnx import helper

RANDOM_OPS = frozenset(("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                        "Bernoulli"))
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def is_random(node: onnx.NodeProto) -> bool:
    """Does `node` draw random numbers (Dropout: only given a training_mode input)?"""
    return node.domain in ("", "ai.onnx") and (
        node.op_type in RANDOM_OPS or (node.op_type == "Dropout" and len(node.input) > 2 and bool(node.input[2])))


def random_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if is_random(n)]


def runs_in_own_dtype(node: onnx.NodeProto) -> bool:
    """Does a float64 copy run `node` in its original float type? Random nodes (above), and
    DequantizeLinear, whose scale onnxruntime takes in float types only (a weight-only int8 file)."""
    return is_random(node) or (node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"))


def pinned(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with a seed on every random node that has none (unchanged seeds kept)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in random_nodes(out):
        if not any(a.name == "seed" for a in n.attribute):  # Dropout's seed is an int, the others' a float
            seed = float(zlib.crc32(n.name.encode()) % (1 << 24))  # a float attribute: exact below 2^24
            n.attribute.append(helper.make_attribute("seed", int(seed) if n.op_type == "Dropout" else seed))
    return out


def describe(model: onnx.ModelProto) -> Optional[str]:
    """What the report says about the pinned seeds, None without random nodes."""
    ops = sorted({n.op_type for n in random_nodes(model)})
    if not ops:
        return None
    return (f"random ops ({', '.join(ops)}) drew with the same pinned seeds in the original, the folded model and "
            "the float64 copy (run in their own dtype there); the written model keeps them unseeded as given")


def own_types(model: onnx.ModelProto) -> dict[str, int]:
    """name -> element type, in `model`, of the float tensors its random nodes read and write
    (onnx's inference; a node's `dtype`, else float, where it gives none)."""
    from .shapes import infer_types

    typed = {name: vi.type.tensor_type.elem_type for name, vi in infer_types(model).items()}
    typed.update((t.name, t.data_type) for t in model.graph.initializer)
    out = {}
    for n in filter(runs_in_own_dtype, model.graph.node):
        dtype = next((a.i for a in n.attribute if a.name == "dtype"), None)
        for k, name in enumerate(list(n.input) + list(n.output)):
            t = typed.get(name) or (dtype or onnx.TensorProto.FLOAT if k >= len(n.input) else None)
            if name and t in _FLOATS:
                out[name] = t
    return out


def in_own_dtype(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    """In a float64 copy (`graph`: every float made double but the random nodes' `dtype`), run each
    node that `runs_in_own_dtype` in the float types its tensors had in the original (`types`, from `own_types`):
    its float inputs cast down to them, its float outputs cast up to double."""
    nodes = []
    for n in graph.node:
        if not runs_in_own_dtype(n):
            nodes.append(n)
            continue
        after = []
        for k, name in enumerate(n.input):
            if types.get(name, onnx.TensorProto.DOUBLE) != onnx.TensorProto.DOUBLE:
                nodes.append(helper.make_node("Cast", [name], [f"{name}__lnfold_own"], to=types[name],
                                              name=f"{n.name}__lnfold_in{k}"))
                n.input[k] = f"{name}__lnfold_own"
        for k, name in enumerate(n.output):
            if types.get(name, onnx.TensorProto.DOUBLE) != onnx.TensorProto.DOUBLE:
                after.append(helper.make_node("Cast", [f"{name}__lnfold_own"], [name], to=onnx.TensorProto.DOUBLE,
                                              name=f"{n.name}__lnfold_out{k}"))
                n.output[k] = f"{name}__lnfold_own"
        nodes += [n] + after
    del graph.node[:]
    graph.node.extend(nodes)
