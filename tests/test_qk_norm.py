"""Per-head q/k LayerNorms over head_dim: centering each head's block of the projection's output
rows (and bias) makes each of them foldable (issue 11). StableLM with qk_layernorm is the real
architecture (lnfold/zoo.py `stablelm_qk`: adversarial γ/β, a large mean per head on the q/k rows)."""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from lnfold import zoo
from lnfold.fx_rewrite import analyze_module, fold_module
from lnfold.onnx_rewrite import analyze_model, fold_model
from lnfold.passes import VerificationError, gate, weights
from lnfold.passes.axes import reshape_block_axis

from .conftest import export_quiet

# By hand from modeling_stablelm.py, 2 layers, 4 heads: per layer input_layernorm +
# post_attention_layernorm + 4 q + 4 k per-head LayerNorm(head_dim) = 10; + final norm = 21.
NORMS, QK_NORMS = 21, 16


@functools.lru_cache(maxsize=None)
def _stablelm():
    module, args = zoo.stablelm_qk()
    return module, args, export_quiet(module, args, ["x"])


def _exact(res, dtype="float32"):
    assert res.criterion == "float64"
    assert res.exact_err <= 2 * res.original_exact_err + gate.FLOOR[dtype], (res.exact_err, res.original_exact_err)


@pytest.mark.slow
def test_qk_norms_fold_on_both_frontends_exactly():
    module, args, model = _stablelm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = fold_module(module, args)
    onnx = fold_model(model)
    for res in (fx, onnx):
        assert len(res.report.norms) == NORMS and res.report.folded == NORMS and res.report.recentered == 0
        _exact(res)
    # the per-head norms are the ones that needed the block centering: what got edited says so
    centered = " ".join(c for s in onnx.report.streams for c in s.centered)
    assert centered.count("q_proj") >= 2 and centered.count("k_proj") >= 2


def _whole_axis_center(center):
    """The planted bug: center the whole row range, not each head's block."""
    return lambda a, axis, block=None, lo=0, hi=None, stride=None: center(a, axis)


def _skip_first_head(center):
    """The planted bug: every head's block centered but the first."""

    def bad(a, axis, block=None, lo=0, hi=None, stride=None):
        out = center(a, axis, block, lo, hi, stride)
        if block is not None and axis is not None and a.shape[axis] not in (1, block):
            first = [slice(None)] * a.ndim
            first[axis] = slice(lo, lo + block)
            out[tuple(first)] = a[tuple(first)]
        return out

    return bad


@pytest.mark.slow
@pytest.mark.parametrize("plant", [_whole_axis_center, _skip_first_head])
def test_planted_per_head_bug_fails_verification(monkeypatch, plant):
    module, args, model = _stablelm()
    monkeypatch.setattr(weights, "center", plant(weights.center))
    with pytest.raises(VerificationError, match="float64"):
        fold_model(model)
    with warnings.catch_warnings(), pytest.raises(VerificationError, match="float64"):
        warnings.simplefilter("ignore")
        fold_module(module, args)


def test_block_centering_centers_each_head():
    a = np.random.default_rng(0).normal(3.0, 1.0, (12, 5)).astype(np.float32)
    got = weights.center(a, 0, 4)
    assert np.allclose(got.reshape(3, 4, 5).mean(1), 0, atol=1e-6)
    assert np.allclose(got - a, np.repeat(got.reshape(3, 4, 5) - a.reshape(3, 4, 5), 1, 0).reshape(12, 5))
    assert not np.allclose(weights.center(a, 0).reshape(3, 4, 5).mean(1), 0, atol=1e-3)  # not the same edit


def test_reshape_block_axis_maps_head_dim_to_blocks():
    assert reshape_block_axis(("B", "T", 4, 8), ("B", "T", 32), 3, None) == (2, 8)  # merge: blocks of hd
    assert reshape_block_axis(("B", "T", 32), ("B", "T", 4, 8), 2, 8) == (3, 8)  # split: the whole hd axis
    assert reshape_block_axis(("B", "T", 8, 4), ("B", "T", 32), 2, None) is None  # hd strided: interleaved
    assert reshape_block_axis(("B", "T", 32), ("B", "T", 4, 8), 2, None) is None  # the whole axis split up


