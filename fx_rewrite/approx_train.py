"""Training with the approximate swap in place: LayerNorm modules replaced by
RMSNorm with the same γ, β and eps — NOT the same function (passes/approx.py) — so that a few
fine-tuning steps can adapt the model to it (Post-LN, where no fold is exact). The replacement holds
the LayerNorm's own Parameters under the same names: state_dict keys, optimizers and checkpoints stay
as they were. Which norms: the user's choice, e.g. those `fold_module(mode="rms-approx")` swapped."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..passes import LnfoldError


class RMSNormWithBias(nn.Module):
    """RMSNorm(x) · γ + β over the LayerNorm's normalized shape, with the LayerNorm's Parameters."""

    def __init__(self, ln: nn.LayerNorm) -> None:
        super().__init__()
        self.normalized_shape, self.eps = tuple(ln.normalized_shape), ln.eps
        self.weight, self.bias = ln.weight, ln.bias

    def forward(self, x):
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return y if self.bias is None else y + self.bias


def swap_for_training(module: nn.Module, names) -> list[str]:
    """Replace the `nn.LayerNorm` submodules named `names` (module paths, as in `named_modules()`)
    by `RMSNormWithBias`, in place; the names swapped. A name that is no LayerNorm of `module` is a
    one-line LnfoldError (nothing is swapped then)."""
    mods = dict(module.named_modules())
    names = list(dict.fromkeys(names))
    bad = [n for n in names if not isinstance(mods.get(n), nn.LayerNorm)]
    if bad:
        raise LnfoldError(f"swap_for_training: `{bad[0]}` is not an nn.LayerNorm of the module")
    for n in names:
        parent, _, attr = n.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, RMSNormWithBias(mods[n]))
    return names
