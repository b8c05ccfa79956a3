"""The one error metric of every calibrated decision: a candidate's outputs against the reference's.

Per output, `compare(reference, candidate) -> OutputError`, a frozen record of

- ``rel_rms``: ‖got − ref‖ / ‖ref‖ in float64 (‖got − ref‖ where ‖ref‖ = 0): the error of a typical
  entry (one entry does not set it);
- ``max_rel``: max |got − ref| / max |ref| (`weights.max_rel_err`, the measure of every verification);
- ``nonfinite_ref``: positions where the reference is NaN or ±inf: left OUT of both errors, counted;
- ``nonfinite_got``: positions where the reference is finite and the candidate is not: both errors
  are then inf (never NaN, and never silently dropped as a NaN is by ``max``), counted;
- ``compared``: the positions compared (those where the reference is finite).

A candidate of another shape, or a missing one, is inf. Non-float references (token ids, masks)
are not compared: `compare_outputs` gives None for them, so that its list lines up with the
outputs' names. `worst(errors)` is the score a search ranks by: the largest ``rel_rms`` (or
``max_rel``) over the compared outputs, 0.0 for none, never NaN. Usage::

    errors = metric.compare_outputs(reference_outputs, candidate_outputs)  # [OutputError | None]
    score = metric.worst(errors)                                           # rel. RMS of the worst output
    print([e.line() for e in errors if e is not None])

`relative_error(reference, candidate)` is that score in one call (passes/approx.relative_error).
IR-neutral: numpy only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import zip_longest
from typing import Iterable, Optional, Sequence

import numpy as np

from .weights import max_rel_err

INF = float("inf")


@dataclass(frozen=True)
class OutputError:
    """One output's error against its reference (module docstring)."""

    rel_rms: float
    max_rel: float
    nonfinite_ref: int = 0  # reference positions not finite: left out of both errors
    nonfinite_got: int = 0  # positions only the candidate has non-finite: the errors are inf
    compared: int = 0  # positions compared (reference finite)
    why: str = ""  # what made the error inf without a number (shapes differ, output missing), if anything

    @property
    def finite(self) -> bool:
        return math.isfinite(self.rel_rms) and math.isfinite(self.max_rel)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        said = [f"rel. RMS error {self.rel_rms:.3g}, max rel. error {self.max_rel:.3g} over {self.compared} value(s)"]
        if self.nonfinite_ref:
            said.append(f"{self.nonfinite_ref} non-finite in the reference (left out)")
        if self.nonfinite_got:
            said.append(f"{self.nonfinite_got} non-finite only in the candidate")
        if self.why:
            said.append(self.why)
        return "; ".join(said)


def _unmeasurable(why: str) -> OutputError:
    return OutputError(INF, INF, why=why)


def _rel_rms(ref: np.ndarray, got: np.ndarray) -> float:
    """‖got − ref‖ / ‖ref‖ (‖got − ref‖ where ‖ref‖ = 0) of finite float64 arrays; never NaN (where
    a norm overflows, the ratio is taken on values scaled by the largest magnitude)."""
    with np.errstate(over="ignore"):
        num, den = float(np.linalg.norm(got - ref)), float(np.linalg.norm(ref))
    if math.isfinite(num) and math.isfinite(den):
        return num / den if den > 0 else num
    scale = max(float(np.abs(ref).max()), float(np.abs(got).max()))
    num, den = float(np.linalg.norm(got / scale - ref / scale)), float(np.linalg.norm(ref / scale))
    return num / den if den > 0 else INF  # (a reference negligible against an overflowing candidate)


def compare(reference, candidate) -> OutputError:
    """One output's error (module docstring); `candidate` None: missing, inf."""
    if candidate is None:
        return _unmeasurable("no candidate output")
    ref, got = np.asarray(reference, dtype=np.float64), np.asarray(candidate)
    if ref.shape != got.shape:
        return _unmeasurable(f"shape {list(got.shape)} against the reference's {list(ref.shape)}")
    try:
        got = got.astype(np.float64)
    except (TypeError, ValueError):
        return _unmeasurable(f"a {got.dtype} candidate is no number")
    ok = np.isfinite(ref)
    ref, got = ref[ok], got[ok]
    bad = int(np.count_nonzero(~np.isfinite(got)))
    counts = dict(nonfinite_ref=int(ok.size - ref.size), nonfinite_got=bad, compared=int(ref.size))
    if bad:
        return OutputError(INF, INF, **counts)
    if not ref.size:
        return OutputError(0.0, 0.0, **counts)
    return OutputError(_rel_rms(ref, got), max_rel_err(ref, got), **counts)


def compare_outputs(reference: Sequence, candidate: Sequence) -> list[Optional[OutputError]]:
    """Per reference output, its `compare` (None: a non-float output, not compared); a candidate
    output missing is inf, one more than the reference's is ignored."""
    return [None if not np.issubdtype(np.asarray(ref).dtype, np.floating) else compare(ref, got)
            for ref, got in zip_longest(reference, list(candidate)[:len(reference)])]


def worst(errors: Iterable[Optional[OutputError]], of: str = "rel_rms") -> float:
    """The largest `of` ("rel_rms" or "max_rel") over the compared outputs: 0.0 for none, inf
    for an unmeasurable one, never NaN."""
    values = [getattr(e, of) for e in errors if e is not None]
    return INF if any(math.isnan(v) for v in values) else max(values, default=0.0)


def relative_error(reference: Sequence, candidate: Sequence) -> float:
    """The worst output's relative RMS error: `worst(compare_outputs(reference, candidate))`."""
    return worst(compare_outputs(reference, candidate))
