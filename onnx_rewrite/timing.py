"""Interleaved A/B timing, and what a measurement can honestly claim.

The order of the variants rotates every round, so drift of a shared machine hits each alike; wall
and process CPU time are both recorded (other processes' load inflates the first much more).
A difference is claimed only where the bootstrap interval of the ratio of medians lies outside the
spread of an A/A comparison in the same rounds (an interval that merely excludes 1 was contradicted
by the next run often enough) and, in `compare_repeats`, every repeat with fresh sessions agrees.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 20, warmup: int = 3,
                until: float = float("inf")) -> dict[str, dict]:
    """Per variant: the `summary` of its wall and CPU times (seconds) over `rounds` interleaved
    rounds, or fewer where time.perf_counter() reaches `until` (warm-up rounds then stop too; one
    of each, and one timed round, always run). The summary's `n`: the rounds run."""
    for w in range(warmup):
        if w and time.perf_counter() >= until:
            break
        for f in fns.values():
            f()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        if r and time.perf_counter() >= until:
            break
        items = list(fns.items())
        order = items[r % len(items):] + items[:r % len(items)]  # each variant takes each place in turn
        for name, f in order:
            c, t = time.process_time(), time.perf_counter()
            f()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return {name: summary(wall[name], cpu[name]) for name in fns}


def summary(wall: list[float], cpu: list[float]) -> dict:
    """Median and quartiles of wall (`median`, `q1`, `q3`) and CPU time (`cpu_*`), with the samples."""
    q1, med, q3 = _quartiles(wall)
    c1, cmed, c3 = _quartiles(cpu)
    return {"median": med, "q1": q1, "q3": q3, "n": len(wall), "cpu_median": cmed, "cpu_q1": c1, "cpu_q3": c3,
            "samples": wall, "cpu_samples": cpu}


def ratio(stats: dict[str, dict], num: str, den: str, *, key: str = "samples", confidence: float = 0.95,
          resamples: int = 2000, seed: int = 0) -> dict:
    """median(num) / median(den), and a bootstrap interval of that ratio (rounds resampled
    together, so that drift shared by both variants in a round stays paired)."""
    a, b = np.asarray(stats[num][key], dtype=float), np.asarray(stats[den][key], dtype=float)
    n = min(len(a), len(b))
    if n == 0 or not np.median(b[:n]) > 0:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "within_noise": True}
    a, b = a[:n], b[:n]
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = np.sort(np.median(a[idx], axis=1) / np.maximum(np.median(b[idx], axis=1), 1e-30))
    cut = (1 - confidence) / 2
    lo, hi = float(boot[int(cut * resamples)]), float(boot[min(resamples - 1, int((1 - cut) * resamples))])
    return {"ratio": float(np.median(a) / np.median(b)), "lo": lo, "hi": hi, "within_noise": lo <= 1.0 <= hi}


def compare(stats: dict[str, dict], num: str, den: str, control: str, *, key: str = "samples") -> dict:
    """`ratio(num, den)` with the claim rule: a difference is claimed only when the ratio's whole
    interval lies outside 1 ± spread, where spread is how far from 1 the A/A ratio
    control/den (or its interval) reaches; `control` is a second measurement of what `den`
    measures, interleaved in the same rounds. Adds `spread` and `aa` (the A/A ratio)."""
    r = ratio(stats, num, den, key=key)
    aa = ratio(stats, control, den, key=key)
    spread = max(abs(aa["ratio"] - 1), abs(aa["lo"] - 1), abs(aa["hi"] - 1))
    claimed = r["hi"] < 1 - spread or r["lo"] > 1 + spread
    return {**r, "aa": aa, "spread": spread, "within_noise": not claimed}


# How far beyond the largest A/A spread the pooled interval must lie. Measured on the demo's
# model (2 shared cores, busy): with one block, two runs with A/A spreads of ±0.5% gave 0.979
# and 0.995; with three repeats and 2x the spread, five runs gave CPU ratios 0.968-0.977 (A/A
# ±1.0-2.4%) and one of them claimed "2.6% less", the other four not.
MARGIN = 3.0


def compare_repeats(blocks: list[dict[str, dict]], num: str, den: str, control: str, *,
                    key: str = "samples") -> dict:
    """`compare` on the rounds of all `blocks` pooled, where each block is a repeat of the whole
    measurement with sessions of its own: one A/A pair did not see all of the session-to-session
    spread (a second run contradicted a claim its A/A allowed), so a difference is claimed only
    when every repeat claims it, in the same direction, and the pooled interval lies beyond
    MARGIN times the largest A/A spread. Adds `repeats` (each block's ratio)."""
    pooled = {name: {key: [x for b in blocks for x in b[name][key]]} for name in (num, den, control)}
    r = compare(pooled, num, den, control, key=key)
    each = [compare(b, num, den, control, key=key) for b in blocks]
    side = (r["ratio"] > 1) - (r["ratio"] < 1)
    agree = all(not e["within_noise"] and (e["ratio"] > 1) - (e["ratio"] < 1) == side for e in each)
    spread = max([r["spread"]] + [e["spread"] for e in each])
    margin = MARGIN * spread
    claimed = (r["hi"] < 1 - margin or r["lo"] > 1 + margin) and agree
    return {**r, "spread": spread, "repeats": [e["ratio"] for e in each], "within_noise": not claimed}


def describe_ratio(r: dict, *, what: str = "time") -> str:
    """'0.970 (95% CI 0.960-0.980; A/A ±1.0%): 3.0% less time' or '...: within noise'."""
    band = f"; A/A ±{r['spread'] * 100:.1f}%" if "spread" in r else ""
    if len(r.get("repeats", ())) > 1:
        band += f"; repeats {', '.join(f'{x:.3f}' for x in r['repeats'])}"
    head = f"{r['ratio']:.3f} (95% CI {r['lo']:.3f}-{r['hi']:.3f}{band})"
    if r["within_noise"]:
        return f"{head}: within noise"
    change = (1 - r["ratio"]) * 100
    return f"{head}: {abs(change):.1f}% {'less' if change > 0 else 'more'} {what}"
