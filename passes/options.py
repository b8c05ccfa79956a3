"""The fold's options, declared once (`OPTIONS`: name, type, default, help, choices, check and a
search space) and checked in one place: every entry point builds a `FoldOptions` from its keywords,
so a bad value is the same one-line `LnfoldError` wherever it is given, and every command adds its
flags from the same declarations (`Option.add_to`, `options_from`). What a frontend emits (ONNX
targets and devices, the torch `norm=`) is the frontend's to declare, with the same `Option`.
"""
from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from .errors import LnfoldError

PLAN_MODES = ("rms", "crms")  # RMSNorm, or CRMSNorm with the stream compressed to d-1 features
APPROX_MODE = "rms-approx"  # NOT exact: kept norms swapped for RMSNorm under a measured budget (passes/approx.py)
MODES = PLAN_MODES + (APPROX_MODE,)
DEFER_POLICIES = ("auto", "on", "off")  # deferred normalization (passes/defer.py)
# stream rotations (passes/rotate.py, passes/orthogonal.py); "-keep-ln": Q·1 = 1, stock LayerNorms stay exact
ROTATIONS = ("hadamard", "orthogonal", "hadamard-keep-ln", "orthogonal-keep-ln")


def check_choice(what: str, value, allowed: tuple) -> str:
    """`value` when it is one of `allowed`, else a one-line LnfoldError naming the choices."""
    if not isinstance(value, str) or value not in allowed:
        raise LnfoldError(f"unknown {what} {value!r} (expected one of {', '.join(allowed)})")
    return value


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LnfoldError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


MASSIVE = "massive"  # spare_channels: each stream's massive-activation channels, found on rows (passes/massive.py)


def check_channels(channels):
    """Channels of a stream to spare from its rotation: "247,507" (the command line) or a sequence of
    non-negative integers, as a sorted tuple without repeats (every rotated stream's); MASSIVE (found
    on rows: passes/massive.py); or what that resolves to, ((a stream's first norm, its channels),
    ...) per stream. None or empty: none."""
    if channels is None or channels == MASSIVE:
        return channels
    try:
        if not isinstance(channels, str) and all(isinstance(c, tuple) and len(c) == 2 for c in channels):
            return tuple((str(norm), _channels(cs)) for norm, cs in channels) or None
        return _channels(channels.split(",") if isinstance(channels, str) else channels) or None
    except (TypeError, ValueError):
        raise LnfoldError(f"spare channels must be non-negative integers (\"247,507\") or {MASSIVE!r}, "
                          f"got {channels!r}") from None


def _channels(items) -> tuple:
    return tuple(sorted({_channel(c) for c in items}))


def _channel(c) -> int:
    if isinstance(c, bool) or not isinstance(c, (int, str)) or int(c) < 0:
        raise ValueError(c)
    return int(c)


