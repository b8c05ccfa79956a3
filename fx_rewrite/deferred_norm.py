"""Emit a deferred norm in a Dynamo (torch-level) FX graph (passes/defer.py decides which).

    r = rsqrt(mean(x², -1, keepdim) + eps)                          per row
    reader: linear(x, W·diag γ) * r + (W β + b)                     the row scale before the bias

The readers' γ-scaled weights are the Applier's constant edits; here the norm goes and each reader
scales its product. Inductor can fuse the reduction with the residual Add that produces x, and the
multiply-add into the GEMM's epilogue (benchmarks/RESULTS.md says what it did).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch import fx

from ..passes.defer import DeferDecision, Deferral
from ..passes.readers import LinearReader

from .classify import is_tuple_getitem, meta_val
from .edits import LOW_PRECISION, add_weight_times, weight_times
from .ops import canonical

BiasNode = Callable[[Deferral, LinearReader], Optional[fx.Node]]


def graph_biases(gm: fx.GraphModule) -> BiasNode:
    """The backend's: each deferred reader's new bias `W β + b` computed in the graph at every call,
    in float64 and rounded once to the bias's dtype (from the parameters themselves, so a changed β
    or W is seen at once, as the backend's other edits: fx_rewrite/apply.GraphConstants)."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def bias_node(d: Deferral, rd: LinearReader) -> Optional[fx.Node]:
        if d.beta is None:
            return None
        args = (nodes[d.beta], nodes[rd.weight.value], nodes[rd.bias.value] if rd.bias is not None else None,
                rd.weight.axis)
        with gm.graph.inserting_before(nodes[rd.node]):
            return gm.graph.call_function(beta_into_bias, args)

    return bias_node


def beta_into_bias(beta: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], axis: int) -> torch.Tensor:
    """`W β + b` in float64, in the dtype of `b` (of `W` where the reader has no bias)."""
    w64, beta64 = w.double(), beta.double()
    if b is None:
        return weight_times(w64, beta64, axis).to(w.dtype)
    return add_weight_times(b.double(), w64, axis, beta64).to(b.dtype)


def emit_all(gm: fx.GraphModule, decision: DeferDecision, bias_node: BiasNode) -> None:
    """Every deferred norm of the plan, after its other edits (γ is in the readers' weights already).
    `bias_node(d, reader)`: the node holding the reader's new bias W β + b (fold_module: a buffer; the
    backend: computed in the graph, `graph_biases`), None where it keeps its own (no β)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for d in decision.deferred:
        emit(gm.graph, nodes, d, bias_node)
    gm.graph.lint()


def emit(graph: fx.Graph, nodes: dict[str, fx.Node], d: Deferral, bias_node: BiasNode) -> None:
    """One deferred norm (`bias_node`: as for `emit_all`)."""
    norm = nodes[d.norm]
    call = canonical(norm)
    if call is None or call.kind != "layer_norm":  # a norm written out: its first mean, its last op
        x, outs = nodes[d.x], [nodes[d.output]]
    else:
        x = call.args["input"]
        outs = [u for u in norm.users if is_tuple_getitem(u) and u.args[1] == 0] \
            if isinstance(meta_val(norm), (tuple, list)) else [norm]
    # x may be a recenter the Applier inserted (no meta): the norm's output has x's shape and dtype
    like = meta_val(x) if meta_val(x) is not None else meta_val(outs[0])
    dtype = getattr(like, "dtype", torch.float32)
    with graph.inserting_before(norm):
        xs = graph.call_method("float", (x,)) if dtype in LOW_PRECISION else x
        sq = graph.call_function(operator.mul, (xs, xs))
        ms = graph.call_function(torch.mean, (sq,), {"dim": -1, "keepdim": True})
        r = graph.call_function(torch.rsqrt, (graph.call_function(operator.add, (ms, d.epsilon)),))
        if dtype in LOW_PRECISION:
            r = graph.call_method("to", (r, dtype))
        r2 = graph.call_method("reshape", (r, -1, 1))
    for out in outs:
        out.replace_all_uses_with(x)
    for u in [u for u in norm.users if is_tuple_getitem(u) and not u.users]:
        graph.erase_node(u)
    erase_unread(graph, outs + [norm])
    rank = d.axis + 1  # passes/defer.py defers only a norm over its input's last axis
    for rd in d.readers:  # a reader behind a row-flattening reshape gets r as [rows, 1]
        _scale_product(graph, nodes[rd.node], r if rd.rank == rank else r2, bias_node(d, rd))
    if not r2.users:
        graph.erase_node(r2)


def _scale_product(graph: fx.Graph, node: fx.Node, r: fx.Node, new_bias: Optional[fx.Node]) -> None:
    call = canonical(node)
    bias = None
    with graph.inserting_before(node):
        if call.kind == "linear":
            bias = call.args.get("bias")
            prod = graph.call_function(torch.nn.functional.linear, (call.args["input"], call.args["weight"]))
        elif call.kind == "addmm":
            bias = call.args["input"]
            prod = graph.call_function(torch.mm, (call.args["mat1"], call.args["mat2"]))
        else:  # matmul: no bias of its own
            prod = graph.call_function(torch.matmul, (call.args["input"], call.args.get("other", call.args.get("mat2"))))
        out = graph.call_function(operator.mul, (prod, r))
        b = new_bias if new_bias is not None else bias
        if b is not None:
            out = graph.call_function(operator.add, (out, b))
    if "example_value" in node.meta or "val" in node.meta:
        out.meta["val" if "val" in node.meta else "example_value"] = meta_val(node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def erase_unread(graph: fx.Graph, start: list[fx.Node]) -> None:
    """Erase the norm's ops nothing reads any more (a written-out norm is several), back to the
    stream: only call_function/call_method nodes, each once it has no users."""
    todo, erased = list(start), set()
    while todo:
        n = todo.pop()
        if n in erased or n._erased or n.users or n.op not in ("call_function", "call_method"):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        todo += inputs
