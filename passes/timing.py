"""Interleaved A/B timing: warm up, then run A B A B ... so machine drift hits every variant alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 20, warmup: int = 3) -> dict[str, dict]:
    """Median and interquartile range (seconds) of each callable, measured in alternation."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, f in order:
            t = time.perf_counter()
            f()
            samples[name].append(time.perf_counter() - t)
    out = {}
    for name, xs in samples.items():
        q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
        out[name] = {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}
    return out
