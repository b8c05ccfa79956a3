"""RMSNorm streams as given (issue 47, first step): a residual stream whose norms are all RMSNorms
(Llama, Qwen, ...) needs no centering, so `rotate=` rotates it exactly once γ is in the readers
(‖xQ‖ = ‖x‖: RMSNorm₁(xQ) = RMSNorm₁(x)·Q), verified against float64 like a folded LayerNorm stream.

Llama-like graphs built with onnx.helper in each form an RMSNorm takes in ONNX files: onnxruntime's
`SimplifiedLayerNormalization`, opset 23's `RMSNormalization` and the decomposed chain torch's
dynamo exporter writes for LlamaRMSNorm (Pow or Mul, ReduceMean, Add ε, Sqrt, Reciprocal + Mul or
Div, optional Casts, Mul by γ). Random γ and weights, large-mean embeddings: a writer or reader left
unrotated, or a γ left in a norm of a rotated stream, moves the outputs far beyond the gate.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.passes import LnfoldError, NothingToFold, VerificationError
from tests.onnx_graphs import Builder

D, F, V, B, T = 32, 64, 50, 2, 5
EPS = 1e-5
FORMS = ("simplified", "rmsnormalization", "decomposed", "decomposed-cast-mul-div")


class _Graph(Builder):
    """tests/onnx_graphs.Builder with float32 weights scaled as a trained layer's (1/√fan-in), and
    RMSNorms in each form a model file holds."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, np.float32)

    def weight(self, base: str, shape, mean: float = 0.0) -> str:
        return super().weight(base, shape, mean, scale=1 / np.sqrt(shape[0]))

    def rms(self, x: str, form: str) -> str:
        gamma = self.const("gamma", (self.rng.uniform(0.5, 2.0, D) * self.rng.choice([-1, 1], D)).astype(np.float32))
        if form in ("gemma", "t5"):
            return self.rms_upcast(x, form, gamma)
        if form == "simplified":
            return self.op("SimplifiedLayerNormalization", [x, gamma], axis=-1, epsilon=EPS)
        if form == "rmsnormalization":
            return self.op("RMSNormalization", [x, gamma], axis=-1, epsilon=EPS)
        cast = form == "decomposed-cast-mul-div"
        xs = self.op("Cast", [x], to=TensorProto.FLOAT) if cast else x
        sq = self.op("Mul", [xs, xs]) if cast else self.op("Pow", [xs, self.const("two", np.float32(2.0))])
        ms = self.op("ReduceMean", [sq, self.const("axes", np.array([-1], np.int64))], keepdims=1)
        rms = self.op("Sqrt", [self.op("Add", [ms, self.const("eps", np.float32(EPS))])])
        n = self.op("Div", [xs, rms]) if cast else self.op("Mul", [xs, self.op("Reciprocal", [rms])])
        if cast:
            n = self.op("Cast", [n], to=TensorProto.FLOAT)
        return self.op("Mul", [gamma, n])  # γ first, as dynamo writes `self.weight * h`

    def rms_upcast(self, x: str, form: str, gamma: str) -> str:
        """The mean square of x's fp32 Cast, then as GemmaRMSNorm writes it without constant folding
        (Cast(x)·(1/rms) times Add(1, Cast(weight)), weight = γ - 1, then Cast back) or as T5LayerNorm does
        (the uncast x times 1/rms, Cast, γ·)."""
        xs = self.op("Cast", [x], to=TensorProto.FLOAT)
        sq = self.op("Pow", [xs, self.const("two", np.float32(2.0))])
        ms = self.op("ReduceMean", [sq, self.const("axes", np.array([-1], np.int64))], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.const("eps", np.float32(EPS))])])])
        if form == "t5":
            return self.op("Mul", [gamma, self.op("Cast", [self.op("Mul", [x, inv])], to=TensorProto.FLOAT)])
        weight = self.inits[-1]  # (gamma's initializer) stored as γ - 1, read as 1 + weight
        weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) - np.float32(1), weight.name))
        gain = self.op("Add", [self.const("one", np.float32(1.0)), self.op("Cast", [gamma], to=TensorProto.FLOAT)])
        return self.op("Cast", [self.op("Mul", [self.op("Mul", [xs, inv]), gain])], to=TensorProto.FLOAT)


