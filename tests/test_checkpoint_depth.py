"""Issue 25: a checkpoint's plan made on a shallow copy of its model (passes/depth.py) is the plan
of the whole model, and where the copy cannot stand for the model the whole model is planned.

The reference is `_plan_of` on the full-depth model (every block exported): the extended plan
must be equal to it in every edit, tie, norm and line of the report, for real `transformers`
architectures of several kinds (tied and untied heads, Conv1D, parallel residual, a stream that
is kept). passes/depth.py's own refusals are tested on hand-made items.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lnfold.passes.depth import LayerStack, NotExtensible
from lnfold.passes.edits import Center, Scale
from lnfold.passes.report import NormVerdict, Report, StreamEdits, requoted
from lnfold.passes.shards import TensorJob

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lnfold.fx_rewrite import checkpoint as ckpt  # noqa: E402

LAYERS = 7

CONFIGS = {
    "opt": lambda: transformers.OPTConfig(vocab_size=61, hidden_size=32, num_hidden_layers=LAYERS, ffn_dim=64,
                                          num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=32),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=61, hidden_size=32, num_hidden_layers=LAYERS,
                                                   num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=32, tie_word_embeddings=False),
    "bloom": lambda: transformers.BloomConfig(vocab_size=61, hidden_size=32, n_layer=LAYERS, n_head=4),
}


def checkpoint(folder: Path, name: str):
    cfg = CONFIGS[name]()
    cls = ckpt.model_class(cfg) if cfg.architectures else getattr(transformers, {
        "opt": "OPTForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
        "bloom": "BloomForCausalLM"}[name])
    torch.manual_seed(0)
    cls(cfg).save_pretrained(folder, max_shard_size="40KB")
    return ckpt.read_checkpoint(folder)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_shallow_plan_extended_is_the_whole_models_plan(tmp_path, name):
    ck = checkpoint(tmp_path / name, name)
    extended = ckpt.plan_checkpoint(ck)
    assert extended.traced.startswith(f"4 of {LAYERS} blocks"), extended.traced
    whole = ckpt._plan_of(ckpt.skeleton(ck.config), ck, "rms")
    assert whole.traced == "every block"
    assert extended.in_place == whole.in_place
    assert extended.new == whole.new and extended.untied == whole.untied
    assert extended.norms == whole.norms and extended.stored == whole.stored
    assert extended.report.to_dict() == whole.report.to_dict()
    assert len(extended.report.norms) == 2 * LAYERS + (2 if name == "bloom" else 1)


def test_a_per_block_setting_in_the_config_plans_every_block(tmp_path):
    ck = checkpoint(tmp_path / "opt", "opt")
    ck.config.lnfold_test_window = [4] * LAYERS  # (as a sliding-window list would)
    assert ckpt.repeated_blocks(ckpt.skeleton(ck.config), ck.config) is None
    assert ckpt.plan_checkpoint(ck).traced == "every block"


def test_blocks_that_differ_in_shape_plan_every_block(tmp_path, monkeypatch):
    ck = checkpoint(tmp_path / "opt", "opt")
    model = ckpt.skeleton(ck.config)
    shallow = ckpt.skeleton(ckpt.with_depth(ck.config, 4))
    assert ckpt.same_blocks(model, shallow, "model.decoder.layers")
    layer = model.model.decoder.layers[3]
    layer.fc1 = torch.nn.Linear(32, 48, device="meta")  # one middle block unlike the others
    assert not ckpt.same_blocks(model, shallow, "model.decoder.layers")


# --- passes/depth.py on hand-made items ----------------------------------------------------------------------

B = LayerStack("model.decoder.layers", depth=6)


def verdict(block: int, reason: str = "") -> NormVerdict:
    return NormVerdict(f"model.decoder.layers.{block}.ln", "fold", reason, stream=0)


def test_blocks_extend_in_order_and_rename_every_spelling():
    items = {"model.embed.weight": (Center(1),), **{
        f"decoder.layers.{k}.fc2.weight": (Center(0),) for k in range(4)}}  # (a file without the `model.` prefix)
    assert list(B.extend_edits(items)) == ["model.embed.weight"] + [f"decoder.layers.{k}.fc2.weight" for k in range(6)]
    assert requoted("`model.decoder.layers.12.fc2` reads `decoder.layers.12.x` of layers.12", lambda n: B.moved(n, 3)) \
        == "`model.decoder.layers.3.fc2` reads `decoder.layers.3.x` of layers.12"  # (names only: what is quoted)
    assert B.block("model.decoder.layers.1x") is None and B.block("xmodel.decoder.layers.1.a") is None


def test_every_name_an_item_holds_is_moved_and_nothing_else():
    """An edit's other constants (a LayerScale folded into its source), a new tensor's source, a
    norm's reason: each record renames what it names."""
    scaled = lambda k: (f"model.decoder.layers.{k}.fc2.weight",  # noqa: E731
                        (Scale(f"model.decoder.layers.{k}.ls", 0, 0), Center(0)))
    assert list(B.extend_edits(dict(scaled(k) for k in range(4))).items()) == [scaled(k) for k in range(6)]
    jobs = [TensorJob(f"model.decoder.layers.{k}.b", f"model.decoder.layers.{k}.a") for k in range(4)]
    assert B.extend(jobs)[4] == TensorJob("model.decoder.layers.4.b", "model.decoder.layers.4.a")
    assert B.extend([verdict(k, f"reads `model.decoder.layers.{k}.x` (not layers.3)") for k in range(4)])[5] == \
        verdict(5, "reads `model.decoder.layers.5.x` (not layers.3)")


def test_middle_blocks_planned_differently_are_not_extended():
    with pytest.raises(NotExtensible, match="not planned alike"):
        B.extend([verdict(0), verdict(1), verdict(2, "kept: something in block 2 only"), verdict(3)])
    with pytest.raises(NotExtensible, match="not planned alike"):
        B.extend([verdict(0), verdict(1), verdict(3)])  # (block 2 has no norm where block 1 has one)


def test_an_item_naming_two_blocks_is_not_extended():
    with pytest.raises(NotExtensible, match=r"blocks \[1, 2\]"):
        B.extend([verdict(1, "reads `model.decoder.layers.2.x`")])


def test_a_stream_inside_one_block_is_not_extended():
    r = Report(norms=[verdict(k) for k in range(4)],
               streams=[StreamEdits(norms=[f"model.decoder.layers.{k}.ln" for k in range(4)]),
                        StreamEdits(norms=["model.decoder.layers.1.q_norm"], centered=["`model.decoder.layers.1.q`"])])
    with pytest.raises(NotExtensible, match="inside one block"):
        B.extend_report(r)
    r.streams.pop()
    assert [v.name for v in B.extend_report(r).norms] == [f"model.decoder.layers.{k}.ln" for k in range(6)]
