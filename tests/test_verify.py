"""Verification on the models users have (issue 10): inputs made up from the graph, user inputs
and dims, and the float64 gate (passes/gate.py) in both frontends.

The graphs reproduce the failures of real exports by hand: Optimum's decoder signature (shared
symbolic dims, `past_sequence_length + sequence_length` masks, past key/values), learned
positions indexed by a computed Range (past + seq must stay inside the table), a conv stem whose
channel dim is symbolic. Each used to fail with "cannot verify"; each now verifies.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from lnfold.onnx_rewrite import fold_model
from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.onnx_rewrite.verify import compare
from lnfold.passes import LnfoldError, VerificationError, gate
from tests import onnx_graphs as G
from tests.conftest import missing_one_centering

D, HEADS, HD, V = 8, 2, 4, 13
BATCH, SEQ, PAST = "batch_size", "sequence_length", "past_sequence_length"


def decoder(positions: str = "input", table: int = 8, emb_mean: float = 4.0, emb_scale: float = 0.5,
            seed: int = 0) -> onnx.ModelProto:
    """A one-block Pre-LN decoder with Optimum's signature: input_ids, attention_mask
    [batch, past + seq], position_ids (positions="input") or positions computed from the past
    length by a Range (positions="computed"), past_key_values.0.key/value; logits and present.*."""
    b = G.Builder(seed)
    ids = b.input("input_ids", TensorProto.INT64, [BATCH, SEQ])
    mask = b.input("attention_mask", TensorProto.INT64, [BATCH, f"{PAST} + {SEQ}"])
    pk = b.input("past_key_values.0.key", TensorProto.FLOAT, [BATCH, HEADS, PAST, HD])
    pv = b.input("past_key_values.0.value", TensorProto.FLOAT, [BATCH, HEADS, PAST, HD])
    wte = b.weight("wte", (V, D), mean=emb_mean, scale=emb_scale)
    wpe = b.weight("wpe", (table, D), mean=-emb_mean / 2, scale=emb_scale)
    if positions == "input":
        pos_ids = b.input("position_ids", TensorProto.INT64, [BATCH, SEQ])
    else:
        past_len = b.op("Gather", [b.op("Shape", [pk]), b.const("two", np.array(2, np.int64))], axis=0)
        seq_len = b.op("Gather", [b.op("Shape", [ids]), b.const("one", np.array(1, np.int64))], axis=0)
        pos_ids = b.op("Range", [past_len, b.op("Add", [past_len, seq_len]), b.const("step", np.array(1, np.int64))])
    h = b.op("Add", [b.op("Gather", [wte, ids], axis=0), b.op("Gather", [wpe, pos_ids], axis=0)])

    n = b.layernorm(h)
    heads = b.const("heads", np.array([0, 0, HEADS, HD], np.int64))

    def split(x):
        return b.op("Transpose", [b.op("Reshape", [x, heads])], perm=[0, 2, 1, 3])

    q, k, v = (split(b.linear(n, D, D)) for _ in range(3))
    k_all = b.op("Concat", [pk, k], axis=2)
    v_all = b.op("Concat", [pv, v], axis=2)
    scores = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k_all], perm=[0, 1, 3, 2])]),
                          b.const("scale", np.array(HD ** -0.5, np.float32))])
    m = b.op("Cast", [b.op("Unsqueeze", [mask, b.const("axes", np.array([1, 2], np.int64))])], to=TensorProto.FLOAT)
    bias = b.op("Mul", [b.op("Sub", [b.const("one_f", np.array(1.0, np.float32)), m]),
                        b.const("neg", np.array(-1e4, np.float32))])
    probs = b.op("Softmax", [b.op("Add", [scores, bias])], axis=-1)
    ctx = b.op("Reshape", [b.op("Transpose", [b.op("MatMul", [probs, v_all])], perm=[0, 2, 1, 3]),
                           b.const("merge", np.array([0, 0, D], np.int64))])
    h = b.op("Add", [h, b.linear(ctx, D, D)])
    logits = b.op("MatMul", [b.layernorm(h), b.weight("lm_head", (D, V))])
    b.output(logits, shape=[BATCH, SEQ, V])
    b.outputs.append(onnx.helper.make_tensor_value_info(k_all, TensorProto.FLOAT, None))
    b.outputs.append(onnx.helper.make_tensor_value_info(v_all, TensorProto.FLOAT, None))
    return b.model(17)


def conv_stem(patches: int = 9) -> onnx.ModelProto:
    """pixel_values [batch, channels, height, width], all symbolic: a 2x2 patch conv over 3
    channels, flattened to tokens, plus a position table of `patches` rows (fixing the side)."""
    b = G.Builder(1)
    x = b.input("pixel_values", TensorProto.FLOAT, ["batch", "num_channels", "height", "width"])
    y = b.op("Conv", [x, b.weight("patch", (D, 3, 2, 2)), b.weight("patch_b", (D,), mean=3.0)],
             kernel_shape=[2, 2], strides=[2, 2])
    tokens = b.op("Transpose", [b.op("Reshape", [y, b.const("flat", np.array([0, D, -1], np.int64))])], perm=[0, 2, 1])
    h = b.op("Add", [tokens, b.weight("pos", (1, patches, D), mean=-2.0)])
    h = b.block(h)
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 3))]), shape=None)
    return b.model(17)


def _old_made_up_inputs_fail(model: onnx.ModelProto, needle: str, sum_dims: bool = False) -> None:
    """What the old verification did: every dynamic dim 7 (batch 2), random ids below the table
    a direct Gather bounds (`sum_dims`: and a 'past + seq' dim 14, so that the mask fits). It
    fails on these graphs, with the issue's message."""
    from lnfold.onnx_rewrite.verify import session

    sess = session(model)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 2 if d.lower().startswith(("batch", "n", "b"))
                 else 14 if sum_dims and "+" in d else 7 for d in i.shape]
        feeds[i.name] = (rng.integers(0, 8, shape) if i.type == "tensor(int64)" else rng.standard_normal(shape)) \
            .astype(np.int64 if i.type == "tensor(int64)" else np.float32)
    with pytest.raises(Exception, match=needle):
        sess.run(None, feeds)


