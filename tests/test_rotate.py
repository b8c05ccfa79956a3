"""γ into the readers and stream rotation (issue 22; DESIGN §6b): exact, in both frontends, with a
reason wherever a norm keeps its γ or a stream stays unrotated.

Every model has randomized γ/β and large-mean sources (zoo.adversarial), so a γ left in a norm,
a reader or writer left unrotated, or a wrong Q moves the outputs far beyond the float64 gate.
"""
from __future__ import annotations

import dataclasses

import functools
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lnfold
from lnfold import fx_rewrite, zoo
from lnfold.passes import LnfoldError, VerificationError
from lnfold.passes import orthogonal, rotate

warnings.filterwarnings("ignore", category=UserWarning)


# --- the matrices ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [512, 768, 1024, 2048, 12 * 4, 12 * 16, 12 * 64, 20 * 2, 20 * 8, 20 * 32, 5120 // 4])
def test_hadamard_orders(n):
    h = orthogonal.hadamard(n)
    assert h is not None and h.shape == (n, n) and set(np.unique(h)) == {-1.0, 1.0}
    assert np.array_equal(h @ h.T, n * np.eye(n))


@pytest.mark.parametrize("kind", orthogonal.KINDS)
@pytest.mark.parametrize("d", [64, 100, 192])
def test_rotations_are_orthogonal_and_seeded(kind, d):
    q = orthogonal.matrix(kind, d, seed=3)
    assert np.abs(q @ q.T - np.eye(d)).max() < 1e-12
    assert np.array_equal(q, orthogonal.matrix(kind, d, seed=3))
    assert not np.allclose(q, orthogonal.matrix(kind, d, seed=4))
    if d == 100:  # no Hadamard order: falls back to a random orthogonal matrix
        assert orthogonal.resolved_kind(kind, d).startswith("orthogonal")
    ones = np.ones(d)
    if kind.endswith("-keep-ln"):
        assert np.abs(q @ ones - ones).max() < 1e-12 and np.abs(q.T @ ones - ones).max() < 1e-12
    else:
        assert np.abs(q @ ones - ones).max() > 0.1


def test_keep_ln_rotation_commutes_with_a_stock_layernorm():
    """LN with unit weight: LN(x·Q) = LN(x)·Q when Q·1 = 1, and not for a plain rotation."""
    d = 192
    x = np.random.default_rng(0).standard_normal((5, d)) + 7.0  # a large mean

    def ln(v):
        c = v - v.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)

    keep = orthogonal.matrix("hadamard-keep-ln", d)
    assert np.abs(ln(x @ keep) - ln(x) @ keep).max() < 1e-12
    plain = orthogonal.matrix("hadamard", d)
    assert np.abs(ln(x @ plain) - ln(x) @ plain).max() > 1e-2


# --- options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [(dict(rotate="walsh"), "unknown rotation"),
                                     (dict(rotate="hadamard", mode="crms"), "needs mode 'rms'"),
                                     (dict(rotate="hadamard", seed=-1), "seed"),
                                     (dict(gamma_into_readers="yes"), "gamma_into_readers")])
def test_bad_options_are_one_line_errors(kw, msg):
    m, args = _toy()
    with pytest.raises(LnfoldError, match=msg):
        lnfold.fold_module(m, args, **kw)
    with pytest.raises(LnfoldError, match=msg):
        lnfold.fold_onnx(_blank_onnx(), **kw)


def test_cli_usage_names_the_options(capsys):
    from lnfold.onnx_rewrite.cli import main

    with pytest.raises(SystemExit):
        main(["fold", "--help"])
    out = capsys.readouterr().out
    assert "--gamma-into-readers" in out and "--rotate" in out and "hadamard-keep-ln" in out and "--seed" in out


# --- a toy Pre-LN model, with one knob per blocking reason --------------------------------------------

