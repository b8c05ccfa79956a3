"""The fold's options, checked in one place: every entry point builds a `FoldOptions` from its
keywords, so a bad value is the same one-line `LnfoldError` wherever it is given. What a frontend
emits (ONNX targets and devices, the torch `norm=`) is the frontend's to check, with `check_choice`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import LnfoldError

MODES = ("rms", "crms")  # RMSNorm, or CRMSNorm with the stream compressed to d-1 features
DEFER_POLICIES = ("auto", "on", "off")  # deferred normalization (passes/defer.py)
# stream rotations (passes/rotate.py, passes/orthogonal.py); "-keep-ln": Q·1 = 1, stock LayerNorms stay exact
ROTATIONS = ("hadamard", "orthogonal", "hadamard-keep-ln", "orthogonal-keep-ln")


def check_rotation(rotate, seed, gamma_into_readers, mode: str) -> None:
    """The rotation options (FoldOptions and PlanRequest alike): a bad one is a one-line LnfoldError."""
    if rotate is not None:
        check_choice("rotation", rotate, ROTATIONS)
        if mode != "rms":
            raise LnfoldError(f"rotate={rotate!r} needs mode 'rms' (a CRMS stream has d-1 features)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LnfoldError(f"seed must be a non-negative integer, got {seed!r}")
    if gamma_into_readers not in (True, False):
        raise LnfoldError(f"gamma_into_readers must be True or False, got {gamma_into_readers!r}")


def check_choice(what: str, value, allowed: tuple) -> str:
    """`value` when it is one of `allowed`, else a one-line LnfoldError naming the choices."""
    if not isinstance(value, str) or value not in allowed:
        raise LnfoldError(f"unknown {what} {value!r} (expected one of {', '.join(allowed)})")
    return value


@dataclass(frozen=True)
class FoldOptions:
    """What any fold was asked to do (the frontend-neutral options)."""

    mode: str = "rms"
    defer: str = "off"
    verify: bool = True
    # γ (and β) of each folded norm into its readers' weights (passes/gamma.py); a rotation implies it
    gamma_into_readers: bool = False
    rotate: Optional[str] = None  # one of ROTATIONS (passes/rotate.py)
    seed: int = 0  # the rotation's random signs / Gaussian matrix

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("defer policy", self.defer, DEFER_POLICIES)
        if self.verify not in (True, False):
            raise LnfoldError(f"verify must be True or False, got {self.verify!r}")
        object.__setattr__(self, "verify", bool(self.verify))
        check_rotation(self.rotate, self.seed, self.gamma_into_readers, self.mode)
        if self.rotate is not None:
            object.__setattr__(self, "gamma_into_readers", True)


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
