"""Padded positions in verification (issue 45 item 2): an ALBERT sliced on real calibration rows
whose attention_mask is 0 on padding was refused for error that sat at the masked positions alone.
Positions a mask zeroes are not outputs a user reads: the gate judges the others and the verdict
says so (onnx_rewrite/masks.py), while a difference at a real position is still refused.

Each model is checked against itself with one Add more at its output, which moves only the padded
positions (or, planted, only the real ones): a deterministic stand-in for a fold's rounding there."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import lnfold
from lnfold.onnx_rewrite import masks, verify
from tests.onnx_graphs import D, T, VOCAB, Builder


def attention_model() -> onnx.ModelProto:
    """ids, attention_mask [batch, T] -> embeddings -> one attention whose scores get (1 - mask) x
    -1e4 (BERT's additive mask) -> residual -> linear -> LayerNorm: hidden [batch, T, D]."""
    b = Builder(11)
    ids = b.input("input_ids", TensorProto.INT64, ["batch", T])
    mask = b.input("attention_mask", TensorProto.INT64, ["batch", T])
    h = b.embed(ids)
    scores = b.op("MatMul", [b.op("MatMul", [h, b.weight("Wq", (D, D), scale=0.2)]),
                             b.op("Transpose", [h], perm=[0, 2, 1])])
    keep = b.op("Unsqueeze", [b.op("Cast", [mask], to=TensorProto.FLOAT), b.const("ax", np.array([1], np.int64))])
    bias = b.op("Mul", [b.op("Sub", [b.const("one", np.float32(1.0)), keep]), b.const("neg", np.float32(-1e4))])
    attn = b.op("MatMul", [b.op("Softmax", [b.op("Add", [scores, bias])], axis=-1), h])
    out = b.layernorm(b.linear(b.op("Add", [h, attn]), D, D))
    b.output(out, shape=["batch", T, D])
    return b.model(17)


def padded_rows() -> dict:
    rng = np.random.default_rng(2)
    ids = rng.integers(1, VOCAB, (3, T)).astype(np.int64)
    mask = np.ones((3, T), np.int64)
    mask[0, 3:], mask[2, 1:] = 0, 0  # two padded rows
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def moved_where(model: onnx.ModelProto, padded: bool, by: float = 0.05) -> onnx.ModelProto:
    """`model` with its first output moved by `by` (relative to ~1) at the padded positions (or the real
    ones): output + by * (1 - mask or mask)[..., None]."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g, out = m.graph, m.graph.output[0].name
    mask = next(i.name for i in g.input if "mask" in i.name)
    inner = f"{out}__before_move"
    for n in g.node:
        n.output[:] = [inner if o == out else o for o in n.output]
        n.input[:] = [inner if i == out else i for i in n.input]
    g.initializer.extend([helper.make_tensor("move_one", TensorProto.FLOAT, [], [1.0]),
                          helper.make_tensor("move_by", TensorProto.FLOAT, [], [by]),
                          helper.make_tensor("move_ax", TensorProto.INT64, [1], [-1])])
    g.node.extend([
        helper.make_node("Cast", [mask], ["move_m"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["move_one", "move_m"], ["move_pad"]),
        helper.make_node("Unsqueeze", ["move_pad" if padded else "move_m", "move_ax"], ["move_w"]),
        helper.make_node("Mul", ["move_w", "move_by"], ["move_d"]),
        helper.make_node("Add", [inner, "move_d"], [out])])
    return m


def test_the_mask_is_recognized_by_what_it_does():
    model, rows = attention_model(), padded_rows()
    name, keep = masks.padding_mask(model, rows)
    assert name == "attention_mask" and keep.sum() == 3 * T - 2 - (T - 1)
    # the ids reach the scores too, but as a table's indices; a mask of ones zeroes nothing
    assert masks.padding_mask(model, {**rows, "attention_mask": np.ones((3, T), np.int64)}) is None


def test_a_difference_at_padded_positions_alone_is_not_judged_and_said():
    model, rows = attention_model(), padded_rows()
    verdict = verify.check(model, moved_where(model, padded=True), inputs=rows)
    assert verdict.ok, verdict.failure  # before issue 45: refused, the padded positions 0.05 away
    assert "positions `attention_mask` zeroes (6 of 15) are padding" in verdict.criterion, verdict.criterion
    assert "judged on the 9 positions it keeps" in verdict.criterion
    # planted: the same difference at the real positions is refused
    assert not verify.check(model, moved_where(model, padded=False), inputs=rows).ok


def test_the_fold_on_padded_rows_says_what_it_judged():
    model, rows = attention_model(), padded_rows()
    result = lnfold.fold_onnx(model, inputs=rows)
    assert result.verdict.ok and "are padding" in result.criterion
    assert "are padding" not in lnfold.fold_onnx(model).criterion  # made-up inputs: nothing masked


@pytest.mark.slow
def test_albert_on_padded_rows(tmp_path):
    """A tiny ALBERT (one layer applied twice) exported by torch's TorchScript exporter: transformers'
    own mask path (Cast, Flatten, Gather of the mask as data, Where, And, Expand) is recognized,
    a move at the padded positions alone passes and is said, one at the real ones is refused, and a
    slice on the padded rows is verified."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(vocab_size=50, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    m = transformers.AlbertModel(cfg).eval()
    ids = torch.randint(1, 50, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, 5:], mask[2, 2:] = 0, 0
    ids[mask == 0] = 0
    path = tmp_path / "albert.onnx"
    torch.onnx.export(m, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state", "pooler_output"], dynamo=False, opset_version=17,
                      dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}})
    model = onnx.load(str(path))
    rows = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    assert masks.padding_mask(model, rows)[0] == "attention_mask"
    verdict = verify.check(model, moved_where(model, padded=True), inputs=rows)
    assert verdict.ok and "zeroes (9 of 32)" in verdict.criterion and "last_hidden_state judged" in verdict.criterion
    assert "pooler_output" not in verdict.criterion.split("are padding")[1]  # [batch, hidden]: judged whole
    assert not verify.check(model, moved_where(model, padded=False), inputs=rows).ok
    sliced = lnfold.slice_onnx(model, rows, fraction=0.25)
    assert "are padding" in sliced.exact.criterion and sliced.report.params_after < sliced.report.params_before
