"""The verification gate (DESIGN §4): is a folded model as exact as the original? Pure numpy.

How a verdict was reached (`Verdict.method`; `Verdict.criterion` is the line that names it with
its bound and the verifier's notes):
  "float64": every output's error against a float64 run at most FACTOR x the original's, plus FLOOR;
  "float64, fixed tolerance": the original ran only in onnx's reference evaluator (no measure of
      its users' error), so the folded model's error against float64 must be within TOLERANCE;
  "float64 copies": the original cannot run in its own dtype; float64 copies of both models are
      compared (judge_float64_copies, within rounding_bound).
Without a float64 run: "tolerance" (folded vs original within TOLERANCE), else "zero-mean norm
inputs" (every folded norm's input has a per-row mean below MEAN_TOL of its RMS, and the outputs
agree within LOOSE x TOLERANCE, which an affine mistake would break).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from .errors import LnfoldError, VerificationError
from .weights import flat_pieces, max_rel_err

FACTOR = 2.0
# The error a correct fold may have beyond FACTOR x the original's, relative to the output's
# largest value: a few units in the last place of the dtype (fp32: ~80 ulp, fp16/bf16: 4 ulp),
# for outputs that the original happens to compute almost exactly.
FLOOR = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
# Fallback without float64: worst relative difference between folded and original, by dtype.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
LOOSE = 10.0
# Float64 copies of original and folded model: float64 arithmetic (~1e-16 per op; 1e-9 leaves
# room for cancellation in a LayerNorm on a large-mean stream and for depth), plus what storing
# the edited weights back in the model's dtype can do: FACTOR x the model's own sensitivity to one
# unit roundoff of its stored weights (rounding_bound; DESIGN §4 derives it).
COPIES_REL = 1e-9
# Unit roundoff (half an ulp, relative) of each storage dtype: round-to-nearest moves a value by
# at most this fraction of itself.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
# Fallback: largest |mean| / RMS of a folded norm's input row (a centered fp32 stream: ~1e-6).
MEAN_TOL = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}

# The methods a verdict names (the module's docstring says what each judges)
FLOAT64, FLOAT64_FIXED, COPIES = "float64", "float64, fixed tolerance", "float64 copies"
TOLERANCE_ONLY, ZERO_MEAN, NOT_JUDGED = "tolerance", "zero-mean norm inputs", "not judged"
OUTPUTS = "outputs"  # the folded model's outputs differ in number or kind from the original's (torch)


@dataclass
class Output:
    """One output of the model: its name, dtype name, and its values in each run."""

    name: str
    dtype: str  # "float32", "float16", "bfloat16", "float64", or an integer/bool type
    original: np.ndarray
    folded: np.ndarray
    exact: Optional[np.ndarray] = None  # the float64 run; None where it could not be made


@dataclass
class Verdict:
    ok: bool
    method: str  # one of the methods above: how the gate judged
    diff: float  # worst relative difference folded vs original, over all outputs
    folded_err: Optional[float] = None  # worst relative error of the folded model vs float64
    original_err: Optional[float] = None  # the same for the original model
    failure: str = ""  # what failed, one line
    # False: the original's outputs are not finite on the inputs used, so no comparison with them
    # proves anything (NaN equals NaN in the measure); `failure` then says why
    judged: bool = True
    input_broken: bool = False  # the original's float outputs are all NaN: the input model is at fault
    no_float64: str = ""  # why no float64 run was made, where none was
    bound: str = ""  # the bound judged against, where the method's name does not say it ("within ...")
    notes: tuple[str, ...] = ()  # what the verifier adds: the runner it used, the seeds it pinned

    @property
    def criterion(self) -> str:
        """The method, its bound and the verifier's notes, as one line (reports, --json)."""
        return ", ".join(filter(None, (self.method, self.bound))) + "".join(f"; {n}" for n in self.notes)

    def noted(self, *notes: str) -> "Verdict":
        """This verdict with the verifier's `notes` added (empty ones dropped)."""
        return replace(self, notes=self.notes + tuple(n for n in notes if n))

    def message(self) -> str:
        if not self.judged:
            return f"verification could not judge the fold: {self.failure}"
        return f"verification failed: {self.failure}"

    def error(self, prefix: str = "") -> LnfoldError:
        """The exception a frontend raises for a verdict that is not ok: exit code 2 where the input
        model itself computes nothing but NaN, 1 otherwise (a failed or unjudged verification)."""
        kind = LnfoldError if self.input_broken else VerificationError
        return kind(prefix + self.message())

    def summary(self) -> str:
        """One line for the command's output."""
        if self.method == COPIES:
            return f"folded vs original, both run in float64: {self.diff:.2e} (criterion: {self.criterion})"
        if self.method in (FLOAT64, FLOAT64_FIXED):
            how = "" if self.criterion == FLOAT64 else f"; criterion: {self.criterion}"  # e.g. pinned seeds
            return (f"error vs float64: folded {self.folded_err:.2e}, original {self.original_err:.2e} "
                    f"(folded vs original {self.diff:.2e}{how})")
        why = f": {self.no_float64}" if self.no_float64 else ""
        return f"folded vs original {self.diff:.2e} (no float64 run{why}; criterion: {self.criterion})"


