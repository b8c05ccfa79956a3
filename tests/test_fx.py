"""The torch frontend: fold_module on torch.export graphs, the `lnfold` torch.compile backend.

Real architectures come from `transformers` config classes with adversarial weights (zoo.py):
skipping any single centering changes their outputs, and a planted-bug test proves it.
Tests that run Inductor are marked slow (`-m "not slow"` skips them).
"""
from __future__ import annotations

import copy
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lnfold import fx_rewrite
from lnfold import onnx_rewrite
from lnfold import zoo
from lnfold.fx_rewrite import NothingToFold, VerificationError, analyze_module, fold_module, lnfold_backend_with
from lnfold.fx_rewrite import backend as backend_mod

from .conftest import missing_one_centering

RTOL = 1e-5
COUNTS = {"gpt2": (5, 0), "vit": (5, 0), "bert": (1, 4)}  # (folded, kept) with 2 layers


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max()).item()


def _eager(gm, example_inputs):
    return gm.forward


# --- fold_module on real architectures ----------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "vit", "bert"])
def test_fold_module_counts_outputs_and_leaves_module_alone(zoo_module, name):
    module, args = zoo_module(name)
    before = _digest(module)
    res = fold_module(module, args)
    assert (res.report.folded, res.report.kept) == COUNTS[name]
    assert res.max_rel_err < RTOL
    assert _digest(module) == before
    with torch.no_grad():
        assert _rel(module(*args), res.module(*args)) < RTOL
    mine = {t.data_ptr() for t in module.state_dict().values()}
    assert not mine & {t.data_ptr() for t in res.module.state_dict().values()}  # no shared storage


def test_an_exported_program_is_folded_as_it_is(zoo_module, monkeypatch):
    """A user's own torch.export program (here: batch dynamic, nothing else) is read as it is, not
    exported again: the same report as the module's, a verified fold that keeps its dynamic batch,
    and the program itself untouched."""
    module, args = zoo_module("vit")
    program = torch.export.export(module, args, dynamic_shapes=({0: torch.export.Dim.DYNAMIC},), strict=False)
    before = _digest(program.module())
    expected = analyze_module(module, args, dynamic=False).to_dict()

    def no_second_export(*a, **k):
        raise AssertionError("exported again")

    monkeypatch.setattr(torch.export, "export", no_second_export)
    assert analyze_module(program, args).to_dict() == expected
    res = fold_module(program, args)
    assert (res.report.folded, res.report.kept) == COUNTS["vit"] and res.max_rel_err < RTOL
    x = torch.randn(3, *args[0].shape[1:])
    with torch.no_grad():
        assert _rel(module(x), res.module(x)) < RTOL
    assert _digest(program.module()) == before


def test_folded_module_takes_other_sequence_lengths(zoo_module):
    module, _ = zoo_module("gpt2")
    res = fold_module(module, (torch.randint(0, 101, (2, 9)),))
    x = torch.randint(0, 101, (3, 17))
    with torch.no_grad():
        assert _rel(module(x), res.module(x)) < RTOL


def test_norm_choice_rms_norm_or_layer_norm(zoo_program):
    _, args, program = zoo_program("gpt2")
    targets = lambda m: [str(n.target) for n in m.graph.nodes if n.op == "call_function"]  # noqa: E731
    rms = fold_module(program, args, norm="rms_norm")
    assert sum("rms_norm" in t for t in targets(rms.module)) == 5
    assert not any("layer_norm" in t for t in targets(rms.module))
    kept = fold_module(program, args)  # eager default: the fused LayerNorm on the centered stream
    assert sum("layer_norm" in t for t in targets(kept.module)) == 5
    assert rms.max_rel_err < RTOL and kept.max_rel_err < RTOL


def test_frontends_agree_on_every_verdict(zoo_program, zoo_onnx):
    """The fast tier's agreement check; the full run checks every zoo architecture (test_differential.py)."""
    name = "gpt2"
    _, args, program = zoo_program(name)
    fx_report = analyze_module(program, args)
    onnx_report = onnx_rewrite.analyze_model(zoo_onnx(name)[2])
    assert [n.verdict for n in fx_report.norms] == [n.verdict for n in onnx_report.norms]
    assert (fx_report.folded, fx_report.kept) == (onnx_report.folded, onnx_report.kept) == COUNTS[name]