# --- input synthesis -----------------------------------------------------------------------------

def test_optimum_decoder_signature_verifies():
    """past_sequence_length is shared by the past key/values and the mask's
    'past_sequence_length + sequence_length'; the old sizes broke the mask Add."""
    model = decoder("input")
    _old_made_up_inputs_fail(model, "Add")
    res = fold_model(model)
    assert res.report.folded == 2 and res.criterion == "float64"
    assert res.exact_err <= 2 * res.original_exact_err + gate.FLOOR["float32"]


def test_computed_positions_stay_inside_the_table():
    """Positions = Range(past, past + seq) into an 8-row table: the old sizes (7 + 7) index past
    its end ("Gather ... indices element out of data bounds, idx=14" in the issue; onnxruntime
    does not always check); the made-up sizes keep past + seq <= 8."""
    from lnfold.onnx_rewrite import inputs as synth

    model = decoder("computed", table=8)
    assert synth.facts(model).length_limit == 8
    _, feeds = next(synth.candidates(model))
    past, seq = feeds["past_key_values.0.key"].shape[2], feeds["input_ids"].shape[1]
    assert past >= 1 and past + seq <= 8 and feeds["attention_mask"].shape[1] == past + seq
    res = fold_model(model)
    assert res.report.folded == 2 and res.criterion == "float64"


def test_symbolic_channel_conv_verifies():
    """The conv's weight fixes the channels (3, not a made-up 7) and the position table's 9 rows
    the image side (6 = 2 x 3 patches)."""
    model = conv_stem()
    _old_made_up_inputs_fail(model, "Conv|kernel channels|Add|broadcast")
    res = fold_model(model)
    assert res.report.folded == 2 and res.criterion == "float64"


