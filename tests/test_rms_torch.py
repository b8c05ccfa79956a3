"""Streams of RMSNorms as given in the torch frontend (issue 47): `fold_module` / `slice_module` on
torch.export graphs holding `torch.nn.RMSNorm` (aten.rms_norm) or an RMSNorm written out as
transformers writes LlamaRMSNorm (Qwen2, Mistral, Phi-3 alike), GemmaRMSNorm (weight read as 1 + γ)
and T5LayerNorm (variance of the fp32 cast, the uncast x divided), recognized by graph pattern
(passes/patterns.match_rms). γ moves into the readers, the stream rotates exactly (verified against
float64) and slices; planted bugs (an unrotated reader, Gemma's 1 + γ read as γ) fail verification.
The transformers zoo (Llama, Qwen2, Mistral, Phi-3, Gemma) in both IRs is slow; the tiny modules
here are its fast siblings. The ONNX forms are tests/test_rms_streams.py's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import lnfold
from lnfold.passes import NothingToFold, VerificationError

transformers = pytest.importorskip("transformers")

D, HIDDEN, VOCAB = 16, 32, 20


def _norm(form: str) -> torch.nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"torch": lambda: torch.nn.RMSNorm(D, eps=1e-6), "torch-default-eps": lambda: torch.nn.RMSNorm(D),
            "llama": lambda: LlamaRMSNorm(D), "qwen2": lambda: Qwen2RMSNorm(D), "mistral": lambda: MistralRMSNorm(D),
            "phi3": lambda: Phi3RMSNorm(D), "gemma": lambda: GemmaRMSNorm(D), "t5": lambda: T5LayerNorm(D)}[form]()


class _Block(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm, torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(torch.nn.Module):
    """Embedding (large mean) -> 2 pre-norm blocks -> final norm -> head; every norm of `form`, with
    random signed γ (Gemma's stored weight is γ - 1, read as 1 + weight)."""

    def __init__(self, form: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList([_Block(_norm(form)) for _ in range(2)])
        self.norm, self.head = _norm(form), torch.nn.Linear(D, 7)
        _randomize(self)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _randomize(model: torch.nn.Module) -> None:
    """Random signed γ in [0.5, 2] on every norm (unit γ would hide a γ left behind) and a large-mean
    embedding, as the zoo's models get."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("layer_norm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 2.0) * torch.randint(0, 2, p.shape).mul(2).sub(1))
        model.get_input_embeddings().weight.add_(3.0) if hasattr(model, "get_input_embeddings") \
            else model.emb.weight.add_(3.0)


def _ids(rows: int = 2, seed: int = 1, vocab: int = VOCAB, tokens: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _rms_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.rms_norm.default]


FAST_FORMS = ("torch", "llama", "gemma", "t5")


@pytest.mark.parametrize("form", FAST_FORMS)
def test_each_rmsnorm_form_rotates_exactly(form):
    m, ids = Tiny(form).eval(), _ids()
    r = lnfold.fold_module(m, (ids,), rotate="hadamard")  # verified against float64 (raises otherwise)
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert s.rotation.startswith(f"rotated (hadamard, d={D}"), s.rotation
    assert len(s.rms) == 3 and not s.norms and r.report.norms == []
    assert all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms), r.report.rms_norms
    # each norm emitted anew as aten.rms_norm with unit weight, the written-out ops gone
    assert len(_rms_nodes(r.module)) == 3 and all(n.args[2] is None for n in _rms_nodes(r.module))
    assert not any(n.target is torch.ops.aten.pow.Tensor_Scalar for n in r.module.graph.nodes)
    torch.testing.assert_close(r.module(_ids(seed=2)), m(_ids(seed=2)), rtol=1e-5, atol=1e-5)


def test_without_gamma_or_rotate_an_rmsnorm_module_has_nothing_to_fold():
    with pytest.raises(NothingToFold, match="its 3 norm.s. are RMSNorms already .*nothing to fold"):
        lnfold.fold_module(Tiny("llama").eval(), (_ids(),))


def test_gamma_into_readers_alone():
    m, ids = Tiny("gemma").eval(), _ids()
    r = lnfold.fold_module(m, (ids,), gamma_into_readers=True)
    (s,) = r.report.streams
    assert not s.rotation and all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms)
    torch.testing.assert_close(r.module(ids), m(ids), rtol=1e-5, atol=1e-5)


def test_an_unrotated_reader_fails_verification(monkeypatch):
    """Planted bug: one reader of the stream (an up projection) keeps its weight in the old basis."""
    from lnfold.passes import plan as plan_module

    real = plan_module.plan_rotation

    def drop_one_reader(*args, **kw):
        rot = real(*args, **kw)
        return dataclasses.replace(rot, readers=list(rot.readers)[1:])

    monkeypatch.setattr(plan_module, "plan_rotation", drop_one_reader)
    with pytest.raises(VerificationError):
        lnfold.fold_module(Tiny("llama").eval(), (_ids(),), rotate="hadamard")


def plant_gain_read_as_gamma(monkeypatch) -> None:
    """Planted bug: GemmaRMSNorm's gain 1 + weight read as the weight (the `+ 1` dropped)."""
    from lnfold.fx_rewrite import api

    real = api.computed_gains

    def gamma_only(gm):
        for node in list(gm.graph.nodes):
            if node.target is torch.ops.aten.add.Tensor and node.args[1] == 1.0 and \
                    all(a.op == "get_attr" or a.target is torch.ops.aten.to.dtype for a in node.all_input_nodes):
                node.args = (node.args[0], 0.0)
        real(gm)

    monkeypatch.setattr(api, "computed_gains", gamma_only)


def test_gemmas_gain_read_as_gamma_fails_verification(monkeypatch):
    plant_gain_read_as_gamma(monkeypatch)
    with pytest.raises(VerificationError):
        lnfold.fold_module(Tiny("gemma").eval(), (_ids(),), rotate="hadamard")


def test_a_graph_output_norm_reads_out_of_the_rotated_stream():
    """The final norm's output is also returned (a bare model's hidden states): γ stays, un-rotated by
    a constant MatMul Qᵀ·diag γ after a unit-weight norm."""

    class Hidden(Tiny):
        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            h = self.norm(x)
            return self.head(h), h

    m, ids = Hidden("llama").eval(), _ids()
    from lnfold.passes import rotate
    r = None
    with pytest.MonkeyPatch.context() as mp:  # rotate even where the readout costs more than it saves
        if hasattr(rotate, "_costs_more"):
            mp.setattr(rotate, "_costs_more", lambda view, rot: None)
        r = lnfold.fold_module(m, (ids,), rotate="hadamard")
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated") and "un-rotated after" in s.rotation, s.rotation
    for got, want in zip(r.module(ids), m(ids)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_softmax_over_the_features_keeps_the_stream_unrotated_and_is_named():
    """A Softmax over the features is not rotation-invariant: the report names it; γ still moves."""

    class Softmaxed(Tiny):
        def forward(self, ids):
            x = self.emb(ids)
            x = self.blocks[0](x)
            side = torch.softmax(x, dim=-1)
            x = self.blocks[1](x)
            return self.head(self.norm(x) + side)

    m, ids = Softmaxed("llama").eval(), _ids()
    r = lnfold.fold_module(m, (ids,), rotate="hadamard")
    (s,) = r.report.streams
    assert s.rotation.startswith("not rotated: aten.softmax.int `softmax` reads the stream tensor"), s.rotation
    assert all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms[:2]), r.report.rms_norms
    torch.testing.assert_close(r.module(ids), m(ids), rtol=1e-5, atol=1e-5)


# --- slicing ------------------------------------------------------------------------------------

def _error_against_exact(result, ids) -> float:
    want, got = result.exact.module(ids), result.module(ids)
    return float((got - want).norm() / want.norm())


def test_a_full_width_slice_is_the_exact_fold():
    """F → 0 (k = d): the calibrated basis rotates the stream, nothing deleted (float64: 1e-12); one
    basis and per block."""
    m = Tiny("gemma").double().eval()
    cal = (_ids(16, seed=3),)
    for per_block in (False, True):
        r = lnfold.slice_module(m, cal, fraction=0.01, per_block=per_block)
        (s,) = r.report.streams
        assert s.keep == D and (s.bases == 3 if per_block else True), s
        assert r.report.error < 1e-12 and _error_against_exact(r, _ids(4, seed=9)) < 1e-12


def test_a_real_slice_has_fewer_parameters():
    m = Tiny("torch").eval()
    r = lnfold.slice_module(m, (_ids(16, seed=3),), fraction=0.25)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (D, 12) and r.report.params_after < r.report.params_before
    assert np.isfinite(r.report.error) and 1e-5 < r.report.error < 10
    assert all(n.args[1] == [12] for n in _rms_nodes(r.module))
    assert torch.isfinite(r.module(_ids(4, seed=9))).all()


def _spanning(form: str, span: int = 12) -> Tiny:
    """Tiny in float64 whose writers (the embedding, each down projection) write into one random
    `span`-dimensional subspace of the 16 features: a slice to k = span deletes only zero directions."""
    m = Tiny(form).double().eval()
    u, _ = torch.linalg.qr(torch.randn(D, span, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    with torch.no_grad():
        m.emb.weight.copy_(m.emb.weight @ u @ u.T)
        for b in m.blocks:
            b.down.weight.copy_(u @ u.T @ b.down.weight)
            b.down.bias.copy_(u @ u.T @ b.down.bias)
    return m


@pytest.mark.parametrize("form", ("torch", "llama"))
def test_a_stream_in_k_dimensions_slices_with_zero_error(form):
    """aten.rms_norm and the written-out form re-emitted over k = 12 features with √(d/k) and ε·d/k:
    the exact fold's outputs (float64)."""
    r = lnfold.slice_module(_spanning(form), (_ids(16, seed=3),), fraction=0.25)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (D, 12) and r.report.params_after < r.report.params_before
    assert _error_against_exact(r, _ids(4, seed=9)) < 1e-10


def test_an_unscaled_sliced_rmsnorm_fails():
    """Planted bug: the sliced norms without their √(d/k) (tests/test_slice.plant_unscaled)."""
    from tests.test_slice import plant_unscaled

    with pytest.MonkeyPatch.context() as mp:
        plant_unscaled(mp)
        r = lnfold.slice_module(_spanning("llama"), (_ids(16, seed=3),), fraction=0.25)
    assert _error_against_exact(r, _ids(4, seed=9)) > 1e-2


# --- a LayerNorm stream and an RMSNorm stream ----------------------------------------------------

class Mixed(torch.nn.Module):
    """An encoder stream of LayerNorms and, read through a projection of its final norm, a decoder
    stream of RMSNorms (an encoder–decoder's two streams, as T5 with a LayerNorm encoder would be)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.enc = torch.nn.ModuleList([_Block(torch.nn.LayerNorm(D)) for _ in range(2)])
        self.enc_norm = torch.nn.LayerNorm(D)
        self.bridge = torch.nn.Linear(D, D)
        self.dec = torch.nn.ModuleList([_Block(_norm("llama")) for _ in range(2)])
        self.dec_norm, self.head = _norm("llama"), torch.nn.Linear(D, 7)
        with torch.no_grad():
            for mod in self.modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.weight.uniform_(0.5, 2.0)
                    mod.bias.normal_()
        _randomize(self)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.enc:
            x = b(x)
        y = self.bridge(self.enc_norm(x))
        for b in self.dec:
            y = b(y)
        return self.head(self.dec_norm(y))


def test_a_layernorm_stream_and_an_rmsnorm_stream_both_rotate():
    m, ids = Mixed().eval(), _ids()
    r = lnfold.fold_module(m, (ids,), rotate="hadamard")
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6)
    ln, rms = sorted(r.report.streams, key=lambda s: bool(s.rms))
    assert len(ln.norms) == 3 and not ln.rms and ln.rotation.startswith("rotated"), ln.rotation
    assert len(rms.rms) == 3 and not rms.norms and rms.rotation.startswith("rotated"), rms.rotation
    torch.testing.assert_close(r.module(_ids(seed=2)), m(_ids(seed=2)), rtol=1e-5, atol=1e-5)


# --- the transformers zoo, both IRs (slow; the tiny modules above are the fast siblings) ------------

ZOO = ("llama", "qwen2", "mistral", "phi3", "gemma")


def zoo_model(arch: str) -> torch.nn.Module:
    """A tiny `transformers` causal LM (2 layers, hidden 64) made adversarial as the zoo's LayerNorm
    models are (lnfold.zoo.adversarial: large-mean sources), with random signed γ on its RMSNorms,
    returning its logits."""
    from lnfold import zoo

    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    cfg, cls = {
        "llama": (lambda: transformers.LlamaConfig(**common), transformers.LlamaForCausalLM),
        "qwen2": (lambda: transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM),
        "mistral": (lambda: transformers.MistralConfig(**common), transformers.MistralForCausalLM),
        "phi3": (lambda: transformers.Phi3Config(**common, pad_token_id=0), transformers.Phi3ForCausalLM),
        "gemma": (lambda: transformers.GemmaConfig(**common, head_dim=16), transformers.GemmaForCausalLM),
        # (benchmarks/rms_zoo only: per-head q/k RMSNorms beside the residual stream's)
        "qwen3": (lambda: transformers.Qwen3Config(**common, head_dim=16), transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = cls(cfg()).eval()
    with torch.no_grad():
        zoo.adversarial(model)
    _randomize(model)

    return zoo.Logits(model, "logits").eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ZOO)
def test_the_zoo_rotates_and_slices_exactly_in_torch(arch):
    """In float64, one export for both (fold_module and slice_module take an ExportedProgram)."""
    from lnfold.fx_rewrite.api import export

    m, ids = zoo_model(arch).double(), _ids(8, seed=3, vocab=96, tokens=8)
    program = export(m, (ids,))
    r = lnfold.fold_module(program, (ids,), rotate="hadamard")
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-12)
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=64") and len(s.rms) == 5, r.report.table()
    other = _ids(2, seed=4, vocab=96, tokens=8)
    # (transformers' norms compute in float32 even in a float64 model; lnfold's emitted norm does not)
    torch.testing.assert_close(r.module(other), m(other), rtol=1e-5, atol=1e-5 * float(m(other).abs().max()))
    sl = lnfold.slice_module(program, (ids,), fraction=0.001)
    assert sl.report.streams[0].keep == 64 and sl.report.error < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("arch", ZOO)
def test_the_zoo_rotates_and_slices_exactly_in_onnx(arch, tmp_path):
    """torch.onnx.export(dynamo=True) of each: its decomposed RMSNorms (Gemma's 1 + γ precomputed by
    the exporter's constant folding) rotate exactly and slice at F → 0 to the exact fold."""
    import onnx

    m, ids = zoo_model(arch), _ids(1, vocab=96, tokens=8)
    path = tmp_path / f"{arch}.onnx"
    torch.onnx.export(m, (ids,), str(path), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                      verbose=False)
    model = onnx.load(path)
    r = lnfold.fold_onnx(model, rotate="hadamard")
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6)
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=64") and len(s.rms) == 5, r.report.table()
    rows = {"input_ids": _ids(8, seed=3, vocab=96, tokens=8).numpy()}  # batch 1 each
    assert lnfold.slice_onnx(model, rows, fraction=0.001).report.error < 1e-5  # (float32 model: its rounding)


@pytest.mark.slow
@pytest.mark.parametrize("form", ("qwen2", "mistral", "phi3", "torch-default-eps"))
def test_the_other_norm_classes_rotate_exactly(form):
    m, ids = Tiny(form).eval(), _ids()
    r = lnfold.fold_module(m, (ids,), rotate="hadamard")
    assert r.report.streams[0].rotation.startswith("rotated") and len(r.report.rms_norms) == 3
    if form == "torch-default-eps":  # eps=None: the input dtype's machine epsilon
        assert all(n.args[3] == torch.finfo(torch.float32).eps for n in _rms_nodes(r.module))


def test_a_layernorm_stream_and_an_rmsnorm_stream_both_rotate_in_onnx(tmp_path):
    """The same model exported by torch's TorchScript exporter (LayerNormalization; the RMSNorms written
    out with a Cast, Pow, ReduceMean, Add, Sqrt, Div(1, ·), Mul)."""
    import onnx
    import onnxruntime as ort

    m, ids = Mixed().eval(), _ids()
    path = tmp_path / "mixed.onnx"
    torch.onnx.export(m, (ids,), str(path), dynamo=False, opset_version=17, input_names=["ids"],
                      output_names=["logits"])
    model = onnx.load(path)
    r = lnfold.fold_onnx(model, rotate="hadamard")
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6)
    ln, rms = sorted(r.report.streams, key=lambda s: bool(s.rms))
    assert len(ln.norms) == 3 and ln.rotation.startswith("rotated"), ln.rotation
    assert len(rms.rms) == 3 and rms.rotation.startswith("rotated"), rms.rotation
    feeds = {"ids": ids.numpy()}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(r.model.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow
def test_a_t5_encoder_rotates_exactly_in_both_irs(tmp_path):
    """transformers' T5EncoderModel (T5LayerNorm: the mean square of the fp32 cast, the uncast x
    divided) under a head, in torch and through the TorchScript exporter (its dynamo export fails
    in torch's own decomposition)."""
    import onnx

    cfg = transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu")
    torch.manual_seed(0)
    encoder = transformers.T5EncoderModel(cfg).eval()
    _randomize(encoder)

    class Head(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m, self.head = m, torch.nn.Linear(64, 5)

        def forward(self, ids):
            return self.head(self.m(input_ids=ids).last_hidden_state)

    m, ids = Head(encoder).eval(), _ids(1, vocab=96, tokens=8)
    r = lnfold.fold_module(m, (ids,), rotate="hadamard")
    path = tmp_path / "t5.onnx"
    torch.onnx.export(m, (ids,), str(path), dynamo=False, opset_version=17, input_names=["input_ids"])
    o = lnfold.fold_onnx(onnx.load(path), rotate="hadamard")
    for res in (r, o):
        assert res.criterion == "float64" and res.exact_err <= max(2 * res.original_exact_err, 1e-6)
        (s,) = res.report.streams
        assert s.rotation.startswith("rotated (hadamard, d=64") and len(s.rms) == 5, res.report.table()


def test_center_embeddings_slices_as_the_module_whose_embedding_was_centered_by_hand():
    """slice_module's center_embeddings (SliceGPT's centering, NOT exact) is the slice of the module
    with each embedding row made zero-mean by hand; without it, another slice (the mean is 3)."""
    import copy

    m = Tiny("llama").double().eval()
    by_hand = copy.deepcopy(m)
    with torch.no_grad():
        by_hand.emb.weight.sub_(by_hand.emb.weight.mean(dim=-1, keepdim=True))
    cal, ids = (_ids(16, seed=3),), _ids(4, seed=9)
    kw = dict(fraction=0.25, per_block=True, full_width_head=True)
    centered = lnfold.slice_module(m, cal, center_embeddings=True, **kw)
    want = lnfold.slice_module(by_hand, cal, **kw).module(ids)
    assert float((centered.module(ids) - want).norm() / want.norm()) < 1e-9
    other = lnfold.slice_module(m, cal, **kw).module(ids)
    assert float((other - want).norm() / want.norm()) > 1e-3
    assert any("centered `" in n for n in centered.report.notes), centered.report.notes
