"""Overflow guards on the residual stream (Hugging Face's fp16 clamp), decided for both frontends.

Whisper, BART, T5, M2M100, ... clamp the residual stream of fp16 models after every layer:

    clamp_value = torch.finfo(torch.float16).max - 1000                # whisper/bart encoders
    clamp_value = where(isinf(h).any(), finfo.max - 1000, finfo.max)   # T5
    h = torch.clamp(h, min=-clamp_value, max=clamp_value)

A clamp is not shift-transparent in general: `clamp(x + m·1) = clamp(x) + m·1` only where no
element reaches a bound. A clamp counts as transparent here only when both bounds lie at least
finfo.max − HF_CLAMP_MARGIN from zero (an overflow guard, not a computation); the frontends keep
it in the folded graph, where it still guards the centered stream.

Why that is exact, and what it assumes:
- a bound ≥ finfo.max (fp32's ±3.4e38, T5's no-inf case) is reached by no finite value: the clamp is
  the identity on every finite stream, in the original and the folded model. Exact on every input
  on which neither model overflows.
- a bound of finfo.max − 1000 (fp16: 64504, stored as 64512) is also reached by the 31 finite fp16
  values 64544 … 65504. There the original clamps and the folded model (whose stream is the
  original's minus a per-row mean) may not. The rule assumes the stream stays below 64512 in
  magnitude (0.985 of fp16's range), i.e. that the guard only ever catches overflow. Within that
  assumption the fold is exact; outside it the original model is itself one residual Add away from
  ±inf. Verification runs both models and catches an input that breaks the assumption.
- `isinf(h)` / `isnan(h)` (T5's test choosing the bound) are all false in both models under the
  same assumption: shift-invariant readers.
Any other clamp (ReLU6, a clamp to a small range) stays a non-transparent reader.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

# Hugging Face's clamp: finfo(dtype).max - 1000 (modeling_whisper.py, modeling_bart.py, modeling_t5.py, ...)
HF_CLAMP_MARGIN = 1000.0


def is_overflow_guard(lo: Optional[float], hi: Optional[float], dtype) -> bool:
    """A clamp to [lo, hi] (None: not a known constant; ±inf: no bound) on a `dtype` stream."""
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating) or lo is None or hi is None:
        return False
    # the smallest |bound| a guard may have, rounded in the dtype as the exporter stores it (fp16: 64504 -> 64512)
    limit = float(np.asarray(float(np.finfo(dt).max) - HF_CLAMP_MARGIN, dtype=dt))
    return lo <= -limit and hi >= limit
