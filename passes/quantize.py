"""Quantization as a stage after the exact fold, IR-neutral: its schemes, the `rotate="auto"`
candidates and the choice over them, the error it reports and the report itself.

A frontend adapter (onnx_rewrite/quantize.py: onnxruntime; fx_rewrite/quantize.py: torchao or
torch.ao) folds a candidate, runs its quantizer and feeds `streamed_errors` the outputs, run by
run; every decision made from those numbers is here. Nothing here imports onnx or torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Optional

from . import metric, search
from .calibration import Rows
from .errors import LnfoldError, NothingToFold
from .options import ROTATIONS
from .pipeline import Progress, stage
from .result import FoldResult

WEIGHTS = ("int8", "int4")
ACTIVATIONS = ("int8",)
AUTO = "auto"  # rotate="auto": the best of AUTO_CANDIDATES on the user's rows

# rotate="auto"'s candidates, simplest first (a tie keeps the earlier). The model not folded is one
# of them, so the choice is never worse than the same quantization without the fold on its rows.
# Plain onnxruntime is measured beside them, never chosen: it quantizes other ops than lnfold's.
def auto_candidates(quantizer: str, spare_channels: Optional[tuple] = None) -> tuple:
    """(label, fold options) of each rotate="auto" candidate, for `quantizer` ("onnxruntime"); with
    `spare_channels` (the user's), one more: the rotation that spares them, γ in float."""
    if spare_channels and isinstance(spare_channels[0], tuple) and not any(cs for _, cs in spare_channels):
        spare_channels = None  # (MASSIVE found none: the candidate would be "orthogonal, γ in float" again)
    spared = (() if not spare_channels else
              ((f"orthogonal sparing channel(s) {spared_text(spare_channels)}, γ in float",
                dict(rotate="orthogonal", gamma_in_float=True, spare_channels=spare_channels)),))
    return ((f"not folded ({quantizer}'s quantizer on lnfold's linear layers)", dict(fold=False)),
            ("fold", dict()), ("fold, γ into the readers", dict(gamma_into_readers=True)),
            *((r, dict(rotate=r)) for r in ROTATIONS),
            # γ left out of the quantized weights (a float Qᵀ·diag γ·Q per norm): where trained γ
            # suppresses massive-activation channels, moved into weights it drowns in their rounding
            ("hadamard, γ in float", dict(rotate="hadamard", gamma_in_float=True)), *spared,
            # QuaRot's R4: the writers' inputs (the MLP's down projection's outlier channels) spread
            # before an activation quantizer sees them; alone, and with the stream rotated
            ("online Hadamard", dict(online_hadamard=True)),
            ("hadamard, online Hadamard", dict(rotate="hadamard", online_hadamard=True)))


def spared_text(spare_channels) -> str:
    """The channels a rotation spares, as a label says them: every stream's, or per stream (by its
    first norm) where MASSIVE resolved them."""
    if spare_channels and isinstance(spare_channels[0], tuple):
        return "; ".join(f"{', '.join(map(str, cs)) or 'none'} in `{norm}`'s stream" for norm, cs in spare_channels)
    return ", ".join(map(str, spare_channels))


AUTO_CANDIDATES = auto_candidates("onnxruntime")
NOT_FOLDED = AUTO_CANDIDATES[0][0]
# a later (less simple) candidate is kept only where it cuts the error by more than this share: a
# few held-out rows rank near-equal candidates by chance (measured on MiniLM: 2% apart, reversed
# on other rows)
AUTO_MARGIN = 0.05
# ... and a candidate whose file is over this multiple of the smallest one's only where its error
# falls by at least the factor its file grows: a rotation no weight absorbs keeps d×d MatMuls in
# float (3.6x the int8 size for a 9 % error gain). The model as given is always eligible.
AUTO_SIZE_SLACK = 1.10


def calibrates(weights: str, activations: Optional[str]) -> bool:
    """The scheme fixes its activations' scales on calibration rows (W8A8: static, QDQ). W4A8 (int4
    weights, int8 activations) quantizes its activations at run time, in the CPU kernel, as int8
    dynamic does: no rows calibrate it."""
    return weights == "int8" and activations == "int8"


def check_scheme(weights: str, activations: Optional[str], rotate: Optional[str], seed) -> None:
    """The options every frontend's quantize shares, checked before any work: one-line LnfoldErrors."""
    if weights not in WEIGHTS:
        raise LnfoldError(f"weights={weights!r}: one of {', '.join(WEIGHTS)}")
    if activations is not None and activations not in ACTIVATIONS:
        raise LnfoldError(f"activations={activations!r}: int8, or none (int8 weights alone: dynamic activations)")
    if rotate is not None and rotate not in ROTATIONS + (AUTO,):
        raise LnfoldError(f"rotate={rotate!r}: one of {', '.join(ROTATIONS + (AUTO,))}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LnfoldError(f"seed {seed!r}: a non-negative integer")


FOLD_ONLY = "rotation, γ into the readers and the online Hadamard are part of the fold: they need fold=True"


def check_rotation_options(rotate: Optional[str], fold: bool, gamma_into_readers: Optional[bool],
                           gamma_in_float: bool, spare_channels, online_hadamard: bool = False) -> None:
    """The fold options of a quantize that go only with others, checked before any work (one-line
    LnfoldErrors). rotate="auto" chooses γ's place itself; the channels it is given to spare, each
    rotation candidate spares (passes/orthogonal.matrix)."""
    if rotate == AUTO and (gamma_into_readers is not None or gamma_in_float or online_hadamard or not fold):
        raise LnfoldError("--rotate auto chooses the fold, γ's place, the rotation and the online Hadamard itself: "
                          "drop fold=False / gamma_into_readers / gamma_in_float / online_hadamard")
    if not fold and ((rotate is not None and rotate != AUTO) or gamma_into_readers or online_hadamard):
        raise LnfoldError(FOLD_ONLY)
    if rotate is None and (gamma_in_float or spare_channels):
        flag = "--gamma-in-float keeps γ beside" if gamma_in_float else "--spare-channels leaves channels out of"
        raise LnfoldError(f"{flag} a rotation: give --rotate too")


# -- the fold's records a quantizer reads ------------------------------------------------------------

def rotated_streams(fold: Optional[FoldResult]) -> int:
    """The streams the fold's plan rotated (its StreamBasis records)."""
    return sum(r.rotated for r in fold.plan.stream_bases) if fold else 0


def float_gammas(fold: Optional[FoldResult]) -> int:
    """The rotated norms whose γ the fold's plan kept in float (their StreamBasis records)."""
    return sum(len(r.float_gammas) for r in fold.plan.stream_bases if r.rotated) if fold else 0


def online_layers(fold: Optional[FoldResult]) -> int:
    """The linear layers whose input the fold's plan rotates online (its OnlineRotation records)."""
    return len(fold.plan.online) if fold else 0


def moved_gamma(fold: Optional[FoldResult]) -> bool:
    """Whether the fold's plan moved some norm's γ into its readers' weights (its GammaFold records)."""
    return fold is not None and any(g.moved and g.gamma is not None for g in fold.plan.gammas.values())


def rotation_summary(fold: Optional[FoldResult]) -> Optional[str]:
    """The fold report's word on each folded stream's rotation (rotated by what, or its blocker)."""
    said = [f"stream {k}: {s.rotation}" for k, s in enumerate(fold.report.streams) if s.rotation] if fold else []
    return "; ".join(said) or None


def fold_for_quantizer(run: Callable[..., FoldResult], *, fold: bool = True, rotate: Optional[str] = None,
                       gamma_into_readers: Optional[bool] = None, gamma_in_float: bool = False,
                       spare_channels: Optional[tuple] = None,
                       online_hadamard: bool = False) -> tuple[Optional[FoldResult], bool, list]:
    """The exact step in front of a quantizer, for both adapters: `run(**fold options)` is the
    frontend's fold. Returns (the fold or None, whether γ moved into the readers' weights, notes).
    γ moves with a rotation by default; a rotation that rotates no stream is folded again with γ left
    in the norms unless asked for (γ moved alone makes weight quantization worse). A model with
    nothing to fold goes to the quantizer as given (said in a note) unless a rotation or γ's move
    was asked for."""
    gamma = bool(rotate) if gamma_into_readers is None else gamma_into_readers
    if rotate and not gamma:
        raise LnfoldError("a rotation needs the norms' weights in their readers (gamma_into_readers=True)")
    if not fold and (rotate or gamma or online_hadamard):
        raise LnfoldError(FOLD_ONLY)
    if not fold:
        return None, False, []
    try:
        result = run(gamma_into_readers=gamma, rotate=rotate, gamma_in_float=gamma_in_float,
                     spare_channels=spare_channels, online_hadamard=online_hadamard)
    except NothingToFold as e:
        if rotate or gamma or online_hadamard:
            raise LnfoldError(f"cannot {'rotate' if rotate or gamma else 'apply the online Hadamard'}: {e}") from None
        return None, False, [f"nothing folded ({e}); quantized as given"]
    if rotate and gamma_into_readers is None and not rotated_streams(result):
        note = (f"--rotate {rotate} rotated no stream ({rotation_summary(result)}): γ left in the norms (moved alone "
                "it makes weight quantization worse)")
        return run(gamma_into_readers=False, rotate=None, gamma_in_float=False, spare_channels=None,
                   online_hadamard=online_hadamard), False, [note]
    return result, gamma and not gamma_in_float, []


# -- the error --------------------------------------------------------------------------------------

def _is_scores(output: str) -> bool:
    """An output whose last axis scores classes (top-1 agreement means something there)."""
    low = output.lower()
    return "logit" in low or "prob" in low or "score" in low or low == "output"


def output_errors(names, reference, got) -> dict:
    """Per float output: passes/metric's relative RMS and max relative error of `got` against
    `reference`, for outputs that score classes the share of rows whose argmax agrees, and for
    logits the mean KL divergence of the candidate's softmax from the reference's (nats per row)."""
    return streamed_errors(names, [(reference, got)])


def streamed_errors(names, batches: Iterable[tuple]) -> dict:
    """`output_errors` accumulated over `batches` of (reference outputs, candidate outputs): the same
    numbers, to the bit, as on the batches joined, with one batch's outputs alive at a time."""
    names = list(names)
    running = metric.RunningErrors(lambda k: k < len(names) and _is_scores(names[k]))
    for pair in batches:
        running.add(*pair)
        del pair  # (before the generator runs the next batch)
    errors = {}
    for name, e, top1, kl in zip(names, running.errors(), running.top1(), running.kl()):
        if e is None:  # (not a float output)
            continue
        entry = {"max_rel_err": e.max_rel, "rel_rms": e.rel_rms}
        if e.nonfinite_ref:
            entry["nonfinite_ref"] = e.nonfinite_ref
        if top1 is not None:
            entry["top1_agreement"] = top1
        if kl is not None and "logit" in name.lower():  # (a softmax over logits is a distribution)
            entry["kl"] = kl if e.finite else math.inf
        errors[name] = entry
    return errors


def score(errors: dict) -> float:
    """What rotate="auto" minimizes, the worst output's error: the KL divergence of logits (`kl`),
    else the relative RMS error (passes/metric: never NaN). On an LM's logits the relative RMS error
    ranks candidates against perplexity: SmolLM2 int4 b32, the model as given has the highest
    (0.300 against a rotation's 0.239) and the lowest perplexity (31.0 against 32.7); its KL (0.298
    against 0.292: within AUTO_MARGIN) keeps it (benchmarks/RESULTS.md)."""
    return max((e.get("kl", e["rel_rms"]) for e in errors.values()), default=0.0)


def worst_rel_rms(errors: dict) -> float:
    return max((e["rel_rms"] for e in errors.values()), default=0.0)


def score_name(errors: dict) -> str:
    """What `score` measured, as a report says it."""
    kl = any("kl" in e for e in errors.values())
    return ("KL divergence of the logits (nats per row)" if kl and len(errors) == 1 else
            "error (KL of logits, else relative RMS)" if kl else "relative RMS error")


def worst_max(errors: dict) -> float:
    return max((e["max_rel_err"] for e in errors.values()), default=0.0)


# -- rotate="auto" ----------------------------------------------------------------------------------

@dataclass
class Quantized:
    """One candidate, prepared by an adapter (`prepared`, with its fold), quantized and measured."""

    prepared: Any
    quantized: Any
    fold: Optional[FoldResult]
    errors: dict
    ops: dict
    bytes: Optional[int]


def changed_ops(before: dict, after: dict) -> dict:
    """op kind -> (before, after) for the kinds whose count the quantizer changed."""
    return {k: (before.get(k, 0), after.get(k, 0)) for k in sorted(set(before) | set(after))
            if before.get(k, 0) != after.get(k, 0)}


def trial(candidate: str, q: Quantized, **extra) -> dict:
    """A measured candidate's record in the report (QuantizeReport.candidates); `extra` after its name."""
    return {"candidate": candidate, **extra, "score": score(q.errors), "rel_rms": worst_rel_rms(q.errors),
            "max_rel_err": worst_max(q.errors), "ops": dict(q.ops), "bytes": q.bytes}


def choose(prepare: Callable[[dict], Any], quantize: Callable[[Any], Quantized],
           plain: Optional[Callable[[], dict]] = None, candidates=AUTO_CANDIDATES,
           plain_name: str = "plain onnxruntime", progress: Progress = None,
           unmeasured: Optional[Callable[[Any], Quantized]] = None) -> tuple[Quantized, list[dict]]:
    """rotate="auto": each candidate's fold options given to `prepare` (unverified; an LnfoldError
    skips it), then `quantize` (quantize and measure), then search.best_of over the candidates within
    the size rule. A candidate that folds the same as a simpler one is skipped unquantized. `plain()`:
    a reference trial record, never chosen. Only one candidate is alive at a time, so the chosen one
    is made again: by `unmeasured` where given (taking the errors of its trial: `quantize` may then
    drop its float artifact), else by `quantize`. Returns (the chosen Quantized, every trial record;
    the chosen one has "chosen": True and "why")."""
    made: dict[int, Quantized] = {}  # each candidate's measurements, its artifacts dropped
    skipped: dict[int, str] = {}
    for k, (label, opts) in enumerate(candidates):  # one candidate's artifacts in memory at a time
        stage(progress, f"rotate auto: candidate {k + 1} of {len(candidates)}, {label}")
        try:
            prepared = prepare(opts)
        except LnfoldError as e:
            skipped[k] = str(e)[:160]
            continue
        if opts.get("rotate") and not rotated_streams(prepared.fold):
            same = "the online Hadamard alone" if opts.get("online_hadamard") else "the fold"
            skipped[k] = f"rotates no stream (the same as {same})"
        elif opts.get("online_hadamard") and not online_layers(prepared.fold):
            skipped[k] = "no linear layer writes a stream (the same as the fold)"
        elif opts.get("gamma_into_readers") and not moved_gamma(prepared.fold):
            skipped[k] = "no γ can move (the same as the fold)"
        elif opts.get("gamma_in_float") and not float_gammas(prepared.fold):
            skipped[k] = "no rotated norm has a γ to keep (the same as the rotation)"
        else:
            q = quantize(prepared)
            made[k] = Quantized(None, None, None, q.errors, q.ops, q.bytes)
            del q
        del prepared
    smallest = min((q.bytes for q in made.values() if q.bytes), default=None)

    def growth(k: int) -> float:
        size = made[k].bytes
        return size / smallest if k and smallest and size else 1.0

    small = [score(q.errors) for k, q in made.items() if growth(k) <= AUTO_SIZE_SLACK]
    lowest_small = min((e for e in small if math.isfinite(e)), default=math.inf)

    def scored(k: int) -> float:
        if k in skipped:
            raise search.Skip(skipped[k])
        g, error = growth(k), score(made[k].errors)
        if g > AUTO_SIZE_SLACK and not error * g <= lowest_small:
            raise search.Skip(f"its file is {g:.2f}x the smallest candidate's and its error ({error:.3g}) does not "
                              f"fall by as much (the lowest within {AUTO_SIZE_SLACK:g}x: {lowest_small:.3g}): "
                              "a lower error does not pay for a bigger model")
        return error

    best = search.best_of(range(len(candidates)), scored, AUTO_MARGIN)
    trials = []
    for t in best.trials:
        label, opts = candidates[t.index]
        trials.append({"candidate": label, "rotate": opts.get("rotate"), "skipped": t.skipped}
                      if t.skipped is not None else trial(label, made[t.index], rotate=opts.get("rotate")))
    chosen = trials[best.index]  # (the first candidate, the model not folded, is never skipped)
    chosen["chosen"] = True
    base = trials[0].get("score")
    counted = sum("score" in t for t in trials)
    plain_score = None
    if plain is not None:
        trials.append(plain())
        plain_score = trials[-1].get("score")
    chosen["why"] = (f"{chosen['candidate']}: the lowest {score_name(made[best.index].errors)} ({chosen['score']:.3g}) of "
                     f"{counted} candidates on the measurement rows, simpler ones kept "
                     f"unless beaten by over {AUTO_MARGIN:.0%}, a bigger file only for a lower error in proportion"
                     + (f" (not folded: {base:.3g})" if base is not None and chosen is not trials[0] else "")
                     + (f"; {plain_name}, for reference: {plain_score:.3g}" if plain_score is not None else ""))
    # the chosen one made again (prepare and quantize are deterministic): the others were never all kept
    stage(progress, f"rotate auto: {candidates[best.index][0]} chosen, quantized again")
    if unmeasured is None:
        return quantize(prepare(candidates[best.index][1])), trials
    q = unmeasured(prepare(candidates[best.index][1]))
    q.errors = made[best.index].errors  # (measured when it was tried, on the same rows)
    return q, trials


# -- the rows it is measured on ---------------------------------------------------------------------

@dataclass
class Measured:
    """The rows the error is measured on (and rotate="auto" chooses by), the rows that calibrate,
    and the rows the fold is verified on (None: made-up ones)."""

    rows: Rows
    described: str
    calibration: Optional[Rows]
    verification: Optional[dict]
    all_calibration: Optional[Rows] = None  # every --calibrate row (the written model's calibration)


def measurement(inputs: Optional[Rows], calibration: Optional[Rows], calibrating: bool,
                made_up: Callable[[], Rows]) -> Measured:
    """--inputs when given; else the --calibrate rows (static activations: held out of calibration
    by the one rule, passes/calibration.Rows.split); else `made_up()` inputs, said to be."""
    if inputs is not None:
        return Measured(inputs, f"your inputs ({inputs.describe()})", calibration, inputs.runs()[0])
    if calibration is None:
        rows = made_up()
        return Measured(rows, f"made-up inputs ({rows.describe()}) — NOT your data: the error on real inputs can be "
                        "far larger; give --inputs or --calibrate", None, None)
    if not calibrating:  # nothing calibrates: every row measures
        return Measured(calibration, f"your --calibrate rows ({calibration.describe()})", None, calibration.runs()[0])
    fit, held = calibration.split()
    if held is None:
        return Measured(calibration, f"the calibration rows themselves ({calibration.describe()}; too few to hold "
                        "any out: give --inputs for an independent figure)", calibration, calibration.runs()[0])
    return Measured(held, f"{held.count} held-out --calibrate rows ({held.describe()}), not used to calibrate; "
                    f"calibrated on the other {fit.count}", fit, held.runs()[0], calibration)


def bounded(m: Measured, row_bytes: Optional[int]) -> Measured:
    """`m` with its measurement rows run so that a run's outputs stay about RUN_OUTPUT_BYTES
    (`Rows.bounded`; `row_bytes`: one row's outputs) and the fold verified on the first such run: the
    memory of measuring a candidate no longer grows with the rows. The calibration rows are kept."""
    rows = m.rows.bounded(row_bytes)
    if rows is m.rows:
        return m
    return replace(m, rows=rows, verification=None if m.verification is None else rows.runs()[0])


# -- the result and its report ----------------------------------------------------------------------

@dataclass
class QuantizeReport:
    """What a quantize did, and how far the result is from the float model: it is NOT exact."""

    scheme: str
    weights: str
    activations: Optional[str]
    block_size: Optional[int]
    per_channel: bool
    folded: int  # LayerNorms folded into RMSNorms (exact, verified)
    kept: int
    fold_verified: Optional[str]  # the gate's criterion ("float64", ...); None: no fold
    fold_max_rel_err: Optional[float]
    gamma_into_readers: bool
    rotate: Optional[str]
    seed: Optional[int]
    rotation: Optional[str]  # the fold report's word on each stream's rotation
    rotated_streams: int  # streams the rotation applied to (0 where every one was blocked)
    online_layers: int  # linear layers whose input the fold rotates online (online_hadamard)
    linear_layers: int  # linear layers (constant 2-D weight) handed to the quantizer
    basis_changes: dict  # the fold's basis-change products, kept float: node -> parameters
    parameters: int  # the float model handed to the quantizer: its weights' elements
    ops_before: dict  # op (or layer) kind -> count, the float model given to the quantizer
    ops_after: dict  # the same, quantized
    bytes_before: int  # the input model
    bytes_after: int  # the quantized model
    errors: dict  # output -> {"max_rel_err", "rel_rms", "top1_agreement"} against the float input model
    error_inputs: str  # what they were measured on
    notes: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    # rotate="auto": every candidate's `trial` record (or {"candidate", "skipped"}), the one kept with
    # why; last, the plain quantizer on the model as given ("plain": True), a reference never chosen
    candidates: list = field(default_factory=list)
    chosen: Optional[str] = None
    exact: bool = False  # quantization is not exact: see `errors`

    @property
    def max_rel_err(self) -> float:
        return worst_max(self.errors)

    @property
    def rel_rms(self) -> float:
        return worst_rel_rms(self.errors)

    def changed_ops(self) -> dict:
        return changed_ops(self.ops_before, self.ops_after)

    def fold_line(self) -> str:
        if self.fold_verified is None:
            return "fold: none (the model went to the quantizer as given)"
        extra = ", γ into the readers" if self.gamma_into_readers else ""
        if self.rotate:
            extra += (f", {self.rotated_streams} stream(s) rotated ({self.rotate}, seed {self.seed})"
                      if self.rotated_streams else f", rotation {self.rotate} asked, no stream rotated")
        if self.online_layers:
            extra += f", an online Hadamard before {self.online_layers} layer(s) that write a stream"
        err = f", max rel. diff {self.fold_max_rel_err:.1e}" if self.fold_max_rel_err is not None else ""
        return (f"fold: {self.folded} LayerNorm(s) folded, {self.kept} kept{extra}: exact, verified "
                f"({self.fold_verified}{err})")

    def error_line(self) -> str:
        parts = []
        for name, e in self.errors.items():
            agree = f", top-1 agreement {e['top1_agreement']:.1%}" if "top1_agreement" in e else ""
            agree += f", KL divergence {e['kl']:.3g} nats per row" if "kl" in e else ""
            left = (f" ({e['nonfinite_ref']} value(s) where the float model itself is not finite left out)"
                    if e.get("nonfinite_ref") else "")
            parts.append(f"{name}: rel. RMS error {e['rel_rms']:.2e}, max rel. error {e['max_rel_err']:.2e}{agree}{left}")
        return "; ".join(parts) or "no float output to compare"

    def table(self) -> str:
        lines = [f"quantized: {self.scheme}",
                 self.fold_line(),
                 f"linear layers quantized: {self.linear_layers}; ops changed: " + ", ".join(
                     f"{k} {a} -> {b}" for k, (a, b) in self.changed_ops().items()),
                 f"size: {self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB "
                 f"({self.bytes_after / max(self.bytes_before, 1):.2f}x)"]
        if self.basis_changes:
            n = sum(self.basis_changes.values())
            lines.append(f"kept float: {len(self.basis_changes)} MatMul(s) the fold inserted to change a basis (a "
                         f"stream's, or a layer's input: online_hadamard) ({', '.join(self.basis_changes)}; {n} "
                         f"parameters, {n / max(self.parameters, 1):.2%} of the model's): no layer of the model, and a "
                         "readout's error would land on the output")
        if self.rotation:
            lines.append(f"rotation: {self.rotation}")
        lines += [f"note: {n}" for n in self.notes]
        for t in self.candidates:
            said = (f"skipped: {t['skipped']}" if "skipped" in t else
                    (f"score {t['score']:.3e} (KL of logits, else rel. RMS), " if t.get("rel_rms", t["score"]) != t["score"]
                     else "")
                    + f"rel. RMS error {t.get('rel_rms', t['score']):.3e}, max rel. error {t['max_rel_err']:.3e}")
            if t.get("bytes"):
                said += f", {t['bytes'] / max(self.bytes_before, 1):.2f}x the size"
            if t.get("plain"):  # quantizes ops lnfold leaves float: what a user of onnxruntime alone gets
                ops = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in t.get("changed_ops", {}).items())
                said += (f" (ops changed: {ops}; " if ops else " (") + \
                    "every op it takes, on the model as given: reference, never chosen)"
            lines.append(f"auto: {t['candidate']}: {said}{'  <- chosen' if t.get('chosen') else ''}")
        if self.chosen:
            lines.append(f"auto chose {self.chosen} (chosen and measured on the same rows)")
        lines.append(f"NOT exact (quantization): against the float model on {self.error_inputs}: {self.error_line()}")
        return "\n".join(lines)

    def metadata(self) -> str:
        """One line for the model's metadata."""
        rot = f", {self.rotated_streams} stream(s) rotated {self.rotate} (seed {self.seed})" if self.rotated_streams else ""
        rot += f", an online Hadamard before {self.online_layers} layer(s)" if self.online_layers else ""
        fold = f"{self.folded} LayerNorm(s) folded exactly{rot}; " if self.fold_verified else ""
        return (f"{fold}then quantized: {self.scheme}. NOT exact: rel. RMS error {self.rel_rms:.2e}, max rel. error "
                f"{self.max_rel_err:.2e} against the float model on {self.error_inputs}")

    def as_dict(self) -> dict:
        return {**asdict(self), "max_rel_err": self.max_rel_err, "rel_rms": self.rel_rms,
                "changed_ops": {k: list(v) for k, v in self.changed_ops().items()}}

    def to_json(self, **kw) -> str:
        return json.dumps(self.as_dict(), **kw)


def report_of(scheme: str, q: Quantized, *, rotate: Optional[str], seed: int, seconds: float, trials: list,
              **fields) -> QuantizeReport:
    """The report of the quantized candidate `q` (chosen from `trials` where rotate="auto"); `fields`:
    the QuantizeReport fields the adapter knows (the scheme's, the float model's)."""
    f = q.fold
    chosen = next((t for t in trials if t.get("chosen")), None)
    rotated = chosen["rotate"] if chosen else rotate
    return QuantizeReport(
        scheme=scheme, **fields, folded=f.report.folded if f else 0, kept=f.report.kept if f else 0,
        fold_verified=f.criterion if f else None, fold_max_rel_err=f.max_rel_err if f else None,
        rotate=rotated, seed=seed if rotated else None, rotation=rotation_summary(f),
        rotated_streams=rotated_streams(f), online_layers=online_layers(f), ops_after=dict(q.ops),
        bytes_after=q.bytes or 0, errors=q.errors, timings={"total": seconds}, candidates=trials,
        chosen=chosen["why"] if chosen else None)


@dataclass
class QuantizeResult:
    """A quantize's result: the quantized `model` (ONNX) or `module` (torch), its report (NOT
    exact: its error), and the exact part's FoldResult (None when nothing folded)."""

    report: QuantizeReport
    model: Any = None
    module: Any = None
    fold: Optional[FoldResult] = None
