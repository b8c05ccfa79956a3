"""ONNX ops -> the stream view of passes/: one table row per op, naming it in the vocabulary of
passes/rules.py with its attributes decoded. Nothing here decides a fold: what an op means for the
stream (and what a multi-op LayerNorm looks like: passes/patterns.py) lives in passes/.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx_graphsurgeon as gs

from ..passes import Node, View
from ..passes.axes import Shape
from ..passes.match import deepest
from ..passes.patterns import collapse_norms
from ..passes.rules import Rule, rule
from ..passes.view import SizeOf

from . import fused, guards
from .computed_shapes import computed_axis_map, read_axes, shape_entries
from .norm_patterns import RMS_KINDS, SKIP_BIAS, find_norms
from .norms import NormMatch, const_values, constant_shape, given, is_constant, reduce_axes
from .stored_integers import dequantized

_FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


class GraphInfo:
    """Shapes and constant-ness of the tensors of one gs.Graph."""

    def __init__(self, graph: gs.Graph, shapes: dict[str, Shape]) -> None:
        self.graph = graph
        self.shapes = shapes
        self.tensors = graph.tensors()  # name -> tensor, as imported (edits add no lookups)
        self.output_names = frozenset(t.name for t in graph.outputs)

    def shape(self, t) -> Shape:
        if t is None or not t.name:
            return None
        s = constant_shape(t)
        return s if s is not None else self.shapes.get(t.name)

    def rank(self, t) -> Optional[int]:
        s = self.shape(t)
        return None if s is None else len(s)


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# --- op families: each returns the node's Rule, or None (opaque) --------------------------------

def _transpose(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    rank = info.rank(node.inputs[0])
    perm = node.attrs.get("perm")
    if perm is None and rank is not None:
        perm = list(reversed(range(rank)))
    return None if perm is None else rule("permute", perm=[int(p) for p in perm])


def _slice_axes(info: GraphInfo, node: gs.Node) -> Optional[set[int]]:
    rank = info.rank(node.inputs[0])
    if rank is None:
        return None
    if "starts" in node.attrs:  # opset < 10
        axes = node.attrs.get("axes", list(range(len(node.attrs["starts"]))))
    elif given(node.inputs, 3) is not None:
        axes = const_values(node.inputs[3])
        if axes is None:
            return None
    else:
        starts = const_values(node.inputs[1])
        if starts is None:
            return None
        axes = list(range(np.size(starts)))
    return {_norm_axis(int(a), rank) for a in np.asarray(axes).reshape(-1)}


def _slice(info: GraphInfo, node: gs.Node) -> Rule:
    """Slice; its start when it cuts one axis with step 1 (a fused q/k/v projection's q rows)."""
    axes = _slice_axes(info, node)
    if "starts" in node.attrs or axes is None or len(axes) != 1:
        return rule("along", data=[0], axes=axes)
    starts = const_values(node.inputs[1])
    step = given(node.inputs, 4)
    steps = const_values(step)
    one_step = step is None or (steps is not None and np.all(np.asarray(steps) == 1))
    if starts is None or np.size(starts) != 1 or not one_step:
        return rule("along", data=[0], axes=axes)
    return rule("along", data=[0], axes=axes, starts=[int(np.asarray(starts).reshape(-1)[0])])


def _gather(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    data, idx = node.inputs[0], node.inputs[1]
    r, q = info.rank(data), info.rank(idx)
    if r is None or q is None:
        return None
    g = _norm_axis(int(node.attrs.get("axis", 0)), r)
    if is_constant(data):  # an embedding table
        return rule("embedding", table=0, q=q) if g == 0 else None
    k = const_values(idx) if q == 0 else None  # a scalar index: a select
    return rule("take", data=0, start=g, stop=g + 1, q=q, index=None if k is None else [int(np.asarray(k).reshape(-1)[0])])


def _gather_nd(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    """`GatherND(data, idx)`: the last axis of idx (k long) indexes data's axes b..b+k-1 after its
    b batch axes (torch's `table[position_ids]` exports as one, with k = 1)."""
    idx = info.shape(node.inputs[1])
    b = int(node.attrs.get("batch_dims", 0))
    if idx is None or not isinstance(idx[-1], int):
        return None
    return rule("take", data=0, start=b, stop=b + idx[-1], q=len(idx) - 1 - b)


def _gather_elements(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    r = info.rank(node.inputs[0])
    return None if r is None else rule("gather_rows", data=0, index=1, axis=_norm_axis(int(node.attrs.get("axis", 0)), r))


def _reduce(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    rank = info.rank(node.inputs[0])
    axes = reduce_axes(node)
    if rank is None or axes is None:
        return None
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return rule("elementwise", op="identity")
        axes = list(range(rank))
    return rule("reduce", axes=sorted({_norm_axis(a, rank) for a in axes}),
                keepdims=bool(int(node.attrs.get("keepdims", 1))), op="mean" if node.op == "ReduceMean" else "sum")


def _softmax(info: GraphInfo, node: gs.Node, opset: int) -> Optional[Rule]:
    rank = info.rank(node.inputs[0])
    if rank is None:
        return None
    arg = node.op.startswith("Arg")
    default = -1 if opset >= 13 or arg else 1
    axis = _norm_axis(int(node.attrs.get("axis", 0 if arg else default)), rank)
    if not arg and opset < 13 and axis != rank - 1:
        axis = None  # older Softmax coerces to 2-D from its axis: over several axes
    return rule("invariant_along", axis=axis)


def _gemm(info: GraphInfo, node: gs.Node) -> Rule:
    a = node.attrs
    return rule("linear", weight=1, w_axis=0 if int(a.get("transB", 0)) else 1,
                bias=2 if given(node.inputs, 2) else None, out_axis=1, data=0,
                in_axis=0 if int(a.get("transA", 0)) else 1, alpha=float(a.get("alpha", 1.0)),
                beta=float(a.get("beta", 1.0)))


def _reshape(info: GraphInfo, node: gs.Node) -> Rule:
    """Reshape spells its target sizes in input 1 (computed from the input's own Shape, the
    prefix/suffix rule places axes shape inference leaves symbolic: computed_shapes.py);
    Flatten/Squeeze/Unsqueeze spell none (their rows in OPS are plain `reshape`)."""
    sizes = _sizes(info, node, 1)
    if sizes is not None and not int(node.attrs.get("allowzero", 0)):  # a 0 copies the input's dim
        x, src = node.inputs[0], info.shape(node.inputs[0]) or ()
        sizes = [SizeOf(x.name, k, src[k] if k < len(src) and isinstance(src[k], int) else None) if e == 0 else e
                 for k, e in enumerate(sizes)]
    return rule("reshape", axis_map=computed_axis_map(node, info.shape(node.inputs[0]), info.shape),
                sizes=sizes, slot=1, fixed=sizes is None)


def _expand(info: GraphInfo, node: gs.Node) -> Rule:
    sizes = _sizes(info, node, 1)
    return rule("broadcast", data=[0], sizes=sizes, slot=1, fixed=sizes is None)


def _sizes(info: GraphInfo, node: gs.Node, slot: int) -> Optional[list]:
    """The output sizes that input `slot` spells, one entry per output axis (an int, a
    passes.view.SizeOf: read from a tensor's shape at run time, None: unknown; computed_shapes.py),
    or None where not even their number is known."""
    out = info.rank(node.outputs[0])
    if out is None or len(node.inputs) <= slot:
        return None
    got = shape_entries(node.inputs[slot], info.shape)
    return [None] * out if got is None or len(got) != out else got


def _conv(info: GraphInfo, node: gs.Node) -> Rule:
    return rule("conv", weight=1, w_axis=1 if node.op == "ConvTranspose" else 0,
                bias=2 if given(node.inputs, 2) else None, groups=int(node.attrs.get("group", 1)))


def _cast(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    if node.attrs.get("to") not in _FLOAT_TYPES:
        return None
    return dequantized(node) or rule("elementwise", op="cast")  # integers to floats: stored_integers.py


def _dropout(node: gs.Node) -> Optional[Rule]:
    """Dropout is the identity unless in training mode (input 2 true, or set at run time): then it
    zeroes random entries and scales the rest, which no centering survives: opaque."""
    mode = given(node.inputs, 2)
    training = mode is not None and (const_values(mode) is None or bool(np.asarray(const_values(mode)).any()))
    return None if training else rule("elementwise", op="dropout")


def _pow(info: GraphInfo, node: gs.Node) -> Rule:
    v = const_values(node.inputs[1]) if len(node.inputs) > 1 else None
    return rule("pow", exponent=float(np.asarray(v).reshape(-1)[0]) if v is not None and np.size(v) == 1 else None)


def _pad(info: GraphInfo, node: gs.Node, opset: int) -> Optional[Rule]:
    """Pad on non-feature axes: zero rows (constant 0) or copied rows (edge/reflect/wrap)."""
    rank = info.rank(node.inputs[0])
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if rank is None:
        return None
    axes_given = given(node.inputs, 3)
    if "pads" in node.attrs:  # opset < 11
        pads, value, axes = node.attrs["pads"], node.attrs.get("value", 0.0), None
    else:
        pads = _computed_const(given(node.inputs, 1), opset)
        value = _computed_const(given(node.inputs, 2), opset) if given(node.inputs, 2) is not None else 0.0
        axes = _computed_const(axes_given, opset)
    if pads is None or value is None or (axes_given is not None and axes is None):
        return None
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    axes = list(range(rank)) if axes is None else [_norm_axis(int(a), rank) for a in np.asarray(axes).reshape(-1)]
    if len(pads) != 2 * len(axes):
        return None
    padded = {a for k, a in enumerate(axes) if pads[k] or pads[k + len(axes)]}
    return rule("pad", axes=padded, zero=mode != "constant" or not np.any(np.asarray(value) != 0))


def _computed_const(t, opset: int, limit: int = 24) -> Optional[np.ndarray]:
    """The value of `t` when it is a constant or a few nodes compute it from constants alone
    (the TorchScript exporter computes Pad's pads at run time: ConstantOfShape, Concat, ...)."""
    if t is None:
        return None
    v = const_values(t)
    if v is not None:
        return np.asarray(v)
    nodes: list[gs.Node] = []
    stack = [t]
    while stack:
        x = stack.pop()
        if isinstance(x, gs.Constant):
            continue
        if len(x.inputs) != 1:
            return None  # a graph input: not constant
        n = x.inputs[0]
        if any(n is m for m in nodes):
            continue
        if len(nodes) >= limit or n.op in ("Shape", "Size") or any(isinstance(a, gs.Graph) for a in n.attrs.values()):
            return None
        nodes.append(n)
        stack.extend(i for i in n.inputs if i is not None and i.name)
    try:
        from onnx.reference import ReferenceEvaluator

        sub = gs.Graph(nodes=list(reversed(nodes)), inputs=[], outputs=[t], opset=opset)
        sub.toposort()
        return np.asarray(ReferenceEvaluator(gs.export_onnx(sub, do_type_check=False)).run(None, {})[0])
    except Exception:  # best effort: an unknown value only keeps the Pad opaque
        return None


def _where(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    """Where(mask, 0, x) or Where(mask, x, 0): masked_fill with zeros (torch.onnx's export of it)."""
    for zero, data in ((1, 2), (2, 1)):
        v = const_values(node.inputs[zero])
        if v is not None and not np.any(np.asarray(v)) and not is_constant(node.inputs[data]):
            return rule("zero_rows", data=data, mask=0)
    return None


def _resize(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    """Resize along the axes whose size it changes; by `sizes` (input 3, opset >= 11) it spells
    every axis's size, by `scales` none. tf_crop_and_resize writes a constant (extrapolation_value)
    outside the crop: opaque."""
    mode = node.attrs.get("coordinate_transformation_mode", "half_pixel")
    if isinstance(mode, bytes):
        mode = mode.decode()
    src, dst = info.shape(node.inputs[0]), info.shape(node.outputs[0])
    if mode == "tf_crop_and_resize" or src is None or dst is None or len(src) != len(dst):
        return None
    axes = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b or not isinstance(a, int)]
    if given(node.inputs, 3) is None:
        return rule("resample", data=0, axes=axes)
    sizes = _sizes(info, node, 3)
    return rule("resample", data=0, axes=axes, sizes=sizes, slot=3, fixed=sizes is None)


def _tile(info: GraphInfo, node: gs.Node) -> Optional[Rule]:
    """Tile along the axes whose repeat count is not 1: read from the repeats where constant (or
    computed from constants), else from the shapes (a size that changes or is symbolic: tiled)."""
    reps = const_values(node.inputs[1]) if len(node.inputs) > 1 else None
    if reps is not None:
        return rule("tile", data=0, axes=[k for k, r in enumerate(np.asarray(reps).reshape(-1)) if r != 1])
    src, dst = info.shape(node.inputs[0]), info.shape(node.outputs[0])
    if src is None or dst is None or len(src) != len(dst):
        return None
    return rule("tile", data=0, axes=[k for k, (a, b) in enumerate(zip(src, dst)) if a != b or not isinstance(a, int)])


def _shape(info: GraphInfo, node: gs.Node) -> Rule:
    reads, sizes = read_axes(node, info.shape, info.output_names)
    return rule("metadata", sized=True, reads=reads, sizes_of=sorted(sizes))


def _axis_attr(info: GraphInfo, node: gs.Node, t) -> Optional[set[int]]:
    """{the node's `axis`} on tensor t's axes (Split's input, Concat's output)."""
    r = info.rank(t)
    return None if r is None else {_norm_axis(int(node.attrs.get("axis", 0)), r)}


def _unary(kind="elementwise", **params):
    return lambda info, n, _: rule(kind, **params)


# op type -> (info, node, opset) -> Rule or None. Adding an op is one entry here.
OPS: dict[str, Callable[[GraphInfo, gs.Node, int], Optional[Rule]]] = {
    "Identity": _unary(op="identity"),
    "Neg": _unary(op="neg"),
    "Dropout": lambda info, n, _: _dropout(n),
    "Cast": lambda info, n, _: _cast(info, n),
    "DequantizeLinear": lambda info, n, _: dequantized(n),
    "Add": _unary("broadcast", data=[0, 1]),
    "Sub": _unary("broadcast", data=[0, 1], minus=[1]),
    "Expand": lambda info, n, _: _expand(info, n),
    "Mul": _unary("scale", operands=[0, 1]),
    "Div": _unary("scale", operands=[0, 1], divide=True),
    "Pow": lambda info, n, _: _pow(info, n),
    "Sqrt": _unary("sqrt"),
    "Reciprocal": _unary("reciprocal"),
    "Reshape": lambda info, n, _: _reshape(info, n),
    "Flatten": _unary("reshape"),
    "Squeeze": _unary("reshape"),
    "Unsqueeze": _unary("reshape"),
    "Transpose": lambda info, n, _: _transpose(info, n),
    "Slice": lambda info, n, _: _slice(info, n),
    "Concat": lambda info, n, _: rule("along", data=list(range(len(n.inputs))),
                                      axes=_axis_attr(info, n, n.outputs[0])),
    "Split": lambda info, n, _: rule("along", data=[0], outs=list(range(len(n.outputs))),
                                     axes=_axis_attr(info, n, n.inputs[0]), partition=True),
    "Gather": lambda info, n, _: _gather(info, n),
    "GatherElements": lambda info, n, _: _gather_elements(info, n),
    "GatherND": lambda info, n, _: _gather_nd(info, n),
    "Where": lambda info, n, _: _where(info, n),
    "Resize": lambda info, n, _: _resize(info, n),
    "Tile": lambda info, n, _: _tile(info, n),
    "ReduceMean": lambda info, n, _: _reduce(info, n),
    "ReduceSum": lambda info, n, _: _reduce(info, n),
    "Softmax": _softmax,
    "LogSoftmax": _softmax,
    "ArgMax": _softmax,
    "ArgMin": _softmax,
    # Shape/Size read no values, but their results hold the width, which CRMSNorm and slicing change
    # (Shape: which axes' sizes the graph reads other than as an output size, computed_shapes.read_axes).
    "Shape": lambda info, n, _: _shape(info, n),
    # Draws as many numbers as its input has, of its type: reads no values (random_ops.py says how
    # verification draws the same numbers in each model).
    "RandomNormalLike": _unary("metadata", sized=True),
    "RandomUniformLike": _unary("metadata", sized=True),
    "Size": _unary("metadata", sized=True),
    "Clip": guards.clip_rule,  # HF's fp16 overflow clamp only (passes/guards.py says why that is sound)
    "IsInf": _unary("nonfinite_test"),
    "IsNaN": _unary("nonfinite_test"),
    "Pad": _pad,
    "MatMul": _unary("matmul", bias_after=True),  # emit.py/deferred_norm.py take a lone Add after it as its bias
    "Gemm": lambda info, n, _: _gemm(info, n),
    "Einsum": lambda info, n, _: rule("einsum", equation=str(n.attrs.get("equation", ""))) if len(n.inputs) == 2 else None,
    "Conv": lambda info, n, _: _conv(info, n),
    "ConvTranspose": lambda info, n, _: _conv(info, n),
}


def _captured(node: gs.Node) -> list[str]:
    """Outer tensors a node's subgraphs (If/Loop/Scan bodies) read implicitly."""
    names: list[str] = []
    for attr in node.attrs.values():
        for g in attr if isinstance(attr, list) else [attr]:
            if isinstance(g, gs.Graph):
                inner = {t.name for n in g.nodes for t in n.outputs} | {t.name for t in g.inputs}
                for n in g.nodes:
                    names += [t.name for t in n.inputs if t.name and t.name not in inner
                              and not isinstance(t, gs.Constant)]
                    names += [x for x in _captured(n) if x not in inner]
    return list(dict.fromkeys(names))


def build_view(info: GraphInfo, opset: int, rms: bool = False) -> tuple[View, dict[str, NormMatch]]:
    """The stream view of `info.graph`, and the LayerNorm matches by view-node name; with `rms`,
    the RMSNorms as given too."""
    graph, shapes = info.graph, info.shapes
    view = View()
    variant_misses: dict = {}
    matches = find_norms(graph, shapes, variant_misses, rms=rms)
    covered = {id(n) for m in matches for n in m.nodes}  # tf2onnx's/jax2onnx's norms: several nodes
    by_first = {id(m.nodes[0]): m for m in matches}
    by_name: dict[str, NormMatch] = {}

    for node in graph.nodes:
        if id(node) in by_first:
            m = by_first[id(node)]
            by_name[m.name] = m
            _add_norm(view, info, m)
            continue
        if id(node) in covered or node.op == "Constant":
            continue
        table = OPS if (node.domain or "") in ("", "ai.onnx") else fused.MS_OPS if node.domain == fused.MS else {}
        r = table[node.op](info, node, opset) if node.op in table else None
        inputs = [t.name if t is not None else "" for t in node.inputs] + _captured(node)
        view.add_node(Node(node.name, _op_name(node), inputs, [t.name for t in node.outputs], rule=r))

    graph_inputs, graph_outputs = {t.name for t in graph.inputs}, {t.name for t in graph.outputs}
    for name, v in view.values.items():
        t = info.tensors.get(name)
        v.shape = s = info.shape(t) if t is not None else shapes.get(name)
        v.rank = None if s is None else len(s)
        v.is_const = is_constant(t)
        v.is_graph_input, v.is_graph_output = name in graph_inputs, name in graph_outputs
        if v.is_const and s is not None and all(d == 1 for d in s):
            v.scalar = float(np.asarray(const_values(t)).reshape(-1)[0])

    nodes, tensors = {n.name: n for n in graph.nodes}, info.tensors
    for name, d in collapse_norms(view, rms=rms).items():  # torch's forms, in the vocabulary of passes/
        kind = "decomposed RMSNorm" if d.rms else "decomposed"
        by_name[name] = NormMatch(d.name, kind, [nodes[n] for n in d.nodes], tensors[d.x], tensors[d.output],
                                  gamma=tensors[d.gamma] if d.gamma else None,
                                  beta=tensors[d.beta] if d.beta else None,
                                  epsilon=d.epsilon, axis=d.axis, rejection=d.rejection)
    for name, miss in variant_misses.items():  # a mean neither torch's form nor tf2onnx's/jax2onnx's
        if name not in by_name:
            have = view.near_misses.get(name)
            view.near_misses[name] = miss if have is None else deepest(have, miss)
    for m in by_name.values():
        spec = view.nodes[m.name].norm
        m.axis, m.rejection = (spec.axis, None) if spec is not None else (None, view.nodes[m.name].norm_rejection)
    return view, by_name


def _op_name(node: gs.Node) -> str:
    """How the report names an op: `MatMul`; with its domain outside the default one
    (`com.microsoft.Attention`), as the torch frontend names `aten.mm.default`."""
    domain = node.domain or ""
    return node.op if domain in ("", "ai.onnx") else f"{domain}.{node.op}"


def _add_norm(view: View, info: GraphInfo, m: NormMatch) -> None:
    if m.kind == "EmbedLayerNormalization":
        return fused.add_embed_view(view, info, m)
    names = lambda ts: [t.name if t is not None else "" for t in ts]  # noqa: E731
    x = m.x.name
    if m.kind in SKIP_BIAS:
        # Seen by the analysis as an Add (input + skip + bias) feeding a LayerNorm (or, for
        # SkipSimplifiedLayerNormalization, an RMSNorm as given).
        summed = m.sum_output.name if m.sum_output is not None else f"{m.name}/input_skip_bias_sum"
        info.shapes.setdefault(summed, info.shape(m.x))
        # Input positions as on the real node (bias is its input 4, or 3), so edits find them.
        at = SKIP_BIAS[m.kind]
        data = [0, 1] + ([at] if m.bias is not None else [])
        view.add_node(Node(f"{m.name}#add", f"{m.kind}(add)", names([m.x, m.skip] + [None] * (at - 2) + [m.bias]),
                           [summed], rule=rule("broadcast", data=data), origin=m.name))
        x = summed
    ins = [x] + names([m.gamma, m.beta])
    if m.kind in RMS_KINDS:  # an RMSNorm as given (no β): its input need not be zero-mean
        view.add_node(Node(m.name, m.kind, ins[:2], [m.output.name],
                           rule=rule("layer_norm", axes=m.axes, gamma=1 if ins[1] else None, eps=m.epsilon, rms=True)))
        return
    view.add_node(Node(m.name, m.kind, ins, [m.output.name],
                       rule=rule("layer_norm", axes=m.axes, gamma=1 if ins[1] else None, beta=2 if ins[2] else None,
                                 eps=m.epsilon, stats_used=m.stats_used)))