def llama_like(form: str = "decomposed", *, seed: int = 0, first=None, softmax: bool = False,
               hidden: bool = False) -> onnx.ModelProto:
    """Embedding -> 2 pre-norm blocks (norm -> MatMul -> SiLU -> MatMul -> residual Add) -> final
    norm -> lm head. `first`: the first block's norm in another form ("layernorm": a LayerNormalization
    on the same stream). `softmax`: the stream after block 0 is also read by a Softmax over the
    features (shift-invariant, not rotation-invariant), whose result is added to the logits' input."""
    g = _Graph(seed)
    h = g.op("Gather", [g.weight("embed", (V, D), mean=3.0), "input_ids"], name="embed", axis=0)
    for layer in range(2):
        which = first if layer == 0 and first is not None else form
        if which == "layernorm":
            n = g.op("LayerNormalization", [h, g.weight("ln_gamma", (D,), mean=1.0), g.weight("ln_beta", (D,))],
                     name="ln0", axis=-1, epsilon=EPS)
        else:
            n = g.rms(h, which)
        up = g.op("MatMul", [n, g.weight("up", (D, F))])
        act = g.op("Mul", [up, g.op("Sigmoid", [up])])
        h = g.op("Add", [h, g.op("MatMul", [act, g.weight("down", (F, D))], name=f"down{layer}")])
        if softmax and layer == 0:
            sm = g.op("Softmax", [h], name="features_softmax", axis=-1)
    n = g.rms(h, form)
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, T, D])] if hidden else []
    if softmax:
        n = g.op("Add", [n, sm])
    logits = g.op("MatMul", [n, g.weight("lm_head", (D, V))], name="lm_head")
    graph = helper.make_graph(g.nodes, "llama_like",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [B, T, V])] + outputs, g.inits)
    opset = 23 if "rmsnormalization" in (form, first) else 18
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ids(seed: int = 1) -> dict:
    return {"input_ids": np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int64)}


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _norm_weights(model: onnx.ModelProto) -> list[np.ndarray]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [inits[n.input[1]] for n in model.graph.node
            if n.op_type in ("SimplifiedLayerNormalization", "RMSNormalization")]


def rotated_exactly(m):
    """(the fold of `m` rotated by a Hadamard, its one stream's report), after checking it was verified
    against float64 within the original's own error and that the stream rotated."""
    r = lnfold.fold_onnx(m, rotate="hadamard")  # verified against float64 (raises otherwise)
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=32"), s.rotation
    return r, s


@pytest.mark.parametrize("form", FORMS)
def test_an_rmsnorm_stream_rotates_exactly(form):
    m = llama_like(form)
    r, s = rotated_exactly(m)
    assert len(s.rms) == 3 and not s.norms and not s.centered
    assert [x.stream for x in r.report.rms_norms] == [0, 0, 0]
    assert all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms), r.report.rms_norms
    assert r.report.norms == [] and "3 RMSNorm(s) as given" in r.report.table()
    weights = _norm_weights(r.model)
    assert len(weights) == 3 and all(np.array_equal(w, np.ones(D, np.float32)) for w in weights)
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("form", ("gemma", "t5"))
def test_gemmas_and_t5s_norms_rotate_exactly(form):
    """GemmaRMSNorm's Add(1, weight) (computed once into γ: onnx_rewrite/already_rms.computed_gains)
    and T5LayerNorm's division of the uncast x, each after an fp32 Cast of x."""
    m = llama_like(form)
    r = lnfold.fold_onnx(m, rotate="hadamard")
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=32"), s.rotation
    assert len(s.rms) == 3 and all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms)
    assert not any(n.op_type in ("Pow", "Add") and "one" in " ".join(n.input) for n in r.model.graph.node)
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_gemmas_gain_read_as_gamma_fails_verification(monkeypatch):
    """Planted bug: the gain 1 + weight computed as the weight (its 1 read as 0)."""
    from lnfold.onnx_rewrite import api

    real = api.computed_gains

    def gamma_only(graph):
        for node in graph.nodes:
            if node.op == "Add" and node.inputs[0].name.startswith("one"):
                node.inputs[0].values = np.zeros_like(node.inputs[0].values)
        real(graph)

    monkeypatch.setattr(api, "computed_gains", gamma_only)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_like("gemma"), rotate="hadamard")


