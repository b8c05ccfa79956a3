"""ONNX's side of the overflow-guard rule (passes/guards.py decides and says why it is sound):
a Clip's bounds (constants, or T5's Where between two constants) and stream dtype as a `clamp` rule.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..passes.rules import Rule, rule
from .norms import const_values, float_dtype, given


def _bound(node, i: int, attr: str, opset: int) -> Optional[float]:
    """Clip's min (i=1) or max (i=2): +-inf when absent, None when not a constant."""
    bound = node.attrs.get(attr) if opset < 11 else given(node.inputs, i)
    if bound is None:
        return -np.inf if i == 1 else np.inf
    if opset < 11:
        return float(bound)
    vals = _possible_values(bound)
    if vals is None or vals.size == 0:
        return None
    return float(np.max(vals)) if i == 1 else float(np.min(vals))


def _possible_values(t) -> Optional[np.ndarray]:
    """Every value a scalar bound can take (in its own dtype): a constant, or T5's
    Where(cond, c1, c2) of two constants (through a Neg for the lower bound)."""
    v = const_values(t)
    if v is not None:
        return np.asarray(v).reshape(-1)
    if len(t.inputs) != 1:
        return None
    p = t.inputs[0]
    if p.op in ("Neg", "Identity"):
        inner = _possible_values(p.inputs[0])
        return None if inner is None else (-inner if p.op == "Neg" else inner)
    if p.op == "Where":
        a, b = (const_values(x) for x in p.inputs[1:3])
        if a is None or b is None or np.asarray(a).dtype != np.asarray(b).dtype:
            return None
        return np.concatenate([np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)])
    return None


def clip_rule(info, node, opset: int) -> Rule:
    """Clip as a `clamp` rule: transparent when it is an overflow guard (passes/guards.py)."""
    dtype = _stream_dtype(node)
    return rule("clamp", lo=_bound(node, 1, "min", opset), hi=_bound(node, 2, "max", opset),
                dtype=None if dtype is None else dtype.name)


def _stream_dtype(node):
    x = node.inputs[0]
    if x.dtype is not None:
        return np.dtype(x.dtype)
    for t in node.inputs[1:]:  # Clip's bounds have the input's type
        v = _possible_values(t) if t is not None and t.name else None
        if v is not None:
            return v.dtype
    return float_dtype(x)  # (before opset 11 the bounds are attributes: no type of their own)
