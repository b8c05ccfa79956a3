"""An online Hadamard on the inputs of the linear layers that write a stream (QuaRot's R4): a layer
`u·W` becomes `(u·H)·(Hᵀ·W)`, exact for any u. For quantizers of activations: H spreads the few
outlier channels of u (the MLP's down projection's input) over all n features. DESIGN §6b.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from . import orthogonal
from .analysis import Component
from .compress import size_along
from .edits import KroneckerHadamard, Project, Seeded
from .readers import linear_in_branch
from .rules import writes_product
from .view import ConstRef, View


@dataclass(frozen=True)
class OnlineRotation:
    """Input `value` of the linear layer `node` times H = `basis` (n × n) before the layer, and the
    layer's `weight` (its input-feature axis) times Hᵀ: `(u·H)(Hᵀ·W) = u·W`."""

    node: str
    value: str
    basis: Union[KroneckerHadamard, Seeded]
    weight: ConstRef

    @property
    def edit(self) -> Project:
        """The weight's side: Hᵀ·W along its input-feature axis."""
        return Project(self.weight.axis, self.basis, self.basis.dim)

    def factors(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(A, B) with H = A ⊗ B, float64, where H is a Hadamard matrix: the emitters apply it as
        `Aᵀ · reshape(u, [..., p, m]) · B` (n·(p+m) multiply-adds); None: a dense n×n H."""
        return self.basis.factors() if isinstance(self.basis, KroneckerHadamard) else None


def plan_online(view: View, comps: list[Component], seed: int,
                trainable=None) -> list[OnlineRotation]:
    """An online rotation of every linear layer that writes one of `comps` (a constant weight whose
    output features are the stream's) on its activation input, each layer once. One H per input
    width: a Hadamard matrix where n allows one (no random signs: its Kronecker factors are applied
    online, passes/edits.KroneckerHadamard), else a random orthogonal matrix from `seed`; every layer
    of a width shares one."""
    out: dict[tuple[str, str], OnlineRotation] = {}
    for comp in comps:
        for src in comp.sources:
            for ref in src.refs:
                if ref.axis is None or (trainable is not None and trainable(ref.value)):
                    continue
                got = _activation_input(view, ref, seed)
                if got is not None:
                    out.setdefault((got.node, got.value), got)
    return list(out.values())


def _activation_input(view: View, ref: ConstRef, seed: int) -> Optional[OnlineRotation]:
    """The online rotation of `ref`'s user where it is a linear layer whose weight is `ref` and whose
    other input is an activation with its features last (known width); else None."""
    node = view.nodes.get(ref.user)
    if node is None or not writes_product(node):
        return None
    for i, x in enumerate(node.inputs):
        v = view.values.get(x)
        if x == ref.value or v is None or v.is_const or not v.rank:
            continue
        # (an inlined If branch's layer answers only through its branch rule: a merged decoder's)
        lin = node.linear(i, v.rank - 1) or linear_in_branch(view, node, i, v.rank - 1)
        n = size_along(view, x, v.rank - 1)
        if lin is None or lin.weight.value != ref.value or lin.weight.axis is None or not isinstance(n, int) or n < 2:
            continue
        basis = KroneckerHadamard(n) if orthogonal.hadamard(n) is not None else Seeded("orthogonal", n, seed)
        return OnlineRotation(node.name, x, basis, lin.weight)
    return None