def test_bert_keeps_post_ln_norms_with_reasons(zoo_program):
    _, args, program = zoo_program("bert")
    report = analyze_module(program, args)
    for n in report.norms[1:]:
        assert "aten.linear" in n.reason and "Post-LN block" in n.reason and "shift-invariant" not in n.reason


# --- the tests can fail --------------------------------------------------------------------------

@pytest.mark.parametrize("norm", ["auto", "rms_norm"])
def test_planted_bug_skipped_centering_fails_verification(zoo_program, monkeypatch, norm):
    """Drop one centering from the plan: verification must catch it, even when the eager module
    keeps LayerNorm (which would hide it), because fold_module also checks the RMSNorm twin."""
    _, args, program = zoo_program("gpt2")
    sabotaged = missing_one_centering(fx_rewrite.api.make_plan)

    monkeypatch.setattr(fx_rewrite.api, "make_plan", sabotaged)
    with pytest.raises(VerificationError):
        fold_module(program, args, norm=norm)


def test_swap_without_centering_is_not_equivalent(zoo_program):
    """The adversarial weights make a bare LayerNorm -> RMSNorm swap visibly wrong."""
    module, args, program = zoo_program("gpt2")
    res = fold_module(program, args, norm="rms_norm", verify=False)
    bare = program.module()
    from lnfold.fx_rewrite.apply import ATEN, rms_probe
    probe = rms_probe(bare, [n.name for n in bare.graph.nodes if "layer_norm" in str(n.target)], ATEN)
    with torch.no_grad():
        assert _rel(module(*args), probe(*args)) > 1e-2
        assert _rel(module(*args), res.module(*args)) < RTOL


# --- small modules: one behaviour each -------------------------------------------------------------

D = 16


class PreLN(nn.Module):
    """Embedding -> L pre-LN blocks (optionally with LayerScale) -> final LN -> tied head."""

    def __init__(self, layers=2, layerscale=False, tied=False):
        super().__init__()
        self.emb = nn.Embedding(11, D)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(D), "fc": nn.Linear(D, D)}) for _ in range(layers))
        self.scale = nn.ParameterList(nn.Parameter(torch.rand(D) + 0.5) for _ in range(layers)) if layerscale else None
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        zoo.adversarial(self)

    def forward(self, ids):
        h = self.emb(ids)
        for k, b in enumerate(self.blocks):
            y = b["fc"](torch.tanh(b["ln"](h)))
            h = h + (y * self.scale[k] if self.scale is not None else y)
        return self.head(self.ln_f(h))


IDS = (torch.randint(0, 11, (2, 5)),)


def test_tied_embedding_is_cloned_not_edited():
    m = PreLN(tied=True)
    res = fold_module(m, IDS, norm="rms_norm")
    assert res.report.folded == 3 and res.max_rel_err < RTOL
    assert m.head.weight is m.emb.weight  # the user's tie is intact


def test_layerscale_is_folded_into_its_source():
    m = PreLN(layerscale=True)
    res = fold_module(m, IDS, norm="rms_norm")
    assert res.report.folded == 3 and res.max_rel_err < RTOL
    muls = [n for n in res.module.graph.nodes if "mul" in str(n.target)]
    assert not muls  # the scale went into fc's weights; the multiplication by ones is gone


class FromInput(nn.Module):
    """A stream that starts at a graph input: only an explicit recenter can center it."""

    def __init__(self, layers):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D) for _ in range(layers + 1))
        self.fcs = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        zoo.adversarial(self)

    def forward(self, x):
        for ln, fc in zip(self.lns, self.fcs):
            x = x + fc(torch.relu(ln(x)))
        return self.lns[-1](x).sum(-1)


def test_graph_input_stream_folds_with_one_recenter():
    x = (torch.randn(2, 5, D) + 3.0,)
    res = fold_module(FromInput(2), x, norm="rms_norm")
    assert (res.report.folded, res.report.recentered) == (3, 1) and res.max_rel_err < RTOL


def test_lone_norm_behind_graph_input_is_not_worth_a_recenter():
    report = analyze_module(FromInput(0), (torch.randn(2, 5, D),))
    assert report.kept == 1 and "recenter" in report.norms[0].reason
    with pytest.raises(NothingToFold):
        fold_module(FromInput(0), (torch.randn(2, 5, D),))