@dataclass(frozen=True)
class Option:
    """One option, declared once: its Python keyword `name` (the flag is --name with dashes; a
    boolean whose default is True is the flag --no-name), `type`, `default`, `help`, the `choices`
    it takes (None allowed where the default is None), a `check` (value -> value, or a one-line
    LnfoldError) and the values a search may try (`search`: Olive's search space, where one makes
    sense)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple = ()
    check: Optional[Callable[[Any], Any]] = None
    search: tuple = ()
    what: str = ""  # what a message calls a value of it ("rotation"); default: the name

    @property
    def flag(self) -> str:
        name = self.name.replace("_", "-")
        return f"--no-{name}" if self.type is bool and self.default is True else f"--{name}"

    def checked(self, value):
        """`value` when it is allowed (checked), else a one-line LnfoldError."""
        if self.choices and not (value is None and self.default is None):
            check_choice(self.what or self.name.replace("_", " "), value, self.choices)
        if self.type is bool:
            if value not in (True, False):
                raise LnfoldError(f"{self.name} must be True or False, got {value!r}")
            return bool(value)
        return self.check(value) if self.check is not None else value

    def add_to(self, parser, *, help: Optional[str] = None, choices: Optional[tuple] = None) -> None:
        """This option's flag on an argparse parser (`help`/`choices`: a command's own wording or subset)."""
        text = help or self.help
        if self.type is bool:  # a switch: --name sets True, --no-name (default True) sets False
            parser.add_argument(self.flag, dest=self.flag[2:].replace("-", "_"), action="store_true", help=text)
            return
        kind = (dict(choices=choices or self.choices) if self.choices else
                dict(type=as_argument(self.check, self.type) if self.check else self.type))
        parser.add_argument(self.flag, default=self.default, help=text, **kind)

    def value_in(self, args) -> Any:
        """The option's value in an argparse Namespace this option's `add_to` declared."""
        if self.type is bool and self.default is True:
            return not getattr(args, self.flag[2:].replace("-", "_"))
        return getattr(args, self.name)


MODE_HELP = ("rms (default): each folded LayerNorm becomes an RMSNorm over the same d features; "
             "crms: CRMSNorm, the zero-mean stream carried in d-1 features (its last feature is minus the "
             "sum of the others); readers absorb gamma, beta and the decompression; a stream that cannot "
             "be compressed stays RMSNorm and the report says why. crms is exact and saves 1/d of the "
             "stream's memory and multiply-adds, but in onnxruntime on CPU its norm (primitive ops) "
             "measured 3.2x the RMS op and no end-to-end gain over rms (benchmarks/RESULTS.md)")

OPTIONS = {o.name: o for o in (
    Option("mode", str, "rms", MODE_HELP + f"; {APPROX_MODE}: NOT exact — after the exact fold, norms that cannot "
           "be folded are swapped to RMSNorm while the outputs' relative error on --calibrate stays within --budget "
           "(the written model's metadata says so)", choices=MODES),
    Option("defer", str, "off", "deferred normalization for norms read only by linear layers (γ into their "
           "weights, the row scale on their products): off (default: it never won in the measurements, "
           "benchmarks/RESULTS.md); auto: per norm by the traffic cost model (defers only where the readers' "
           "outputs are narrower than d/2); on: wherever it is exact", choices=DEFER_POLICIES, what="defer policy"),
    Option("verify", bool, True, "verify the fold against float64 (the gate, passes/gate.py); --no-verify skips it"),
    Option("gamma_into_readers", bool, False, "move each folded norm's γ (and β) into the weights (biases) of the "
           "linear layers that read it, leaving unit-weight RMSNorms (exact; the report says where it could not)"),
    Option("rotate", str, None, "rotate each folded stream by an orthogonal Q (exact; implies "
           "--gamma-into-readers): hadamard (a randomized Hadamard where the width allows one, else orthogonal), "
           "orthogonal (random, from --seed); -keep-ln: Q·1 = 1, so stock LayerNorms stay exact too",
           choices=ROTATIONS, search=(None,) + ROTATIONS[:2], what="rotation"),
    Option("gamma_in_float", bool, False, "with --rotate: keep each rotated norm's γ in float after the unit-weight "
           "norm, as a constant MatMul by Qᵀ·diag(γ)·Q, the readers taking Q alone (exact; one d×d MatMul per "
           "norm, kept float by the quantizers). Trained LLMs' γ suppresses their few massive-activation "
           "channels; moved into weights that are then quantized, that suppression drowns in the rounding"),
    Option("spare_channels", str, None, "with --rotate: channels the rotation leaves as they are (\"247,507\", "
           f"each rotated stream's indices; {MASSIVE}: each stream's channels whose largest value on the rows "
           "(--calibrate, --inputs, else made-up ones) is over 20x the median channel's): a trained LM's few "
           "massive-activation channels, which its norms' γ suppresses and a full rotation spreads into every "
           "channel's quantization blocks. Exact like any rotation", check=check_channels),
    Option("online_hadamard", bool, False, "a Hadamard on the input of each linear layer that writes a stream, "
           "online (constant MatMuls before the layer, kept float by the quantizers: H = A (x) B as two small "
           "products) and folded into its weight (QuaRot's R4; exact, with or without --rotate): spreads the "
           "outlier channels of the MLP's down projection input before a quantizer of activations (int8 dynamic, "
           "W8A8) sees them"),
    Option("seed", int, 0, "the rotation's random seed (default 0)", check=check_seed),
)}


# how a slice is shaped (passes/slicer.SliceScheme; NOT exact): the slice commands' and keywords' own
SLICE_OPTIONS = {o.name: o for o in (
    Option("per_block", bool, False, "a basis per block input (SliceGPT's scheme): each residual shortcut gets a "
           "k x k MatMul between consecutive bases; a stream whose residual Adds do not allow it keeps one basis"),
    Option("full_width_head", bool, False, "with per_block: the last segment (what the model's head reads) keeps all "
           "d features, as SliceGPT's head does: a k x d shortcut into it; better perplexity where the head is "
           "sensitive, more parameters"),
    Option("center_embeddings", bool, False, "with per_block: subtract each embedding row's mean before slicing an "
           "RMSNorm stream, as SliceGPT's fuse_modules does on every model; NOT exact even unsliced (an RMSNorm "
           "reads the mean). With it, per_block + full_width_head is SliceGPT's slice (SmolLM2: the same "
           "perplexity within 0.03 at F = 0.1, 0.2, 0.25); it helps or hurts by fraction (SmolLM2: better at F = "
           "0.2 and 0.25, worse at 0.1; benchmarks/RESULTS.md)"),
)}


@dataclass(frozen=True)
class FoldOptions:
    """What any fold was asked to do (the frontend-neutral options; OPTIONS declares each field)."""

    mode: str = OPTIONS["mode"].default
    defer: str = OPTIONS["defer"].default
    verify: bool = OPTIONS["verify"].default
    # γ (and β) of each folded norm into its readers' weights (passes/gamma.py); a rotation implies it
    gamma_into_readers: bool = OPTIONS["gamma_into_readers"].default
    rotate: Optional[str] = OPTIONS["rotate"].default  # one of ROTATIONS (passes/rotate.py)
    # with a rotation: γ kept as a float Qᵀ·diag γ·Q after each rotated norm (passes/gamma.py), not in the readers
    gamma_in_float: bool = OPTIONS["gamma_in_float"].default
    # with a rotation: channels of each rotated stream it leaves as they are (passes/orthogonal.matrix)
    spare_channels: Optional[tuple] = OPTIONS["spare_channels"].default
    # an online Hadamard on the stream writers' inputs, Hᵀ in their weights (passes/online.py)
    online_hadamard: bool = OPTIONS["online_hadamard"].default
    seed: int = OPTIONS["seed"].default  # the rotation's random signs / Gaussian matrix

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, OPTIONS[f.name].checked(getattr(self, f.name)))
        if self.mode == APPROX_MODE and (self.rotate is not None or self.gamma_into_readers):
            # the approximate swap keeps β and γ on kept norms' uncentered streams; γ into the readers
            # and a rotation assume every swapped norm's input is zero-mean
            raise LnfoldError(f"--mode {APPROX_MODE} is not combined with --gamma-into-readers or --rotate "
                              "(they need exactly folded norms)")
        if self.gamma_in_float and self.rotate is None:
            raise LnfoldError("--gamma-in-float keeps γ beside a rotation: give --rotate too")
        if self.spare_channels and self.rotate is None:
            raise LnfoldError("--spare-channels leaves channels out of a rotation: give --rotate too")
        if self.rotate is not None:
            if self.mode != "rms":
                raise LnfoldError(f"rotate={self.rotate!r} needs mode 'rms' (a CRMS stream has d-1 features)")
            object.__setattr__(self, "gamma_into_readers", True)

    @property
    def reads_rms_norms(self) -> bool:
        """RMSNorms as given are norms of the view (their streams analyzed): where their γ can move
        (and their streams rotate), or their writers' inputs take an online rotation."""
        return self.gamma_into_readers or self.online_hadamard