def test_unrunnable_model_names_the_op_and_the_input(tmp_path, capsys):
    """A fixed Reshape that needs batch x seq = 6: no made-up size fits; the error says which
    op failed and which input reaches it, and points at --dim / --inputs, which fix it."""
    b = G.Builder(2)
    x = b.input("hidden", TensorProto.FLOAT, ["batch", "seq", D])
    h = b.op("Reshape", [b.linear(x, D, D), b.const("shape", np.array([2, 3, D], np.int64))])
    h = b.block(h)
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 3))]), shape=None)
    src = G.save_model(b.model(17), tmp_path / "m.onnx")
    with pytest.raises(LnfoldError, match=r"cannot verify.*Reshape `.*` \(reached from input hidden\).*--dim"):
        fold_model(onnx.load(str(src)))
    assert cli_main(["fold", str(src), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Reshape" in err[0] and "--inputs" in err[0]
    assert cli_main(["fold", str(src), "-o", str(tmp_path / "o.onnx"), "--dim", "seq=3"]) == 0
    assert fold_model(onnx.load(str(src)), dims={"seq": 3}).report.folded == 2


# --- user inputs and dims --------------------------------------------------------------------------

def _decoder_feeds(seq: int = 3, past: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "input_ids": rng.integers(0, V, (1, seq)).astype(np.int64),
        "attention_mask": np.ones((1, past + seq), np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
        "past_key_values.0.key": rng.standard_normal((1, HEADS, past, HD)).astype(np.float32),
        "past_key_values.0.value": rng.standard_normal((1, HEADS, past, HD)).astype(np.float32),
    }


def test_inputs_npz_and_dims(tmp_path, capsys):
    src = G.save_model(decoder("input"), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **_decoder_feeds())
    assert cli_main(["fold", str(src), "-o", str(tmp_path / "a.onnx"), "--inputs", str(tmp_path / "in.npz")]) == 0
    assert "error vs float64" in capsys.readouterr().out
    assert cli_main(["fold", str(src), "-o", str(tmp_path / "b.onnx"), "--dim", "sequence_length=2",
                     "--dim", "past_sequence_length=4", "--dim", "batch_size=1"]) == 0
    res = fold_model(onnx.load(str(src)), inputs=_decoder_feeds(), dims=None)
    assert res.report.folded == 2 and res.exact_err is not None
    assert fold_model(onnx.load(str(src)), inputs=str(tmp_path / "in.npz")).report.folded == 2


@pytest.mark.parametrize("args, needle", [
    (["--dim", "sequence_length"], "NAME=SIZE"),
    (["--dim", "sequence_length=0"], "positive integer"),
    (["--dim", "nonsense=3"], "not a symbolic dim"),
    (["--inputs", "missing.npz"], "no such inputs file"),
    (["--inputs", "garbage.npz"], "not a readable .npz"),
    (["--inputs", "wrong_name.npz"], "is not an input"),
    (["--inputs", "short.npz"], "missing position_ids"),
    (["--inputs", "wrong_dtype.npz"], "the model takes int64"),
])
def test_bad_inputs_and_dims_are_one_line_errors(tmp_path, capsys, monkeypatch, args, needle):
    src = G.save_model(decoder("input"), tmp_path / "m.onnx")
    feeds = _decoder_feeds()
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "wrong_name.npz", **feeds, extra=np.zeros(1))
    np.savez(tmp_path / "short.npz", **{k: v for k, v in feeds.items() if k != "position_ids"})
    np.savez(tmp_path / "wrong_dtype.npz", **{**feeds, "input_ids": feeds["input_ids"].astype(np.float32)})
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli_main(["fold", "m.onnx", "-o", "out.onnx", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lnfold: error:") and needle in err[0], err
    assert not (tmp_path / "out.onnx").exists()


# --- the gate -------------------------------------------------------------------------------------

def _precise_decoder():
    """Learned positions and embeddings with a mean far above their spread: the original's
    fp32 LayerNorm cancels digits (error vs float64 > 1e-4), the folded model does not."""
    return decoder("input", emb_mean=2000.0, emb_scale=0.1, seed=3)


def test_gate_passes_a_fold_more_exact_than_the_original():
    model = _precise_decoder()
    res = fold_model(model)
    assert res.criterion == "float64"
    assert res.original_exact_err > 1e-4  # the original is this far from exact arithmetic,
    assert res.exact_err < res.original_exact_err / 10  # the fold much closer,
    assert res.max_rel_err > 1e-4  # and a fixed 1e-4 between the two would have refused it
    assert compare(model, res.model)[0] == res.max_rel_err


def test_gate_still_fails_a_missed_centering_on_an_inexact_original(monkeypatch):
    """The original's own error widens the bound; a missed centering is far outside it."""
    from lnfold.onnx_rewrite import api

    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match="away from a float64 run"):
        fold_model(_precise_decoder())


def test_gate_fp16_is_judged_against_float64():
    res = fold_model(G.pre_ln(dtype=np.float16))
    assert res.criterion == "float64" and res.exact_err <= 2 * res.original_exact_err + gate.FLOOR["float16"]


def test_gate_fallback_without_float64():
    """An op neither onnxruntime (no double kernel) nor onnx's reference evaluator runs in
    float64 (com.microsoft BiasGelu): the gate falls back and says which criterion it used."""
    b = G.Builder(4)
    ids = b.input("ids", TensorProto.INT64, [2, 5])
    h = b.op("Gather", [b.weight("emb", (V, D), mean=2000.0, scale=0.1), ids], axis=0)
    n = b.layernorm(h)
    mlp = b.linear(b.op("BiasGelu", [b.linear(n, D, 2 * D), b.weight("bg", (2 * D,))], domain="com.microsoft"), 2 * D, D)
    h = b.op("Add", [h, mlp])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 3))]), shape=None)
    model = b.model(17, extra_opsets=[("com.microsoft", 1)])
    res = fold_model(model)
    assert res.exact_err is None and res.criterion in ("tolerance", "zero-mean norm inputs")


