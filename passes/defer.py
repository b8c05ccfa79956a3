"""Deferred normalization: which folded norms may skip writing their normalized tensor,
and whether it pays. With `r(x) = rsqrt(mean(x²) + eps)` per row and only linear readers,
`W (γ ⊙ x · r(x) + β) + b = r(x) · ((W·diag γ) x) + (W β + b)`: the row scale is applied to each
reader's product — cheaper only where that multiply rides in the GEMM's epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import numpy as np

from . import weights
from .edits import ConstEdit, Scale, const_edits
from .frozen import FrozenList
from .options import DEFER_POLICIES, check_choice
from .readers import LinearReader, linear_readers
from .view import View


@dataclass(frozen=True)
class Costs:
    """Memory traffic per row, in elements, of the two exact emissions of a norm: the RMS op reads x
    and writes y (2d); deferred, one reduction reads x (d) and the row scale reads and writes each
    reader's product (2·out) unless fused into the GEMM's epilogue (measured per target:
    benchmarks/RESULTS.md, "Deferred normalization")."""

    epilogue_fused: bool = False

    def rms(self, d: int) -> float:
        return 2.0 * d

    def deferred(self, d: int, out_widths: list[int]) -> float:
        return d + (0.0 if self.epilogue_fused else 2.0 * sum(out_widths))


# Measured on this project's CPU (2026-11-22, benchmarks/RESULTS.md "Deferred normalization"):
# onnxruntime runs the row scale as its own Mul over the MatMul's output (and loses its MatMul+Add
# fusion); Inductor calls the ATen GEMM and applies the scale in a separate fused kernel, by default
# and under max_autotune alike. Deferred lost to the RMS emission in every onnxruntime case.
ORT_CPU = Costs(epilogue_fused=False)
INDUCTOR_CPU = Costs(epilogue_fused=False)
EAGER = Costs(epilogue_fused=False)  # eager torch runs every op as a kernel of its own


@dataclass(frozen=True)
class Deferral:
    norm: str
    x: str  # the norm's input value (the stream)
    output: str  # the norm's output value
    axis: int
    gamma: Optional[str]
    beta: Optional[str]
    epsilon: float
    readers: list[LinearReader] = field(default_factory=list)


@dataclass(frozen=True)
class DeferDecision:
    deferred: list[Deferral] = field(default_factory=FrozenList)
    reasons: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # folded norm -> why not deferred


def plan_deferral(view: View, plan, policy: str = "auto", costs: Costs = ORT_CPU) -> DeferDecision:
    """Which folded norms of `plan` (its swaps, constant edits and compressions so far) to emit
    deferred, and for each other one why not. make_plan asks it; it changes nothing."""
    check_choice("defer policy", policy, DEFER_POLICIES)
    if policy == "off":
        return DeferDecision()
    deferred: list[Deferral] = []
    reasons: dict[str, str] = {}
    edited = {u for e in plan.const_edits for u in e.users}
    crms = {n for cc in plan.compressions if cc.compressed for n in cc.norms}
    for name in plan.swaps:
        if name in crms:  # its readers' weights absorb γ, β and the decompression already
            reasons[name] = "it is emitted as CRMSNorm (mode crms)"
            continue
        node = view.nodes[name]
        spec = node.norm
        x, y = node.inputs[spec.input], node.outputs[0]
        rank = view.values[y].rank
        readers, why = linear_readers(view, y, spec.axis, products_only=True)
        variable = [f"its {what} `{val}` is not a constant" for what, val in (("γ", spec.gamma), ("β", spec.beta))
                    if val is not None and not view.values[val].is_const]
        if variable:
            why = variable[0]
        elif rank is None or spec.axis != rank - 1:
            why = f"its feature axis is not the last axis of `{y}`"
        elif why is None and rank != view.values[x].rank:
            why = "its output and input ranks differ"
        elif why is None and any(r.rank not in (rank, 2) for r in readers):
            # the emitters apply the row scale as it is or flattened to [rows, 1]
            why = "a reader reads it through a reshape to another rank than 2"
        if why is None:
            shared = [r for r in readers if (r.weight.user, r.weight.user_input) in edited]
            if shared:
                why = f"the weight of `{shared[0].node}` is also edited by the fold (it writes into a stream)"
        if why is not None:
            reasons[name] = why
            continue
        d = view.values[x].shape[-1] if view.values[x].shape else None
        widths = [r.out_width for r in readers]
        if policy == "auto":
            if not isinstance(d, int) or any(w is None for w in widths):
                reasons[name] = "cost model: feature sizes unknown"
                continue
            rms, moved = costs.rms(d), costs.deferred(d, widths)
            if moved >= rms:
                reasons[name] = (f"cost model: deferring moves {moved:g} elements per row against "
                                 f"the RMS op's {rms:g} (row scale over {sum(widths)} output features, "
                                 f"not fused into the GEMM)")
                continue
        deferred.append(Deferral(name, x, y, spec.axis, spec.gamma, spec.beta, spec.epsilon, FrozenList(readers)))
    return DeferDecision(FrozenList(deferred), MappingProxyType(reasons))


def gamma_edits(view: View, decision: DeferDecision) -> list[ConstEdit]:
    """γ folded into each reader's weight (`W·diag γ`), as constant edits (the plan's)."""
    uses = [(r.weight.value, (Scale(d.gamma, (view.values[d.gamma].rank or 1) - 1, r.weight.axis),),
             (r.weight.user, r.weight.user_input))
            for d in decision.deferred if d.gamma is not None for r in d.readers]
    return const_edits(view, uses)


def compute_biases(decision: DeferDecision, get_array: Callable[[str], np.ndarray],
                   ) -> dict[tuple[str, str], Optional[np.ndarray]]:
    """(norm, reader) -> the reader's new bias `W β + b` (float64, cast once), or None where β is
    absent (the bias, if any, stays as it is). Uses the reader's original weight, before γ."""
    out: dict[tuple[str, str], Optional[np.ndarray]] = {}
    for d in decision.deferred:
        beta = None if d.beta is None else np.asarray(get_array(d.beta)).reshape(-1)
        for r in d.readers:
            if beta is None or not np.any(beta):
                out[(d.norm, r.node)] = None
                continue
            w = np.asarray(get_array(r.weight.value))
            b = None if r.bias is None else np.asarray(get_array(r.bias.value))
            dtype = b.dtype if b is not None else w.dtype
            nb = weights.beta_into_bias(w, beta, None if b is None else b.reshape(-1), r.weight.axis, dtype)
            out[(d.norm, r.node)] = nb.reshape(b.shape) if b is not None else nb
    return out