class Toy(nn.Module):
    """Embedding + position table, 2 Pre-LN blocks, final norm, head. `block`: which reason to plant."""

    def __init__(self, block: str = "", d: int = 48, vocab: int = 37) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Parameter(torch.randn(16, d) * 0.1)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(4))
        self.fc1 = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(2))
        self.fc2 = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.stem = nn.Linear(d, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, ids):
        h = self.tok(ids) + self.position_embeddings[: ids.shape[1]]
        if self.block == "opaque":  # the stream starts at a nonlinearity: recentered (tests/test_rotate_recentered.py)
            h = torch.tanh(self.stem(h))
        for k in range(2):
            h = h + self.fc2[k](torch.relu(self.fc1[k](self.ln[2 * k](h))))
        out = self.ln_f(h)
        if self.block == "final_output":  # the final norm's output is a graph output
            return out
        if self.block == "nonlinear_reader":  # the final norm's output read by a nonlinearity
            out = torch.tanh(out)
        if self.block == "conv_reader":  # read by a conv with spatial extent (over the tokens)
            out = self.conv(out.transpose(1, 2)).transpose(1, 2)
        y = self.head(out)
        if self.block == "softmax":  # an invariant sink of the stream that is no norm
            return y + torch.softmax(h, -1)[..., :1]
        return y


def _toy(block: str = "", seed: int = 0):
    torch.manual_seed(seed)
    m = zoo.adversarial(Toy(block), seed)
    # (the unused norms ln[1], ln[3] are gone from the graph: 3 norms)
    return m, (torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(seed)),)


@functools.lru_cache(maxsize=None)
def _toy_program(block: str = ""):
    """(lnfold's own export of `_toy(block)`, its args), once per worker as `_toy_onnx` is: the torch
    tests fold it with their options (fold_module reads a program as it is; test_fx checks)."""
    m, args = _toy(block)
    return fx_rewrite.api.export(m, args), args


@functools.lru_cache(maxsize=None)
def _toy_onnx(block: str = ""):
    m, args = _toy(block)
    return zoo.export_onnx(m, args, ["ids"])


def _blank_onnx():
    return _toy_onnx()


BLOCKS = {  # planted blocker -> words its reason must contain
    "softmax": "neither one of its norms nor transparent",
}
# a norm whose readers cannot take γ and Qᵀ (a graph output, a non-linear reader, a conv over the
# tokens): the stream rotates all the same, that norm un-rotating its output by a constant MatMul
UNROTATED = {
    "final_output": "is a graph output",
    "nonlinear_reader": "is not a linear layer",
    "conv_reader": "is not a linear layer",
}


def _rotations(report):
    """Each stream's rotation as both frontends must agree on it (node names are each IR's own)."""
    return [re.sub(r"`[^`]*`", "`…`", s.rotation) for s in report.streams]


def test_gamma_into_readers_is_exact_in_torch():
    res = lnfold.fold_module(*_toy_program(), gamma_into_readers=True)
    assert res.criterion == "float64" and res.report.folded == 3
    assert all("into the weight of" in n.gamma for n in res.report.norms), [n.gamma for n in res.report.norms]
    # every folded norm has unit weight now: no LayerNorm/RMSNorm in the graph reads a weight
    norms = [n for n in res.module.graph.nodes if "norm" in str(n.target)]
    assert norms and all(len([a for a in n.args if isinstance(a, torch.fx.Node)]) == 1 for n in norms)
    assert not res.report.streams[0].rotation