def options_from(args, **overrides) -> FoldOptions:
    """The FoldOptions of a command whose parser added the options' flags (`Option.add_to`);
    the ones it did not add keep their defaults (or `overrides`)."""
    given = {f.name: OPTIONS[f.name].value_in(args) for f in fields(FoldOptions)
             if hasattr(args, f.name) or hasattr(args, OPTIONS[f.name].flag[2:].replace("-", "_"))}
    return FoldOptions(**{**given, **overrides})


def takes_options(fn: Callable) -> Callable:
    """The Python keywords of the fold options, derived from OPTIONS: `fn(..., options: FoldOptions,
    ...)` is exposed as `fn(..., mode=..., defer=..., ...)`, one keyword-only argument per FoldOptions
    field with its default (its signature and help say so), checked into the `options` it receives.
    A new option reaches every decorated entry point without a word there."""
    own = inspect.signature(fn)
    names = [f.name for f in fields(FoldOptions)]
    params = [p for p in own.parameters.values() if p.name != "options"]
    at = next((k for k, p in enumerate(params) if p.kind is p.KEYWORD_ONLY), len(params))
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=OPTIONS[n].default,
                               annotation=Optional[OPTIONS[n].type] if OPTIONS[n].default is None else OPTIONS[n].type)
             for n in names]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = {n: kwargs.pop(n) for n in names if n in kwargs}
        return fn(*args, options=FoldOptions(**given), **kwargs)

    wrapper.__signature__ = own.replace(parameters=params[:at] + added + params[at:])
    wrapper.__doc__ = (fn.__doc__ or "").rstrip() + "\n\n    The fold's options (passes/options.OPTIONS):\n" + "".join(
        f"\n    `{n}` (default {OPTIONS[n].default!r}): {OPTIONS[n].help}" for n in names) + "\n"
    return wrapper


# --- the command line's numbers and paths: checked as argparse reads them (`as_argument`), and by
# the API functions that take them, before any model is read ---------------------------------------

def check_threads(threads) -> int:
    """onnxruntime intra-op threads: 0 (its default) up to the machine's logical cores (a million
    made onnxruntime hang creating them; more threads than cores only make the timing noisy)."""
    cores = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= cores:
        raise LnfoldError(f"{threads!r} threads: give 0 (onnxruntime's default) or a count up to this machine's "
                          f"{cores} logical cores")
    return threads


def check_seconds(seconds) -> float:
    """A duration: a finite number of seconds above 0 (nan, inf and negatives are no time to run for)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise LnfoldError(f"{seconds!r} seconds: give a finite number of seconds above 0")
    return float(seconds)


def check_output(path: str) -> str:
    """An -o path: not empty (an empty one was taken as no -o, and the default output written)."""
    if not isinstance(path, str) or not path:
        raise LnfoldError(f"{path!r} is an empty output path: give a file or folder name")
    return path


def as_argument(check: Callable, parse: Callable = str) -> Callable:
    """An argparse `type=` from a check above: argparse's one-line usage error (exit 2) on a bad value."""
    import argparse

    def convert(text: str):
        value = parse(text)  # (a ValueError: argparse's own "invalid int value: 'x'")
        try:
            return check(value)
        except LnfoldError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert
