"""Deferred normalization (issue 14): γ into the readers' weights, the row scale on their products.

Exactness is judged against float64 (DESIGN §4): the deferred model's error against a float64 run
of the original module may not exceed the original fp32 model's own error by more than a factor,
plus a floor. Planted bugs (γ not folded; one reader without its row scale) must fail verification.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from lnfold import zoo
from lnfold.fx_rewrite import api as fx_api
from lnfold.fx_rewrite import backend as fx_backend
from lnfold.onnx_rewrite import VerificationError, fold_model
from lnfold.onnx_rewrite import api as onnx_api
from lnfold.onnx_rewrite import deferred_norm as onnx_defer
from lnfold.onnx_rewrite.verify import session
from lnfold.passes.weights import max_rel_err

from .conftest import export_quiet

FACTOR, FLOOR = 2.0, 1e-6
DEFERRED = {"gpt2": 5, "vit": 4}  # ViT's last norm writes the graph output: nothing reads it


def _ref64(module, args) -> np.ndarray:
    import copy

    with torch.no_grad():
        return copy.deepcopy(module).double()(*[a.double() if a.is_floating_point() else a for a in args]).numpy()


def _run_onnx(model, name, args) -> np.ndarray:
    return session(model).run(None, {zoo.INPUT_NAMES[name][0]: args[0].numpy()})[0]


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_onnx_deferred_is_exact_against_float64(zoo_onnx, name):
    module, args, model = zoo_onnx(name)
    res = fold_model(model, defer="on")
    assert sum(n.deferred for n in res.report.norms) == DEFERRED[name]
    ops = [n.op_type for n in res.model.graph.node]
    assert ops.count("ReduceSumSquare") == DEFERRED[name]
    assert ops.count("SimplifiedLayerNormalization") == 5 - DEFERRED[name]
    ref = _ref64(module, args)
    own = max_rel_err(ref, _run_onnx(model, name, args))
    got = max_rel_err(ref, _run_onnx(res.model, name, args))
    assert got <= FACTOR * own + FLOOR, (got, own)


def test_onnx_auto_follows_the_cost_model(zoo_onnx):
    _, _, model = zoo_onnx("gpt2")
    res = fold_model(model, defer="auto")  # onnxruntime's row scale is a Mul of its own (RESULTS.md)
    assert not any(n.deferred for n in res.report.norms)
    assert all(n.defer_reason.startswith("cost model") for n in res.report.norms)
    assert not any(n.deferred for n in fold_model(model).report.norms)  # the default: off


def _without_gamma_edits(make_plan):
    """`make_plan` with a planted bug: the deferred norms' γ is not folded into their readers' weights."""
    def sabotaged(view, *a, **kw):
        plan = make_plan(view, *a, **kw)
        gammas = {d.gamma for d in plan.deferral.deferred}
        edits = [e for e in plan.const_edits if not (len(e.ops) == 1 and getattr(e.ops[0], "by", None) in gammas)]
        assert plan.deferral.deferred and len(edits) < len(plan.const_edits)
        return replace(plan, const_edits=edits)
    return sabotaged


def test_onnx_planted_bug_gamma_not_folded_fails(zoo_onnx, monkeypatch):
    _, _, model = zoo_onnx("gpt2")
    monkeypatch.setattr(onnx_api, "make_plan", _without_gamma_edits(onnx_api.make_plan))
    with pytest.raises(VerificationError):
        fold_model(model, defer="on")


def test_onnx_planted_bug_one_reader_unscaled_fails(zoo_onnx, monkeypatch):
    _, _, model = zoo_onnx("vit")
    real, calls = onnx_defer._scale_product, []

    def skip_second(em, node, scale, new_bias, rd):
        calls.append(node.name)
        if len(calls) == 2:  # the second reader keeps its bias edit but loses its row scale
            scale = em.const("lnfold/one", np.ones([1], np.float32))
        real(em, node, scale, new_bias, rd)

    monkeypatch.setattr(onnx_defer, "_scale_product", skip_second)
    with pytest.raises(VerificationError):
        fold_model(model, defer="on")


# --- a reader that is not a linear layer ---------------------------------------------------------

class ReluHead(nn.Module):
    """ln1 is read by a Linear (deferrable); ln2 by a ReLU (not). (A Linear that reads a norm and
    writes into the stream itself is refused too: its weight is already edited by the fold.)"""

    def __init__(self, d=16, vocab=11, fc1_bias=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d, bias=fc1_bias), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 5)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.fc2(torch.tanh(self.fc1(self.ln1(x))))
        return self.head(torch.relu(self.ln2(x)))


def _relu_head():
    m = zoo.adversarial(ReluHead())
    return m, (torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1)),)


def test_onnx_nonlinear_reader_is_not_deferred_with_reason():
    m, args = _relu_head()
    model = export_quiet(m, args, ["input_ids"])
    res = fold_model(model, defer="on")
    first, second = res.report.norms
    assert first.deferred and not second.deferred
    assert "Relu" in second.defer_reason and "not a linear layer" in second.defer_reason


# --- the torch.compile backend -------------------------------------------------------------------

def _compile_eager(module, defer, **kw):
    torch._dynamo.reset()
    backend = fx_backend.lnfold_backend_with(defer=defer, inner=lambda gm, _: gm.forward, **kw)
    return torch.compile(module, backend=backend)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_backend_deferred_is_exact_against_float64(name):
    module, args = zoo.MODELS[name]()
    with torch.no_grad():
        own = max_rel_err(_ref64(module, args), module(*args).numpy())
        got_t = _compile_eager(module, "on", verify=True)(*args)
    report = fx_backend.reports[-1]
    # GPT-2's final norm is read through a token slice (logits of the kept positions): not deferred
    assert sum(n.deferred for n in report.norms) == 4
    got = max_rel_err(_ref64(module, args), got_t.numpy())
    assert got <= FACTOR * own + FLOOR, (got, own)


def test_backend_nonlinear_reader_is_not_deferred_with_reason():
    m, args = _relu_head()
    with torch.no_grad():
        _compile_eager(m, "on", verify=True)(*args)
    first, second = fx_backend.reports[-1].norms
    assert first.deferred and not second.deferred
    assert "relu" in second.defer_reason and "not a linear layer" in second.defer_reason


def test_backend_planted_bug_gamma_not_folded_fails(monkeypatch):
    module, args = _relu_head()  # (its ln1 deferred; the backend defers GPT-2's and ViT's in the full run)
    monkeypatch.setattr(fx_backend, "make_plan", _without_gamma_edits(fx_backend.make_plan))
    with torch.no_grad(), pytest.raises(Exception) as err:  # Dynamo wraps a backend's exception
        _compile_eager(module, "on", verify=True)(*args)
    assert isinstance(getattr(err.value, "inner_exception", err.value), VerificationError)


def test_backend_bias_follows_a_changed_parameter():
    """W β + b is derived from parameters: an in-place update must reach the compiled graph."""
    module, args = zoo.vit()
    with torch.no_grad():
        compiled = _compile_eager(module, "on")
        compiled(*args)
        module.model.layers[0].layernorm_before.bias.add_(0.5)
        module.model.layers[0].attention.q_proj.weight.mul_(1.5)
        want, got = module(*args), compiled(*args)
    assert max_rel_err(want.numpy(), got.numpy()) < 1e-4


def test_backend_zero_beta_and_bias_free_reader():
    """The deferred reader's bias input is W β + b; with β zero and no b it is zeros (it was the
    weight itself: a shape error, or a wrong sum where the weight broadcasts). ln1 is read by a
    Linear without a bias, its β all zeros (as nn.LayerNorm starts)."""
    m = zoo.adversarial(ReluHead(fc1_bias=False))
    with torch.no_grad():
        m.ln1.bias.zero_()
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        compiled = _compile_eager(m, "on", verify=True)
        got = compiled(ids)
        assert fx_backend.reports[-1].norms[0].deferred
        assert max_rel_err(m(ids).numpy(), got.numpy()) < 1e-5
        m.ln1.bias.add_(0.5)  # β no longer zero: W β joins the product
        assert max_rel_err(m(ids).numpy(), compiled(ids).numpy()) < 1e-5


class HandNormHead(nn.Module):
    """A LayerNorm written out (mean, x - mean, variance, γ, β) read by a Linear head."""

    def __init__(self, d=16, vocab=11):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, 5)
        g = torch.Generator().manual_seed(4)  # γ, β random: zoo.adversarial randomizes LayerNorm modules
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d, generator=g))
        self.bias = nn.Parameter(0.5 * torch.randn(d, generator=g))

    def forward(self, ids):
        x = self.emb(ids)
        c = x - x.mean(-1, keepdim=True)
        return self.head(self.weight * (c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5)) + self.bias)


def test_written_out_norm_is_deferred_in_fold_module_and_the_backend():
    """The deferred emission of a norm written out rewires the readers of its last op (it took
    the first mean for the norm: the head read the normalized tensor, scaled once more)."""
    m = zoo.adversarial(HandNormHead())
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    res = fx_api.fold_module(m, (ids,), defer="on", dynamic=False)  # verified against float64
    assert [n.deferred for n in res.report.norms] == [True]
    with torch.no_grad():
        got = _compile_eager(m, "on", verify=True)(ids)
        assert [n.deferred for n in fx_backend.reports[-1].norms] == [True]
        assert max_rel_err(m(ids).numpy(), got.numpy()) < 1e-5


# --- fold_module (the eager module; the same plan as the backend's) --------------------------------
def _layer_norms(gm) -> int:
    return sum("layer_norm" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_fold_module_deferred_is_exact_against_float64(name, zoo_program):
    module, args, program = zoo_program(name, dynamic=False)
    res = fx_api.fold_module(program, args, defer="on")
    assert sum(n.deferred for n in res.report.norms) == 4 and _layer_norms(res.module) == 1
    with torch.no_grad():
        own = max_rel_err(_ref64(module, args), module(*args).numpy())
        got = max_rel_err(_ref64(module, args), res.module(*args).numpy())
    assert got <= FACTOR * own + FLOOR, (got, own)


def test_a_norm_reading_an_explicit_recenter_is_deferred():
    """BLOOM: the embedding LayerNorm's output is recentered by an inserted `x - mean` (no FX meta);
    the next norm, deferred, reads that node (was: AttributeError on its missing shape)."""
    module, args = zoo.MODELS["bloom"]()
    res = fx_api.fold_module(module, args, defer="on", dynamic=False)
    assert res.criterion == "float64" and sum(n.deferred for n in res.report.norms) >= 3
    with torch.no_grad():
        own = max_rel_err(_ref64(module, args), module(*args).numpy())
        got = max_rel_err(_ref64(module, args), res.module(*args).numpy())
    assert got <= FACTOR * own + FLOOR, (got, own)


def test_fold_module_auto_defers_nothing_in_eager_mode(zoo_program):
    """Eager torch fuses no multiply into a GEMM: the traffic cost model never defers there."""
    _, args, program = zoo_program("gpt2", dynamic=False)
    res = fx_api.fold_module(program, args, defer="auto")
    assert not any(n.deferred for n in res.report.norms) and _layer_norms(res.module) == 5


def test_fold_module_planted_bug_beta_not_moved_fails(monkeypatch, zoo_program):
    """The readers keep their own bias instead of `W β + b`: verification must refuse it."""
    _, args, program = zoo_program("gpt2", dynamic=False)
    monkeypatch.setattr(fx_api, "compute_biases", lambda decision, get: {
        (d.norm, r.node): None for d in decision.deferred for r in d.readers})
    with pytest.raises(VerificationError):
        fx_api.fold_module(program, args, defer="on")


@pytest.mark.slow
def test_backend_deferred_under_inductor():
    module, args = zoo.vit()
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(*args)
        got = torch.compile(module, backend="lnfold", options={"lnfold.defer": "on"})(*args)
    assert sum(n.deferred for n in fx_backend.reports[-1].norms) == 4
    assert max_rel_err(want.numpy(), got.numpy()) < 1e-4


def test_cli_defer_on(zoo_onnx, tmp_path):
    from lnfold.onnx_rewrite import load, save
    from lnfold.onnx_rewrite.cli import main as cli_main

    _, _, model = zoo_onnx("gpt2")
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    save(model, src)
    assert cli_main(["fold", str(src), "-o", str(dst), "--defer", "on"]) == 0
    ops = [n.op_type for n in load(dst).graph.node]
    assert ops.count("ReduceSumSquare") == DEFERRED["gpt2"] and "SimplifiedLayerNormalization" not in ops
