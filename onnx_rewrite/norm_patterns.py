"""How a LayerNorm is spelled in an ONNX graph: one list of rules, `PATTERNS` (DESIGN §7, "Adding a
norm pattern"). A `NormPattern`'s `match(node, shapes, graph outputs)` returns a `NormMatch` or a
`passes.match.NoMatch` saying why not (a near miss, depth >= 1, is reported); the emitter removes the
covered nodes. torch's decomposed form, which both frontends see, and an RMSNorm written out are
matched over the view instead (passes/patterns.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import onnx_graphsurgeon as gs

from ..passes.axes import Shape
from ..passes.match import MatchResult, NoMatch, deepest
from . import fused, norm_variants
from .norms import NormMatch, given, rank_of, uses_stats

Check = Callable[[gs.Node, dict, set], MatchResult[NormMatch]]
ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class NormPattern:
    name: str
    ops: tuple  # the op types a match starts at
    domains: Optional[tuple]  # ... in these domains (None: any)
    match: Check

    def starts(self, node: gs.Node) -> bool:
        return node.op in self.ops and (self.domains is None or (node.domain or "") in self.domains)


def match_layernormalization(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> NormMatch:
    x = node.inputs[0]
    rank = rank_of(x, shapes)
    axis = int(node.attrs.get("axis", -1))
    m = NormMatch(node.name, "LayerNormalization", [node], x, node.outputs[0], gamma=given(node.inputs, 1),
                  beta=given(node.inputs, 2), epsilon=float(node.attrs.get("epsilon", 1e-5)),
                  stats_used=uses_stats(node.outputs[1:], outputs))
    if rank is not None:
        m.axes = list(range(axis + rank if axis < 0 else axis, rank))
    return m


def match_skip(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> NormMatch:
    ins, outs = list(node.inputs) + [None] * 5, list(node.outputs) + [None] * 4  # (absent optional slots)
    m = NormMatch(node.name, "SkipLayerNormalization", [node], ins[0], outs[0], gamma=ins[2], beta=given(ins, 3),
                  epsilon=float(node.attrs.get("epsilon", 1e-5)), skip=ins[1], bias=given(ins, 4),
                  sum_output=given(outs, 3))
    m.stats_used = uses_stats(outs[1:3], outputs)
    return m


def match_rms_op(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> MatchResult[NormMatch]:
    """onnxruntime's SimplifiedLayerNormalization (X, scale; Y [, inv_std_var]) and opset 23's
    RMSNormalization (X, scale; Y): an RMSNorm as given over axes [axis, rank), one axis only."""
    x = node.inputs[0]
    rank = rank_of(x, shapes)
    if rank is None:
        return NoMatch("the rank of its input is unknown", 1)
    axis = int(node.attrs.get("axis", -1))
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    if len(axes) != 1:
        return NoMatch(f"an RMSNorm over axes {axes} of a rank-{rank} tensor, not one feature axis", 1)
    if uses_stats(node.outputs[1:], outputs):
        return NoMatch("an RMSNorm whose inverse standard deviation output is used", 1)
    return NormMatch(node.name, node.op, [node], x, node.outputs[0], gamma=given(node.inputs, 1),
                     epsilon=float(node.attrs.get("epsilon", 1e-5)), axis=axes[0], axes=axes)


def match_skip_rms(node: gs.Node, shapes: dict[str, Shape], outputs: set[str]) -> MatchResult[NormMatch]:
    """onnxruntime's SkipSimplifiedLayerNormalization (input, skip, gamma [, bias]; output [, mean,
    inv_std_var, input_skip_bias_sum]): the residual Add input + skip (+ bias) feeding an RMSNorm as
    given over the last axis, the Add part of the stream as SkipLayerNormalization's is."""
    ins, outs = list(node.inputs) + [None] * 4, list(node.outputs) + [None] * 4  # (absent optional slots)
    rank = rank_of(ins[0], shapes)
    if rank is None:
        return NoMatch("the rank of its input is unknown", 1)
    if uses_stats(outs[1:3], outputs):
        return NoMatch("an RMSNorm whose mean or inverse standard deviation output is used", 1)
    return NormMatch(node.name, "SkipSimplifiedLayerNormalization", [node], ins[0], outs[0], gamma=given(ins, 2),
                     epsilon=float(node.attrs.get("epsilon", 1e-5)), axis=rank - 1, axes=[rank - 1], skip=ins[1],
                     bias=given(ins, 3), sum_output=given(outs, 3))


PATTERNS = (
    NormPattern("LayerNormalization", ("LayerNormalization",), ONNX_DOMAINS, match_layernormalization),
    NormPattern("SkipLayerNormalization", ("SkipLayerNormalization",), (fused.MS,), match_skip),
    NormPattern("EmbedLayerNormalization", ("EmbedLayerNormalization",), (fused.MS,), fused.match_embed),
    # tf2onnx's Keras and jax2onnx's flax forms, tried in this order at a mean of x
    NormPattern("tf2onnx Keras LayerNorm", norm_variants.MEANS, None, norm_variants.match_keras),
    NormPattern("jax2onnx flax LayerNorm", norm_variants.MEANS, None, norm_variants.match_flax),
    # flax.linen's fast variance through jax2tf + tf2onnx: its means are ReduceSum · 1/n
    NormPattern("jax2tf flax.linen LayerNorm", ("ReduceSum",), None, norm_variants.match_jax2tf),
)


# RMSNorms as given: looked for only where γ into the readers or a rotation is asked
# (`find_norms(rms=True)`); without, a model of RMSNorms folds nothing.
RMS_PATTERNS = (
    NormPattern("SimplifiedLayerNormalization", ("SimplifiedLayerNormalization",), ONNX_DOMAINS + (fused.MS,),
                match_rms_op),
    NormPattern("RMSNormalization", ("RMSNormalization",), ONNX_DOMAINS, match_rms_op),
    NormPattern("SkipSimplifiedLayerNormalization", ("SkipSimplifiedLayerNormalization",), (fused.MS,),
                match_skip_rms),
)  # (an RMSNorm written out: passes/patterns.match_rms, over the view)
RMS_KINDS = ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization")
# the fused ops whose residual Add is part of the stream (classify.py, emit.py): input slot of their bias
SKIP_BIAS = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}


def find_norms(graph: gs.Graph, shapes: dict[str, Shape], near_misses: Optional[dict] = None,
               rms: bool = False) -> list[NormMatch]:
    """Every match of `PATTERNS` in `graph` (the first pattern that matches at a node wins); where
    none does, the failure that got furthest goes into `near_misses` (node name -> NoMatch) when
    it is a near miss. `rms`: RMSNorms as given too (RMS_PATTERNS), at nodes no earlier match covers."""
    out = []
    outputs = {t.name for t in graph.outputs}
    covered: set[int] = set()
    for node in graph.nodes:
        if rms and id(node) in covered:
            continue
        tried: list[NoMatch] = []
        for pattern in PATTERNS + (RMS_PATTERNS if rms else ()):
            if pattern.starts(node):
                m = pattern.match(node, shapes, outputs)
                if m:
                    out.append(m)
                    covered.update(id(n) for n in m.nodes)
                    break
                tried.append(m)
        else:
            miss = deepest(*tried) if tried else None
            if miss is not None and miss.near and near_misses is not None:
                near_misses[node.name] = miss
    return out
