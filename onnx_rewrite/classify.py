"""ONNX ops -> the stream view of passes/. One entry per op family; nothing here decides a fold.

Each builder returns the callables a `passes.Node` carries (transfer / backward / centering /
channel_scale / invariant) for one graph node, reading inferred shapes to place the feature axis.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx_graphsurgeon as gs

from ..passes import ConstRef, Node, NormSpec, View
from ..passes.axes import broadcast_rules, permute_rules, same_axes_rules
from ..passes.view import ChannelScale, DimRef, LinearRead

from . import fused, guards
from .computed_shapes import computed_axis_map
from .norms import NormMatch, const_values, constant_shape, find_norms, is_constant, reduce_axes
from .shapes import Shape, reshape_axis

_FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


class GraphInfo:
    """Shapes and constant-ness of the tensors of one gs.Graph."""

    def __init__(self, graph: gs.Graph, shapes: dict[str, Shape]) -> None:
        self.graph = graph
        self.shapes = shapes
        self.tensors = graph.tensors()  # name -> tensor, as imported (edits add no lookups)

    def shape(self, t) -> Shape:
        if t is None or not t.name:
            return None
        s = constant_shape(t)
        return s if s is not None else self.shapes.get(t.name)

    def rank(self, t) -> Optional[int]:
        s = self.shape(t)
        return None if s is None else len(s)

    def is_const(self, t) -> bool:
        return t is not None and is_constant(t)

    def const_ref(self, node: gs.Node, i: int, axis: Optional[int]) -> Optional[ConstRef]:
        """The constant behind input `i` of `node`, through a Transpose/Identity/Cast it alone reads."""
        t = node.inputs[i]
        if self.is_const(t):
            return ConstRef(t.name, axis, node.name, i)
        p = t.inputs[0] if len(t.inputs) == 1 else None
        if p is None or len(t.outputs) != 1 or t in self.graph.outputs or not self.is_const(p.inputs[0]):
            return None
        if p.op == "Transpose":
            perm = p.attrs.get("perm") or list(reversed(range(self.rank(p.inputs[0]) or 0)))
            return ConstRef(p.inputs[0].name, None if axis is None else int(perm[axis]), p.name, 0)
        if p.op == "Identity" or (p.op == "Cast" and p.attrs.get("to") in _FLOAT_TYPES):
            return ConstRef(p.inputs[0].name, axis, p.name, 0)
        return None


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# --- op families --------------------------------------------------------------------------------
# Each returns a dict of keyword arguments for passes.Node.

def _unary(info: GraphInfo, node: gs.Node) -> dict:
    return dict(
        transfer=lambda i, b: [(0, b)] if i == 0 else None,
        backward=lambda o, a: [(0, a)] if o == 0 else None,
    )


def _add(info: GraphInfo, node: gs.Node, data: list[int]) -> dict:
    """Add/Sub with numpy broadcasting: every input in `data` carries the stream."""
    return broadcast_rules([info.rank(t) for t in node.inputs], info.rank(node.outputs[0]),
                      [info.is_const(t) for t in node.inputs], data)


def _mul(info: GraphInfo, node: gs.Node) -> dict:
    """Mul/Div by a factor constant along the feature axis is transparent; per-channel is LayerScale."""
    R = info.rank(node.outputs[0])
    is_div = node.op == "Div"

    def aligned_dim(j, a):
        s = info.shape(node.inputs[j])
        if s is None or R is None:
            return "unknown"
        k = a - (R - len(s))
        return 1 if k < 0 else s[k]

    def transfer(i, b):
        if R is None or info.rank(node.inputs[i]) is None or (is_div and i != 0):
            return None
        a = b + R - info.rank(node.inputs[i])
        return [(0, a)] if aligned_dim(1 - i, a) == 1 else None

    def backward(o, a):
        cands = [i for i in ((0,) if is_div else (0, 1)) if aligned_dim(1 - i, a) == 1]
        if len(cands) != 1:
            return None
        i = cands[0]
        b = a - (R - info.rank(node.inputs[i]))
        return [(i, b)] if b >= 0 else None

    def channel_scale(o, a):
        if is_div or R is None:
            return None
        for j in (0, 1):
            i = 1 - j
            if not info.is_const(node.inputs[j]) or info.is_const(node.inputs[i]):
                continue
            s = info.shape(node.inputs[j])
            k = a - (R - len(s))
            if k < 0 or any(d != 1 for n, d in enumerate(s) if n != k):
                continue
            b = a - (R - info.rank(node.inputs[i]))
            if b < 0:
                continue
            return ChannelScale(i, b, ConstRef(node.inputs[j].name, k, node.name, j))
        return None

    return dict(transfer=transfer, backward=backward, channel_scale=channel_scale)


def _reshape(info: GraphInfo, node: gs.Node) -> dict:
    src, dst = node.inputs[0], node.outputs[0]
    # a target shape computed from the input's own Shape (computed_shapes.py) places axes that
    # shape inference leaves symbolic
    computed = computed_axis_map(node, info.shape(src), info.rank) if node.op == "Reshape" else {}

    def transfer(i, b):
        if i != 0:
            return None
        got = reshape_axis(info.shape(src), info.shape(dst), b)
        return _wrap(computed.get(b) if got is None else got)

    def backward(o, a):
        if o != 0:
            return None
        got = reshape_axis(info.shape(dst), info.shape(src), a)
        if got is None:
            got = next((k for k, v in computed.items() if v == a), None)
        return _wrap_in(got)

    return dict(regroups=True, transfer=transfer, backward=backward)


def _wrap(axis):
    return None if axis is None else [(0, axis)]


def _wrap_in(axis):
    return None if axis is None else [(0, axis)]


def _transpose(info: GraphInfo, node: gs.Node) -> dict:
    rank = info.rank(node.inputs[0])
    perm = node.attrs.get("perm")
    if perm is None and rank is not None:
        perm = list(reversed(range(rank)))
    if perm is None:
        return {}
    return permute_rules([int(p) for p in perm])


def _slice_axes(info: GraphInfo, node: gs.Node) -> Optional[set[int]]:
    rank = info.rank(node.inputs[0])
    if rank is None:
        return None
    if "starts" in node.attrs:  # opset < 10
        axes = node.attrs.get("axes", list(range(len(node.attrs["starts"]))))
    elif len(node.inputs) > 3 and node.inputs[3] is not None and node.inputs[3].name:
        axes = const_values(node.inputs[3])
        if axes is None:
            return None
    else:
        starts = const_values(node.inputs[1])
        if starts is None:
            return None
        axes = list(range(np.size(starts)))
    return {_norm_axis(int(a), rank) for a in np.asarray(axes).reshape(-1)}


def _gather(info: GraphInfo, node: gs.Node) -> dict:
    data, idx = node.inputs[0], node.inputs[1]
    r, q = info.rank(data), info.rank(idx)
    if r is None or q is None:
        return {}
    g = _norm_axis(int(node.attrs.get("axis", 0)), r)
    if info.is_const(data):  # an embedding table: a source, centered row by row
        if g != 0:
            return {}
        return dict(centering=lambda o, a: [ConstRef(data.name, a - q + 1, node.name, 0)] if a >= q else None)

    def transfer(i, b):
        if i != 0 or b == g:
            return None
        return [(0, b if b < g else b - 1 + q)]

    def backward(o, a):
        if a < g:
            return [(0, a)]
        if a >= g + q:
            return [(0, a - q + 1)]
        return None

    return dict(transfer=transfer, backward=backward)


def _expand(info: GraphInfo, node: gs.Node) -> dict:
    return _add(info, node, data=[0])


def _reduce(info: GraphInfo, node: gs.Node) -> dict:
    """ReduceMean/ReduceSum over token axes: the shift survives, the feature axis moves up."""
    rank = info.rank(node.inputs[0])
    axes = reduce_axes(node)
    if rank is None or axes is None:
        return {}
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return _unary(info, node)
        axes = list(range(rank))
    axes = {_norm_axis(a, rank) for a in axes}
    keep = int(node.attrs.get("keepdims", 1))

    def transfer(i, b):
        if i != 0 or b in axes:
            return None
        return [(0, b if keep else b - sum(x < b for x in axes))]

    def backward(o, a):
        kept = [d for d in range(rank) if keep or d not in axes]
        if a >= len(kept) or kept[a] in axes:
            return None
        return [(0, kept[a])]

    return dict(transfer=transfer, backward=backward)


def _softmax(info: GraphInfo, node: gs.Node, opset: int) -> dict:
    rank = info.rank(node.inputs[0])
    if rank is None:
        return {}
    default = -1 if opset >= 13 or node.op.startswith("Arg") else 1
    axis = _norm_axis(int(node.attrs.get("axis", 0 if node.op.startswith("Arg") else default)), rank)
    if node.op.startswith("Arg"):
        ok = axis  # ArgMax/ArgMin reduce one axis in every opset
    else:
        ok = axis if opset >= 13 or axis == rank - 1 else None  # older: coerced to 2-D from axis
    return dict(invariant=lambda i, b: i == 0 and b == ok)


def _matmul(info: GraphInfo, node: gs.Node) -> dict:
    R = info.rank(node.outputs[0])

    def centering(o, a):
        if R is None or R < 2:
            return None
        r1, r0 = info.rank(node.inputs[1]), info.rank(node.inputs[0])
        if a == R - 1 and r1 is not None and r1 >= 2:
            ref = info.const_ref(node, 1, r1 - 1)
            if ref is not None:
                return [ref]
        if a == R - 2 and r0 is not None and r0 >= 2:  # W @ x: rows of W are output features
            ref = info.const_ref(node, 0, r0 - 2)
            if ref is not None:
                return [ref]
        return None

    def linear(i, a):
        # x @ W with a constant [in, out] W (behind a Transpose for a tied lm_head)
        r0 = info.rank(node.inputs[0])
        if i != 0 or r0 is None or r0 < 2 or a != r0 - 1 or info.rank(node.inputs[1]) != 2:
            return None
        w = info.const_ref(node, 1, 0)
        return None if w is None else LinearRead(w, _bias_after(info, node))

    return dict(centering=centering, linear=linear)


def _bias_after(info: GraphInfo, node: gs.Node) -> Optional[ConstRef]:
    """The constant bias of the lone Add that alone reads a MatMul's output (torch's Linear)."""
    out = node.outputs[0]
    if len(out.outputs) != 1 or out in info.graph.outputs or out.outputs[0].op != "Add":
        return None
    add = out.outputs[0]
    slot = 1 if add.inputs[0] is out else 0
    b, w = info.shape(add.inputs[slot]), info.shape(node.inputs[1])
    if b is None or w is None or len(b) != 1 or b[0] != w[-1] or not info.is_const(add.inputs[slot]):
        return None
    return ConstRef(add.inputs[slot].name, 0, add.name, slot)


def _gemm(info: GraphInfo, node: gs.Node) -> dict:
    def centering(o, a):
        if a != 1:
            return None
        trans_b = int(node.attrs.get("transB", 0))
        refs = [info.const_ref(node, 1, 0 if trans_b else 1)]
        if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
            c = node.inputs[2]
            rc = info.rank(c)
            refs.append(info.const_ref(node, 2, None if rc == 0 else rc - 1))
        return None if any(r is None for r in refs) else refs

    def linear(i, a):
        if (i != 0 or a != 1 or int(node.attrs.get("transA", 0)) or float(node.attrs.get("alpha", 1.0)) != 1.0
                or float(node.attrs.get("beta", 1.0)) != 1.0):
            return None
        w = info.const_ref(node, 1, 1 if int(node.attrs.get("transB", 0)) else 0)
        if w is None:
            return None
        bias = None
        if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
            s = info.shape(node.inputs[2])
            if not info.is_const(node.inputs[2]) or s is None or len(s) > 1 and s[0] != 1:
                return None  # a C that varies along rows is not a bias
            bias = ConstRef(node.inputs[2].name, None if not s else len(s) - 1, node.name, 2)
        return LinearRead(w, bias)

    return dict(centering=centering, linear=linear)


def _conv(info: GraphInfo, node: gs.Node) -> dict:
    w_axis = 1 if node.op == "ConvTranspose" else 0

    def centering(o, a):
        if a != 1 or int(node.attrs.get("group", 1)) != 1:
            return None
        refs = [info.const_ref(node, 1, w_axis)]
        if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
            refs.append(info.const_ref(node, 2, 0))
        return None if any(r is None for r in refs) else refs

    return dict(centering=centering)


def _cast(info: GraphInfo, node: gs.Node) -> dict:
    return _unary(info, node) if node.attrs.get("to") in _FLOAT_TYPES else {}


def _pad(info: GraphInfo, node: gs.Node, opset: int) -> dict:
    """Pad on non-feature axes: zero rows (constant 0) or copied rows (edge/reflect/wrap)."""
    rank = info.rank(node.inputs[0])
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    ins = list(node.inputs) + [None] * 4
    if rank is None:
        return {}
    if "pads" in node.attrs:  # opset < 11
        pads, value, axes = node.attrs["pads"], node.attrs.get("value", 0.0), None
    else:
        pads = _computed_const(ins[1], opset)
        value = _computed_const(ins[2], opset) if ins[2] is not None and ins[2].name else 0.0
        axes = _computed_const(ins[3], opset) if ins[3] is not None and ins[3].name else None
    if pads is None or value is None or (ins[3] is not None and ins[3].name and axes is None):
        return {}
    if mode == "constant" and np.any(np.asarray(value) != 0):
        return {}  # rows of a nonzero constant: not zero-mean
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    axes = list(range(rank)) if axes is None else [_norm_axis(int(a), rank) for a in np.asarray(axes).reshape(-1)]
    if len(pads) != 2 * len(axes):
        return {}
    padded = {a for k, a in enumerate(axes) if pads[k] or pads[k + len(axes)]}
    return same_axes_rules([0], [0], padded)


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


def _split_axis(info, node):
    r = info.rank(node.inputs[0])
    return None if r is None else {_norm_axis(int(node.attrs.get("axis", 0)), r)}


def _concat_axis(info, node):
    r = info.rank(node.outputs[0])
    return None if r is None else {_norm_axis(int(node.attrs.get("axis", 0)), r)}


# op type -> builder(info, node, opset) -> Node kwargs. Adding an op is one entry here.
OPS: dict[str, Callable[[GraphInfo, gs.Node, int], dict]] = {
    "Identity": lambda info, n, _: _unary(info, n),
    "Neg": lambda info, n, _: _unary(info, n),
    "Dropout": lambda info, n, _: _unary(info, n),
    "Cast": lambda info, n, _: _cast(info, n),
    "Add": lambda info, n, _: _add(info, n, data=[0, 1]),
    "Sub": lambda info, n, _: _add(info, n, data=[0, 1]),
    "Mul": lambda info, n, _: _mul(info, n),
    "Div": lambda info, n, _: _mul(info, n),
    "Reshape": lambda info, n, _: _reshape(info, n),
    "Flatten": lambda info, n, _: _reshape(info, n),
    "Squeeze": lambda info, n, _: _reshape(info, n),
    "Unsqueeze": lambda info, n, _: _reshape(info, n),
    "Transpose": lambda info, n, _: _transpose(info, n),
    "Slice": lambda info, n, _: same_axes_rules([0], [0], _slice_axes(info, n)),
    "Concat": lambda info, n, _: same_axes_rules(list(range(len(n.inputs))), [0], _concat_axis(info, n)),
    "Split": lambda info, n, _: same_axes_rules([0], list(range(len(n.outputs))), _split_axis(info, n)),
    "Gather": lambda info, n, _: _gather(info, n),
    "Expand": lambda info, n, _: _expand(info, n),
    "ReduceMean": lambda info, n, _: _reduce(info, n),
    "ReduceSum": lambda info, n, _: _reduce(info, n),
    "Softmax": _softmax,
    "LogSoftmax": _softmax,
    "ArgMax": _softmax,
    "ArgMin": _softmax,
    # Shape/Size read no values: nothing about the stream's mean can reach their outputs.
    "Shape": lambda info, n, _: dict(invariant=lambda i, b: True, shape_only=True),
    "Size": lambda info, n, _: dict(invariant=lambda i, b: True, shape_only=True),
    "Pad": _pad,
    "MatMul": lambda info, n, _: _matmul(info, n),
    "Gemm": lambda info, n, _: _gemm(info, n),
    "Conv": lambda info, n, _: _conv(info, n),
    "Clip": guards.clip_rules,  # HF's fp16 overflow clamp only (guards.py says why that is sound)
    "IsInf": guards.isinf_rules,
    "IsNaN": guards.isinf_rules,
    "ConvTranspose": lambda info, n, _: _conv(info, n),
}


# --- what CRMSNorm compression asks (passes/compress.py): linear readers, sizes spelled in shapes -

# Ops that only move or copy elements: they commute with any map along the feature axis.
LAYOUT = {"Identity", "Dropout", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose",
          "Slice", "Concat", "Split", "Gather", "Expand", "Pad"}


def _shape_entry(info: GraphInfo, t, k: int):
    """Entry `k` of a 1-D int64 shape tensor: its value when constant (directly or as a constant
    piece of a Concat), "computed" when a Concat piece is not constant, None when unknown."""
    v = const_values(t)
    if v is not None:
        v = np.asarray(v).reshape(-1)
        return int(v[k]) if k < v.size else None
    p = t.inputs[0] if len(t.inputs) == 1 else None
    if p is None or p.op != "Concat":
        return None
    at = 0
    for piece in p.inputs:
        s = info.shape(piece)
        if s is None or len(s) != 1 or not isinstance(s[0], int):
            return None
        if at <= k < at + s[0]:
            return _shape_entry(info, piece, k - at) if is_constant(piece) else "computed"
        at += s[0]
    return None


def _width_refs(info: GraphInfo, node: gs.Node) -> dict:
    """Reshape/Expand spell the output's size in their shape input (input 1)."""
    out = node.outputs[0]

    def width_refs(o, axis):
        s = info.shape(out)
        if s is None or not isinstance(s[axis], int) or len(node.inputs) < 2:
            return None
        entry = _shape_entry(info, node.inputs[1], axis)
        if node.op == "Expand":
            s_in = info.shape(node.inputs[0])
            k = axis - (len(s) - len(s_in)) if s_in is not None else -1
            if k >= 0 and s_in[k] == s[axis] and entry in (1, -1):
                return []  # broadcast from the input: follows its width
        elif entry == -1:
            return []  # inferred
        return [DimRef(node.name, 1, axis)] if entry == s[axis] else None

    return dict(width_refs=width_refs)


