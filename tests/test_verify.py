"""Verification on the models users have (issue 10): inputs made up from the graph, user inputs
and dims, and the float64 gate (passes/gate.py) in both frontends.

The graphs reproduce the failures of real exports by hand: Optimum's decoder signature (shared
symbolic dims, `past_sequence_length + sequence_length` masks, past key/values), learned
positions indexed by a computed Range (past + seq must stay inside the table), a conv stem whose
channel dim is symbolic. Each used to fail with "cannot verify"; each now verifies.
"""
from __future__ import annotations

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


def test_model_onnxruntime_refuses_is_folded_and_checked_by_the_reference_evaluator():
    from lnfold.onnx_rewrite.verify import session

    model = _fp16_ln_with_fp32_affine()
    with pytest.raises(Exception, match="Type"):
        session(model)
    res = fold_model(model)
    assert res.report.folded == 3 and res.exact_err is not None
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