def test_gate_fallback_fails_a_missed_centering(monkeypatch):
    from lnfold.onnx_rewrite import api

    b = G.Builder(4)
    ids = b.input("ids", TensorProto.INT64, [2, 5])
    h = b.op("Gather", [b.weight("emb", (V, D), mean=3.0), ids], axis=0)
    mlp = b.linear(b.op("BiasGelu", [b.linear(b.layernorm(h), D, 2 * D), b.weight("bg", (2 * D,))],
                                     domain="com.microsoft"), 2 * D, D)
    h = b.op("Add", [h, mlp])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 3))]), shape=None)
    model = b.model(17, extra_opsets=[("com.microsoft", 1)])
    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match="no float64 run"):
        fold_model(model)


def test_gate_unit():
    """The rule itself: at least as exact as the original passes; worse than FACTOR x plus the
    floor fails; without float64 the fallback is named."""
    exact = np.linspace(1, 2, 10)
    orig = exact + 1e-3
    ok = gate.judge([gate.Output("y", "float32", orig, exact + 1e-5, exact)])
    assert ok.ok and ok.criterion == "float64" and ok.diff > 1e-4
    bad = gate.judge([gate.Output("y", "float32", orig, exact + 5e-3, exact)])
    assert not bad.ok and "output y" in bad.message()
    fb = gate.judge([gate.Output("y", "float32", orig, orig + 1e-6)])
    assert fb.ok and fb.criterion == "tolerance"
    centered = {"n": np.array([[1.0, -1.0, 2.0, -2.0]])}
    off = {"n": np.array([[1.0, 1.0, 2.0, 2.0]])}
    far = [gate.Output("y", "float32", orig, orig + 5e-4)]
    assert gate.judge(far, centered).ok and gate.judge(far, centered).criterion == "zero-mean norm inputs"
    assert "mean" in gate.judge(far, off).message()


# --- models onnxruntime refuses to load -------------------------------------------------------------

def _fp16_ln_with_fp32_affine() -> onnx.ModelProto:
    """TorchScript's fp16 export: LayerNormalization with fp16 X but fp32 γ/β."""
    model = G.pre_ln(dtype=np.float16)
    gammas = {i for n in model.graph.node if n.op_type == "LayerNormalization" for i in n.input[1:3]}
    for t in model.graph.initializer:
        if t.name in gammas:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float32), t.name))
    return onnx.shape_inference.infer_shapes(model)  # exporters write value_info


def _fold_what_onnxruntime_refuses(model, refusal: str):
    """onnxruntime refuses to load `model` (its error matches `refusal`); lnfold folds it and
    still measures the fold's error against float64."""
    from lnfold.onnx_rewrite.verify import session

    with pytest.raises(Exception, match=refusal):
        session(model)
    res = fold_model(model)
    assert res.exact_err is not None
    return res


def test_model_onnxruntime_refuses_is_folded_and_checked_by_the_reference_evaluator():
    res = _fold_what_onnxruntime_refuses(_fp16_ln_with_fp32_affine(), "Type")
    assert res.report.folded == 3
    assert "onnxruntime refuses to load the model" in res.criterion and "reference evaluator" in res.criterion


def test_model_onnxruntime_refuses_planted_bug_still_fails(monkeypatch):
    from lnfold.onnx_rewrite import api

    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan))
    with pytest.raises(VerificationError, match="float64"):
        fold_model(_fp16_ln_with_fp32_affine())


# --- the torch frontend ---------------------------------------------------------------------------