def test_gemmas_gain_slices_to_the_exact_fold():
    r = lnfold.slice_onnx(llama_like("gemma"), {"input_ids": np.random.default_rng(3).integers(0, V, (16, T))},
                          fraction=0.01)
    assert r.report.streams[0].keep == D and r.report.error < 1e-5  # (float32: its rounding)


def test_a_norm_whose_output_is_a_graph_output_reads_out_of_the_rotated_stream():
    """The final norm's output is also the model's hidden states: its γ stays, and it is emitted with
    unit weight followed by the constant MatMul Qᵀ·diag γ (a readout), exactly."""
    m = llama_like("simplified", hidden=True)
    r = lnfold.fold_onnx(m, rotate="hadamard")
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard") and "un-rotated after" in s.rotation, s.rotation
    assert "un-rotated by a constant MatMul" in r.report.rms_norms[-1].gamma
    assert sum("basis_change" in n.name for n in r.model.graph.node) == 1
    feeds = _ids()
    for want, got in zip(ort.InferenceSession(m.SerializeToString()).run(None, feeds),
                         ort.InferenceSession(r.model.SerializeToString()).run(None, feeds)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("form", FORMS[::2])
def test_without_rotate_an_rmsnorm_model_has_nothing_to_fold(form):
    with pytest.raises(NothingToFold, match="RMSNorms already.*nothing to fold"):
        lnfold.fold_onnx(llama_like(form))


def test_gamma_into_readers_alone():
    m = llama_like("decomposed")
    r = lnfold.fold_onnx(m, gamma_into_readers=True)
    (s,) = r.report.streams
    assert not s.rotation and all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms)
    assert all(np.array_equal(w, np.ones(D, np.float32)) for w in _norm_weights(r.model))
    assert not any(n.op_type == "Pow" for n in r.model.graph.node)  # the decomposed norms re-emitted
    feeds = _ids()
    assert np.abs(_run(r.model, feeds) - _run(m, feeds)).max() <= 1e-5 * np.abs(_run(m, feeds)).max()


def test_a_writer_left_unrotated_fails_verification(monkeypatch):
    from lnfold.passes import plan as plan_module

    real = plan_module.plan_rotation

    def drop_one_writer(*args, **kw):  # one down projection's weight stays in the old basis
        rot = real(*args, **kw)
        k = next(k for k, (ref, _) in enumerate(rot.writers) if ref.value.startswith("down"))
        return dataclasses.replace(rot, writers=rot.writers[:k] + rot.writers[k + 1:])

    monkeypatch.setattr(plan_module, "plan_rotation", drop_one_writer)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_like("simplified"), rotate="hadamard")


def test_a_softmax_over_the_features_keeps_the_stream_unrotated():
    m = llama_like("decomposed", softmax=True)
    r = lnfold.fold_onnx(m, rotate="hadamard")  # γ still goes into the readers, exactly
    (s,) = r.report.streams
    assert s.rotation.startswith("not rotated: Softmax `features_softmax` reads the stream tensor"), s.rotation
    feeds = _ids()
    assert np.abs(_run(r.model, feeds) - _run(m, feeds)).max() <= 1e-5 * np.abs(_run(m, feeds)).max()


@pytest.mark.parametrize("form", ("simplified", "decomposed"))
def test_a_stream_mixing_layernorm_and_rmsnorm_keeps_its_layernorms(form):
    m = llama_like(form, first="layernorm")
    with pytest.raises(NothingToFold, match=r"ln0: .*normalized by .*an RMSNorm as given"):
        lnfold.fold_onnx(m, rotate="hadamard")
    with pytest.raises(NothingToFold):  # and without rotation, as before
        lnfold.fold_onnx(m)


def test_cli_fold_and_quantize_rotate_an_rmsnorm_model(tmp_path, capsys):
    from lnfold.onnx_rewrite import cli

    src = tmp_path / "llama.onnx"
    onnx.save(llama_like("decomposed"), src)
    assert cli.main(["fold", str(src), "-o", str(tmp_path / "plain.onnx")]) == 2
    assert "RMSNorms already" in capsys.readouterr().err
    assert cli.main(["fold", str(src), "-o", str(tmp_path / "rot.onnx"), "--rotate", "hadamard"]) == 0
    assert "rotated (hadamard, d=32" in capsys.readouterr().out
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--weights", "int8",
                     "--rotate", "hadamard"]) == 0
    out = capsys.readouterr().out
    assert "rotated (hadamard" in out, out


