"""The one error metric of every calibrated decision: a candidate's outputs against the reference's.

Per output, an `OutputError`: ``rel_rms`` = ‖got − ref‖ / ‖ref‖ in float64 (the error of a typical
entry), ``max_rel`` = max |got − ref| / max |ref| (the verification's measure). Reference positions
that are NaN or ±inf are left out and counted; where only the candidate is not finite, or its shape
differs, the errors are inf, never NaN (which ``max`` would silently drop). Non-float references
(token ids, masks) are not compared: None, so that a list lines up with the outputs' names.

`RunningErrors` / `RunningError` accumulate the same record batch by batch, IDENTICAL to
`compare_outputs` on the batches joined, in a few MiB whatever the outputs' size. numpy only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np


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


# values per segment of the accumulated sums: a first-axis row's flattened values are cut into
# segments of at most this many (float64 temporaries of a few MiB, whatever the output's size)
SEGMENT = 1 << 20


class RunningError:
    """One output's error accumulated batch by batch (`add`): `error()` is IDENTICAL to `compare` on
    the batches joined. The sums of squares are kept per first-axis row (per segment of at most
    SEGMENT values: the same cuts in every batching), scaled by a power of two from the row's largest
    magnitude (no overflow; exact), and added at the end, in row order, by math.fsum (correctly
    rounded): how the rows come in batches changes no bit. `scores`: the last axis scores classes
    (`top1`, `kl`)."""

    def __init__(self, scores: bool = False) -> None:
        self.scores = scores
        self.why = ""
        self.nonfinite_ref = self.nonfinite_got = self.compared = 0
        self.exps: list = []  # per segment: its power-of-two scale
        self.num: list = []  # per segment: Σ ((got − ref) / 2^e)²
        self.den: list = []  # per segment: Σ (ref / 2^e)²
        self.max_diff = self.max_ref = 0.0
        self.agree = self.ranked = 0  # rows whose argmax agrees, rows ranked
        self.kl_sums: list = []  # per ranked segment of rows: KL(softmax ref ‖ softmax got) of each row

    def add(self, reference, candidate) -> None:
        """One batch (`candidate` None: missing, inf)."""
        if self.why:
            return
        if candidate is None:
            self.why = "no candidate output"
            return
        ref, got = np.asarray(reference), np.asarray(candidate)
        if ref.shape != got.shape:
            self.why = f"shape {list(got.shape)} against the reference's {list(ref.shape)}"
            return
        if not ref.size:
            return
        n = ref.shape[0] if ref.ndim else 1
        flat_ref, flat_got = ref.reshape(n, -1), got.reshape(n, -1)
        k = flat_ref.shape[1]
        step = max(1, SEGMENT // k)  # whole rows per segment, or one row cut in SEGMENT-value pieces
        try:
            for i in range(0, n, step):
                for j in range(0, k, SEGMENT):
                    self._segment(flat_ref[i:i + step, j:j + SEGMENT], flat_got[i:i + step, j:j + SEGMENT])
        except (TypeError, ValueError):
            self.why = f"a {got.dtype} candidate is no number"
            return
        if self.scores and ref.ndim >= 2 and ref.shape[-1] > 1:
            step = max(1, SEGMENT // ref.shape[-1])
            flat_ref, flat_got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, ref.shape[-1])
            for i in range(0, len(flat_ref), step):
                a, b = flat_ref[i:i + step], flat_got[i:i + step]
                ok = np.isfinite(a).all(axis=-1)  # (rows where the float model is not finite: left out)
                self.agree += int(np.count_nonzero((a.argmax(-1) == b.argmax(-1)) & ok))
                self.ranked += int(np.count_nonzero(ok))
                self.kl_sums.append(_kl_rows(a[ok], b[ok]))

    def _segment(self, ref: np.ndarray, got: np.ndarray) -> None:
        """Rows × at most SEGMENT values: counted, and (while every compared candidate value is finite)
        summed per row, scaled by 2^-e (e from the row's largest magnitude: exact, never overflows)."""
        ref, got = ref.astype(np.float64), got.astype(np.float64)
        ok = np.isfinite(ref)
        compared = int(np.count_nonzero(ok))
        self.nonfinite_ref += ok.size - compared
        self.compared += compared
        self.nonfinite_got += int(np.count_nonzero(ok & ~np.isfinite(got)))
        if self.nonfinite_got or not compared:
            return  # (the errors are inf, or nothing here is compared)
        if compared < ok.size:
            ref, got = np.where(ok, ref, 0.0), np.where(ok, got, 0.0)
        e = np.frexp(np.maximum(np.abs(ref).max(axis=1), np.abs(got).max(axis=1)))[1][:, None]
        ref, got = np.ldexp(ref, -e), np.ldexp(got, -e)
        diff = got - ref
        self.exps.append(e[:, 0])
        self.num.append(np.add.reduce(diff * diff, axis=1))
        self.den.append(np.add.reduce(ref * ref, axis=1))
        self.max_diff = max(self.max_diff, float(np.ldexp(np.abs(diff).max(axis=1), e[:, 0]).max()))
        self.max_ref = max(self.max_ref, float(np.ldexp(np.abs(ref).max(axis=1), e[:, 0]).max()))

    def error(self) -> OutputError:
        if self.why:
            return OutputError(INF, INF, why=self.why)
        counts = dict(nonfinite_ref=self.nonfinite_ref, nonfinite_got=self.nonfinite_got, compared=self.compared)
        if self.nonfinite_got:
            return OutputError(INF, INF, **counts)
        if not self.exps:
            return OutputError(0.0, 0.0, **counts)
        exps = np.concatenate(self.exps)
        top = int(exps.max())
        num, den = (math.fsum(np.ldexp(np.concatenate(q), 2 * (exps - top)).tolist()) for q in (self.num, self.den))
        with np.errstate(over="ignore"):
            rel_rms = math.sqrt(num) / math.sqrt(den) if den > 0 else float(np.ldexp(math.sqrt(num), top))
        max_rel = self.max_diff / self.max_ref if self.max_ref > 0 else self.max_diff
        return OutputError(rel_rms, max_rel, **counts)

    def top1(self) -> Optional[float]:
        """The share of rows (reference finite) whose argmax agrees; None: not scores, no such row, or
        not measurable (`why`)."""
        return self.agree / self.ranked if self.ranked and not self.why else None

    def kl(self) -> Optional[float]:
        """The mean over rows (reference finite) of KL(softmax(reference) ‖ softmax(candidate)) along
        the scored axis, in nats: how far the candidate's predicted distribution is from the
        reference's where the reference puts its mass (the measure llama.cpp's perplexity tool
        reports for quantized LMs); inf where a candidate row is not finite. None as for `top1`."""
        if not self.ranked or self.why:
            return None
        return math.fsum(np.concatenate(self.kl_sums).tolist()) / self.ranked


def _kl_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) ‖ softmax(got)) of each row (last axis), in float64; inf where `got` is not finite."""
    if not len(ref):
        return np.zeros(0)
    with np.errstate(invalid="ignore", over="ignore"):  # (a non-finite candidate row: inf below)
        lp, lq = (_log_softmax(x.astype(np.float64)) for x in (ref, got))
        kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return np.where(np.isfinite(got).all(axis=-1), np.maximum(kl, 0.0), INF)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class RunningErrors:
    """Every output's `RunningError`, batch by batch: `add(reference_outputs, candidate_outputs)`
    per batch, then `errors()` (as `compare_outputs` on the joined batches: None for a non-float
    reference; a candidate output missing is inf, one more than the reference's is ignored).
    `scores(k)`: whether output k scores classes (its top-1 agreement is kept)."""

    def __init__(self, scores: Callable[[int], bool] = lambda k: False) -> None:
        self.scores = scores
        self.outputs: Optional[list[Optional[RunningError]]] = None

    def add(self, reference: Sequence, candidate: Sequence) -> "RunningErrors":
        if self.outputs is None:
            self.outputs = [RunningError(self.scores(k)) if np.issubdtype(np.asarray(r).dtype, np.floating) else None
                            for k, r in enumerate(reference)]
        for k, running in enumerate(self.outputs):
            if running is not None:
                running.add(reference[k], candidate[k] if k < len(candidate) else None)
        return self

    def errors(self) -> list[Optional[OutputError]]:
        return [None if r is None else r.error() for r in self.outputs or []]

    def top1(self) -> list[Optional[float]]:
        return [None if r is None else r.top1() for r in self.outputs or []]

    def kl(self) -> list[Optional[float]]:
        return [None if r is None else r.kl() for r in self.outputs or []]


def compare(reference, candidate) -> OutputError:
    """One output's error (module docstring); `candidate` None: missing, inf. `RunningError` over one batch."""
    running = RunningError()
    running.add(reference, candidate)
    return running.error()


def compare_outputs(reference: Sequence, candidate: Sequence) -> list[Optional[OutputError]]:
    """Per reference output, its `compare` (None: a non-float output, not compared); a candidate
    output missing is inf, one more than the reference's is ignored."""
    return RunningErrors().add(reference, candidate).errors()


def worst(errors: Iterable[Optional[OutputError]], of: str = "rel_rms") -> float:
    """The largest `of` ("rel_rms" or "max_rel") over the compared outputs: 0.0 for none, inf
    for an unmeasurable one, never NaN."""
    values = [getattr(e, of) for e in errors if e is not None]
    return INF if any(math.isnan(v) for v in values) else max(values, default=0.0)


def relative_error(reference: Sequence, candidate: Sequence) -> float:
    """The worst output's relative RMS error: `worst(compare_outputs(reference, candidate))`."""
    return worst(compare_outputs(reference, candidate))