def test_gamma_into_readers_is_exact_in_onnx():
    m, args = _toy()
    res = lnfold.fold_onnx(_toy_onnx(), gamma_into_readers=True)
    assert res.criterion == "float64" and res.report.folded == 3
    assert all("into the weight of" in n.gamma for n in res.report.norms)
    # the head has no bias: the final norm's β became a new one (W β)
    assert "new" in res.report.norms[-1].beta
    import onnx.numpy_helper as nh

    inits = {t.name: nh.to_array(t) for t in res.model.graph.initializer}
    for node in res.model.graph.node:
        if node.op_type == "SimplifiedLayerNormalization":
            assert np.array_equal(inits[node.input[1]], np.ones_like(inits[node.input[1]]))


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal-keep-ln"])
def test_rotation_is_exact_and_reported_alike_in_both_frontends(kind):
    t = lnfold.fold_module(*_toy_program(), rotate=kind, seed=5)
    o = lnfold.fold_onnx(_toy_onnx(), rotate=kind, seed=5)
    for res in (t, o):
        assert res.criterion == "float64"
        assert res.report.streams[0].rotation.startswith(f"rotated ({orthogonal.resolved_kind(kind, 48)}, d=48, seed 5)")
    assert _rotations(t.report) == _rotations(o.report)
    assert "rotation" in t.report.to_json()


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_each_blocking_reason_keeps_the_stream_unrotated_and_exact(block):
    res = lnfold.fold_module(*_toy_program(block), rotate="hadamard")
    (stream,) = res.report.streams
    assert stream.rotation.startswith("not rotated: ") and BLOCKS[block] in stream.rotation, stream.rotation
    assert res.criterion == "float64"


@pytest.mark.parametrize("block", sorted(UNROTATED))
def test_a_norm_that_keeps_gamma_unrotates_its_output_exactly(block):
    res = lnfold.fold_module(*_toy_program(block), rotate="hadamard")
    (stream,) = res.report.streams
    assert stream.rotation.startswith("rotated (hadamard") and "un-rotated after `layer_norm_2`" in stream.rotation
    assert UNROTATED[block] in res.report.norms[-1].gamma
    assert res.criterion == "float64"


@pytest.mark.slow
@pytest.mark.parametrize("block", ["final_output", "softmax"])
def test_blocking_reasons_are_the_same_in_onnx(block):
    m, args = _toy(block)
    res = lnfold.fold_onnx(_toy_onnx(block), rotate="hadamard")
    (stream,) = res.report.streams
    if block in UNROTATED:
        assert stream.rotation.startswith("rotated (hadamard") and "un-rotated after" in stream.rotation
        assert res.criterion == "float64"
    else:
        assert stream.rotation.startswith("not rotated: ") and BLOCKS[block] in stream.rotation, stream.rotation
        assert res.criterion == "float64"


def _one_reader_unrotated(real):
    def plan(*a, **kw):
        out = real(*a, **kw)
        if out.rotated:  # the planted bug: one reader keeps reading x, not x·Q
            out = dataclasses.replace(out, readers=out.readers[1:])
        return out
    return plan


def _wrong_q(real):
    def plan(*a, **kw):
        out = real(*a, **kw)
        return dataclasses.replace(out, writers=[
            (ref, rotate.Project(op.axis, rotate.Seeded(op.basis.kind, op.basis.dim, op.basis.seed + 1), op.keep))
            for ref, op in out.writers])
    return plan


@pytest.mark.parametrize("bug", [_one_reader_unrotated, _wrong_q])
def test_a_planted_rotation_bug_is_refused(monkeypatch, bug):
    from lnfold.passes import plan as plan_module

    monkeypatch.setattr(plan_module, "plan_rotation", bug(plan_module.plan_rotation))
    with pytest.raises(VerificationError):
        lnfold.fold_module(*_toy_program(), rotate="hadamard")
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(_toy_onnx(), rotate="hadamard")


def test_keep_ln_rotation_keeps_stock_layernorms_exact():
    """torch's default emission keeps aten.layer_norm on the folded stream: with a keep-LN Q (Q·1 = 1)
    the rotated stream stays zero-mean and the stock LayerNorms (unit weight) stay exact; with a
    plain Q the norms must become RMSNorms (and do)."""
    keep = lnfold.fold_module(*_toy_program(), rotate="hadamard-keep-ln")
    targets = [str(n.target) for n in keep.module.graph.nodes if "norm" in str(n.target)]
    assert targets and all("layer_norm" in t for t in targets)
    plain = lnfold.fold_module(*_toy_program(), rotate="hadamard")
    targets = [str(n.target) for n in plain.module.graph.nodes if "norm" in str(n.target)]
    assert targets and all("rms_norm" in t for t in targets)