def _dynamo_llama(tmp_path):
    """LlamaForCausalLM (2 layers, hidden 32, vocab 64) through torch.onnx.export(dynamo=True): its
    decomposed RMSNorms (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul by γ) with random γ each
    (the exporter shares equal initializers: ones would be one tensor) and a large-mean embedding.
    (path, input ids)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 2.0) * torch.randint(0, 2, p.shape).mul(2).sub(1))
        model.model.embed_tokens.weight.add_(3.0)

    from lnfold import zoo

    ids = torch.randint(0, 64, (1, 8))
    path = tmp_path / "llama.onnx"
    torch.onnx.export(zoo.Logits(model, "logits"), (ids,), str(path), dynamo=True, input_names=["input_ids"],
                      output_names=["logits"], verbose=False)
    return path, ids


@pytest.mark.slow
def test_a_dynamo_export_of_a_transformers_llama_rotates_exactly(tmp_path):
    path, ids = _dynamo_llama(tmp_path)
    m = onnx.load(path)
    r = lnfold.fold_onnx(m, rotate="hadamard")
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=32") and len(s.rms) == 5, r.report.table()
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6)
    feeds = {"input_ids": ids.numpy()}
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# --- onnxruntime's SkipSimplifiedLayerNormalization (issue 47, second step) -----------------------

def llama_skip(*, bias: bool = False, last_sum: bool = False, seed: int = 0, layers: int = 2) -> onnx.ModelProto:
    """Llama as onnxruntime's transformers optimizer and onnxruntime-genai's builder write it: the
    first norm a SimplifiedLayerNormalization of the embedding, every later one a
    SkipSimplifiedLayerNormalization(stream, block output, γ [, bias]) whose output 3 (the sum) is the
    next stream tensor. `bias`: the down projections' biases as its input 3. `last_sum`: the final
    norm names its sum output too, which nothing reads."""
    g = _Graph(seed)
    h = g.op("Gather", [g.weight("embed", (V, D), mean=3.0), "input_ids"], name="embed", axis=0)
    n = g.rms(h, "simplified")
    for layer in range(layers):
        up = g.op("MatMul", [n, g.weight("up", (D, F))])
        act = g.op("Mul", [up, g.op("Sigmoid", [up])])
        d = g.op("MatMul", [act, g.weight("down", (F, D))], name=f"down{layer}")
        gamma = g.const("gamma", (g.rng.uniform(0.5, 2.0, D) * g.rng.choice([-1, 1], D)).astype(np.float32))
        ins = [h, d, gamma] + ([g.weight("bias", (D,), mean=1.0)] if bias else [])
        n, h = g.name("skip_norm"), g.name("skip_sum")
        outs = [n, "", "", h] if layer < layers - 1 or last_sum else [n]
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ins, outs, name=g.name("SkipSimplified"),
                                        domain="com.microsoft", epsilon=EPS))
    logits = g.op("MatMul", [n, g.weight("lm_head", (D, V))], name="lm_head")
    graph = helper.make_graph(g.nodes, "llama_skip",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [B, T, V])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


@pytest.mark.parametrize("bias,last_sum", [(False, False), (True, False), (False, True), (True, True)])
def test_a_skip_simplified_stream_rotates_exactly(bias, last_sum):
    m = llama_skip(bias=bias, last_sum=last_sum)
    r, s = rotated_exactly(m)
    assert len(s.rms) == 3 and not s.norms and not s.centered
    assert [x.op for x in r.report.rms_norms] == ["SimplifiedLayerNormalization"] + 2 * ["SkipSimplifiedLayerNormalization"]
    assert all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms), r.report.rms_norms
    skips = [n for n in r.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(skips) == 2 and all(len(n.input) == (4 if bias else 3) for n in skips)  # still fused
    inits = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    assert all(np.array_equal(inits[n.input[2]], np.ones(D, np.float32)) for n in skips)
    if bias:  # the biases are writers of the stream: rotated too
        before = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        assert all(not np.allclose(inits[n.input[3]], before[o.input[3]])
                   for n, o in zip(skips, [n for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]))
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("what", ("down", "bias"))
def test_a_skip_simplified_writer_left_unrotated_fails_verification(monkeypatch, what):
    from lnfold.passes import plan as plan_module

    real = plan_module.plan_rotation

    def drop_one_writer(*args, **kw):  # one down projection's weight (or one bias) stays in the old basis
        rot = real(*args, **kw)
        k = next(k for k, (ref, _) in enumerate(rot.writers) if ref.value.startswith(what))
        return dataclasses.replace(rot, writers=rot.writers[:k] + rot.writers[k + 1:])

    monkeypatch.setattr(plan_module, "plan_rotation", drop_one_writer)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_skip(bias=True), rotate="hadamard")


def test_a_skip_simplified_sum_that_is_a_graph_output_keeps_the_stream_unrotated():
    m = llama_skip()
    sums = [n.output[3] for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization" and len(n.output) > 3]
    m.graph.output.append(helper.make_tensor_value_info(sums[0], TensorProto.FLOAT, [B, T, D]))
    r = lnfold.fold_onnx(m, rotate="hadamard")  # γ still moves, exactly
    (s,) = r.report.streams
    assert s.rotation.startswith("not rotated") and "graph output" in s.rotation, s.rotation
    feeds = _ids()
    for want, got in zip(ort.InferenceSession(m.SerializeToString()).run(None, feeds),
                         ort.InferenceSession(r.model.SerializeToString()).run(None, feeds)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow
def test_onnxruntimes_optimizer_output_of_a_dynamo_llama_rotates_exactly(tmp_path):
    """onnxruntime's transformers optimizer (model_type "gpt2") on the dynamo export fuses each residual
    Add with the next RMSNorm: one SimplifiedLayerNormalization, then SkipSimplifiedLayerNormalization."""
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    path, ids = _dynamo_llama(tmp_path)
    optimized = optimizer.optimize_model(str(path), model_type="gpt2", num_heads=4, hidden_size=32, opt_level=0)
    optimized.save_model_to_file(str(tmp_path / "optimized.onnx"))
    m = onnx.load(tmp_path / "optimized.onnx")
    ops = [n.op_type for n in m.graph.node]
    if ops.count("SkipSimplifiedLayerNormalization") != 4:
        pytest.skip(f"this onnxruntime's optimizer fused no SkipSimplifiedLayerNormalization ({sorted(set(ops))})")
    r = lnfold.fold_onnx(m, rotate="hadamard")
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard, d=32") and len(s.rms) == 5, r.report.table()
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6)
    assert [n.op_type for n in r.model.graph.node].count("SkipSimplifiedLayerNormalization") == 4
    feeds = {"input_ids": ids.numpy()}
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    rows = {"input_ids": np.random.default_rng(1).integers(0, 64, (16, 8)).astype(np.int64)}  # batch 1 each
    assert lnfold.slice_onnx(m, rows, fraction=0.01).report.error < 1e-5
    sliced = lnfold.slice_onnx(m, rows, fraction=0.25)
    assert sliced.report.streams[0].keep == 24 and sliced.report.params_after < sliced.report.params_before
    assert 0 < sliced.report.error < 1


# --- slicing streams of RMSNorms as given (issue 47, second step) ---------------------------------

def llama_span(form: str = "decomposed", span=None, seed: int = 0, batch="batch") -> onnx.ModelProto:
    """A float64 Llama-like graph (embedding -> 2 pre-norm blocks -> final RMSNorm -> lm head, random
    signed γ, large-mean embedding), a dynamic batch and a Reshape to [-1, T, d] on the stream that
    spells d. `span`: every writer's output side lies in one `span`-dim subspace of the d = 16 features
    (tests/test_slice.py's trick): slicing at k = span then deletes only zero directions."""
    from tests.onnx_graphs import Builder

    d, t, vocab = 16, 5, 20
    b = Builder(seed, np.float64)
    ids = b.input("ids", TensorProto.INT64, [batch, t])
    rng = np.random.default_rng(seed + 7)
    onto = None if span is None else np.linalg.qr(rng.standard_normal((d, span)))[0]

    def writer(base, shape, mean):
        name = b.weight(base, shape, mean=mean)
        if onto is not None:
            w = numpy_helper.to_array(b.inits[-1]) @ onto @ onto.T
            b.inits[-1].CopyFrom(numpy_helper.from_array(w, name))
        return name

    def rms(x):
        gamma = b.const("gamma", rng.uniform(0.5, 2.0, d) * rng.choice([-1, 1], d))
        if form == "simplified":
            return b.op("SimplifiedLayerNormalization", [x, gamma], axis=-1, epsilon=EPS)
        sq = b.op("Pow", [x, b.const("two", np.float64(2.0))])
        ms = b.op("ReduceMean", [sq, b.const("axes", np.array([-1], np.int64))], keepdims=1)
        r = b.op("Sqrt", [b.op("Add", [ms, b.const("eps", np.float64(EPS))])])
        return b.op("Mul", [gamma, b.op("Mul", [x, b.op("Reciprocal", [r])])])

    h = b.op("Gather", [writer("emb", (vocab, d), 3.0), ids], axis=0)
    for layer in range(2):
        u = b.op("MatMul", [rms(h), b.weight("up", (d, 2 * d))])
        u = b.op("Mul", [u, b.op("Sigmoid", [u])])
        h = b.op("Add", [h, b.op("MatMul", [u, writer("down", (2 * d, d), 0.0)])])
        if layer == 0:
            h = b.op("Reshape", [h, b.const("shape", np.array([-1, t, d], np.int64))])
    y = b.op("MatMul", [rms(h), b.weight("head", (d, vocab))])
    b.output(y, shape=[batch, t, vocab])
    return b.model(18)


def _span_rows(rows: int = 16, seed: int = 1) -> dict:
    return {"ids": np.random.default_rng(seed).integers(0, 20, (rows, 5)).astype(np.int64)}


def _error_against_exact(result) -> float:
    """The sliced model's relative error against the exact (rotated) fold, on fresh rows."""
    from lnfold.onnx_rewrite import calibration as calibration_io
    from lnfold.passes.approx import relative_error

    rows = [_span_rows(8, seed=99)]
    return relative_error(calibration_io.run(result.exact.model, rows), calibration_io.run(result.model, rows))


@pytest.mark.parametrize("form", ("decomposed", "simplified"))
def test_an_rmsnorm_stream_in_k_dimensions_slices_with_zero_error(form):
    """The writers span 12 of 16 dimensions: at F = 0.25 (k = 12) only zero directions go."""
    r = lnfold.slice_onnx(llama_span(form, span=12), _span_rows(), fraction=0.25)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (16, 12) and s.variance_kept == pytest.approx(1.0, abs=1e-12), s
    assert _error_against_exact(r) < 1e-10
    assert r.report.params_after < r.report.params_before
    shapes = [numpy_helper.to_array(t).tolist() for t in r.model.graph.initializer if t.data_type == TensorProto.INT64]
    assert [-1, 5, 12] in shapes and [-1, 5, 16] not in shapes


def test_a_real_slice_of_an_rmsnorm_stream():
    """Random weights (no subspace): F = 0.25 deletes real directions: a finite, nonzero error."""
    r = lnfold.slice_onnx(llama_span(), _span_rows(), fraction=0.25)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (16, 12) and s.variance_kept < 1 - 1e-5
    err = _error_against_exact(r)
    assert np.isfinite(err) and 1e-4 < err < 10 and np.isfinite(r.report.error)
    assert r.report.params_after < r.report.params_before


def test_an_unscaled_sliced_rmsnorm_fails(monkeypatch):
    """Planted bug: a sliced RMSNorm without its √(d/k): the zero-error slice is no longer exact."""
    from tests.test_slice import plant_unscaled

    plant_unscaled(monkeypatch)
    r = lnfold.slice_onnx(llama_span(span=12), _span_rows(), fraction=0.25)
    assert _error_against_exact(r) > 1e-2


def test_cli_slices_an_rmsnorm_model(tmp_path, capsys):
    from lnfold.onnx_rewrite import cli

    src, cal, out = tmp_path / "m.onnx", tmp_path / "cal.npz", tmp_path / "sliced.onnx"
    onnx.save(llama_span(span=12), src)
    np.savez(cal, **_span_rows())
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal), "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["streams"][0]["keep"] == 12 and report["error"] < 1e-10