def test_multi_axis_layernorm_is_kept_with_reason():
    class TwoAxes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.ln = nn.LayerNorm([5, D])

        def forward(self, x):
            return self.ln(self.fc(x))

    report = analyze_module(TwoAxes(), (torch.randn(2, 5, D),))
    assert report.kept == 1 and "axes [1, 2]" in report.norms[0].reason  # one wording for both frontends


def test_stream_as_output_blocks_with_reason():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.ln = nn.LayerNorm(D)

        def forward(self, x):
            h = self.fc(x)
            return self.ln(h), h

    report = analyze_module(Leaky(), (torch.randn(2, 5, D),))
    assert report.kept == 1 and "graph output" in report.norms[0].reason


def test_train_mode_dropout_on_the_stream_is_not_transparent():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.drop = nn.Dropout(0.5)
            self.ln = nn.LayerNorm(D)

        def forward(self, x):
            return self.ln(self.drop(self.fc(x)))

    m = Drop()
    assert analyze_module(m.eval(), (torch.randn(2, D),)).folded == 1
    assert analyze_module(m.train(), (torch.randn(2, D),)).folded == 0


def test_bad_arguments():
    with pytest.raises(fx_rewrite.LnfoldError):
        fold_module(PreLN(), IDS, mode="nope")
    with pytest.raises(fx_rewrite.LnfoldError):
        fold_module(PreLN(), IDS, norm="nope")


# --- the torch.compile backend ---------------------------------------------------------------------

def test_backend_folds_torch_level_graph_eagerly():
    """Dynamo's torch-level graph (F.layer_norm, F.linear, operator.add): same verdicts, exact."""
    m = PreLN(tied=True, layerscale=True)
    graphs = []

    def inner(gm, ex):
        graphs.append(gm)
        return gm.forward

    c = torch.compile(m, backend=lnfold_backend_with(inner=inner))
    with torch.no_grad():
        assert _rel(m(*IDS), c(*IDS)) < RTOL
    report = backend_mod.reports[-1]
    assert (report.folded, report.kept) == (3, 0)
    names = [getattr(n.target, "__name__", str(n.target)) for n in graphs[-1].graph.nodes]
    assert "layer_norm" not in names and names.count("rms_norm") == 3


def test_backend_options_reach_the_fold(monkeypatch):
    seen = []
    monkeypatch.setattr(backend_mod, "_inductor", lambda gm, ex, **kw: gm.forward)
    torch._dynamo.reset()
    c = torch.compile(PreLN(), backend="lnfold", options={"lnfold.mode": "crms", "lnfold.on_report": seen.append})
    with torch.no_grad():
        c(*IDS)
    assert seen and seen[-1].mode == "crms" and seen[-1].folded == 3
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown lnfold option"):
        torch.compile(PreLN(), backend="lnfold", options={"lnfold.nope": 1})(*IDS)


def test_backend_cache_notices_changed_parameters():
    """Inference reads cached centered copies; an in-place update must not leave them stale."""
    m = PreLN(tied=True)
    c = torch.compile(m, backend=lnfold_backend_with(inner=_eager))
    with torch.no_grad():
        assert _rel(m(*IDS), c(*IDS)) < RTOL
        before = _digest(m)
        c(*IDS)
        assert _digest(m) == before  # the user's parameters are never written
        m.emb.weight.add_(1.0)
        m.blocks[0]["fc"].bias.mul_(3.0)
        assert _rel(m(*IDS), c(*IDS)) < RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_compile_matches_eager_and_inductor_sees_no_layernorm(zoo_module, monkeypatch, name):
    module, args = zoo_module(name)
    handed = []
    real = backend_mod._inductor

    def recording(gm, example_inputs, **kw):
        handed.append(gm)
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(backend_mod, "_inductor", recording)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="lnfold")
    with torch.no_grad():
        assert _rel(module(*args), compiled(*args)) < RTOL
    assert handed
    names = [getattr(n.target, "__name__", str(n.target)) for gm in handed for n in gm.graph.nodes]
    assert "layer_norm" not in names and names.count("rms_norm") == COUNTS[name][0]


