"""The RMSNorms a model already has (a folded model's, or one built that way): listed in the
report, and named when a model has no LayerNorm to fold."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes.report import RmsNorm

RMS_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")


def rms_norms(model: onnx.ModelProto) -> list:
    """The RMSNorms of the main graph (a folded model's): the fused ops, and mean(x²) -> [+ eps]
    -> Sqrt -> x / rms (or x · 1/rms) written out, as the portable target emits it."""
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

    def is_one(value: str) -> bool:
        t = consts.get(value)
        return (t is not None and t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims)) == 1
                and float(onnx.numpy_helper.to_array(t).reshape(-1)[0]) == 1.0)

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
        rec = one(t, "Reciprocal", "Div")  # 1/rms: Reciprocal, or Div(1, rms) (Optimum's, TorchScript's)
        if rec is not None and rec.op_type == "Div" and (rec.input[1] != t or not is_one(rec.input[0])):
            rec = None
        final = one(rec.output[0] if rec is not None else t, "Mul" if rec is not None else "Div")
        if final is not None and set(final.input) & xs:
            out.append(RmsNorm(n.name, "decomposed RMSNorm"))
    return out


_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}


def computed_gains(graph: gs.Graph) -> None:
    """Constants the graph computes from one initializer with a scalar (GemmaRMSNorm's `1 + weight`,
    which an exporter without constant folding writes as Add(1, weight), maybe of a Cast), computed
    once and read in their place: the view sees a constant γ, which can move into the readers like any
    (fx_rewrite/api.computed_gains is the torch twin). Default-domain Add/Sub/Mul/Div of a constant
    (or a Cast of one) and a scalar, whose result is one vector; nothing else changes."""
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