def test_a_full_width_slice_of_an_rmsnorm_stream_is_the_exact_fold():
    """F → 0 (k = d): the calibrated basis rotates the stream, nothing deleted: the exact fold's outputs;
    per block too (one basis per segment between the norms)."""
    r = lnfold.slice_onnx(llama_span("simplified"), _span_rows(), fraction=0.01)
    assert r.report.streams[0].keep == 16 and _error_against_exact(r) < 1e-12
    r = lnfold.slice_onnx(llama_span("simplified"), _span_rows(), fraction=0.25, per_block=True)
    assert r.report.streams[0].bases == 3 and np.isfinite(r.report.error) and r.report.error > 1e-4


@pytest.mark.parametrize("last_sum", [True, False])
def test_a_skip_simplified_stream_slices(last_sum):
    """SkipSimplifiedLayerNormalization (the last one's sum named as output 3 or not: the fold names it,
    for the capture): F → 0 is the exact fold, F = 0.25 has fewer parameters and stays fused."""
    m = llama_skip(bias=True, last_sum=last_sum)
    for t in list(m.graph.input) + list(m.graph.output):
        t.type.tensor_type.shape.dim[0].dim_param = "batch"
    rows = {"input_ids": np.random.default_rng(1).integers(0, V, (16, T)).astype(np.int64)}
    assert lnfold.slice_onnx(m, rows, fraction=0.01).report.error < 1e-5
    r = lnfold.slice_onnx(m, rows, fraction=0.25)
    assert r.report.streams[0].keep == 24 and r.report.params_after < r.report.params_before
    assert 1e-4 < r.report.error < 1
    assert [n.op_type for n in r.model.graph.node].count("SkipSimplifiedLayerNormalization") == 2


