"""Per-head blocks followed through a periodic selection (issue 23, Persimmon): a fused q/k/v
output viewed as (heads, 3, head_dim) and q, k, v selected along the 3. q's rows are runs of
head_dim every 3·head_dim; centering those (and k's) folds the per-head q/k norms, and v's rows,
read by the attention's matmul, stay as they were. Layouts that do not keep the runs whole
(head_dim interleaved with the 3, a select along the heads) must stay kept or recentered."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from lnfold import zoo
from lnfold.fx_rewrite import analyze_module, fold_module
from lnfold.fx_rewrite.edits import center as torch_center
from lnfold.onnx_rewrite import analyze_model, fold_model
from lnfold.passes import VerificationError, gate, weights
from lnfold.passes.axes import merge_row_runs, split_periodic_runs

from .conftest import export_quiet

H, HD = 4, 8
D = H * HD


def _exact(res):
    assert res.criterion == "float64"
    assert res.exact_err <= 2 * res.original_exact_err + gate.FLOOR["float32"], (res.exact_err, res.original_exact_err)


# --- the axis maps ----------------------------------------------------------------------------

def test_split_and_merge_of_every_third_run_are_inverse():
    fused, heads = ("B", "T", 3 * D), ("B", "T", H, 3, HD)
    for k in range(3):
        assert split_periodic_runs(fused, heads, 2, HD, k * HD, 3 * HD) == (4, 3, k)
        assert merge_row_runs(heads, fused, 4, 3, k) == (2, k * HD, 3 * HD)


def test_other_layouts_are_not_periodic_runs():
    fused = ("B", "T", 3 * D)
    assert split_periodic_runs(fused, ("B", "T", 3, H, HD), 2, HD, 0, 3 * HD) is None  # (3, heads, hd)
    assert split_periodic_runs(fused, ("B", "T", H, HD, 3), 2, HD, 0, 3 * HD) is None  # hd interleaved
    assert split_periodic_runs(fused, ("B", "T", H, 3 * HD), 2, HD, 0, 3 * HD) is None  # runs not one axis
    assert merge_row_runs(("B", "T", H, 3, HD), fused, 4, 2, 0) is None  # the row axis is the heads'
    assert merge_row_runs(("B", "T", H, HD, 3), fused, 3, 4, 0) is None  # the row axis after the features


# --- the edit -----------------------------------------------------------------------------------

def test_center_every_third_run_numpy_and_torch_agree():
    a = np.random.default_rng(0).normal(3.0, 1.0, (3 * D, 5))
    for k in range(3):
        got = weights.center(a, 0, HD, k * HD, None, 3 * HD)
        runs = got.reshape(H, 3, HD, 5)
        assert np.allclose(runs[:, k].mean(axis=1), 0)
        others = [j for j in range(3) if j != k]
        assert np.array_equal(runs[:, others], a.reshape(H, 3, HD, 5)[:, others])  # v's rows untouched
        t = torch_center(torch.from_numpy(a), 0, HD, k * HD, None, 3 * HD).numpy()
        assert np.allclose(t, got)
    with pytest.raises(ValueError):
        weights.center(a, 0, HD, 0, None, 5 * HD)  # 96 rows are not whole periods of 40


# --- the architectures --------------------------------------------------------------------------

class HeadsThreeHeadDim(nn.Module):
    """Persimmon's attention in small: qkv viewed as (heads, 3, head_dim) (`layout` "h3d"), per-head
    LayerNorm(head_dim) on q and k. "hd3": (heads, head_dim, 3), q's entries every third one, not
    runs; "head": the norm reads one head's (3, head_dim) rows, q, k and v of it."""

    def __init__(self, layout="h3d"):
        super().__init__()
        self.layout = layout
        self.qkv = nn.Linear(D, 3 * D)
        self.q_norm = nn.LayerNorm(HD)
        self.k_norm = nn.LayerNorm(HD)
        zoo.adversarial(self)
        with torch.no_grad():
            zoo.per_head_means(self.qkv, 3 * H)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)
        if self.layout == "hd3":
            qkv = qkv.view(B, T, H, HD, 3)
            q, k, v = qkv[..., 0], qkv[..., 1], qkv[..., 2]
        else:
            qkv = qkv.view(B, T, H, 3, HD)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        if self.layout == "head":
            q = q + self.q_norm(qkv[:, :, 0]).mean(2, keepdim=True)  # head 0's q, k and v rows, normalized
        else:
            q = self.q_norm(q)
        k = self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / HD ** 0.5, -1)
        return (att @ v).transpose(1, 2).reshape(B, T, D)


