"""Verification of the torch frontends: run the original (and a float64 copy) and a folded
module or graph on the same inputs; passes/gate.py judges (DESIGN §4)."""
from __future__ import annotations

import contextlib
import copy
import io
from typing import Callable, Optional

import torch
from torch import fx

from ..passes import VerificationError, gate

from .dynamo import concrete_inputs
from .edits import to_numpy
from .float64 import Float64Everywhere
from .hf import fresh, pytree


class Verifier:
    """Runs the original (and a float64 copy of it, `ref64`) once and judges folded modules with the
    gate of passes/gate.py (DESIGN §4; its fallback where the float64 copy cannot be run)."""

    def __init__(self, original: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.original, self.args, self.kwargs = original, args, kwargs
        with torch.no_grad():
            self.ref = pytree.tree_leaves(_seeded(original, args, kwargs))
        self.exact = ref64(original, args, kwargs, self.ref)

    def verdict(self, folded: torch.nn.Module) -> gate.Verdict:
        with torch.no_grad():
            got = pytree.tree_leaves(_seeded(folded, self.args, self.kwargs))
        return judge_outputs(self.ref, got, self.exact)

    def check(self, folded: torch.nn.Module) -> gate.Verdict:
        v = self.verdict(folded)
        if not v.ok:
            raise v.error()
        return v


def ref64(original: Callable, args, kwargs: dict, ref: list) -> Optional[list]:
    """The leaves of a float64 run of a copy of `original` (every op in float64: float64.py), or None
    where it cannot be made (a module that does not copy or does not run in float64)."""
    cast = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    try:
        m64 = copy.deepcopy(original).double()
        # a graph that makes float32 tensors of its own fails here, and torch.fx prints the
        # traceback before raising: an expected, handled failure, not the user's to read
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()), Float64Everywhere():
            out = pytree.tree_leaves(_seeded(m64, pytree.tree_map(cast, tuple(args)), pytree.tree_map(cast, kwargs)))
    except Exception:
        return None
    return out if len(out) == len(ref) else None


def judge_outputs(ref: list, got: list, exact: Optional[list]) -> gate.Verdict:
    """The gate's verdict on output leaves (non-tensor leaves must be equal)."""
    if len(ref) != len(got):
        return gate.Verdict(False, gate.OUTPUTS, float("inf"), failure=f"{len(got)} outputs instead of {len(ref)}")
    outs = []
    for k, (r, g) in enumerate(zip(ref, got)):
        if not isinstance(r, torch.Tensor):
            if r != g:
                return gate.Verdict(False, gate.OUTPUTS, float("inf"), failure=f"output {r!r} became {g!r}")
            continue
        e = exact[k] if exact is not None and isinstance(exact[k], torch.Tensor) else None
        outs.append(gate.Output(f"#{k}", str(r.dtype).removeprefix("torch."), to_numpy(r), to_numpy(g),
                                None if e is None else to_numpy(e)))
    return gate.judge(outs)


def _seeded(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Run with a fixed seed, so that random ops (train-mode dropout) draw the same numbers, on
    fresh copies of the inputs (hf.fresh: a key/value cache grows in place at every run)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return module(*fresh(args), **fresh(kwargs))


def verify_graph(original: fx.GraphModule, folded: fx.GraphModule, example_inputs: list) -> None:
    """Judge the folded graph with the gate of passes/gate.py (against a float64 run of a copy of
    the original graph where one can be made). Under dynamic shapes the graphs take symbolic
    sizes among their inputs: they run here with the sizes of the tensors at hand."""
    example_inputs = concrete_inputs(original, example_inputs)
    if example_inputs is None:
        raise VerificationError("lnfold: cannot verify: a symbolic size of this graph has no example value "
                                "(an unbacked size no input carries); compile without lnfold.verify, or verify "
                                "with lnfold.fold_module")
    with torch.no_grad():
        ref = pytree.tree_leaves(original(*example_inputs))
        got = pytree.tree_leaves(folded(*example_inputs))
    verdict = judge_outputs(ref, got, ref64(original, example_inputs, {}, ref))
    if not verdict.ok:
        raise verdict.error("lnfold: ")
