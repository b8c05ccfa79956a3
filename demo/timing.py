"""Interleaved A/B timing, and what a measurement can honestly claim.

Variants run A B A B ... (the order flips every round), so drift of a shared machine hits each
alike. Each call records wall time and the process's CPU time (other processes' load inflates
the first much more than the second). `ratio` compares two variants round by round and gives a
bootstrap confidence interval, so a report can say "within noise" when the interval holds 1.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Callable


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 20, warmup: int = 3) -> dict[str, dict]:
    """Per variant: median and quartiles of wall time (`median`, `q1`, `q3`) and CPU time
    (`cpu_median`, `cpu_q1`, `cpu_q3`), in seconds, and the raw per-round samples."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, f in order:
            c, t = time.process_time(), time.perf_counter()
            f()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    out = {}
    for name in fns:
        q1, med, q3 = _quartiles(wall[name])
        c1, cmed, c3 = _quartiles(cpu[name])
        out[name] = {"median": med, "q1": q1, "q3": q3, "n": rounds, "cpu_median": cmed, "cpu_q1": c1,
                     "cpu_q3": c3, "samples": wall[name], "cpu_samples": cpu[name]}
    return out


def ratio(stats: dict[str, dict], num: str, den: str, *, key: str = "samples", confidence: float = 0.95,
          resamples: int = 2000, seed: int = 0) -> dict:
    """num/den from paired rounds: the median of per-round ratios and its bootstrap interval."""
    pairs = [a / b for a, b in zip(stats[num][key], stats[den][key]) if b > 0]
    if not pairs:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "within_noise": True}
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
    cut = (1 - confidence) / 2
    lo, hi = boot[int(cut * resamples)], boot[min(resamples - 1, int((1 - cut) * resamples))]
    return {"ratio": statistics.median(pairs), "lo": lo, "hi": hi, "within_noise": lo <= 1.0 <= hi}


def describe_ratio(r: dict, *, what: str = "time") -> str:
    """'0.97 (95% CI 0.95-0.99): 3% less time' or '1.01 (95% CI 0.97-1.05): within noise'."""
    head = f"{r['ratio']:.3f} (95% CI {r['lo']:.3f}-{r['hi']:.3f})"
    if r["within_noise"]:
        return f"{head}: within noise"
    change = (1 - r["ratio"]) * 100
    return f"{head}: {abs(change):.1f}% {'less' if change > 0 else 'more'} {what}"