# --- center_embeddings: SliceGPT's centering of the embedding rows before its per-block bases (NOT exact)

def _embedding_centered_by_hand(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each row of its Gather's table made zero-mean (what SliceGPT's fuse_modules does)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    (gather,) = [n for n in out.graph.node if n.op_type == "Gather"]
    (table,) = [t for t in out.graph.initializer if t.name == gather.input[0]]
    rows = numpy_helper.to_array(table)
    table.CopyFrom(numpy_helper.from_array(rows - rows.mean(axis=-1, keepdims=True), table.name))
    return out


def _centered_slice(model: onnx.ModelProto, **kw):
    return lnfold.slice_onnx(model, _span_rows(), fraction=0.25, per_block=True, full_width_head=True, **kw)


def _outputs_apart(a, b) -> float:
    from lnfold.onnx_rewrite import calibration as calibration_io
    from lnfold.passes.approx import relative_error

    rows = [_span_rows(8, seed=99)]
    return relative_error(calibration_io.run(a.model, rows), calibration_io.run(b.model, rows))


def test_center_embeddings_slices_as_the_model_whose_embedding_was_centered_by_hand():
    """Every basis (step 0's too) is SliceGPT's: computed on the centered embedding; the large-mean
    embedding (mean 3) makes the uncentered slice another model."""
    m = llama_span("simplified")
    centered = _centered_slice(m, center_embeddings=True)
    assert _outputs_apart(centered, _centered_slice(_embedding_centered_by_hand(m))) < 1e-9
    assert _outputs_apart(centered, _centered_slice(m)) > 1e-3
    assert any(n.startswith("center_embeddings (SliceGPT's choice; NOT exact") and "`emb" in n
               for n in centered.report.notes), centered.report.notes


def test_center_embeddings_planted_bug_first_segment_from_the_uncentered_embedding(monkeypatch):
    """Planted bug: the first segment's basis from the exact fold's (uncentered) capture: another slice."""
    from lnfold.passes import slicer

    sequential = slicer.sequential
    monkeypatch.setattr(slicer, "sequential", lambda *a: sequential(*a[:4], False))
    m = llama_span("simplified")
    wrong = _centered_slice(m, center_embeddings=True)
    monkeypatch.undo()
    assert _outputs_apart(wrong, _centered_slice(_embedding_centered_by_hand(m))) > 1e-6


def test_center_embeddings_needs_per_block_and_says_when_it_centers_nothing():
    with pytest.raises(LnfoldError, match=r"center_embeddings \(--center-embeddings\) .* give per_block"):
        lnfold.slice_onnx(llama_span(), _span_rows(), fraction=0.25, center_embeddings=True)
    from tests.test_slice import calibration, stream_model  # a LayerNorm stream: the exact fold centers it

    r = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True, center_embeddings=True)
    assert any("center_embeddings: no sliced stream of RMSNorms as given" in n for n in r.report.notes)