# --- zoo architectures (with their heads: a bare model returns the final norm's output) --------------

def _with_head(name: str):
    cfgs = {
        "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                                                     num_attention_heads=4, max_position_embeddings=64,
                                                     word_embed_proj_dim=64), "ids"),
        "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                                intermediate_size=256, image_size=32, patch_size=8,
                                                                num_labels=5), "pixels"),
        "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", zoo._WHISPER, "audio"),
    }
    cfg, model, kw, inputs = cfgs[name]
    c, m, g = zoo._tiny(cfg, model, 0, kw)
    if inputs == "audio":
        x = torch.randn(2, c.num_mel_bins, 2 * c.max_source_positions, generator=g)
        return zoo.Seq2Seq(m, "logits").eval(), (x, torch.randint(0, 50, (2, 7), generator=g)), ["x", "decoder_input_ids"]
    x = torch.randint(0, 101, (2, 9), generator=g) if inputs == "ids" else torch.randn(2, 3, 32, 32, generator=g)
    return zoo.Logits(m, "logits").eval(), (x,), ["input_ids" if inputs == "ids" else "pixel_values"]


@pytest.mark.slow
@pytest.mark.parametrize("name, rotated", [("gpt2", [True]), ("opt", [True]), ("vit", [True]),
                                           ("whisper", [True, True]), ("bare_vit", [True])])
def test_zoo_rotation_is_exact_in_both_frontends(name, rotated, zoo_onnx):
    """Whisper: its encoder stream starts at GELU(conv) (recentered, then projected by an emitted
    MatMul), its decoder's rotates on its own (each stream is independent)."""
    if name == "gpt2":
        m, args = zoo.gpt2()
        names = ["input_ids"]
    elif name == "bare_vit":  # last_hidden_state out: the final norm un-rotates its output
        m, args = zoo.vit()
        names = ["pixel_values"]
    else:
        m, args, names = _with_head(name)
    t = lnfold.fold_module(m, args, rotate="hadamard")
    assert [s.rotation.startswith("rotated") for s in t.report.streams] == rotated, _rotations(t.report)
    assert ("un-rotated after" in t.report.streams[-1].rotation) == (name == "bare_vit")
    assert t.criterion == "float64"
    if name == "whisper":  # the ONNX export of the seq2seq model costs more than the rest of the file
        return
    shared = {"gpt2": "gpt2", "bare_vit": "vit"}.get(name)  # the zoo's own models: the session's export
    o = lnfold.fold_onnx(zoo_onnx(shared)[2] if shared else zoo.export_onnx(m, args, names), rotate="hadamard")
    assert o.criterion == "float64"
    assert _rotations(t.report) == _rotations(o.report)


# --- trained weights: the held-out metric (benchmarks/trained/harness.py) -----------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_stdlib", "vit_digits"])
def test_rotation_keeps_the_trained_models_metric(name, trained_onnx):
    """Rotated (randomized Hadamard, d = 192 = 2⁴·12 and 64) in both frontends: the float64 gate
    passes and the held-out metric is the original's up to float noise."""
    from benchmarks.trained import harness

    rows = {"gpt2_stdlib": 4, "vit_digits": 359}[name]
    module = harness.logits_module(name)
    before = harness.evaluate(name, harness.torch_runner(module), rows)
    t = lnfold.fold_module(module, harness.example_args(name), rotate="hadamard")
    o = lnfold.fold_onnx(trained_onnx(name), rotate="hadamard")
    assert _rotations(t.report) == _rotations(o.report)
    assert all(s.rotation.startswith("rotated (hadamard") for s in t.report.streams)
    for after in (harness.evaluate(name, harness.torch_runner(t.module), rows),
                  harness.evaluate(name, harness.onnx_runner(o.model), rows)):
        assert after.count == before.count and abs(after.loss - before.loss) <= 1e-5 * before.loss, (before, after)
        if name == "vit_digits":
            assert after.value == before.value


