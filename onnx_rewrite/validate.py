"""Checks on an ONNX model before any work: a supported opset, a valid graph, whole tensors.

Each failure is a one-line LnfoldError saying what is wrong with the input.
"""
from __future__ import annotations

import math
from typing import Sequence

import onnx

from ..passes import LnfoldError

MIN_OPSET = 9
# Bytes per element of the types whose raw data can be checked against their dims.
ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2,
              17: 1, 18: 1, 19: 1, 20: 1, 24: 1}


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise LnfoldError("the model imports no standard ONNX opset")


def check_opset(model: onnx.ModelProto) -> int:
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise LnfoldError(f"unsupported opset {opset} (lnfold supports opsets {MIN_OPSET} to {newest})")
    return opset


def element_count(t: onnx.TensorProto) -> int:
    """The number of elements `t`'s dims say it holds (a negative dim is a corrupt tensor)."""
    if any(d < 0 for d in t.dims):
        raise LnfoldError(f"initializer `{t.name}` has a negative dimension {list(t.dims)}")
    return math.prod(t.dims)


def raw_bytes(t: onnx.TensorProto) -> int:
    """len(t.raw_data) as its shape says it, where the type fixes the element size: protobuf copies
    the bytes out on every read of the field (0.1 s for a GPT-2 token table), and a size decision
    needs only the count (check_tensors holds the two equal for the input)."""
    size = ITEM_BYTES.get(t.data_type)
    return element_count(t) * size if size is not None else len(t.raw_data)


def check_tensors(model: onnx.ModelProto) -> None:
    """Every initializer holds as many elements as its dims say (a truncated weight file or a
    corrupt proto otherwise fails much later, deep inside numpy)."""
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue  # not loaded (load_external_data=False): checked where it is read
        n = element_count(t)
        if t.HasField("raw_data"):
            size = ITEM_BYTES.get(t.data_type)
            if size is not None and len(t.raw_data) != n * size:
                raise LnfoldError(f"initializer `{t.name}` holds {len(t.raw_data)} bytes, but its shape "
                                  f"{list(t.dims)} needs {n * size} (truncated or corrupt weights)")
        elif t.data_type in ITEM_BYTES:
            have = len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data) + len(t.uint64_data)
            if have != n:
                raise LnfoldError(f"initializer `{t.name}` holds {have} values, but its shape {list(t.dims)} "
                                  f"needs {n} (truncated or corrupt weights)")


def check_graph(model: onnx.ModelProto) -> None:
    """The main graph is a DAG whose every input is provided, or raise LnfoldError naming why.

    Checked up front because a cycle or a dangling input otherwise surfaces as an unrelated
    failure (unknown shapes, a toposort error, onnxruntime refusing the folded model).
    """
    g = model.graph
    check_initializer_names(g)
    provided = {i.name for i in g.input} | {t.name for t in g.initializer}
    provided |= {t.values.name for t in g.sparse_initializer}
    producer: dict[str, int] = {}
    for k, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in producer or o in provided:
                raise LnfoldError(f"tensor `{o}` is produced twice (node `{n.name or n.op_type}`): "
                                  "not a valid ONNX graph")
            producer[o] = k
    for n in g.node:
        for i in n.input:
            if i and i not in provided and i not in producer:
                raise LnfoldError(f"node `{n.name or n.op_type}` reads `{i}`, which no node, graph input or "
                                  "initializer provides (dangling input)")
    for o in g.output:
        if o.name not in provided and o.name not in producer:
            raise LnfoldError(f"graph output `{o.name}` is produced by no node")
    # Kahn's algorithm: whatever is left waiting lies on (or after) a cycle.
    waiting = [sum(1 for i in n.input if i in producer) for n in g.node]
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(g.node):
        for i in n.input:
            if i in producer:
                readers.setdefault(i, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    while ready:
        for o in g.node[ready.pop()].output:
            for r in readers.get(o, ()):
                waiting[r] -= 1
                if waiting[r] == 0:
                    ready.append(r)
    stuck = next((n for k, n in enumerate(g.node) if waiting[k] > 0), None)
    if stuck is not None:
        raise LnfoldError(f"the graph has a cycle (through node `{stuck.name or stuck.op_type}`): "
                          "not a valid ONNX graph")


def check_initializer_names(graph: onnx.GraphProto) -> None:
    """No two initializers (dense or sparse) of `graph` or of a subgraph in it share a name:
    onnx.checker refuses such a model, and which copy a reader gets is then anyone's guess."""
    todo = [graph]
    while todo:
        g = todo.pop()
        seen: set[str] = set()
        for name in [t.name for t in g.initializer] + [t.values.name for t in g.sparse_initializer]:
            if name in seen:
                where = "" if g is graph else f" (in subgraph `{g.name}`)"
                raise LnfoldError(f"initializer `{name}` is defined twice{where}: not a valid ONNX graph "
                                  "(onnx.checker refuses it)")
            seen.add(name)
        todo.extend(sub for n in g.node for sub in _subgraphs(n))


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """Every graph a node's attributes hold, whatever type they declare (a hostile model may lie)."""
    return [sub for a in node.attribute for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def no_norm_message(model: onnx.ModelProto, rms: Sequence = ()) -> str:
    """Why `model` has nothing to fold; `rms`: its RMSNorms (already_rms.rms_norms)."""
    inner = subgraph_norms(model)
    if inner:
        return (f"no LayerNorm found in the main graph ({inner} inside If/Loop/Scan subgraphs, "
                "which lnfold does not fold): nothing to fold")
    if rms:
        ops = sorted({r.op for r in rms})
        return (f"no LayerNorm found: the model's {len(rms)} norm(s) are RMSNorms already ({', '.join(ops)}; "
                "a model lnfold folded, or one built that way): nothing to fold")
    return "no LayerNorm found in the model: nothing to fold"


def subgraph_norms(model: onnx.ModelProto) -> int:
    """LayerNorms inside If/Loop/Scan bodies, which lnfold leaves alone."""
    def norms(graph: onnx.GraphProto) -> int:  # nested ones included
        return sum(n.op_type in ("LayerNormalization", "SkipLayerNormalization") for n in graph.node) \
            + sum(norms(sub) for n in graph.node for sub in _subgraphs(n))

    return sum(norms(sub) for n in model.graph.node for sub in _subgraphs(n))
