"""The ONNX ops that are LayerNorms by themselves, and the constants they read.

- `LayerNormalization` (opset 17+);
- onnxruntime's `SkipLayerNormalization`: an Add (+ bias) and a LayerNorm in one node;
- onnxruntime's `EmbedLayerNormalization` (fused.py);
- tf2onnx's Keras and jax2onnx's flax decomposed LayerNorms (norm_variants.py), matched here
  over the ONNX graph and seen by the analysis as one `layer_norm` rule like the ops above.

The decomposed form older exporters emit (ReduceMean, Sub, Pow, ReduceMean, [Add eps], Sqrt, Div,
[Mul γ], [Add β]) is recognized over the view, for both frontends, by passes/patterns.py; the
emitter sees all three as a `NormMatch`: the graph nodes it covers, its data input, γ/β, eps and
its axis (or the reason it is not a single-axis LayerNorm, decided in passes/rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes.axes import Shape


@dataclass
class NormMatch:
    name: str
    kind: str  # "LayerNormalization", "decomposed", "SkipLayerNormalization"
    nodes: list  # gs.Node covered, in graph order; the last one produces `output`
    x: gs.Tensor  # normalized input (for Skip: input; skip/bias are separate)
    output: gs.Tensor
    gamma: Optional[gs.Tensor] = None
    beta: Optional[gs.Tensor] = None
    epsilon: float = 1e-5
    axis: Optional[int] = None  # normalized axis of x (non-negative), when a single one
    rejection: Optional[str] = None  # why this is not a foldable single-axis LayerNorm
    axes: list = field(default_factory=lambda: [-1])  # normalized axes, as the op names them
    stats_used: bool = False  # its mean / inverse-std outputs are read
    skip: Optional[gs.Tensor] = None  # SkipLayerNormalization only
    bias: Optional[gs.Tensor] = None
    sum_output: Optional[gs.Tensor] = None  # Skip's input+skip+bias output, when used


def _constant_node_value(t):
    if t is not None and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        return t.inputs[0].attrs.get("value")
    return None


def is_constant(t) -> bool:
    """Without loading its data (weights of a big model stay on disk until edited)."""
    return isinstance(t, gs.Constant) or isinstance(_constant_node_value(t), gs.Constant)


def constant_shape(t) -> Optional[tuple]:
    if isinstance(t, gs.Constant):
        return tuple(t.shape)
    c = _constant_node_value(t)
    return tuple(c.shape) if isinstance(c, gs.Constant) else None


def const_values(t) -> Optional[np.ndarray]:
    """The value of a constant tensor (an initializer or a Constant node's output), else None.

    Read afresh each time and not kept in the graph: a big model's weights are read one at a
    time where the fold uses them (from the input's data file, when loaded lazily) and dropped
    after, and graphsurgeon exports the untouched ones from their original TensorProto.
    """
    c = t if isinstance(t, gs.Constant) else _constant_node_value(t)
    if not isinstance(c, gs.Constant):
        return None
    v = c._values
    if type(v) is gs.ir.tensor.LazyValues:  # (not SparseValues: their values are computed)
        from .read import is_lazy, read_external

        return read_external(v.tensor) if is_lazy(v.tensor) else v.load()
    return c.values


def reduce_axes(node: gs.Node) -> Optional[list[int]]:
    """Axes of a Reduce* node (attribute before opset 18, input after); None if not constant."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].name:
        v = const_values(node.inputs[1])
        return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    return []  # reduce over all axes (unless noop_with_empty_axes)


def match_layernormalization(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> NormMatch:
    x = node.inputs[0]
    rank = _rank(x, shapes)
    axis_attr = int(node.attrs.get("axis", -1))
    m = NormMatch(
        node.name, "LayerNormalization", [node], x, node.outputs[0],
        gamma=node.inputs[1] if len(node.inputs) > 1 and node.inputs[1].name else None,
        beta=node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None,
        epsilon=float(node.attrs.get("epsilon", 1e-5)),
    )
    if rank is not None:
        first = axis_attr + rank if axis_attr < 0 else axis_attr
        m.axes = list(range(first, rank))
    m.stats_used = _uses_stats(node.outputs[1:], outputs)
    return m


def _uses_stats(stats, graph_outputs: set[str]) -> bool:
    return any(o is not None and o.name and (o.outputs or o.name in graph_outputs) for o in stats)


def match_skip(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> NormMatch:
    ins = list(node.inputs) + [None] * (5 - len(node.inputs))
    outs = list(node.outputs) + [None] * (4 - len(node.outputs))
    x = ins[0]
    m = NormMatch(
        node.name, "SkipLayerNormalization", [node], x, outs[0],
        gamma=ins[2], beta=ins[3] if ins[3] is not None and ins[3].name else None,
        epsilon=float(node.attrs.get("epsilon", 1e-5)),
        skip=ins[1], bias=ins[4] if ins[4] is not None and ins[4].name else None,
        sum_output=outs[3] if outs[3] is not None and outs[3].name else None,
    )
    m.stats_used = _uses_stats(outs[1:3], outputs)
    return m


def _rank(t: gs.Tensor, shapes: dict[str, Shape]) -> Optional[int]:
    s = shapes.get(t.name)
    return None if s is None else len(s)


def find_norms(graph: gs.Graph, shapes: dict[str, Shape], near_misses: Optional[dict] = None) -> list[NormMatch]:
    """Every LayerNorm op and tf2onnx/jax2onnx LayerNorm pattern of `graph`; the patterns that
    almost matched go into `near_misses` (first node's name -> passes.match.NoMatch)."""
    out = []
    outputs = {t.name for t in graph.outputs}
    for node in graph.nodes:
        if node.op == "LayerNormalization" and (node.domain or "") in ("", "ai.onnx"):
            out.append(match_layernormalization(node, shapes, outputs))
        elif node.op == "SkipLayerNormalization" and node.domain == "com.microsoft":
            out.append(match_skip(node, shapes, outputs))
        elif node.op == "EmbedLayerNormalization" and node.domain == "com.microsoft":
            from .fused import match_embed

            out.append(match_embed(node, shapes, outputs))
        elif node.op in ("ReduceMean", "GlobalAveragePool", "ReduceSum"):
            # tf2onnx's, jax2onnx's and jax2tf's forms (norm_variants.py); torch's is passes/patterns.py's
            from .norm_variants import match_variant

            m = match_variant(node, shapes, outputs)
            if m:
                out.append(m)
            elif m.near and near_misses is not None:
                near_misses[node.name] = m
    return out


RMS_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")


def rms_norms(model: onnx.ModelProto) -> list:
    """The RMSNorms of the main graph (a folded model's): the fused ops, and mean(x²) -> [+ eps]
    -> Sqrt -> x / rms (or x · 1/rms) written out, as the portable target emits it."""
    from ..passes.report import RmsNorm

    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, list] = {}
    for n in nodes:
        for i in dict.fromkeys(n.input):
            if i:
                readers.setdefault(i, []).append(n)
    consts = {t.name: t for t in model.graph.initializer}
    consts.update({n.output[0]: a.t for n in nodes if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value"})

    def one(value: str, *ops: str):
        r = readers.get(value, [])
        return r[0] if len(r) == 1 and r[0].op_type in ops else None

    def is_two(value: str) -> bool:
        t = consts.get(value)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL or int(np.prod(t.dims)) != 1:
            return False  # (a scalar exponent is stored inline; no weight is read here)
        return float(onnx.numpy_helper.to_array(t).reshape(-1)[0]) == 2.0

    def squared(value: str) -> Optional[set]:
        """The tensors that `value` is the square of (x, and what x is a Cast of)."""
        p = producer.get(value)
        if p is None or not ((p.op_type == "Mul" and len(p.input) == 2 and p.input[0] == p.input[1])
                             or (p.op_type == "Pow" and len(p.input) == 2 and is_two(p.input[1]))):
            return None
        x = p.input[0]
        c = producer.get(x)
        xs = {x} | ({c.input[0]} if c is not None and c.op_type == "Cast" else set())
        # x - mean(x) squared is a LayerNorm's variance (torch's decomposed form), not an RMS
        centered = any(producer.get(v) is not None and producer[v].op_type == "Sub" and len(producer[v].input) == 2
                       and producer.get(producer[v].input[1]) is not None
                       and producer[producer[v].input[1]].op_type == "ReduceMean" for v in xs)
        return None if centered else xs

    out = []
    for n in nodes:
        if n.op_type in RMS_OPS:
            out.append(RmsNorm(n.name, n.op_type))
            continue
        if n.op_type != "ReduceMean" or not n.input:
            continue
        xs = squared(n.input[0])
        t = n.output[0]
        add = one(t, "Add")
        t = add.output[0] if add is not None else t
        root = one(t, "Sqrt")
        if xs is None or root is None:
            continue
        t = root.output[0]
        rec = one(t, "Reciprocal")
        final = one(rec.output[0] if rec is not None else t, "Mul" if rec is not None else "Div")
        if final is not None and set(final.input) & xs:
            out.append(RmsNorm(n.name, "decomposed RMSNorm"))
    return out
