"""Overflow guards on the residual stream (Hugging Face's fp16 clamp), decided for both frontends.

Whisper, BART, T5, M2M100, ... clamp the stream of fp16 models after every layer to
±(finfo.max − 1000) (T5: ±finfo.max where nothing is inf). A clamp is shift-transparent only where
no element reaches a bound, so it counts as transparent only when both bounds lie at least
finfo.max − HF_CLAMP_MARGIN from zero; the frontends keep it, guarding the centered stream.

Why that is exact: a bound ≥ finfo.max is reached by no finite value (the identity in both models).
fp16's 64504 (stored as 64512) is also reached by the 31 finite values 64544 … 65504, where the
original clamps and the folded stream (minus a per-row mean) may not: the rule assumes the stream
stays below 64512 (0.985 of fp16's range), i.e. that the guard only ever catches overflow; beyond it
the original is itself one residual Add from ±inf. T5's `isinf(h)` test is then false in both
models. Verification runs both models and catches an input that breaks the assumption. Any other
clamp (ReLU6, a small range) stays a non-transparent reader.
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