def _linear_reader(info: GraphInfo, node: gs.Node) -> dict:
    """MatMul(x, W) [+ Add(b)] and Gemm(x, W, C) with a constant weight read x's last axis."""
    def linear(i, axis):
        x, rank = node.inputs[0], info.rank(node.inputs[0])
        if i != 0 or rank is None or axis != rank - 1:
            return None
        if node.op == "Gemm":
            a = node.attrs
            if int(a.get("transA", 0)) or float(a.get("alpha", 1.0)) != 1 or float(a.get("beta", 1.0)) != 1:
                return None
            w = info.const_ref(node, 1, 1 if int(a.get("transB", 0)) else 0)
            if w is None:
                return None
            if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
                c = node.inputs[2]
                sc = info.shape(c)
                if not info.is_const(c) or sc is None or (len(sc) == 2 and sc[0] != 1) or len(sc) > 2:
                    return None
                return LinearRead(w, ConstRef(c.name, len(sc) - 1 if sc else None, node.name, 2))
            return LinearRead(w)
        if info.rank(node.inputs[1]) != 2:
            return None
        w = info.const_ref(node, 1, 0)
        if w is None:
            return None
        y = node.outputs[0]
        add = y.outputs[0] if len(y.outputs) == 1 else None
        if add is not None and add.op == "Add" and y not in info.graph.outputs:
            slot = 1 if add.inputs[0] is y else 0
            b = add.inputs[slot]
            sb = info.shape(b)
            if info.is_const(b) and sb is not None and sb and all(d == 1 for d in sb[:-1]):
                return LinearRead(w, ConstRef(b.name, len(sb) - 1, add.name, slot))
        return LinearRead(w)

    return dict(linear=linear)