@pytest.mark.slow
def test_per_head_norm_streams_stay_unrotated_and_the_main_stream_rotates():
    """StableLM's q/k LayerNorms (one per head) are components of their own, centered in blocks:
    not rotated, with the reason; the residual stream rotates, its q/k projections' weights edited
    on both sides (γ and Qᵀ on the input axis, the per-head centering on the output axis)."""
    m, args = zoo.stablelm_qk()
    res = lnfold.fold_module(m, args, rotate="hadamard")
    rotations = [s.rotation for s in res.report.streams]
    assert rotations[0].startswith("rotated (hadamard, d=64")
    assert rotations[1:] and all(r == "not rotated: its norms normalize blocks of the features (per-head norms)"
                                 for r in rotations[1:])
    assert res.criterion == "float64"


class _WrittenOutFinalNorm(nn.Module):
    """A stream whose last norm is written out by hand, with no γ or β, and is the model's output
    (DeBERTa's embedding norm, hand-written modules): the rotated stream is un-rotated after it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.emb = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(11, 8, generator=g) + 4.0)
            self.proj.bias.copy_(torch.randn(8, generator=g) + 3.0)
            self.ln.weight.copy_(torch.rand(8, generator=g) + 0.5)
            self.ln.bias.copy_(torch.randn(8, generator=g))

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.proj(torch.relu(self.ln(h)))
        mu = h.mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + 1e-5)


def _readouts_at_any_cost(monkeypatch) -> None:
    """Rotate streams even where the un-rotating MatMuls outweigh the reader weights absorbing the
    rotation (rotate._costs_more keeps those unrotated, issue 45): the models below exercise the
    readout itself on streams read by no weight at all."""
    from lnfold.passes import rotate
    monkeypatch.setattr(rotate, "_costs_more", lambda view, rot: None)


def test_written_out_norm_without_gamma_is_unrotated_in_torch(monkeypatch):
    m, args = _WrittenOutFinalNorm().eval(), (torch.randint(0, 11, (2, 5)),)
    (kept,) = lnfold.fold_module(m, args, rotate="hadamard").report.streams
    assert kept.rotation.startswith("not rotated: its readers' weights absorb too little"), kept.rotation
    _readouts_at_any_cost(monkeypatch)
    res = lnfold.fold_module(m, args, rotate="hadamard")
    assert res.criterion == "float64" and res.report.folded == 2
    (stream,) = res.report.streams
    assert stream.rotation.startswith("rotated") and "un-rotated after" in stream.rotation, stream.rotation
    torch.testing.assert_close(res.module(*args), m(*args), rtol=1e-4, atol=1e-4)


def test_a_readout_inside_an_if_branch_keeps_its_unrotation(monkeypatch):
    """Optimum's merged decoder holds both decoders in If branches: each branch's share of the plan
    (Plan.scoped) carries the rotations, so a readout norm there is un-rotated (it was not: the
    gate refused the fold at 0.66 relative error). Its norms' readers share weights across the
    branches and keep γ, so every norm is a readout: rotated only at any cost."""
    from pathlib import Path

    import onnx

    from lnfold.onnx_rewrite import fold_model

    _readouts_at_any_cost(monkeypatch)
    model = onnx.load(str(Path(__file__).parent / "corpus" / "optimum_gpt2_decoder_model_merged.onnx"))
    res = fold_model(model, rotate="hadamard", seed=3)  # verified against float64
    assert res.criterion == "float64; verified on both branches of If `optimum::if` (use_cache_branch False and True)" \
        and res.exact_err < 1e-5
    assert any(s.rotation.startswith("rotated") and "un-rotated after" in s.rotation for s in res.report.streams)