def judge(outputs: Sequence[Output], norm_inputs: Optional[dict[str, np.ndarray]] = None,
          norm_dtype: str = "float32", original_is_faithful: bool = True, no_float64: str = "") -> Verdict:
    """The verdict on a fold. `norm_inputs` (folded norm -> its input in the folded model, feature
    axis last) is used only by the fallback without float64. `original_is_faithful=False`: the
    original's run is not what its users get (onnx's reference evaluator computes an fp16
    LayerNorm in fp16, where it overflows), so its error cannot widen the bound: the folded
    model's error against float64 must then be within TOLERANCE. `no_float64`: why the frontend
    could not make a float64 run, said in the verdict's summary and failure."""
    unjudged = _non_finite(outputs)
    if unjudged is not None:
        return unjudged
    errs = [max_rel_err(o.original, o.folded) for o in outputs]
    diff = max(errs, default=0.0)
    if len(outputs) and all(o.exact is not None for o in outputs):
        return _judge_exact(outputs, diff, original_is_faithful)
    if all(e <= TOLERANCE.get(o.dtype, 0.0) for o, e in zip(outputs, errs)):
        return Verdict(True, TOLERANCE_ONLY, diff, no_float64=no_float64)
    worst_err, worst = max(zip(errs, outputs), key=lambda eo: eo[0] / TOLERANCE.get(eo[1].dtype, 1.0))
    too_far = (f"output {worst.name} differs from the original's by {worst_err:.3g} (relative), above "
               f"{TOLERANCE.get(worst.dtype, 0.0):g}, and no float64 run of the model was possible"
               + (f" ({no_float64})" if no_float64 else ""))
    if not norm_inputs:
        return Verdict(False, TOLERANCE_ONLY, diff, failure=too_far, no_float64=no_float64)
    bad = off_center(norm_inputs, norm_dtype)
    failure = ""
    if bad:
        failure = (f"{too_far}; the input of folded norm {bad[0]} has mean {bad[1]:.3g} of its RMS (above "
                   f"{MEAN_TOL.get(norm_dtype, 1e-4):g})")
    elif any(e > LOOSE * TOLERANCE.get(o.dtype, 0.0) for o, e in zip(outputs, errs)):
        failure = f"{too_far}, even {LOOSE:g}x that"
    return Verdict(not failure, ZERO_MEAN, diff, failure=failure, no_float64=no_float64)


def allowance(own: float, dtype: str, faithful: bool) -> float:
    """The error against float64 an output of `dtype` may have: FACTOR x the original's own (`own`)
    plus the dtype's FLOOR where the float64 run is faithful, else the dtype's fixed TOLERANCE."""
    return FACTOR * own + FLOOR.get(dtype, 0.0) if faithful else TOLERANCE.get(dtype, 0.0)


def _judge_exact(outputs: Sequence[Output], diff: float, faithful: bool) -> Verdict:
    folded_worst = original_worst = 0.0
    failure = ""
    for o in outputs:
        own = max_rel_err(o.exact, o.original)
        now = max_rel_err(o.exact, o.folded)
        folded_worst, original_worst = max(folded_worst, now), max(original_worst, own)
        bound = allowance(own, o.dtype, faithful)
        if not now <= bound and not failure:
            failure = (f"output {o.name} ({o.dtype}) is {now:.3g} (relative) away from a float64 run, "
                       f"the original model {own:.3g}; allowed {bound:.3g}")
    return Verdict(not failure, FLOAT64 if faithful else FLOAT64_FIXED, diff, folded_worst,
                   original_worst, failure)