@pytest.mark.slow
def test_training_step_same_loss_and_gradients(zoo_module):
    """Through the backend under autograd: the optimizer's parameters are centered in the graph,
    so loss and gradients are the original model's. Reference: the same step in float64."""
    module, (ids,) = zoo_module("gpt2")

    def step(model, fn):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        logits = fn(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        return loss.detach(), grads, {k: p.detach().clone() for k, p in model.named_parameters()}

    ref_model = copy.deepcopy(module).double()
    loss64, grads64, params64 = step(ref_model, ref_model)
    model = copy.deepcopy(module)
    torch._dynamo.reset()
    loss, grads, params = step(model, torch.compile(model, backend="lnfold"))
    assert backend_mod.reports[-1].folded == 5
    assert abs(loss.double() - loss64).item() / abs(loss64).item() < RTOL
    assert grads.keys() == grads64.keys()
    for k in grads64:
        assert _rel(grads64[k], grads[k]) < RTOL, k
        assert _rel(params64[k], params[k]) < RTOL, k


@pytest.mark.slow
def test_entry_point_works_without_importing_lnfold():
    """After `pip install`, backend="lnfold" resolves through the torch_dynamo_backends entry point."""
    code = textwrap.dedent("""
        import sys, torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(11, 16)
                self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)
                self.fc = nn.Linear(16, 16)
            def forward(self, ids):
                h = self.emb(ids)
                h = h + self.fc(torch.tanh(self.ln1(h)))
                return self.ln2(h)
        m = M().eval()
        with torch.no_grad():
            m.emb.weight.add_(3.0 * torch.randn(11, 1))
        assert "lnfold.fx_rewrite" not in sys.modules
        ids = torch.randint(0, 11, (2, 5))
        with torch.no_grad():
            got = torch.compile(m, backend="lnfold")(ids)
            ref = m(ids)
        from lnfold.fx_rewrite.backend import reports
        assert reports and reports[-1].folded == 2, reports
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


class Pooled(nn.Module):
    """Token selection, slicing and mean pooling on the stream before the last norms."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, D)
        self.ln1, self.fc = nn.LayerNorm(D), nn.Linear(D, D)
        self.ln_cls, self.ln_mean, self.ln_tail = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        zoo.adversarial(self)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(torch.tanh(self.ln1(h)))
        return self.ln_cls(h[:, 0]) + self.ln_mean(h.mean(1)) + self.ln_tail(h[:, 1:]).sum(1)


def test_token_select_slice_and_mean_pool_are_transparent():
    m = Pooled()
    res = fold_module(m, IDS, norm="rms_norm")
    assert (res.report.folded, res.report.kept) == (4, 0) and res.max_rel_err < RTOL
    c = torch.compile(m, backend=lnfold_backend_with(inner=_eager))
    with torch.no_grad():
        assert _rel(m(*IDS), c(*IDS)) < RTOL
    assert backend_mod.reports[-1].folded == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fold_is_as_accurate_as_the_original(zoo_module, dtype):
    """16-bit: centering runs in float64 and is cast back; the folded model's error against a
    float64 run is checked against the original model's own (DESIGN §4)."""
    module, args = zoo_module("gpt2")
    half = copy.deepcopy(module).to(dtype)
    res = fold_module(half, args, norm="rms_norm")
    assert res.report.folded == 5
    assert all(p.dtype == dtype for p in res.module.parameters())


def test_number_added_to_the_stream_is_zeroed():
    """`h * 2 + 0.5`: the scale is transparent, the 0.5 is a per-row constant the plan zeroes."""
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln = nn.Embedding(11, D), nn.LayerNorm(D)
            self.fc, self.ln2 = nn.Linear(D, D), nn.LayerNorm(D)

        def forward(self, ids):
            h = self.emb(ids) * 2.0 + 0.5
            h = h - self.fc(torch.relu(self.ln(h)))
            return self.ln2(h)

    m = Shifted()
    res = fold_module(m, IDS, norm="rms_norm")
    assert res.report.folded == 2 and res.max_rel_err < RTOL
    c = torch.compile(m, backend=lnfold_backend_with(inner=_eager))
    with torch.no_grad():
        assert _rel(m(*IDS), c(*IDS)) < RTOL


def test_backend_planted_bug_is_caught_by_verify(monkeypatch):
    """The backend's own check (`verify=True` / options={"lnfold.verify": True}) catches a
    skipped centering at compile time."""
    sabotaged = missing_one_centering(backend_mod.make_plan, index=0)

    m = PreLN()
    ok = torch.compile(m, backend=lnfold_backend_with(inner=_eager, verify=True))
    with torch.no_grad():
        ok(*IDS)
    monkeypatch.setattr(backend_mod, "make_plan", sabotaged)
    torch._dynamo.reset()
    bad = torch.compile(m, backend=lnfold_backend_with(inner=_eager, verify=True))
    with torch.no_grad(), pytest.raises(Exception, match="verification failed"):
        bad(*IDS)


def test_roll_flip_and_pad_on_token_axes_are_transparent():
    class Layout(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(11, D), nn.Linear(D, D)
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            zoo.adversarial(self)

        def forward(self, ids):
            h = self.emb(ids)
            h = torch.roll(h, 1, 1) + self.fc(torch.tanh(self.ln1(torch.flip(h, [1]))))
            h = nn.functional.pad(nn.functional.pad(h, (0, 0, 1, 2)), (0, 0, 1, 1), mode="replicate")
            return self.ln2(h.roll(2, dims=1).flip(0))

    m = Layout()
    res = fold_module(m, IDS, norm="rms_norm")
    assert res.report.folded == 2 and res.max_rel_err < RTOL
    c = torch.compile(m, backend=lnfold_backend_with(inner=_eager, verify=True))
    with torch.no_grad():
        assert _rel(m(*IDS), c(*IDS)) < RTOL
    assert backend_mod.reports[-1].folded == 2


# --- the backend on generated models (tests/fuzz/: known verdicts, adversarial weights) ----

def _backend_case(seed: int):
    from tests.fuzz import gen

    return gen.from_seed(seed).to(torch.float64)  # float64: any difference is a fold bug, not rounding


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_backend_on_generated_models_inference_and_gradients(seed):
    """Verdicts equal the generator's ground truth; outputs, loss and gradients equal eager's.
    (A per-row constant's gradient is mathematically zero through a LayerNorm: the folded graph
    gives exactly 0 where eager gives rounding noise, which a 4-wide LayerNorm with eps=1e-12
    amplifies to ~3e-8 of the largest gradient even in float64; so gradients are compared on
    the scale of the largest one, to 1e-6.)"""
    from tests.fuzz.properties import flat

    case = _backend_case(seed)
    m1, m2 = case.module, copy.deepcopy(case.module)
    torch._dynamo.reset()
    backend_mod.reports.clear()
    compiled = torch.compile(m2, backend=lnfold_backend_with(inner=_eager))

    def loss(outs):
        return sum((o ** 2).mean() for o in flat(outs) if o.is_floating_point())

    l1, l2 = loss(m1(*case.inputs)), loss(compiled(*case.inputs))
    assert sum(r.folded for r in backend_mod.reports) == case.expected.count("fold")
    assert abs(l1.item() - l2.item()) <= 1e-9 * abs(l1.item())
    l1.backward()
    l2.backward()
    g1 = {k: p.grad for k, p in m1.named_parameters() if p.grad is not None}
    g2 = {k: p.grad for k, p in m2.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in g1.values())
    for k, g in g1.items():
        other = g2.get(k, torch.zeros_like(g))
        assert (g - other).abs().max().item() <= 1e-6 * scale, k


def test_keyword_arguments_dict_outputs_and_per_token_mask():
    """kwargs reach the export, dict outputs come back, a per-token mask is a transparent scale."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(11, D), nn.Linear(D, D)
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            zoo.adversarial(self)

        def forward(self, ids, mask=None):
            h = self.emb(ids) * mask[..., None]
            h = h + self.fc(torch.relu(self.ln1(h)))
            return {"out": self.ln2(h), "ids": ids}

    m = Masked()
    res = fold_module(m, IDS, {"mask": torch.ones(2, 5)}, norm="rms_norm")
    assert res.report.folded == 2 and res.max_rel_err < RTOL
    ids, mask = torch.randint(0, 11, (3, 7)), torch.rand(3, 7)
    with torch.no_grad():
        assert _rel(m(ids, mask=mask)["out"], res.module(ids, mask=mask)["out"]) < RTOL


def test_report_names_weights_by_their_state_dict_names():
    """The exported graph names a weight `model_transformer_h_0_attn_c_proj_weight`; the report says
    `model.transformer.h.0.attn.c_proj.weight`, a key of the module's state_dict, as the ONNX path does."""
    import re

    model, args = zoo.gpt2()
    keys = set(model.state_dict())
    for report in (analyze_module(model.eval(), args), fold_module(model.eval(), args).report):
        (stream,) = report.streams
        named = [re.match(r"`([^`]*)`", c)[1] for c in stream.centered + stream.cloned]
        assert "model.transformer.h.0.attn.c_proj.weight" in named, named
        assert set(named) <= keys, set(named) - keys
        assert "_weight`" not in report.table()
