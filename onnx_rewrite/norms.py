"""Recognize LayerNorms in an ONNX graph, in the three forms exporters and onnxruntime emit.

- `LayerNormalization` (opset 17+);
- the decomposed form older exporters emit: ReduceMean, Sub, Pow, ReduceMean, [Add eps], Sqrt,
  Div, [Mul γ], [Add β] (eps and γ/β nodes are dropped by exporters when trivial);
- onnxruntime's `SkipLayerNormalization`: an Add (+ bias) and a LayerNorm in one node.

Each match is a `NormMatch`: the graph nodes it covers, its data input, γ/β, eps and axes, or
the reason it is not a single-axis LayerNorm.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .shapes import Shape


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
    skip: Optional[gs.Tensor] = None  # SkipLayerNormalization only
    bias: Optional[gs.Tensor] = None
    sum_output: Optional[gs.Tensor] = None  # Skip's input+skip+bias output, when used
    extra: dict = field(default_factory=dict)


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
        from .io import is_lazy, read_external

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


def _single(t: gs.Tensor, op: str) -> Optional[gs.Node]:
    """The only reader of `t`, when it is an `op`."""
    if len(t.outputs) == 1 and t.outputs[0].op == op:
        return t.outputs[0]
    return None


def _other(node: gs.Node, t: gs.Tensor) -> Optional[gs.Tensor]:
    ins = [i for i in node.inputs if i is not t]
    return ins[0] if len(ins) == 1 else None


def _scalar(t) -> Optional[float]:
    v = const_values(t)
    if v is None or np.asarray(v).size != 1:
        return None
    return float(np.asarray(v).reshape(-1)[0])


def _norm_axis(axes: list[int], rank: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    if rank is None:
        return None, "rank of its input is unknown"
    norm = sorted({a + rank if a < 0 else a for a in axes})
    if len(norm) != 1:
        return None, f"normalizes over axes {norm} of a rank-{rank} tensor, not one feature axis"
    return norm[0], None


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
        m.axis, m.rejection = _norm_axis(list(range(first, rank)), rank)
    else:
        m.rejection = "rank of its input is unknown"
    if _uses_stats(node.outputs[1:], outputs):
        m.rejection = "its Mean/InvStdDev outputs are used"
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
    rank = _rank(x, shapes)
    m.axis, m.rejection = _norm_axis([-1], rank)
    if _uses_stats(outs[1:3], outputs):
        m.rejection = "its Mean/InvStdDev outputs are used"
    return m


def match_decomposed(mean1: gs.Node, shapes: dict[str, Shape]) -> Optional[NormMatch]:
    """ReduceMean(x) -> Sub(x, mean) -> Pow(2) -> ReduceMean -> [Add eps] -> Sqrt -> Div -> [Mul γ] -> [Add β]."""
    if int(mean1.attrs.get("keepdims", 1)) != 1:
        return None
    x = mean1.inputs[0]
    axes = reduce_axes(mean1)
    if axes is None:
        return None
    sub = _single(mean1.outputs[0], "Sub")
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean1.outputs[0]:
        return None
    d = sub.outputs[0]
    # fp16/bf16 exports compute the statistics in fp32: Sub -> Cast -> Pow/Div ... Div -> Cast.
    up = _single(d, "Cast")
    if up is not None and up.attrs.get("to") not in (1, 10, 11, 16):
        return None
    if up is not None:
        d = up.outputs[0]
    readers = {n.op: n for n in d.outputs}
    if len(d.outputs) != 2 or set(readers) != {"Pow", "Div"}:
        return None
    pow_, div = readers["Pow"], readers["Div"]
    if pow_.inputs[0] is not d or _scalar(pow_.inputs[1]) != 2.0 or div.inputs[0] is not d:
        return None
    mean2 = _single(pow_.outputs[0], "ReduceMean")
    if mean2 is None or reduce_axes(mean2) != axes or int(mean2.attrs.get("keepdims", 1)) != 1:
        return None
    nodes = [mean1, sub] + ([up] if up is not None else []) + [pow_, mean2]
    t = mean2.outputs[0]
    eps = 0.0
    add_eps = _single(t, "Add")
    if add_eps is not None:
        e = _scalar(_other(add_eps, t))
        if e is None:
            return None
        eps, t = e, add_eps.outputs[0]
        nodes.append(add_eps)
    sqrt = _single(t, "Sqrt")
    if sqrt is None or div.inputs[1] is not sqrt.outputs[0] or len(sqrt.outputs[0].outputs) != 1:
        return None
    nodes += [sqrt, div]
    out = div.outputs[0]
    down = _single(out, "Cast") if up is not None else None
    if down is not None:
        nodes.append(down)
        out = down.outputs[0]
    rank = _rank(x, shapes)
    axis, rejection = _norm_axis(axes, rank)

    def affine(t) -> bool:  # γ/β vary along the normalized axis only; any other constant
        # (a position table added to a γ-less norm's output) is the next op, not the norm's
        return const_values(t) is not None and (rejection is not None or _affine_along(t, None, axis, rank))

    gamma = beta = None
    mul = _single(out, "Mul")
    if mul is not None and affine(_other(mul, out)):
        gamma, out = _other(mul, out), mul.outputs[0]
        nodes.append(mul)
        add = _single(out, "Add")
        if add is not None and affine(_other(add, out)):
            beta, out = _other(add, out), add.outputs[0]
            nodes.append(add)
    m = NormMatch(mean1.name, "decomposed", nodes, x, out, gamma=gamma, beta=beta, epsilon=eps)
    m.axis, m.rejection = axis, rejection
    if m.rejection is None and not _affine_along(gamma, beta, m.axis, _rank(x, shapes)):
        m.rejection = "its γ/β vary along more than the normalized axis"
    return m


def _affine_along(gamma, beta, axis: int, rank: int) -> bool:
    for t in (gamma, beta):
        v = const_values(t) if t is not None else None
        if v is None:
            continue
        v = np.asarray(v)
        if v.ndim > rank:
            return False
        shape = (1,) * (rank - v.ndim) + v.shape
        if any(s != 1 for i, s in enumerate(shape) if i != axis):
            return False
    return True


def _rank(t: gs.Tensor, shapes: dict[str, Shape]) -> Optional[int]:
    s = shapes.get(t.name)
    return None if s is None else len(s)


def find_norms(graph: gs.Graph, shapes: dict[str, Shape]) -> list[NormMatch]:
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
        elif node.op in ("ReduceMean", "GlobalAveragePool"):
            m = match_decomposed(node, shapes) if node.op == "ReduceMean" else None
            if m is None:  # tf2onnx's and jax2onnx's forms (norm_variants.py)
                from .norm_variants import match_variant

                m = match_variant(node, shapes, outputs)
            if m is not None:
                out.append(m)
    return out