def _both(module):
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = fold_module(module, (x,))
    return fx, fold_model(export_quiet(module, (x,), ["x"]))


def test_heads_three_head_dim_q_and_k_norms_fold_v_rows_untouched():
    for res in _both(HeadsThreeHeadDim().eval()):
        assert [n.verdict for n in res.report.norms] == ["fold", "fold"], res.report.norms
        assert res.report.recentered == 0
        _exact(res)


def _analyses(module):
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = analyze_module(module, (x,))
    return fx, analyze_model(export_quiet(module, (x,), ["x"]))


@pytest.mark.slow  # the hand-built views below check the same refusals in milliseconds
@pytest.mark.parametrize("layout", ["hd3", "head"])
def test_selections_that_do_not_keep_runs_whole_are_not_block_folded(layout):
    """(heads, head_dim, 3): q's features are every third entry, no run of the projection's
    rows; one head's (3, head_dim) rows: v's among them. Neither is a per-block centering."""
    for rep in _analyses(HeadsThreeHeadDim(layout).eval()):
        q = [n for n in rep.norms if "q_norm" in n.name or n.name.endswith("layer_norm")][0]
        assert q.verdict == "keep" or rep.recentered, rep.norms


def test_planted_contiguous_runs_bug_fails_verification(monkeypatch):
    """Centering q's runs as if back to back (the stride ignored) edits k's and v's rows: the
    float64 check must refuse it."""
    model = export_quiet(HeadsThreeHeadDim().eval(), (torch.randn(2, 5, D),), ["x"])
    real = weights.center
    monkeypatch.setattr(weights, "center", lambda a, axis, block=None, lo=0, hi=None, stride=None:
                        real(a, axis, block, lo, None if stride is None else lo + (a.shape[axis] // stride) * block))
    with pytest.raises(VerificationError, match="float64"):
        fold_model(model)


# --- a feature axis merged with the batch and split back out (issue 23, MobileViT) ---------------

def test_regroup_factor_follows_mobilevits_unfolding():
    """(B, C, H, W) -> (B·C·nph, ph, npw, pw): the C channels sit nph apart along axis 0; after
    a transpose of the other axes, (B·C·nph, npw, ph, pw) -> (B, C, npw·nph, ph·pw) has them
    whole at axis 1 again; symbolic batch sizes as the frontends spell them."""
    from lnfold.passes.axes import regroup_factor

    assert regroup_factor(("batch", 32, 8, 8), ("128*batch", 2, 4, 2), 1, 32, 1) == (0, (4, ()))
    assert regroup_factor(("128*batch", 4, 2, 2), ("batch", 32, 16, 4), 0, 32, 4) == (1, None)
    assert regroup_factor(("s77", 64, 4, 4), ("64*s77", 2, 2, 2), 1, 64, 1) == (0, (1, ()))  # nph = 1: a run
    # torch.export's dynamic image sizes: nph = s53//2
    nph = (1, ("s53//2",))
    assert regroup_factor(("s77", 8, "s53", "s0"), ("8*s77*((s53//2))", "(s53//((s53//2)))", "(s0//2)", 2), 1, 8, 1) \
        == (0, nph)
    assert regroup_factor(("8*s77*((s53//2))", "(s0//2)", 2, 2), ("s77", 8, "((s0//2))*((s53//2))", 4), 0, 8, nph) \
        == (1, None)
    # (B, H, C, W) -> (B, H·C·W): C entries W apart along axis 1
    assert regroup_factor(("B", 8, 32, 4), ("B", 8 * 32 * 4), 2, 32, 1) == (1, (4, ()))


def test_regroup_factor_refuses_reshapes_that_do_not_keep_the_channels():
    from lnfold.passes.axes import regroup_factor

    assert regroup_factor(("B", 32, 8, 8), ("B", 16, 16, 8), 1, 32, 1) is None  # the channels split in two
    assert regroup_factor(("B", 32, 64), ("B", 64, 32), 2, 64, 1) is None  # spatial features, no channel
    assert regroup_factor(("B", 32, 8, 8), ("2*B", 16, 64), 1, 32, 1) is None  # half the channels per row
    assert regroup_factor((None, 32, 8, 8), ("128*B", 2, 4, 2), 1, 32, 1) is None  # a size before it unknown
    # the sizes after the channels never enter: equal element counts fix them (a reshape that runs)
    assert regroup_factor(("B", 32, 8, None), ("128*B", 2, 4, 2), 1, 32, 1) == (0, (4, ()))


class Unfolding(nn.Module):
    """MobileViT's block in small: conv_1x1 -> unfold (B, C, H, W) -> (B·C·nph, ph, npw, pw) ->
    (B·pa, P, C) -> one pre-LN block -> LayerNorm -> fold back -> conv. `mix`: the unfolded
    patches are read as (B, P·pa, C) by a reshape, not a transpose: the last axis holds
    spatial entries, not the channels, and no centering of conv_1x1 makes it zero-mean."""

    def __init__(self, c=8, mix=False):
        super().__init__()
        self.c, self.mix = c, mix
        self.conv_1x1 = nn.Conv2d(c, c, 1, bias=False)
        self.ln1, self.fc, self.ln2 = nn.LayerNorm(c), nn.Linear(c, c), nn.LayerNorm(c)
        self.proj = nn.Conv2d(c, c, 1)
        zoo.adversarial(self)
        with torch.no_grad():
            self.conv_1x1.weight.add_(1.5)  # a large mean across channels

    def forward(self, x):
        B, C, H, W = x.shape
        ph = pw = 2
        nph, npw = H // ph, W // pw
        f = self.conv_1x1(x)
        p = f.reshape(B * C * nph, ph, npw, pw).transpose(1, 2).reshape(B, C, nph * npw, ph * pw)
        t = p.reshape(B * ph * pw, nph * npw, C) if self.mix else p.transpose(1, 3).reshape(B * ph * pw, nph * npw, C)
        t = t + self.fc(torch.relu(self.ln1(t)))
        t = self.ln2(t)
        back = t.reshape(B, ph * pw, nph * npw, C).transpose(1, 3).reshape(B * C * nph, npw, ph, pw)
        back = back.transpose(1, 2).reshape(B, C, H, W)
        return self.proj(back)


def _unfold_both(module, fold):
    x = torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = (fold_module if fold else analyze_module)(module, (x,))
    onnx_model = export_quiet(module, (x,), ["x"])
    return fx, (fold_model if fold else analyze_model)(onnx_model)


@pytest.mark.slow  # torch.export with dynamic image sizes: ~20-35 s on a shared CPU
def test_unfolded_stream_folds_by_centering_conv_1x1():
    for res in _unfold_both(Unfolding().eval(), fold=True):
        assert [n.verdict for n in res.report.norms] == ["fold", "fold"], res.report.norms
        assert res.report.recentered == 0
        assert any("conv_1x1" in c for s in res.report.streams for c in s.centered), res.report.streams
        _exact(res)


@pytest.mark.slow  # torch.export with dynamic image sizes: ~20-35 s on a shared CPU
def test_unfolding_that_mixes_channels_with_space_is_not_centered():
    for rep in _unfold_both(Unfolding(mix=True).eval(), fold=False):
        assert rep.recentered or all(n.verdict == "keep" for n in rep.norms), rep.norms
        assert not any("conv_1x1" in c for s in rep.streams for c in s.centered), rep.streams


# --- the same on a hand-built view (passes/ alone) ---------------------------------------------

def _fused_view(index_known=True, layout=(H, 3, HD)):
    """x -> Linear(3D) -> view (B, T, *layout) -> select q, k, v along the 3 -> q/k norms; v and
    the norms' outputs read by a MatMul (not invariant)."""
    from lnfold.passes import View
    from lnfold.passes.rules import rule

    v = View()
    v.input("x", (2, 5, D))
    v.const("W", (D, 3 * D))
    v.const("b", (3 * D,))
    v.add("qkv", "Linear", rule("linear", weight=1, w_axis=1, bias=2, data=0), ["x", "W", "b"], {"f": (2, 5, 3 * D)})
    v.add("view", "Reshape", rule("reshape", data=0), ["f"], {"f5": (2, 5, *layout)})
    three = layout.index(3) + 2
    sel = [d for k, d in enumerate((2, 5, *layout)) if k != three]
    for k, name in enumerate("qkv"):
        v.add(f"sel_{name}", "Gather", rule("take", data=0, start=three, stop=three + 1, q=0,
                                            index=[k] if index_known else None), ["f5"], {name: tuple(sel)})
    for name in "qk":
        v.const(f"{name}.g", (HD,))
        v.const(f"{name}.bb", (HD,))
        v.add(f"{name}_norm", "LayerNormalization", rule("layer_norm", axes=[-1], gamma=1, beta=2, eps=1e-5),
              [name, f"{name}.g", f"{name}.bb"], {f"{name}n": tuple(sel)})
    v.add("att", "MatMul", rule("matmul"), ["qn", "kn"], {"s": (2, 5, H, H)})
    v.add("out", "MatMul", rule("matmul"), ["s", "v"], {"o": (2, 5, H, HD)})
    v.output("o")
    return v


def test_view_periodic_runs_center_q_and_k_rows_of_the_fused_projection():
    from lnfold.passes import compute_constants, make_plan

    view = _fused_view()
    plan = make_plan(view)
    assert sorted(plan.swaps) == ["k_norm", "q_norm"] and plan.recenters == []
    rng = np.random.default_rng(0)
    arrays = {"W": rng.normal(2.0, 1.0, (D, 3 * D)), "b": rng.normal(2.0, 1.0, 3 * D)}
    got = {e.value: a for e, a in compute_constants(plan.const_edits, arrays.__getitem__)}
    assert set(got) == {"W", "b"}
    for name, a in got.items():  # q's and k's runs centered (both edits of one constant), v's as they were
        runs, was = (t.reshape(*t.shape[:-1], H, 3, HD) for t in (a, arrays[name]))
        assert np.allclose(runs[..., 0, :].mean(-1), 0) and np.allclose(runs[..., 1, :].mean(-1), 0)
        assert np.array_equal(runs[..., 2, :], was[..., 2, :])


@pytest.mark.parametrize("case", ["index unknown", "(3, heads, head_dim)", "(heads, head_dim, 3)"])
def test_view_selections_not_known_to_keep_runs_stay_kept(case):
    from lnfold.passes import make_plan

    view = {"index unknown": lambda: _fused_view(index_known=False),
            "(3, heads, head_dim)": lambda: _fused_view(layout=(3, H, HD)),
            "(heads, head_dim, 3)": lambda: _fused_view(layout=(H, HD, 3))}[case]()
    plan = make_plan(view)
    assert plan.swaps == [] and plan.const_edits == [], (plan.swaps, plan.const_edits)
