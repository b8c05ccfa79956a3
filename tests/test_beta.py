"""β into the readers' biases: a plan decision (passes/beta.py), executed alike by both frontends.

GPT-2 from the zoo has random nonzero β (zoo.adversarial): ln_1 and ln_2 of each block are read
only by linear layers with biases (c_attn, c_fc), so their β moves into those biases; ln_f is
read by the bias-free lm_head, so its β stays an Add. A planted bug that drops β instead of
folding it must fail verification in both frontends.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

from lnfold import fx_rewrite, onnx_rewrite, zoo
from lnfold.fx_rewrite import fold_module
from lnfold.onnx_rewrite import fold_model
from lnfold.passes import VerificationError
from lnfold.passes.edits import AddWeightTimes

from .conftest import export_quiet


@pytest.fixture
def gpt2(zoo_onnx):
    return zoo_onnx("gpt2")  # (the session's export, shared with the other files)


def _kinds(report) -> list[tuple[str, int]]:
    """Per norm, in graph order: where β went, and into how many readers' biases."""
    out = []
    for n in report.norms:
        kind = n.beta.split(" (")[0] if n.beta.startswith("kept") else n.beta[:16]
        out.append((kind, n.beta.count("`") // 2 if n.beta.startswith("into") else 0))
    return out


def _ort(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids})[0]


def test_both_frontends_fold_beta_into_the_same_biases(gpt2, zoo_program):
    _, args, model = gpt2
    on, fx = fold_model(model), fold_module(zoo_program("gpt2")[2], args)  # (the worker's export of the module)
    expected = [("into the bias of", 1)] * 4 + [("kept as an Add", 0)]
    assert _kinds(on.report) == _kinds(fx.report) == expected, (on.report.table(), fx.report.table())
    assert all("not a linear layer" in r.norms[-1].beta or "no bias" in r.norms[-1].beta for r in (on.report, fx.report))

    # executed as planned: ONNX has one β Add (ln_f's) after its RMSNorms, fx one norm with β
    ops = {o: n.op_type for n in on.model.graph.node for o in n.input}
    rms_out = [n.output[0] for n in on.model.graph.node if n.op_type == "SimplifiedLayerNormalization"]
    assert len(rms_out) == 5 and sum(ops.get(o) == "Add" for o in rms_out) == 1
    norms = [n for n in fx.module.graph.nodes if "layer_norm" in str(n.target) or "rms_norm" in str(n.target)]
    assert len(norms) == 5 and all("layer_norm" in str(n.target) for n in norms)  # (input, shape, weight, bias, eps)
    assert sum(n.args[3] is not None if len(n.args) > 3 else False for n in norms) == 1

    # both outputs agree with the original computed in float64
    ids = args[0]
    with torch.no_grad():
        ref = zoo.gpt2()[0].double()(ids).numpy()
        got_fx = fx.module(ids).double().numpy()
    got_onnx = _ort(on.model, ids.numpy()).astype(np.float64)
    scale = np.abs(ref).max()
    assert np.abs(got_fx - ref).max() / scale < 1e-5
    assert np.abs(got_onnx - ref).max() / scale < 1e-5


def _dropping_beta(make_plan):
    """`make_plan` with a planted bug: β is dropped (no Add) but the biases do not absorb it."""
    def sabotaged(view, mode="rms", *a, **kw):
        plan = make_plan(view, mode, *a, **kw)
        edits = [replace(e, ops=tuple(op for op in e.ops if not isinstance(op, AddWeightTimes)))
                 for e in plan.const_edits]
        dropped = sum(len(a.ops) != len(e.ops) for a, e in zip(edits, plan.const_edits))
        assert dropped and any(b.folded for b in plan.betas.values())
        return replace(plan, const_edits=[e for e in edits if e.ops])
    return sabotaged


def test_dropping_beta_instead_of_folding_fails_verification(monkeypatch, gpt2, zoo_program):
    _, args, model = gpt2
    monkeypatch.setattr(onnx_rewrite.api, "make_plan", _dropping_beta(onnx_rewrite.api.make_plan))
    monkeypatch.setattr(fx_rewrite.api, "make_plan", _dropping_beta(fx_rewrite.api.make_plan))
    with pytest.raises(VerificationError):
        fold_model(model)
    with pytest.raises(VerificationError):
        fold_module(zoo_program("gpt2")[2], args)


def test_plan_lists_residual_fusions_it_orders(gpt2):
    """On CUDA the plan fuses each residual Add with its norm (SkipSimplifiedLayerNormalization);
    the report lists every fused norm, and the emission has exactly those (verified: onnxruntime's
    CPU provider runs the fused op too)."""
    _, _, model = gpt2
    res = fold_model(model, device="cuda")
    fused = [n for s in res.report.streams for n in s.fused]
    ops = [n.op_type for n in res.model.graph.node]
    assert fused and ops.count("SkipSimplifiedLayerNormalization") == len(fused)
    assert "fused with the residual Add" in res.report.table()
    assert not [n for s in fold_model(model, verify=False).report.streams for n in s.fused]  # CPU


class _LayerScaled(torch.nn.Module):
    """Pre-LN blocks whose branch ends in a LayerScale (`ls * W h`): the plan folds `ls` into W
    and b, the Mul then multiplies by ones, and the plan drops it."""

    def __init__(self, d: int = 16, vocab: int = 31) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, d)
        self.emb.weight.data += 3.0 * torch.randn(vocab, 1, generator=g)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)
        self.ls = torch.nn.Parameter(1 + 0.5 * torch.randn(d, generator=g))
        self.head = torch.nn.Linear(d, 5)
        for ln in (self.ln1, self.ln2):
            ln.weight.data = 1 + 0.5 * torch.randn(d, generator=g)
            ln.bias.data = 0.5 * torch.randn(d, generator=g)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.ls * self.fc(torch.tanh(self.ln1(x)))
        return self.head(self.ln2(x))