class FusedQKV(nn.Module):
    """A fused q/k/v projection, q read at row offset `start`, then per-head LayerNorm(hd) on q."""

    def __init__(self, start, d=32, heads=4):
        super().__init__()
        self.start, self.d, self.heads = start, d, heads
        self.qkv = nn.Linear(d, 3 * d + start)
        self.q_norm = nn.LayerNorm(d // heads)
        zoo.adversarial(self)

    def forward(self, x):
        qkv = self.qkv(x)
        q = qkv[..., self.start:self.start + self.d]
        v = qkv[..., -self.d:]
        B, T, _ = x.shape
        q = self.q_norm(q.reshape(B, T, self.heads, -1))
        return q.reshape(B, T, -1) * v


class InterleavedHeads(nn.Module):
    """head_dim strided across the projection's rows (view as (hd, H), then transpose)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(d // heads)
        zoo.adversarial(self)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, -1, self.heads).transpose(2, 3)
        return self.q_norm(q)


class FusedScalarShift(FusedQKV):
    """A fused projection plus one number added to all of q, k and v: zeroing it (as a whole
    axis' centering would) changes v too, and no edit can remove it from q's rows alone."""

    def forward(self, x):
        qkv = self.qkv(x) + 0.75
        B, T, _ = x.shape
        q = self.q_norm(qkv[..., :self.d].reshape(B, T, self.heads, -1))
        return q.reshape(B, T, -1) * qkv[..., -self.d:]


@pytest.mark.parametrize("module,why", [
    (FusedQKV(start=3), "no per-block edit can center"),  # the q rows start off a head boundary
    (InterleavedHeads(), "no weight edit can make zero-mean"),
    (FusedScalarShift(start=0), "broadcast along the feature axis"),
], ids=["misaligned-slice", "interleaved-heads", "scalar-shift-on-fused"])
def test_unaligned_heads_are_kept_with_a_reason(module, why):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = analyze_module(module.eval(), (x,))
        onnx = analyze_model(export_quiet(module, (x,), ["x"]))
    for rep in (fx, onnx):  # the one LayerNorm, q_norm
        assert [n.verdict for n in rep.norms] == ["keep"] and why in rep.norms[0].reason, rep.norms


class FusedQKVNorms(nn.Module):
    """One fused q/k/v projection (bias), split into q, k, v; per-head LayerNorm(hd) on q and on
    k (OLMo / hand-written attention); v is read un-normalized, so its rows must stay as they are."""

    def __init__(self, d=32, heads=4, split=True):
        super().__init__()
        self.d, self.heads, self.use_split = d, heads, split
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm = nn.LayerNorm(d // heads)
        self.k_norm = nn.LayerNorm(d // heads)
        zoo.adversarial(self)
        with torch.no_grad():
            zoo.per_head_means(self.qkv, 3 * heads)

    def forward(self, x):
        B, T, d = x.shape
        qkv = self.qkv(x)
        if self.use_split:
            q, k, v = qkv.split(d, dim=-1)
        else:
            q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        q = self.q_norm(q.view(B, T, self.heads, -1)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.heads, -1)).transpose(1, 2)
        v = v.view(B, T, self.heads, -1).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1)
        return (att @ v).transpose(1, 2).reshape(B, T, d)


@pytest.mark.parametrize("split", [True, False], ids=["split", "slices"])
def test_fused_qkv_q_and_k_norms_fold_v_rows_untouched(split):
    module = FusedQKVNorms(split=split).eval()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = fold_module(module, (x,))
    onnx = fold_model(export_quiet(module, (x,), ["x"]))
    for res in (fx, onnx):
        assert [n.verdict for n in res.report.norms] == ["fold", "fold"], res.report.norms
        _exact(res)


@pytest.mark.parametrize("plant", [
    lambda center: lambda a, axis, block=None, lo=0, hi=None, stride=None: center(a, axis, block),  # v's rows centered too
    _skip_first_head,  # q's first head left as it was
], ids=["whole-range", "skip-head"])
def test_planted_fused_bug_fails_verification(monkeypatch, plant):
    module = FusedQKVNorms().eval()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model = export_quiet(module, (x,), ["x"])
    monkeypatch.setattr(weights, "center", plant(weights.center))
    with pytest.raises(VerificationError, match="float64"):
        fold_model(model)


def test_fold_for_training_centers_each_head_in_forward():
    """The training fold computes the per-head centering from the parameters in forward."""
    import copy

    import lnfold

    module = FusedQKVNorms().eval().double()
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    folded = copy.deepcopy(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = lnfold.fold_for_training(folded, (x,))
    assert res.report.folded == 2
    ref = module(x)
    assert ((folded(x) - ref).abs().max() / ref.abs().max()).item() < 1e-12
