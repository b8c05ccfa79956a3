"""The RMSNorms a model already has (a folded model's, or one built that way): listed in the
report, and named when a model has no LayerNorm to fold; and GemmaRMSNorm's computed γ."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes import View
from ..passes.patterns import collapse_norms
from ..passes.report import RmsNorm
from .classify import GraphInfo
from .norm_patterns import RMS_KINDS, find_norms

RMS_OPS = RMS_KINDS  # the single ops that are an RMSNorm (verify.py: the ones a fold added)


def rms_norms(info: GraphInfo, view: View) -> list[RmsNorm]:
    """The RMSNorms of the main graph `info` describes, in graph order, found as the fold finds them
    where γ into the readers is asked. `view`, the fold's own view of the graph, must be done with:
    collapse_norms edits it."""
    single = [RmsNorm(m.name, m.kind) for m in find_norms(info.graph, info.shapes, rms=True) if m.kind in RMS_KINDS]
    collapse_norms(view, rms=True)
    written = [RmsNorm(n.name, "decomposed RMSNorm") for n in view.nodes.values()
               if n.op == "DecomposedRMSNorm" and n.norm is not None]  # (as view.rms_norms(), op first: cheap)
    order = {n.name: i for i, n in enumerate(info.graph.nodes)}  # (the main graph's: not an If branch's)
    return sorted((r for r in single + written if r.name in order), key=lambda r: order[r.name])


_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}


def computed_gains(graph: gs.Graph) -> None:
    """Constants the graph computes from one initializer (or a Cast of one) and a scalar by Add/Sub/Mul/Div,
    whose result is one vector (GemmaRMSNorm's `1 + weight`, unfolded by the exporter), computed once and
    read in their place: the view sees a constant γ, which can move into the readers like any."""
    outputs = {t.name for t in graph.outputs}

    def value(t):  # a constant, or a Cast of one: (values, the Cast node or None)
        if isinstance(t, gs.Constant):
            return np.asarray(t.values), None
        cast = t.inputs[0] if len(t.inputs) == 1 else None
        if cast is not None and cast.op == "Cast" and (cast.domain or "") in ("", "ai.onnx") \
                and len(cast.inputs) == 1 and isinstance(cast.inputs[0], gs.Constant):
            to = onnx.helper.tensor_dtype_to_np_dtype(int(cast.attrs["to"]))
            return np.asarray(cast.inputs[0].values).astype(to), cast
        return None, None

    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if ((node.domain or "") not in ("", "ai.onnx") or node.op not in _ARITHMETIC or len(node.inputs) != 2
                    or len(node.outputs) != 1 or node.outputs[0].name in outputs):
                continue
            got = [value(t) for t in node.inputs]
            if any(v is None for v, _ in got) or min(v.size for v, _ in got) != 1:
                continue
            out = _ARITHMETIC[node.op](got[0][0], got[1][0]).astype(np.result_type(got[0][0], got[1][0]))
            if out.dtype.kind != "f" or int(np.prod(out.shape[:-1])) != 1:
                continue  # (a γ is one vector; other constant arithmetic is left as it is)
            t = node.outputs[0]
            node.inputs.clear()
            node.outputs.clear()
            t.to_constant(out)
            graph.nodes.remove(node)
            for _, cast in got:  # a Cast nothing else reads goes with it
                if cast is not None and cast in graph.nodes and not cast.outputs[0].outputs \
                        and cast.outputs[0].name not in outputs:
                    cast.inputs.clear()
                    cast.outputs.clear()
                    graph.nodes.remove(cast)
            changed = True
