"""A tiny Post-LN model for the geometry and approximate-swap tests (tests/test_geometry.py,
tests/test_approx.py): an embedding norm that folds, and a Post-LN norm that cannot (a linear
layer reads the residual sum). `shift` plants a mean in that norm's input (a constant added to the
branch's bias): its angle to 1 moves away from 90°, and swapping it for RMSNorm costs a lot."""
from __future__ import annotations

import functools

import torch
from torch import nn

D, VOCAB = 32, 64


class PostLN(nn.Module):
    def __init__(self, shift: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():  # the same weights for every instance with this seed
            torch.manual_seed(seed)
            self.emb = nn.Embedding(VOCAB, D)
            self.ln0, self.fc, self.ln1, self.head = nn.LayerNorm(D), nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, VOCAB)
        with torch.no_grad():
            for ln in (self.ln0, self.ln1):  # γ, β randomized: γ = 1, β = 0 hide affine mistakes
                ln.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
                ln.bias.copy_(0.05 * torch.randn(D, generator=g))
            self.emb.weight.add_(3.0)  # a large mean the exact fold removes (the embedding norm folds)
            self.fc.bias.add_(shift)  # the planted mean of the Post-LN norm's input
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln0(self.emb(ids))
        h = self.ln1(h + self.fc(h))  # Post-LN: `h` is read by `fc`, a linear layer: not foldable
        return self.head(h)


def ids(rows: int = 8, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _exported(shift: float) -> bytes:
    from lnfold import zoo

    return zoo.export_onnx(PostLN(shift), (ids(2),), ["ids"], dynamo=False).SerializeToString()


def onnx_model(shift: float = 0.0):
    """The model exported once per session (TorchScript exporter: the quicker one), a fresh proto each call."""
    import onnx

    return onnx.load_from_string(_exported(shift))
