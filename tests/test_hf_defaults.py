"""Hugging Face models as users bring them (issue 16), through `fold_module` and the backend.

Default configs but for the sizes: key/value caches on (`use_cache=True`), `return_dict`, sdpa
attention, attention masks with padding, pooling heads; tiny, with adversarial weights
(lnfold.zoo). The backend also under dynamic shapes (`dynamic=True`, or a second input shape),
with and without its own verification. Every output leaf (logits, the cache's keys and values,
pooled outputs) is judged against eager with the gate of passes/gate.py (against a float64 run),
and the fold counts are the zoo's hand counts (tests/test_differential.py HAND). Tests that run
Inductor are marked slow.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch import nn
from torch.utils import _pytree as pytree

from lnfold import zoo
from lnfold.fx_rewrite import LnfoldError, fold_module, lnfold_backend_with
from lnfold.fx_rewrite import backend as backend_mod
from lnfold.fx_rewrite.api import judge_outputs, ref64
from lnfold.fx_rewrite.hf import fresh, register_caches

from .test_differential import HAND

V, W, H = zoo.V, zoo.W, zoo.H
TEXT = dict(vocab_size=V, hidden_size=W, num_hidden_layers=2, num_attention_heads=H, intermediate_size=4 * W,
            max_position_embeddings=64)
WHISPER = dict(vocab_size=V, d_model=W, encoder_layers=2, decoder_layers=2, encoder_attention_heads=H,
               decoder_attention_heads=H, encoder_ffn_dim=4 * W, decoder_ffn_dim=4 * W, num_mel_bins=16,
               max_source_positions=16, max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=0)

# name -> (the model with its config's defaults but for the sizes, the kind of input it takes)
DEFAULTS = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=W, n_head=H, vocab_size=V, n_positions=64, bos_token_id=0, eos_token_id=0)), "text"),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=V, hidden_size=W, num_hidden_layers=2, num_attention_heads=H, ffn_dim=4 * W,
        max_position_embeddings=64, word_embed_proj_dim=W)), "text"),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        hidden_size=W, num_hidden_layers=2, num_attention_heads=H, intermediate_size=4 * W, image_size=32,
        patch_size=8)), "image"),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(**TEXT)), "text"),
    "whisper": (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER)), "audio"),
}


def build(name: str) -> nn.Module:
    make, _ = DEFAULTS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo.adversarial(make())


def inputs(name: str, size: int = 9, batch: int = 2, seed: int = 0) -> tuple[tuple, dict]:
    """The inputs a user passes: ids with an attention mask (row 1 padded), pixels, or mel frames
    with decoder ids. `size` is the sequence length of text and decoder ids."""
    g = torch.Generator().manual_seed(seed)
    kind = DEFAULTS[name][1]
    if kind == "image":
        return (torch.randn(batch, 3, 32, 32, generator=g),), {}
    if kind == "audio":
        return (torch.randn(batch, 16, 32, generator=g),), {"decoder_input_ids": torch.randint(3, V, (batch, size),
                                                                                                generator=g)}
    mask = torch.ones(batch, size, dtype=torch.long)
    mask[1, size - 3:] = 0
    return (torch.randint(3, V, (batch, size), generator=g),), {"attention_mask": mask}


def counts(report) -> tuple[int, int, int]:
    return len(report.norms), report.folded, report.recentered


def judge(model: nn.Module, run, args: tuple, kwargs: dict):
    """`run`'s outputs against eager's, every leaf, with the gate (float64 reference)."""
    register_caches(model)  # so that pytree.tree_leaves sees the cache's tensors in the outputs
    with torch.no_grad():
        ref = model(*fresh(args), **fresh(kwargs))
        got = run(*fresh(args), **fresh(kwargs))
    assert type(got) is type(ref)
    for key in getattr(ref, "keys", list)():
        assert type(got[key]) is type(ref[key]), key  # the same ModelOutput fields, the same cache class
    ref_leaves, got_leaves = pytree.tree_leaves(ref), pytree.tree_leaves(got)
    assert all(isinstance(t, torch.Tensor) for t in ref_leaves)  # the caches were flattened
    verdict = judge_outputs(ref_leaves, got_leaves, ref64(model, args, kwargs, ref_leaves))
    assert verdict.ok, verdict.failure
    return verdict


def _eager(gm, example_inputs):
    return gm.forward


# --- fold_module --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_fold_module_with_default_config(name):
    """Caches on, return_dict, masks: the folded module returns the same output class and cache
    class with the same values (the gate), at the example's size and at another one."""
    model = build(name)
    args, kwargs = inputs(name)
    result = fold_module(model, args, kwargs)
    assert counts(result.report) == HAND[name]
    judge(model, result.module, args, kwargs)
    other = inputs(name, size=6, seed=1) if DEFAULTS[name][1] == "text" else inputs(name, batch=3, seed=1)
    judge(model, result.module, *other)


