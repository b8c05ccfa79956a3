"""onnxruntime's fused transformer ops (com.microsoft), as its transformer optimizer emits them.

- `EmbedLayerNormalization(input_ids, segment_ids, word, position, segment, γ, β, mask, position_ids)`
  is `LN(word[ids] + position[pos] + segment[seg])` and a per-batch `mask_index` (on CPU, the count
  of ones per row of `mask`). The view sees a source node (the lookups' sum: its tables are centered
  row by row) feeding a LayerNorm. Emitted as its parts (onnxruntime has no fused embed + RMSNorm op):
  a Gather per table, the Adds, the target's RMSNorm, and the CPU kernel's mask_index where it is read.
- `Attention(input, weights, bias, ...)` projects its input by a constant weight first: a linear
  reader of input 0 (a norm's β folds into its bias), but no source.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes import Node, View
from ..passes.axes import Shape
from ..passes.rules import rule
from .norms import NormMatch, given, is_constant, uses_stats
from .stored_integers import MS_DEQUANTIZING, dequantized

MS = "com.microsoft"
# EmbedLayerNormalization's inputs
_IDS, _SEG_IDS, _WORD, _POS, _SEG, _GAMMA, _BETA, _MASK, _POS_IDS = range(9)


def match_embed(node: gs.Node, shapes: dict[str, Shape], outputs: set) -> NormMatch:
    ins, outs = list(node.inputs), list(node.outputs)
    out = outs[0] if outs else None
    summed = given(outs, 2) or gs.Variable(f"{node.name}/embedding_sum")
    if out is not None and out.name in shapes:
        shapes.setdefault(summed.name, shapes[out.name])
    m = NormMatch(node.name, "EmbedLayerNormalization", [node], summed, out,
                  gamma=given(ins, _GAMMA), beta=given(ins, _BETA),
                  epsilon=float(node.attrs.get("epsilon", 1e-12)))
    s = shapes.get(out.name) if out is not None else None
    m.axis = 2 if s is not None and len(s) == 3 else None
    tables = [t for t in (given(ins, _WORD), given(ins, _POS), given(ins, _SEG)) if t is not None]
    if m.axis is None:
        m.rejection = "rank of its output is unknown"
    elif not all(is_constant(t) for t in tables + [m.gamma]) or (m.beta is not None and not is_constant(m.beta)):
        m.rejection = "its embedding tables or γ/β are not constants"
    elif uses_stats(outs[1:2], outputs) and int(node.attrs.get("mask_index_type", 1)) != 1:
        m.rejection = f"its mask_index output (mask_index_type={node.attrs.get('mask_index_type')}) is read"
    return m


def add_embed_view(view: View, info, m: NormMatch) -> None:
    """The lookups' sum as a source node (tables centered per row), then the norm."""
    node = m.nodes[0]
    ins = list(node.inputs)
    summed = m.x.name
    names = [t.name if t is not None else "" for t in ins]
    slots = [i for i in (_WORD, _POS, _SEG) if given(ins, i) is not None]
    view.add_node(Node(f"{m.name}#sum", "EmbedLayerNormalization(lookups)", names[:_GAMMA] + [""] * 2 + names[_MASK:],
                       [summed], rule=rule("embedding", table=slots, q=2), origin=m.name))  # [B, S] ids
    beta = given(ins, _BETA) is not None
    view.add_node(Node(m.name, m.kind, [summed, names[_GAMMA], names[_BETA] if beta else ""], [m.output.name],
                       rule=rule("layer_norm", axes=[-1], gamma=1, beta=2 if beta else None, eps=m.epsilon,
                                 rejection=m.rejection)))


def embed_sum(em, m: NormMatch) -> gs.Tensor:
    """Replace the fused op's lookups (on its live, centered tables) and its mask_index; return
    the sum the RMSNorm reads. Called by the emitter before it detaches the node."""
    node = m.nodes[0]
    ins, outs = list(node.inputs), list(node.outputs)
    ids = ins[_IDS]
    word = em.var(f"{m.name}/lnfold_word")
    em.node("Gather", [ins[_WORD], ids], [word], axis=0)
    pos = em.var(f"{m.name}/lnfold_position")
    if given(ins, _POS_IDS) is not None:
        em.node("Gather", [ins[_POS], ins[_POS_IDS]], [pos], axis=0)
    else:  # rows 0 .. S-1, broadcast over the batch (the kernel's `index % sequence_length`)
        seq = em.var(f"{m.name}/lnfold_seq_len", np.int64)
        if em.opset >= 15:
            em.node("Shape", [ids], [seq], start=1, end=2)
        else:
            _shape_dim(em, ids, 1, seq)
        em.node("Slice", [ins[_POS], em.const("lnfold/zero", np.array([0], np.int64)), seq,
                          em.const("lnfold/axis0", np.array([0], np.int64))], [pos])
    total = em.var(f"{m.name}/lnfold_word_pos")
    em.node("Add", [word, pos], [total])
    if given(ins, _SEG) is not None and given(ins, _SEG_IDS) is not None:
        seg = em.var(f"{m.name}/lnfold_segment")
        em.node("Gather", [ins[_SEG], ins[_SEG_IDS]], [seg], axis=0)
        with_seg = em.var(f"{m.name}/lnfold_sum")
        em.node("Add", [total, seg], [with_seg])
        total = with_seg
    summed = given(outs, 2)
    if summed is not None:  # embedding_sum is read: it becomes the (centered) sum itself
        node.outputs[2] = gs.Variable.empty()
        em.node("Identity", [total], [summed])
        total = summed
    mask_index = given(outs, 1)
    if mask_index is not None and (mask_index.outputs or mask_index in em.graph.outputs):
        node.outputs[1] = gs.Variable.empty()
        _mask_index(em, m.name, ids, given(ins, _MASK), mask_index)
    return total


def _shape_dim(em, t, k: int, out) -> None:
    shape = em.var("lnfold/shape", np.int64)
    em.node("Shape", [t], [shape])
    em.node("Gather", [shape, em.const("lnfold/k", np.array([k], np.int64))], [out], axis=0)


def _mask_index(em, name: str, ids, mask, out) -> None:
    """The CPU kernel's mask_index: the number of ones in each row of `mask` (int32), else zeros."""
    if mask is None:
        batch = em.var(f"{name}/lnfold_batch", np.int64)
        _shape_dim(em, ids, 0, batch)
        em.node("ConstantOfShape", [batch], [out], value=onnx.helper.make_tensor("v", onnx.TensorProto.INT32, [1], [0]))
        return
    ones = em.var(f"{name}/lnfold_mask_ones", np.bool_)
    em.node("Equal", [mask, em.const("lnfold/one", np.array(1, np.int32))], [ones])
    count = em.var(f"{name}/lnfold_mask_count", np.int32)
    em.node("Cast", [ones], [count], to=int(onnx.TensorProto.INT32))
    em.reduce("ReduceSum", count, [1], out, keepdims=0)


def _attention(info, node: gs.Node, opset: int):
    return rule("linear", weight=1, w_axis=1, bias=2 if given(node.inputs, 2) else None, data=0, source=False)


# com.microsoft ops the view classifies (the fused norms are matched in norm_patterns.py)
MS_OPS = {"Attention": _attention,
          **{op: lambda info, node, opset: dequantized(node) for op in MS_DEQUANTIZING}}
