"""fold_to_rmsnorm: the user's own module, its folded LayerNorms plain torch.nn.RMSNorm modules,
verified against float64, saved and loaded the ways users save and load (issue 22, items 4-5).

Weights are adversarial (lnfold.zoo: randomized γ/β, sources with a large mean), so a missed
centering or a β left behind changes the outputs; a planted bug shows verification refuses it.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import lnfold
from lnfold import zoo
from lnfold.fx_rewrite import VerificationError
from lnfold.fx_rewrite import handoff as handoff_mod

from .conftest import missing_one_centering

transformers = pytest.importorskip("transformers")


def _opt():
    cfg = transformers.OPTConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64,
                                 attn_implementation="eager")
    torch.manual_seed(0)
    m = zoo.adversarial(transformers.OPTForCausalLM(cfg))
    return zoo.Logits(m, "logits").eval(), (torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0)),)


def _vit():
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                 image_size=32, patch_size=8, num_labels=10, attn_implementation="eager")
    torch.manual_seed(0)
    m = zoo.adversarial(transformers.ViTForImageClassification(cfg))
    return zoo.Logits(m, "logits").eval(), (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


BUILDERS = {"gpt2": zoo.gpt2, "opt": _opt, "vit": _vit}


@functools.lru_cache(maxsize=None)
def handed_off(name: str, rotate=None):
    """(hand-off result, original copy, args), one fold per architecture and rotation for every test."""
    module, args = BUILDERS[name]()
    original = copy.deepcopy(module)
    return lnfold.fold_to_rmsnorm(module, args, rotate=rotate), original, args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()


def _class_named_rmsnorm(model: nn.Module) -> list[str]:
    """How ModelOpt and SpinQuant find a model's norms: by class name."""
    return [n for n, m in model.named_modules() if "RMSNorm" in type(m).__name__]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,rotate", [pytest.param("gpt2", None, marks=SLOW), ("gpt2", "hadamard"), ("opt", "hadamard"),
                                         ("vit", "hadamard"), pytest.param("opt", None, marks=SLOW),
                                         pytest.param("vit", None, marks=SLOW),
                                         pytest.param("opt", "orthogonal", marks=SLOW)])
def test_handoff_is_the_users_module_with_plain_rmsnorms_and_exact(name, rotate):
    result, original, args = handed_off(name, rotate)
    module, hf = result.module, result.module.model
    assert type(hf) is type(original.model)  # the user's own class (and object: folded in place)
    assert result.criterion == "float64" and result.exact_err <= max(2 * result.original_exact_err, 1e-6)
    with torch.no_grad():
        assert _rel(original(*args), module(*args)) < 1e-5
    found = _class_named_rmsnorm(module)
    assert found == result.handoff.rmsnorm and len(found) == 5  # every LayerNorm of these Pre-LN models
    assert all(type(module.get_submodule(n)) is nn.RMSNorm for n in found)
    assert not [m for m in module.modules() if isinstance(m, nn.LayerNorm)]
    # elementwise_affine, with a unit weight: γ moved into the readers
    assert all(torch.equal(module.get_submodule(n).weight, torch.ones(64)) for n in found)
    assert hf.config.rms_norm_eps == result.handoff.eps[found[0]]
    assert hf.config.lnfold["rmsnorm"] == [n.removeprefix("model.") for n in found]
    # β went into the readers: a bias-free reader got one (GPT-2's and OPT's lm_head; ViT's classifier has one)
    assert ("model.lm_head" in result.handoff.new_biases) == (name != "vit")
    streams = [s.rotation for s in result.report.streams]
    assert all(s.startswith("rotated") and rotate in s for s in streams) if rotate else not any(streams)
    assert hf.config.lnfold["rotation"] == (rotate and {"kind": rotate, "seed": 0})


def test_a_tie_the_fold_breaks_is_said_and_not_restored_on_load():
    result, original, _ = handed_off("gpt2", "hadamard")
    hf = result.module.model
    assert original.model.lm_head.weight is original.model.transformer.wte.weight
    assert hf.lm_head.weight is not hf.transformer.wte.weight  # wte centered, lm_head not
    assert result.handoff.untied == ["model.transformer.wte.weight / model.lm_head.weight: the fold makes them "
                                     "differ (each holds its own tensor now)"]
    assert hf.config.tie_word_embeddings is False


