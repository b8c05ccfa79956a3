"""γ into the readers (DESIGN §6b, "γ into readers"): which folded norms leave a unit-weight
RMSNorm, `W(γ⊙n + β) + b = (W·diag γ) n + (W β + b)`, γ a `Scale` of each reader's weight. A stream
rotation needs it of every norm of the stream (a unit-γ RMSNorm commutes with Q, one with γ does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .beta import BetaFold
from .edits import Scale
from .readers import LinearReader, linear_readers
from .view import ConstRef, View


@dataclass
class GammaFold:
    """One folded norm's γ: moved into the weights of `readers`, kept (`why`), or kept in float
    beside a rotation (`in_float`: the readers take the rotation alone, and the rotated norm is
    followed by a float Qᵀ·diag γ·Q, passes/rotate.py; where its stream is not rotated, γ stays in
    the norm)."""

    norm: str
    gamma: Optional[str]
    readers: list[LinearReader] = field(default_factory=list)
    why: str = ""
    by_readers: bool = False  # kept because of what reads the norm (a graph output, a non-linear reader)
    read_as_output: bool = False  # the norm's output is a graph output (a model's hidden states as its output)
    in_float: bool = False  # asked (gamma_in_float) where γ could move: it stays beside the rotation

    @property
    def moved(self) -> bool:
        """γ goes into the readers' weights."""
        return not self.why and not self.in_float

    def edits(self, view: View) -> list[tuple[ConstRef, Scale]]:
        """(reader weight, W·diag γ along its input axis) for each reader; none where γ is absent."""
        if self.gamma is None or not self.moved:
            return []
        g_axis = (view.values[self.gamma].rank or 1) - 1
        return [(r.weight, Scale(self.gamma, g_axis, r.weight.axis)) for r in self.readers]

    def describe(self, view: View) -> str:
        if self.in_float:  # (a rotated stream's plan says more: passes/plan.py)
            return "kept in the norm (gamma_in_float, and its stream is not rotated)"
        if not self.moved:
            return f"kept in the norm ({self.why})"
        if self.gamma is None:
            return "none (unit weight already)"
        return "into the weight of " + ", ".join(view.nodes[r.node].describe() for r in self.readers)


def decide(view: View, norm: str, beta: Optional[BetaFold], kept_by_target: Optional[str] = None,
           compressed: bool = False) -> GammaFold:
    """Whether the folded norm `norm` can leave its γ to its readers, and why not."""
    node = view.nodes[norm]
    spec = node.norm
    out = GammaFold(norm, spec.gamma)
    x = view.values[node.inputs[spec.input]].shape
    if compressed:
        out.why = "it is emitted as CRMSNorm, whose readers absorb γ already"
    elif kept_by_target is not None:
        out.why = f"the target keeps this norm ({kept_by_target})"
    elif spec.gamma is not None and not view.values[spec.gamma].is_const:
        out.why = f"γ `{spec.gamma}` is not a constant"
    elif x is None or spec.axis >= len(x) or not isinstance(x[spec.axis], int):
        out.why = "its feature size is not known (a unit weight needs it)"
    if out.why:
        return out
    y = node.outputs[0]
    readers, why = linear_readers(view, y, spec.axis, through_layout=True)
    out.by_readers, out.read_as_output = why is not None, view.values[y].is_graph_output
    if why is None and spec.beta is not None and (beta is None or beta.emits_add):
        why = ("β stays with the norm (" + (beta.why if beta is not None else "the target folds no β")
               + "), and a β Add after a unit-γ norm would be scaled by γ in the readers")
    if why is None and spec.gamma is not None:
        d = view.values[spec.gamma].shape
        for r in readers:
            ws = view.values[r.weight.value].shape
            if ws is None or d is None or ws[r.weight.axis] != d[-1]:
                why = f"the sizes of {view.nodes[r.node].describe()}'s weight and γ are not known to fit"
                break
    if why is None:
        out.readers = readers
    else:
        out.why = why
    return out