def test_fx_gate_passes_a_fold_more_exact_than_the_original():
    torch = pytest.importorskip("torch")
    from lnfold.fx_rewrite import fold_module

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.wte = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.05 + 4000)
            self.wpe = torch.nn.Parameter(torch.randn(8, D, generator=g) * 0.05 - 2000)
            self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            for ln in (self.ln1, self.ln2):
                ln.weight.data = torch.randn(D, generator=g) * 0.5 + 1
                ln.bias.data = torch.randn(D, generator=g) * 0.5
            self.fc = torch.nn.Linear(D, D)
            self.head = torch.nn.Linear(D, V)

        def forward(self, ids):
            h = self.wte[ids] + self.wpe[torch.arange(ids.shape[1])]
            h = h + self.fc(torch.relu(self.ln1(h)))
            return self.head(self.ln2(h))

    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    res = fold_module(Tiny(), (ids,), norm="rms_norm")
    assert res.criterion == "float64" and res.original_exact_err > 1e-4
    assert res.exact_err < res.original_exact_err and res.max_rel_err > 1e-4


# --- models neither onnxruntime nor the reference evaluator runs in their own dtype ---------------

def _fp16_cast_typed_fp16() -> onnx.ModelProto:
    """onnxconverter-common's fp16 files: a Cast(to=FLOAT) kept from the fp32 model whose output
    value_info says float16. onnxruntime refuses to load it ("Type (tensor(float16)) of output arg
    ... does not match expected type"); onnx's reference evaluator runs the Cast as written and
    then meets float32 * float16 ("Input type mismatch")."""
    b = G.Builder(5, np.float16)
    ids = b.input("ids", TensorProto.INT64, [2, G.T])
    h = b.embed(ids)
    a = b.op("Relu", [b.linear(b.layernorm(h), D, 2 * D)])
    half = b.op("Cast", [b.const("half", np.array(0.5, np.float16))], to=TensorProto.FLOAT)
    h = b.op("Add", [h, b.linear(b.op("Mul", [a, half]), 2 * D, D)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, V))]), shape=[2, G.T, V])
    model = b.model(17)
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(half, TensorProto.FLOAT16, []))
    return model


def test_fp16_file_both_evaluators_refuse_is_judged_by_float64_copies():
    from onnx.reference import ReferenceEvaluator
    from lnfold.onnx_rewrite.verify import session

    model = _fp16_cast_typed_fp16()
    with pytest.raises(Exception, match="mismatch"):
        ReferenceEvaluator(model).run(None, {"ids": np.zeros((2, G.T), np.int64)})
    res = _fold_what_onnxruntime_refuses(model, r"Type \(tensor\(float16\)\) of output arg")
    assert res.report.folded == 2
    assert res.criterion.startswith("float64 copies") and "refuses the folded model for the same reason" in res.criterion
    # the edited weights are stored back in float16: more than float64 noise, within its floor
    assert 1e-9 < res.exact_err <= gate.COPIES_REL + gate.FLOOR["float16"] and res.original_exact_err is None
    with pytest.raises(Exception, match=r"Type \(tensor\(float16\)\) of output arg"):
        session(res.model)


def test_fp16_file_both_evaluators_refuse_planted_bug_still_fails(monkeypatch):
    from lnfold.onnx_rewrite import api

    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match="float64 copies of the folded and the original model differ"):
        fold_model(_fp16_cast_typed_fp16())


def test_fp16_file_folded_model_refused_for_a_new_reason_fails():
    """The folded model may be refused by onnxruntime only for the input's reason: a new type
    error (here on the first node's output) is a fold that made the file worse."""
    from lnfold.onnx_rewrite.verify import check

    model = _fp16_cast_typed_fp16()
    folded = fold_model(model, verify=False).model
    first = folded.graph.node[0].output[0]
    folded.graph.value_info.append(onnx.helper.make_tensor_value_info(first, TensorProto.INT64, None))
    with pytest.raises(VerificationError, match="for a reason the input does not have"):
        check(model, folded)


def test_gate_float64_copies_unit():
    exact = np.linspace(1, 2, 10)
    ok = gate.judge_float64_copies([gate.Output("y", "float64", exact, exact * (1 + 1e-4))], "float16")
    assert ok.ok and ok.criterion.startswith("float64 copies") and "float64 copies" in ok.summary()
    tight = gate.judge_float64_copies([gate.Output("y", "float64", exact, exact * (1 + 1e-4))], "float64")
    assert not tight.ok and "above" in tight.message()