def rounding_bound(storage_dtype: str, sensitivity: Optional[float]) -> float:
    """How far a correct fold's float64 copy may be from the original's (DESIGN §4 derives it):
    `sensitivity` is how far the outputs move when every weight stored in `storage_dtype` is moved
    by one unit roundoff (a random sign each); without a measure (None): FLOOR of the dtype."""
    return COPIES_REL + (FLOOR.get(storage_dtype, 0.0) if sensitivity is None else FACTOR * sensitivity)


def judge_float64_copies(outputs: Sequence[Output], storage_dtype: str,
                         sensitivity: Optional[float] = None) -> Verdict:
    """The verdict where only float64 copies of the two models run (`Output.original` and
    `.folded` are their float64 runs): every output within rounding_bound of the original's,
    relative to its largest value. `folded_err` is that difference (the folded model's error
    against a float64 run of the original); the original has no error to measure."""
    bound = rounding_bound(storage_dtype, sensitivity)
    unjudged = _non_finite(outputs)
    if unjudged is not None:
        return unjudged
    diff, failure = 0.0, ""
    for o in outputs:
        d = max_rel_err(o.original, o.folded)
        diff = max(diff, d)
        if not d <= bound and not failure:
            failure = (f"output {o.name}: the float64 copies of the folded and the original model differ by {d:.3g} "
                       f"(relative), above {bound:.3g} (float64 arithmetic plus the rounding of the edited weights to "
                       f"{storage_dtype})")
    how = f"{FLOOR.get(storage_dtype, 0.0):g}" if sensitivity is None else \
        f"{FACTOR:g} x {sensitivity:.3g}, the outputs' move under one {storage_dtype} rounding of every weight"
    return Verdict(not failure, COPIES, diff, diff, None, failure, bound=f"within {COPIES_REL:g} + {how}")


def _non_finite(outputs: Sequence[Output]) -> Optional[Verdict]:
    """A verdict that nothing could be judged, where a float output of the original has no finite
    value on these inputs (NaN compared with NaN "agrees": such an output proves nothing); None
    otherwise. An output with some non-finite values is judged on the others, and must keep its
    NaNs and infinities where they are (max_rel_err): NaN weights in one embedding row."""
    floats = [o for o in outputs if o.dtype in FLOOR]
    blind = [o for o in floats if np.size(o.original) and not _anywhere(np.isfinite, o.original)]
    if not blind:
        return None
    if not any(_anywhere(_not_nan, o.original) for o in floats):
        return Verdict(False, NOT_JUDGED, float("nan"), judged=False, input_broken=True,
                       failure="the input model's outputs are all NaN on these inputs: it computes nothing "
                               "to compare a fold with")
    o = blind[0]
    what = "NaN or infinite" if _anywhere(_not_nan, o.original) else "NaN"
    return Verdict(False, NOT_JUDGED, float("nan"), judged=False,
                   failure=f"output {o.name} of the original model is {what} everywhere on these inputs, and a "
                           "comparison with it proves nothing; give inputs on which it is finite")


def _anywhere(test, a) -> bool:
    """Does `test` hold for some value of `a` (in float64)? Piece by piece (weights.flat_pieces): no
    float64 copy of a whole output."""
    return any(test(piece.astype(np.float64)).any() for (piece,) in flat_pieces(np.asarray(a)))


def _not_nan(x: np.ndarray) -> np.ndarray:
    return ~np.isnan(x)


def off_center(norm_inputs: dict[str, np.ndarray], dtype: str) -> Optional[tuple[str, float]]:
    """The first folded norm whose input is not zero-mean along its last axis, and how far."""
    tol = MEAN_TOL.get(dtype, 1e-4)
    for name, x in norm_inputs.items():
        x = np.asarray(x, dtype=np.float64)
        if x.size == 0:
            continue
        mean = np.abs(x.mean(axis=-1))
        rms = np.sqrt((x * x).mean(axis=-1))
        ratio = float(np.max(np.where(rms > 0, mean / np.where(rms > 0, rms, 1.0), mean)))
        if not ratio <= tol:
            return name, ratio
    return None
