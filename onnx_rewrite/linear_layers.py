"""The linear layers of an ONNX graph as onnxruntime's quantizers want to see them.

onnxruntime's int4 (MatMulNBits) and dynamic int8 (MatMulInteger) quantizers take only MatMul nodes
with a constant B: `gemm_to_matmul` makes a Gemm with an initializer weight, alpha = beta = 1 and no
transposed A, a MatMul (+ Add of C), the same function; `constant_weights` makes a weight read through
ops that only alias, lay out or widen an initializer (WEIGHT_VIEWS: ALBERT's Transpose, TorchScript's
Identity) an initializer, unless another node reads that initializer as given: a quantized copy would
be stored beside the float one, a file bigger than the float model.

`linear_layers` leaves out the fold's `basis_changes` (emit.BASIS_CHANGE), the MatMuls it inserted to
take a rotated stream into or out of its basis: no layer of the model, and a readout's error lands on
the output unfiltered (quantized, they doubled the rotated error of the zoo's Whisper encoder).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .emit import BASIS_CHANGE
from .sessions import graph_reads, subgraphs

_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def graphs(model: onnx.ModelProto) -> list[tuple[str, onnx.GraphProto, dict]]:
    """The main graph, then every subgraph in it (If/Loop/Scan bodies, nested), each as (where,
    graph, the initializers it can read by name: its own and its outer graphs'). onnxruntime's
    quantizers quantize inside them too, reading a weight from the outer graph."""
    out = []

    def visit(g: onnx.GraphProto, where: str, outer: dict) -> None:
        inits = {**outer, **{t.name: t for t in g.initializer}}
        out.append((where, g, inits))
        for n in g.node:
            for a in n.attribute:
                subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs) \
                    if a.type == onnx.AttributeProto.GRAPHS else []
                for k, sub in enumerate(subs):
                    visit(sub, f"{n.op_type} `{n.name}` {a.name}{f'[{k}]' if len(subs) > 1 else ''}", inits)

    visit(model.graph, "main graph", {})
    return out


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name, across the main graph and its subgraphs (the quantizers
    select nodes by name, in a branch too)."""
    seen: set[str] = set()
    for _, g, _ in graphs(model):
        for k, node in enumerate(g.node):
            if not node.name or node.name in seen:
                node.name = _unique(f"{node.op_type}_{k}" if not node.name else f"{node.name}_{k}", seen)
            seen.add(node.name)


def gemm_to_matmul(model: onnx.ModelProto) -> tuple[int, list[str]]:
    """Rewrite, in place, the Gemms with an initializer weight into MatMul (+ Add), in every graph
    (`graphs`). Returns (how many were rewritten, [why each other Gemm was kept])."""
    everything = graphs(model)
    owner = {name: g for _, g, _ in everything for name in (t.name for t in g.initializer)}
    uses = Counter(i for _, g, _ in everything for n in g.node for i in n.input)
    rewritten, kept = 0, []
    for _, g, inits in everything:
        nodes, changed = [], False
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
            if a.get("transB", 0):  # MatMul takes B as [K, N]: one transposed weight beside its initializer
                home, name = owner[b], f"{b}__transposed"
                if name not in owner:
                    home.initializer.append(numpy_helper.from_array(numpy_helper.to_array(inits[b]).T.copy(), name))
                    owner[name] = home
                uses[b] -= 1
                if not uses[b]:  # (every reader rewritten: the untransposed one goes)
                    home.initializer.remove(next(t for t in home.initializer if t.name == b))
                b = name
            out = node.output[0]
            mm_out = f"{out}__matmul" if c is not None else out
            nodes.append(helper.make_node("MatMul", [node.input[0], b], [mm_out], name=f"{node.name}__matmul"))
            if c is not None:
                nodes.append(helper.make_node("Add", [mm_out, c], [out], name=f"{node.name}__bias"))
            rewritten += 1
            changed = True
        if changed:
            del g.node[:]
            g.node.extend(nodes)
    return rewritten, kept


# ops that hand a constant on unchanged in value: an alias, a layout, a float widening or narrowing
WEIGHT_VIEWS = ("Identity", "Transpose", "Reshape", "Cast")


def _view_value(node: onnx.NodeProto, value, consts: dict) -> Optional[np.ndarray]:
    """`node`'s output, a WEIGHT_VIEWS op on the constant `value` (None where it is not one here)."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if node.op_type == "Identity":
        return value
    if node.op_type == "Transpose":
        perm = a.get("perm")
        return np.transpose(value, list(perm) if perm else None)
    if node.op_type == "Cast":
        to = a.get("to")
        if to not in _FLOAT or value.dtype.kind != "f":
            return None
        return value.astype(helper.tensor_dtype_to_np_dtype(to))
    if node.op_type == "Reshape":
        shape = consts.get(node.input[1]) if len(node.input) > 1 else None
        if shape is None or shape.dtype != np.int64:
            return None
        dims = [int(s) for s in shape.reshape(-1)]
        if not a.get("allowzero", 0):
            dims = [value.shape[k] if s == 0 and k < value.ndim else s for k, s in enumerate(dims)]
        try:
            return value.reshape(dims)
        except ValueError:
            return None
    return None


def constant_weights(model: onnx.ModelProto) -> tuple[int, list[str]]:
    """In place: each MatMul's (Gemm's) weight that is an initializer seen through WEIGHT_VIEWS made
    an initializer read directly (the initializer itself where the chain changes nothing), the chain
    removed; only where every reader of the initializer, through such chains, reads it as a linear
    layer's weight. Returns (weights rewritten, [why each other one stayed float])."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for k, i in enumerate(n.input):
            readers.setdefault(i, []).append((n, k))
    outer = {i for n in g.node for sub in subgraphs(n) for i in graph_reads(sub)}
    outputs = {o.name for o in g.output}
    memo: dict[str, Optional[np.ndarray]] = {}
    arrays: dict[str, np.ndarray] = {}

    def const(name: str) -> Optional[np.ndarray]:
        if name in inits:
            if name not in arrays:
                arrays[name] = numpy_helper.to_array(inits[name])
            return arrays[name]
        return value(name)

    def value(name: str) -> Optional[np.ndarray]:
        if name not in memo:
            memo[name] = None
            n = producer.get(name)
            if n is not None and n.op_type in WEIGHT_VIEWS and n.domain in ("", "ai.onnx") and n.input:
                src = const(n.input[0])
                if src is not None:
                    memo[name] = _view_value(n, src, {i: const(i) for i in n.input[1:] if i in inits})
        return memo[name]

    def root(name: str) -> str:
        while name not in inits:
            name = producer[name].input[0]
        return name

    def is_weight(node: onnx.NodeProto, k: int) -> bool:
        return k == 1 and node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Gemm")

    def is_matrix(v: Optional[np.ndarray]) -> bool:
        return v is not None and v.ndim == 2 and v.dtype.kind == "f"

    def others(name: str, seen: set) -> list[str]:
        """The readers of `name`, through WEIGHT_VIEWS chains, that are no linear layer's weight."""
        out = ["a subgraph" if name in outer else None, "the graph's outputs" if name in outputs else None]
        for n, k in readers.get(name, []):
            if n.op_type in WEIGHT_VIEWS and k == 0 and n.domain in ("", "ai.onnx") and value(n.output[0]) is not None:
                if n.output[0] not in seen:
                    seen.add(n.output[0])
                    out += others(n.output[0], seen)
            elif not (is_weight(n, k) and is_matrix(const(name))):
                out.append(f"{n.op_type} `{n.name or n.output[0]}`")
        return [o for o in out if o]

    targets = [(n, k) for n in g.node for k, i in enumerate(n.input)
               if is_weight(n, k) and i not in inits and is_matrix(value(i))]
    blocked: dict[str, list[str]] = {}
    made: dict[str, str] = {}  # chain output -> the initializer its readers now read
    kept = []
    for n, k in targets:
        name = n.input[k]
        src = root(name)
        if src not in blocked:
            blocked[src] = others(src, set())
        if blocked[src]:
            kept.append(f"{n.op_type} `{n.name}` reads `{src}` through "
                        f"{_chain(name, producer, inits)}, and `{src}` is also read by {', '.join(blocked[src][:3])}: "
                        "a quantized copy would be stored beside the float one (a bigger file)")
            continue
        if name not in made:
            v, s = value(name), const(src)
            if v.dtype == s.dtype and v.shape == s.shape and np.array_equal(v, s):
                made[name] = src  # an alias: the initializer itself
            else:
                new = _unique(f"{src}__{'_'.join(_chain(name, producer, inits).lower().split(' then '))}", inits)
                t = numpy_helper.from_array(np.ascontiguousarray(v), new)
                g.initializer.append(t)
                inits[new] = t
                made[name] = new
        n.input[k] = made[name]
    if made:
        _drop_dead(model, {i for i, v in memo.items() if v is not None}, {root(i) for i in made})
    return len(targets) - len(kept), kept


