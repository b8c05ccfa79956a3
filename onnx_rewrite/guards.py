"""Overflow guards on the residual stream: Hugging Face's fp16 clamp.

Whisper, BART, T5, M2M100, ... clamp the residual stream of fp16 models after every layer so that
an overflow (±inf) does not poison the next LayerNorm:

    clamp_value = torch.finfo(torch.float16).max - 1000           # whisper/bart encoders
    clamp_value = where(isinf(h).any(), finfo.max - 1000, finfo.max)   # T5
    h = torch.clamp(h, min=-clamp_value, max=clamp_value)

exported as `Clip(h, -c, c)` with constant (or Where-selected constant) bounds.

A clip is not shift-transparent in general: `Clip(x + m·1) = Clip(x) + m·1` only where no
element reaches a bound. This rule treats a Clip as transparent only when both bounds lie
within `HF_CLAMP_MARGIN` of the dtype's largest finite value (an overflow guard, not a
computation), and keeps the Clip in the folded graph, where it still guards the centered stream.

Why that is exact, and what it assumes:
- a bound ≥ finfo.max (fp32's ±3.4e38 clamp, T5's no-inf case) is reached by no finite value: the
  clip is the identity on every finite stream, in the original and the folded model. Exact on
  every input on which neither model overflows.
- a bound of finfo.max − 1000 (fp16: 64504, stored as 64512) is also reached by the 31 finite
  fp16 values 64544 … 65504. There the original clamps and the folded model (whose stream is the
  original's minus a per-row mean) may not. The rule assumes the stream stays below 64512 in
  magnitude (0.985 of fp16's range), i.e. that the guard only ever catches overflow. Within that
  assumption the fold is exact; outside it the original model is itself one residual Add away from
  ±inf. Verification runs both models and catches an input that breaks the assumption.
Any other Clip (ReLU6, a clamp to a small range) stays a non-transparent reader, as before.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .norms import const_values

# Hugging Face's clamp: finfo(dtype).max - 1000 (modeling_whisper.py, modeling_bart.py, modeling_t5.py, ...)
HF_CLAMP_MARGIN = 1000.0


def guard_bound(dtype) -> Optional[float]:
    """The smallest |bound| a Clip on a `dtype` stream may have to count as an overflow guard."""
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        return None
    top = float(np.finfo(dt).max)
    # rounded in the dtype, as the exporter stores it (fp16: 64504 -> 64512)
    return float(np.asarray(top - HF_CLAMP_MARGIN, dtype=dt))


def _bound(node, i: int, attr: str, opset: int) -> Optional[float]:
    """Clip's min (i=1) or max (i=2): +-inf when absent, None when not a constant."""
    if opset < 11:
        v = node.attrs.get(attr)
        return (-np.inf if i == 1 else np.inf) if v is None else float(v)
    if len(node.inputs) <= i or node.inputs[i] is None or not node.inputs[i].name:
        return -np.inf if i == 1 else np.inf
    vals = _possible_values(node.inputs[i])
    if vals is None or vals.size == 0:
        return None
    vals = vals.astype(np.float64)
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


def is_overflow_guard(node, dtype, opset: int) -> bool:
    """A Clip whose both bounds are at least `guard_bound(dtype)` away from zero."""
    limit = guard_bound(dtype)
    if limit is None:
        return False
    lo, hi = _bound(node, 1, "min", opset), _bound(node, 2, "max", opset)
    return lo is not None and hi is not None and lo <= -limit and hi >= limit


def clip_rules(info, node, opset: int) -> dict:
    """Clip as a transparent op when it is an overflow guard (see the module docstring)."""
    dtype = _stream_dtype(info, node)
    if dtype is None or not is_overflow_guard(node, dtype, opset):
        return {}
    return dict(
        transfer=lambda i, b: [(0, b)] if i == 0 else None,
        backward=lambda o, a: [(0, a)] if o == 0 else None,
    )


def isinf_rules(info, node, opset: int) -> dict:
    """IsInf/IsNaN of the stream (T5's `isinf(h).any()` choosing the clamp): all false in the
    original and in the folded model alike under the guard's assumption that neither overflows."""
    return dict(invariant=lambda i, b: i == 0)


def _stream_dtype(info, node):
    x = node.inputs[0]
    if x.dtype is not None:
        return np.dtype(x.dtype)
    for t in node.inputs[1:]:  # Clip's bounds have the input's type
        v = _possible_values(t) if t is not None and t.name else None
        if v is not None:
            return v.dtype
    return None