def test_plan_drops_the_layerscale_mul_in_both_frontends():
    module, ids = _LayerScaled().eval(), torch.randint(0, 31, (2, 7), generator=torch.Generator().manual_seed(1))
    model = export_quiet(module, (ids,), ["input_ids"])
    on, fx = fold_model(model), fold_module(module, (ids,))
    for res in (on, fx):
        (stream,) = res.report.streams
        assert len(stream.scaled) == 1 and len(stream.dropped) == 1, res.report.table()
        assert res.report.norms[1].beta.startswith("into the bias of")  # ln2 -> head
    assert not any(n.op_type == "Mul" and any("lnfold_ones" in i for i in n.input) for n in on.model.graph.node)
    muls = [n for n in fx.module.graph.nodes if n.op == "call_function" and "mul" in str(n.target)]
    assert not any(a.op == "get_attr" and "ls" in a.target for n in muls for a in n.all_input_nodes)


class _HandLayerNorm(torch.nn.Module):
    """A LayerNorm written out (x - mean, variance, γ, β): the fx frontend drops its β Add."""

    def __init__(self, d: int, g: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.5 * torch.randn(d, generator=g))
        self.bias = torch.nn.Parameter(0.5 * torch.randn(d, generator=g))

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return self.weight * (c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5)) + self.bias


class _ReaderWritesStream(torch.nn.Module):
    """`x + fc(ln(x))`: fc reads the norm (its bias absorbs β) and writes the stream (its bias is
    centered): the bias edit must be C(b + Wβ), β folded first."""

    def __init__(self, hand: bool, d: int = 16, vocab: int = 23) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.emb = torch.nn.Embedding(vocab, d)
        self.emb.weight.data += 3.0 * torch.randn(vocab, 1, generator=g)
        self.ln, self.ln_f = (_HandLayerNorm(d, g) if hand else torch.nn.LayerNorm(d) for _ in range(2))
        if not hand:
            for ln in (self.ln, self.ln_f):
                ln.weight.data, ln.bias.data = 1 + 0.5 * torch.randn(d, generator=g), 0.5 * torch.randn(d, generator=g)
        self.fc = torch.nn.Linear(d, d)
        self.fc.bias.data += 2.0
        self.head = torch.nn.Linear(d, 3)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.fc(self.ln(x))
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("hand", [False, True])
def test_beta_into_a_bias_that_is_also_centered(hand):
    module = _ReaderWritesStream(hand).eval()
    ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(3))
    results = [fold_module(module, (ids,))]
    if not hand:  # (the exporter writes the hand-written norm as LayerNormalization-free ops too)
        results.append(fold_model(export_quiet(module, (ids,), ["input_ids"])))
    for res in results:  # verified against float64: a bias centered before β joins it fails
        assert res.report.folded == 2
        assert all(n.beta.startswith("into the bias of") for n in res.report.norms), res.report.table()
        assert any("fc" in c and "bias" in c for c in res.report.streams[0].centered)


def _eager(gm, _):
    return gm.forward


def test_backend_folds_beta_at_inference_and_in_training():
    """torch.compile(backend="lnfold"): the same β destinations as fold_module at inference
    (the new biases are cached inputs); under autograd `b + Wβ` is computed in the graph from
    the parameters, so β and the bias get the original model's gradients."""
    from lnfold.fx_rewrite import lnfold_backend_with

    module = _ReaderWritesStream(hand=False)
    ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(3))
    reports = []
    compiled = torch.compile(module, backend=lnfold_backend_with(inner=_eager, on_report=reports.append))
    with torch.no_grad():
        ref = module(ids)
        assert (compiled(ids) - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert [n.beta[:16] for n in reports[-1].norms] == ["into the bias of"] * 2

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=lnfold_backend_with(inner=_eager, on_report=reports.append))
    compiled(ids).square().sum().backward()
    got = {k: p.grad.clone() for k, p in module.named_parameters()}
    module.zero_grad()
    module(ids).square().sum().backward()
    assert [n.beta[:16] for n in reports[-1].norms] == ["into the bias of"] * 2
    for k, p in module.named_parameters():
        assert torch.allclose(got[k], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max()), k


def test_beta_decisions_on_a_hand_built_view():
    """passes/ alone (no onnx, no torch): ln1's only reader fc1 has a bias, so ln1's β goes into
    it; ln_f's output is the graph's, so its β stays an Add; a target that keeps each norm's β
    (the module-level training fold) gets no bias edit and the norm's Add."""
    from lnfold.passes import make_plan
    from lnfold.passes.request import Capabilities

    from .test_passes import pre_ln

    plan = make_plan(pre_ln())
    assert plan.betas["ln1"].folded and not plan.emissions["ln1"].beta_add
    assert plan.betas["ln_f"].why == "`ln_f.y` is a graph output" and plan.emissions["ln_f"].beta_add
    assert [n.beta for n in plan.report.norms] == ["into the bias of Linear `fc1`",
                                                   "kept as an Add (`ln_f.y` is a graph output)"]
    kept = make_plan(pre_ln(), target=Capabilities(folds_beta=False))
    assert "fc1.bias" not in {e.value for e in kept.const_edits} and kept.emissions["ln1"].beta_add
    assert kept.report.norms[0].beta == ""