def test_save_pretrained_from_pretrained_and_state_dict_round_trips(tmp_path):
    result, _, args = handed_off("gpt2", "hadamard")
    module = result.module
    with torch.no_grad():
        want = module(*args)
    module.model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    lnfold.restore_rmsnorm(loaded)  # the one documented call after from_pretrained
    assert _class_named_rmsnorm(loaded) == [n.removeprefix("model.") for n in result.handoff.rmsnorm]
    with torch.no_grad():
        assert torch.equal(zoo.Logits(loaded.eval(), "logits")(*args), want)
    # state_dict: a model built from the saved config, restored, loads it strictly
    state = module.model.state_dict()
    torch.save(state, tmp_path / "state.pt")
    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(tmp_path,
                                                                                 attn_implementation="eager"))
    lnfold.restore_rmsnorm(fresh)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt"), strict=True)
    with torch.no_grad():
        assert torch.equal(zoo.Logits(fresh.eval(), "logits")(*args), want)


def test_torch_dynamic_quantization_takes_the_handoff():
    """One real torch quantizer on the result (not exact: int8 weights; the error is said, not hidden)."""
    result, original, args = handed_off("opt", "hadamard")
    q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(result.module), {nn.Linear}, dtype=torch.qint8)
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in q.modules())
    assert len(_class_named_rmsnorm(q)) == 5
    with torch.no_grad():
        err = _rel(original(*args), q(*args))
    assert 0 < err < 0.2, err


def test_a_planted_bug_is_refused_and_the_module_restored(monkeypatch):
    module, args = _opt()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        want = module(*args)
    monkeypatch.setattr(handoff_mod, "make_plan", missing_one_centering(handoff_mod.make_plan))
    with pytest.raises(VerificationError):
        lnfold.fold_to_rmsnorm(module, args)
    after = module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert module.model.lm_head.weight is module.model.model.decoder.embed_tokens.weight  # the tie is back
    assert not _class_named_rmsnorm(module) and not hasattr(module.model.config, "lnfold")
    with torch.no_grad():
        assert torch.equal(module(*args), want)


@pytest.mark.slow
def test_a_norm_whose_beta_cannot_move_stays_a_layernorm_with_the_reason():
    module, args = zoo.vit()  # ViTModel: the final norm's output is the model's output
    result = lnfold.fold_to_rmsnorm(module, args)
    assert list(result.handoff.kept) == ["model.layernorm"]
    assert "is a graph output" in result.handoff.kept["model.layernorm"]
    assert isinstance(module.model.layernorm, nn.LayerNorm) and len(result.handoff.rmsnorm) == 4


def _one_rotation_dropped(make_plan):
    """`make_plan` with a planted bug: the rotation of one constant (a reader's or a writer's) is left out."""
    from dataclasses import replace

    from lnfold.passes.edits import Project

    def sabotaged(view, request):
        plan = make_plan(view, request)
        edits = list(plan.const_edits)
        k = max(i for i, e in enumerate(edits) if any(isinstance(op, Project) for op in e.ops))
        edits[k] = replace(edits[k], ops=tuple(op for op in edits[k].ops if not isinstance(op, Project)))
        return replace(plan, const_edits=edits)

    return sabotaged


def test_a_constant_left_unrotated_is_refused(monkeypatch):
    module, args = _opt()
    monkeypatch.setattr(handoff_mod, "make_plan", _one_rotation_dropped(handoff_mod.make_plan))
    with pytest.raises(VerificationError):
        lnfold.fold_to_rmsnorm(module, args, rotate="hadamard")
    assert not _class_named_rmsnorm(module)


def test_keep_ln_rotations_are_fold_modules():
    module, args = _opt()
    with pytest.raises(lnfold.LnfoldError, match="keeps the LayerNorms"):
        lnfold.fold_to_rmsnorm(module, args, rotate="hadamard-keep-ln")


@pytest.mark.slow
def test_a_stream_that_would_need_an_unrotating_matmul_stays_unrotated():
    module, args = zoo.vit()  # the final norm keeps γ (its output is the model's): fold_module un-rotates it
    result = lnfold.fold_to_rmsnorm(module, args, rotate="hadamard")  # an nn.RMSNorm cannot: not rotated
    (stream,) = [s.rotation for s in result.report.streams]
    assert stream.startswith("not rotated") and "un-rotated by a constant MatMul" in stream
    assert result.criterion == "float64" and len(result.handoff.rmsnorm) == 4