# --- tf2onnx's Erfc ---------------------------------------------------------------------------------

def _erfc_gelu_block(op: str = "Erfc") -> onnx.ModelProto:
    """tf2onnx's Keras GELU: 0.5 x Erfc(-x/√2), with Erfc, which is not an ONNX op."""
    b = G.Builder(6)
    ids = b.input("ids", TensorProto.INT64, [2, G.T])
    h = b.embed(ids)
    a = b.linear(b.layernorm(h), D, 2 * D)
    erfc = b.op(op, [b.op("Mul", [a, b.const("m", np.array(-2 ** -0.5, np.float32))])])
    gelu = b.op("Mul", [b.op("Mul", [a, b.const("h", np.array(0.5, np.float32))]), erfc])
    h = b.op("Add", [h, b.linear(gelu, 2 * D, D)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, V))]), shape=[2, G.T, V])
    model = b.model(17)
    # onnx's shape inference stops at an op without a schema; the exporter knows the shape
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(erfc, TensorProto.FLOAT, [2, G.T, 2 * D]))
    return model


def test_erfc_reference_implementation():
    from lnfold.onnx_rewrite.sessions import reference as _reference

    b = G.Builder(0, np.float64)
    b.output(b.op("Erfc", [b.input("x", TensorProto.DOUBLE, [5])]), shape=[5])
    x = np.array([-3.0, -0.5, 0.0, 0.7, 10.0])
    (y,) = _reference(b.model(17)).run(None, {"x": x})
    assert np.allclose(y[:4], [1 - math.erf(v) for v in x[:4]], rtol=1e-15, atol=0)
    assert y[4] > 0  # erfc(10) ~ 2e-45, where 1 - erf(10) is 0


def test_erfc_model_verifies_with_the_reference_evaluator():
    res = _fold_what_onnxruntime_refuses(_erfc_gelu_block(), "Erfc")
    assert res.report.folded == 2
    assert res.criterion.startswith("float64") and "tf2onnx writes Erfc" in res.criterion


def test_erfc_model_planted_bug_still_fails(monkeypatch):
    from lnfold.onnx_rewrite import api

    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match="away from a float64 run"):
        fold_model(_erfc_gelu_block())


def test_other_unknown_op_still_cannot_verify():
    with pytest.raises(LnfoldError, match="cannot verify.*'Erfcx'"):
        fold_model(_erfc_gelu_block("Erfcx"))


def test_the_float64_copy_computes_erf_in_float64():
    """onnx's reference evaluator rounds Erf to float32; the float64 copy runs Erf there (onnxruntime
    has no double kernel for it), so without lnfold's own Erf every GELU would put a float32 error
    into the reference the gate judges against."""
    import math

    from onnx import TensorProto, helper

    from lnfold.onnx_rewrite.exact import exact_run

    graph = helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.array([0.1234567, 0.5, 1.3], dtype=np.float32)
    (y,), how = exact_run(model, {"x": x})
    assert y.dtype == np.float64 and "reference" in how
    libm = np.array([math.erf(float(v)) for v in x])
    assert np.all(np.abs(y - libm) <= 4 * np.spacing(libm)), how  # a float32 Erf is ~1e-8 away (1e8 ulp)
    from lnfold.onnx_rewrite.sessions import _elementwise  # (libm's, where scipy is not installed)

    assert np.array_equal(_elementwise(math.erf)(x.astype(np.float64)), libm)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_float64_copy_computes_gelu_in_float64(approximate):
    """Opset 20's Gelu (dynamo exports of Whisper, ViT, BERT at opset ≥ 20): onnx runs its function
    body, whose Erf is onnx's own float32 one; lnfold's Gelu keeps the float64 copy in float64."""
    import math

    from onnx import TensorProto, helper

    from lnfold.onnx_rewrite.exact import exact_run

    graph = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = np.array([-2.345678, 0.1234567, 0.5, 1.3], dtype=np.float32)
    (y,), how = exact_run(model, {"x": x})
    v = x.astype(np.float64)
    if approximate == "tanh":
        want = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    else:
        want = np.array([0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in v])
    assert y.dtype == np.float64 and "Gelu" in how
    assert np.all(np.abs(y - want) <= 8 * np.spacing(np.abs(want))), (y - want, how)  # float32: ~1e8 ulp away