def crms_info(info: GraphInfo, node: gs.Node) -> dict:
    """The view's CRMS fields for one standard-domain node (see passes/view.py)."""
    kw: dict = {}
    if node.op in LAYOUT:
        kw["layout"] = True
    if node.op in ("Reshape", "Expand"):
        kw.update(_width_refs(info, node))
    if node.op in ("MatMul", "Gemm"):
        kw.update(_linear_reader(info, node))
    if node.op in ("Shape", "Size"):
        kw["width_refs"] = lambda o, a: None  # its result holds the width
    return kw


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


def build_view(info: GraphInfo, opset: int) -> tuple[View, dict[str, NormMatch]]:
    """The stream view of `info.graph`, and the LayerNorm matches by view-node name."""
    graph, shapes = info.graph, info.shapes
    view = View()
    matches = find_norms(graph, shapes)
    covered = {id(n) for m in matches for n in m.nodes}
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
        kwargs = {}
        if (node.domain or "") in ("", "ai.onnx") and node.op in OPS:
            kwargs = OPS[node.op](info, node, opset)
            kwargs.update(crms_info(info, node))
        inputs = [t.name if t is not None else "" for t in node.inputs]
        inputs += _captured(node)
        view.add_node(Node(node.name, node.op, inputs, [t.name for t in node.outputs], **kwargs))

    for name, v in view.values.items():
        t = info.tensors.get(name)
        s = info.shape(t) if t is not None else shapes.get(name)
        v.shape = s
        v.rank = None if s is None else len(s)
        v.is_const = t is not None and info.is_const(t)
    for t in graph.inputs:
        if t.name in view.values:
            view.values[t.name].is_graph_input = True
    for t in graph.outputs:
        if t.name in view.values:
            view.values[t.name].is_graph_output = True
    return view, by_name


