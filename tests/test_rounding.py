"""Edited weights are the float64 result rounded once to the stored dtype (fx_rewrite/edits.py
`rounded`): torch's float64 -> float16/bfloat16 conversion goes through float32 and rounds twice,
one unit off for values near a half-way point of the narrow type."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from lnfold.fx_rewrite.edits import from_numpy, rounded


def neighbours(v: float, dtype: torch.dtype) -> list[float]:
    """The representable values of `dtype` around float64 v."""
    x = torch.tensor([v], dtype=torch.float64).to(dtype)
    i = x.view(torch.int16).item()
    return [torch.tensor([i + d], dtype=torch.int16).view(dtype).double().item() for d in (-1, 0, 1)]


def nearest(v: float, dtype: torch.dtype) -> float:
    """v rounded to nearest, ties to the even last bit, by exact rational arithmetic."""
    cands = neighbours(v, dtype)
    best = min(abs(Fraction(v) - Fraction(c)) for c in cands)
    ties = [c for c in cands if abs(Fraction(v) - Fraction(c)) == best]
    return min(ties, key=lambda c: torch.tensor([c], dtype=torch.float64).to(dtype).view(torch.int16).item() & 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounded_once_where_torch_rounds_twice(dtype):
    # a value just above a half-way point of `dtype` that float32 rounds down onto the half-way point
    step = neighbours(1.0, dtype)[2] - 1.0
    v = 1.0 + step / 2 + 2 ** -40  # above the midpoint by less than half a float32 unit
    assert torch.tensor([v], dtype=torch.float64).to(dtype).double().item() == 1.0  # torch: twice, down
    assert rounded(np.array([v]), dtype).double().item() == 1.0 + step == nearest(v, dtype)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(20000) * rng.choice([1e-3, 1.0, 300.0], 20000)
    got = rounded(a, dtype).double().numpy()
    for i in rng.choice(a.size, 300, replace=False):
        assert got[i] == nearest(a[i], dtype)


def test_from_numpy_rounds_float64_once():
    like = torch.zeros(1, dtype=torch.float16)
    v = 1.0 + 2 ** -11 + 2 ** -40
    assert from_numpy(np.array([v]), like).item() == 1.0 + 2 ** -10


def test_the_applier_rounds_its_float64_buffers_once():
    """Rotation, readout, shortcut and sliced-γ buffers (fx_rewrite/apply.Applier._buffer) of an fp16
    model: the float64 constant rounded once, not through float32."""
    from types import SimpleNamespace

    from torch import fx

    from lnfold.fx_rewrite.apply import Applier

    gm = fx.symbolic_trace(torch.nn.Identity())
    output = next(n for n in gm.graph.nodes if n.op == "output")
    v = 1.0 + 2 ** -11 + 2 ** -40  # torch's float64 -> float16 cast gives 1.0
    node = Applier._buffer(SimpleNamespace(gm=gm), "b", np.array([v]), torch.zeros(1, dtype=torch.float16), output)
    assert getattr(gm, node.target).item() == 1.0 + 2 ** -10
