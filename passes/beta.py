"""Where each folded norm's β goes (THEORY §1, "β into the readers"): into the biases of its readers
(an `AddWeightTimes` of each), or an Add. A reader without a bias keeps β as an Add in both frontends
(a new bias is a new op in ONNX; folding into one would give the two IRs of one model different
emissions), except where `decide(into_readers=True)` asks for one (W β).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable, Optional

from .edits import AddWeightTimes
from .readers import LinearReader, linear_readers
from .view import ConstRef, View


@dataclass
class BetaFold:
    """One folded norm's β: `folded` into the biases of `readers`, or kept (`why`)."""

    norm: str
    beta: Optional[str]  # the β constant, None when the norm has none
    readers: list[str] = field(default_factory=list)  # described readers whose biases absorb β
    edits: list[tuple[ConstRef, AddWeightTimes]] = field(default_factory=list)  # (bias, b + W β)
    # readers with no bias that get one, W β (gamma_into_readers only): (reader node, W β, its weight)
    new: list[tuple[str, AddWeightTimes, ConstRef]] = field(default_factory=list)
    zero: bool = False  # β is all zeros: the norm emits no Add and nothing is edited
    why: str = ""  # why β stays an Add

    @property
    def folded(self) -> bool:
        return bool(self.edits or self.new)

    @property
    def emits_add(self) -> bool:
        return self.beta is not None and not self.zero and not self.folded

    def describe(self) -> str:
        if self.beta is None:
            return ""
        if self.zero:
            return "is zero"
        if self.folded:
            return "into the bias of " + ", ".join(self.readers) + (f" ({len(self.new)} new)" if self.new else "")
        return f"kept as an Add ({self.why})"


def decide(view: View, norm: str, zero: Optional[Callable[[str], bool]] = None,
           into_readers: bool = False) -> BetaFold:
    """β of the folded norm `norm`: zero, into its readers' biases, or kept (with the reason).
    `into_readers` (γ goes into the readers too, passes/gamma.py): readers reached through any
    layout op that keeps the features last, and a reader without a bias gets one (W β)."""
    node = view.nodes[norm]
    beta = node.norm.beta
    if beta is None:
        return BetaFold(norm, None)
    if not view.values[beta].is_const:
        return BetaFold(norm, beta, why=f"β `{beta}` is not a constant")
    if zero is not None and zero(beta):
        return BetaFold(norm, beta, zero=True)
    found, why = linear_readers(view, node.outputs[0], node.norm.axis, through_layout=into_readers)
    if why is None:
        edits, new, why = _bias_edits(view, beta, found, into_readers)
    if why is not None:
        return BetaFold(norm, beta, why=why)
    return BetaFold(norm, beta, [view.nodes[r.node].describe() for r in found], edits, new)


def _bias_edits(view: View, beta: str, found: list[LinearReader], new_biases: bool):
    edits, new = [], []
    d = _numel(view, beta)
    for r in found:
        w, b, name = r.weight, r.bias, r.node
        ws = view.values[w.value].shape
        if b is None:
            if not new_biases:
                return [], [], f"{view.nodes[name].describe()} has no bias to absorb it"
            if ws is None or d is None or ws[w.axis] != d:
                return [], [], f"the sizes of {view.nodes[name].describe()}'s weight and β are not known to fit"
            new.append((name, AddWeightTimes(w.value, w.axis, beta), w))
            continue
        bn = _numel(view, b.value)
        if ws is None or len(ws) != 2 or d is None or ws[w.axis] != d or bn != ws[1 - w.axis]:
            return [], [], f"the sizes of {view.nodes[name].describe()}'s weight and bias are not known to fit β"
        edits.append((b, AddWeightTimes(w.value, w.axis, beta)))
    return edits, new, None


def _numel(view: View, value: str) -> Optional[int]:
    s = view.values[value].shape
    return prod(s) if s is not None and all(isinstance(x, int) for x in s) else None