def _add_norm(view: View, info: GraphInfo, m: NormMatch) -> None:
    if m.kind == "EmbedLayerNormalization":
        return fused.add_embed_view(view, info, m)
    names = lambda ts: [t.name if t is not None else "" for t in ts]  # noqa: E731
    spec = None if m.rejection else NormSpec(0, m.axis, getattr(m.gamma, "name", None),
                                             getattr(m.beta, "name", None), m.epsilon)
    x = m.x.name
    if m.kind == "SkipLayerNormalization":
        # Seen by the analysis as an Add (input + skip + bias) feeding a LayerNorm.
        summed = m.sum_output.name if m.sum_output is not None else f"{m.name}/input_skip_bias_sum"
        inputs = names([m.x, m.skip, None, None, m.bias])
        info.shapes.setdefault(summed, info.shape(m.x))
        # Input positions as on the real node (bias is its input 4), so edits find them.
        ranks = [info.rank(t) if t is not None else None for t in (m.x, m.skip, None, None, m.bias)]
        const = [t is not None and info.is_const(t) for t in (m.x, m.skip, None, None, m.bias)]
        data = [0, 1] + ([4] if m.bias is not None else [])
        kwargs = broadcast_rules(ranks, info.rank(m.x), const, data)
        view.add_node(Node(f"{m.name}#add", "SkipLayerNormalization(add)", inputs, [summed], **kwargs))
        x = summed
    view.add_node(Node(m.name, m.kind, [x] + names([m.gamma, m.beta]), [m.output.name],
                       norm=spec, norm_rejection=m.rejection))