def _chain(name: str, producer: dict, inits: dict) -> str:
    ops = []
    while name not in inits:
        ops.append(producer[name].op_type)
        name = producer[name].input[0]
    return " then ".join(reversed(ops))


def _unique(name: str, taken) -> str:
    k, out = 1, name
    while out in taken:
        k, out = k + 1, f"{name}_{k}"
    return out


def _drop_dead(model: onnx.ModelProto, values: set[str], roots: set[str]) -> None:
    """Remove the WEIGHT_VIEWS nodes producing `values` that nothing reads any more, then those of
    the initializers `roots` that nothing reads any more (and no graph input names)."""
    g = model.graph
    outputs = {o.name for o in g.output}
    while True:
        read = graph_reads(g) | outputs
        dead = [n for n in g.node if n.op_type in WEIGHT_VIEWS and all(o in values and o not in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    read = graph_reads(g) | outputs | {i.name for i in g.input}
    for t in [t for t in g.initializer if t.name in roots and t.name not in read]:
        g.initializer.remove(t)


def linear_layers(model: onnx.ModelProto, *, with_basis_changes: bool = False) -> list[str]:
    """Names of the MatMul nodes whose B is a 2-D float initializer (of their graph or an outer
    one), in the main graph and its subgraphs (`graphs`), but for the fold's `basis_changes`
    (`with_basis_changes`: those too)."""
    return [name for names in layers_by_graph(model, with_basis_changes=with_basis_changes).values()
            for name in names]


def layers_by_graph(model: onnx.ModelProto, *, with_basis_changes: bool = False) -> dict[str, list[str]]:
    """`linear_layers` by the graph that holds them (`graphs`' where: "main graph", then each
    branch), graphs with none left out."""
    out = {}
    for where, g, inits in graphs(model):
        names = [n.name for n in g.node
                 if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2
                 and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
                 and inits[n.input[1]].data_type in _FLOAT and (with_basis_changes or not is_basis_change(n))]
        if names:
            out[where] = names
    return out


def is_basis_change(node: onnx.NodeProto) -> bool:
    return node.op_type == "MatMul" and node.name.startswith(BASIS_CHANGE)


def basis_changes(model: onnx.ModelProto) -> dict[str, int]:
    """The MatMuls the fold inserted to change a stream's basis (emit.BASIS_CHANGE), in any graph:
    node name -> its constant matrix's parameter count."""
    out = {}
    for _, g, inits in graphs(model):
        out.update({n.name: sum(int(np.prod(inits[i].dims)) for i in n.input if i in inits)
                    for n in g.node if is_basis_change(n)})
    return out


def float_parameters(model: onnx.ModelProto) -> int:
    """The floating-point constants' element count (initializers and Constant nodes' values): a model's
    parameters, as slicing and quantization report them."""
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.name == "value"]
    return sum(int(np.prod(t.dims)) for t in tensors if t.data_type in _FLOAT)