def test_a_cache_from_a_previous_step():
    """A decoding step: past_key_values (a DynamicCache, which grows in place whenever the model
    runs) as an input, through fold_module (the user's cache is left as it was) and the backend."""
    model = build("gpt2")
    args, kwargs = inputs("gpt2")
    with torch.no_grad():
        cache = model(*args, **kwargs).past_key_values
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    step = {"attention_mask": torch.cat([kwargs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1),
            "past_key_values": cache}
    nxt = (torch.randint(3, V, (2, 1), generator=torch.Generator().manual_seed(2)),)
    result = fold_module(model, nxt, step)
    assert counts(result.report) == HAND["gpt2"]
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert cache.get_seq_length() == 9 and all(torch.equal(a, b) for a, b in zip(before, after))
    judge(model, result.module, nxt, step)
    torch._dynamo.reset()
    backend_mod.reports.clear()
    judge(model, torch.compile(model, backend=lnfold_backend_with(inner=_eager, verify=True)), nxt, step)
    assert backend_mod.reports and all(counts(r) == HAND["gpt2"] for r in backend_mod.reports)


class ToyCache:
    """A cache class torch.export has never heard of."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsToyCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(11, 8), nn.LayerNorm(8)

    def forward(self, ids):
        h = self.emb(ids)
        return self.ln(h), ToyCache(h)


class Box:
    """Any other class torch.export has never heard of."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class TakesABox(ReturnsToyCache):
    def forward(self, ids, box):
        return self.ln(self.emb(ids) + box.t)


def test_type_export_cannot_flatten_is_one_line_error():
    ids = torch.randint(0, 11, (2, 5))
    with pytest.raises(LnfoldError, match=r"returns a .*ToyCache, a key/value cache .*'use_cache': False") as e:
        fold_module(ReturnsToyCache(), (ids,))
    assert "\n" not in str(e.value)
    with pytest.raises(LnfoldError, match=r"takes a .*Box, which torch.export cannot .*register_pytree_node") as e:
        fold_module(TakesABox(), (ids, Box(torch.zeros(8))))
    assert "\n" not in str(e.value)


# --- the backend ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_backend_with_default_config(name):
    """Dynamo's graphs of the default models fold as the hand count says (Whisper's decoder reads
    its position table as `weight[position_ids]`: a row gather, centered, not recentered), and
    the compiled model returns eager's outputs. The folded graph runs eagerly here; Inductor
    runs in the slow tests below."""
    model = build(name)
    args, kwargs = inputs(name)
    torch._dynamo.reset()
    backend_mod.reports.clear()
    compiled = torch.compile(model, backend=lnfold_backend_with(inner=_eager, verify=True))
    judge(model, compiled, args, kwargs)
    assert backend_mod.reports and all(counts(r) == HAND[name] for r in backend_mod.reports)


def test_backend_verifies_and_folds_under_dynamic_shapes():
    """`dynamic=True` with lnfold.verify: the graph takes symbolic sizes (verified at their hints,
    the sizes at hand) and reads each LayerNorm's eps through `.item()` of a 0-d input that
    Dynamo specialized (a number to the analysis, not an unknown: every norm folds)."""
    model = build("gpt2")
    torch._dynamo.reset()
    backend_mod.reports.clear()
    compiled = torch.compile(model, backend=lnfold_backend_with(inner=_eager, verify=True), dynamic=True)
    for size in (9, 13):
        judge(model, compiled, *inputs("gpt2", size=size, seed=size))
    assert backend_mod.reports and all(counts(r) == HAND["gpt2"] for r in backend_mod.reports)


def test_backend_verifies_with_an_unbacked_batch_size():
    """`mark_unbacked`: the graph's batch size is a symbol without a hint; verification reads its
    value off the example tensor that carries it."""
    model = build("vit")
    (pixels,), _ = inputs("vit")
    torch._dynamo.decorators.mark_unbacked(pixels, 0)
    torch._dynamo.reset()
    backend_mod.reports.clear()
    compiled = torch.compile(model, backend=lnfold_backend_with(inner=_eager, verify=True))
    with torch.no_grad():
        got = compiled(pixels)
    assert backend_mod.reports and all(counts(r) == HAND["vit"] for r in backend_mod.reports)
    judge(model, lambda px: got, (pixels,), {})


SHAPES = {"gpt2": [dict(size=9), dict(size=13, seed=1)], "vit": [dict(batch=2), dict(batch=3, seed=1)]}


@pytest.mark.slow
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("how", ["dynamic", "second-shape"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_readme_backend_snippet_under_dynamic_shapes(name, how, verify):
    """The README's `torch.compile(model, backend="lnfold", options={"lnfold.mode": "rms",
    "lnfold.verify": ...})` through Inductor, with `dynamic=True` or a second input shape (which
    recompiles with dynamic sizes): eager's outputs at both shapes, every graph folded."""
    model = build(name)
    torch._dynamo.reset()
    backend_mod.reports.clear()
    compiled = torch.compile(model, backend="lnfold", dynamic=True if how == "dynamic" else None,
                             options={"lnfold.mode": "rms", "lnfold.verify": verify})
    for shape in SHAPES[name]:
        judge(model, compiled, *inputs(name, **shape))
    assert backend_mod.reports and all(counts(r) == HAND[name] for r in backend_mod.reports)


def test_backend_keeps_the_reports_of_the_last_graphs_only():
    """A process that keeps compiling does not keep every report and timing forever."""
    graphs = []
    torch._dynamo.reset()
    model = build("vit")
    args, _ = inputs("vit")
    torch.compile(model, backend=lambda gm, ex: graphs.append((gm, ex)) or gm.forward)(*args)
    gm, example = graphs[0]
    seen = []
    for _ in range(backend_mod.KEPT + 3):
        backend_mod.compile_folded(gm, example, inner=_eager, on_report=seen.append)
    assert len(backend_mod.reports) == len(backend_mod.timings) == backend_mod.KEPT
    assert backend_mod.reports[-1] is seen[-1] and backend_mod.reports[0] is seen[3]
