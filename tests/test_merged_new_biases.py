"""New biases inside the branches of an If (Optimum's merged decoders of OPT and Whisper).

A LayerNorm's β moves into its readers' biases when its stream is rotated (or γ goes into the
readers); a reader with no bias (OPT's lm_head, Whisper's k_proj) gets a new one, `W β`. In a merged
decoder those readers are in the If's branches: the new bias was emitted in the main graph, where
the branch's node is not (`KeyError: 'optimum::if/then_branch::/lm_head/MatMul'`). Now every new
bias goes into the graph that holds its reader, its `W β` computed from the constants by view name
as the constant edits are (onnx_rewrite/subgraphs.apply).

A small synthetic merged decoder (a LayerNorm block and a bias-free head per branch, the weights
shared in the main graph) runs in the fast tier; the committed Optimum files run where present
(slow: a few seconds each). Each folds, verifies in float64 (the fold's own gate), and is checked
again here on rows of BOTH branches. Planted bug: the new bias's `W β` left out (the head loses β's
contribution: the then_branch's logits differ and the fold's own verification refuses it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.passes import VerificationError

CORPUS = Path(__file__).parent / "corpus"
MERGED = ["optimum_opt_decoder_model_merged.onnx", "optimum_whisper_decoder_model_merged.onnx",
          "optimum_gpt2_decoder_model_merged.onnx", "optimum_llama_decoder_model_merged.onnx",
          "onnxslim_gpt2_decoder_model_merged.onnx"]
D, M, V, T, N = 16, 32, 24, 5, 4  # width, MLP width, vocabulary, tokens, rows


def _branch(label: str, extra: bool) -> onnx.GraphProto:
    """One decoder: embedding, a pre-LN MLP block, a final LayerNorm, a head with no bias.
    `extra`: one more (identity-valued) Add, so the branches differ as Optimum's do."""
    p = lambda s: f"{label}_{s}"  # noqa: E731  (tensor names are unique across branches)
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], [p("h0")], name="/embed", axis=0),
             helper.make_node("LayerNormalization", [p("h0"), "g0", "b0"], [p("n0")], name="/layer0/norm",
                              axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", [p("n0"), "up"], [p("up")], name="/layer0/up/MatMul"),
             helper.make_node("Add", [p("up"), "up_bias"], [p("upb")], name="/layer0/up/Add"),
             helper.make_node("Relu", [p("upb")], [p("act")], name="/layer0/act"),
             helper.make_node("MatMul", [p("act"), "down"], [p("down")], name="/layer0/down/MatMul"),
             helper.make_node("Add", [p("h0"), p("down")], [p("h1")], name="/layer0/residual")]
    h = p("h1")
    if extra:
        nodes.append(helper.make_node("Add", [h, "zero"], [p("h1z")], name="/layer0/extra"))
        h = p("h1z")
    nodes += [helper.make_node("LayerNormalization", [h, "gf", "bf"], [p("nf")], name="/final_norm",
                               axis=-1, epsilon=1e-5),
              helper.make_node("MatMul", [p("nf"), "head"], [p("logits")], name="/lm_head/MatMul")]
    return helper.make_graph(nodes, label, [], [helper.make_tensor_value_info(p("logits"), TensorProto.FLOAT,
                                                                              None)])


def merged_model(seed: int = 0) -> onnx.ModelProto:
    """An If on `use_cache_branch` whose branches read the main graph's weights (as merge_decoders
    leaves them), with random γ and β and a large mean in the embedding."""
    rng = np.random.default_rng(seed)
    w = {"emb": rng.standard_normal((V, D)) + 3.0, "up": rng.standard_normal((D, M)) / 4,
         "up_bias": rng.standard_normal(M), "down": rng.standard_normal((M, D)) / 4,
         "head": rng.standard_normal((D, V)) / 4, "zero": np.zeros(D)}
    for k in ("0", "f"):
        w[f"g{k}"] = 1 + rng.standard_normal(D) / 2
        w[f"b{k}"] = rng.standard_normal(D)
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    node = helper.make_node("If", ["use_cache_branch"], ["logits"], name="optimum::if",
                            then_branch=_branch("then", extra=True), else_branch=_branch("else", extra=False))
    graph = helper.make_graph([node], "merged",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                               helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _outputs(model: onnx.ModelProto, use_cache: bool) -> np.ndarray:
    ids = np.random.default_rng(1).integers(0, V, (N, T)).astype(np.int64)
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"input_ids": ids, "use_cache_branch": np.array([use_cache])})[0]


@pytest.mark.parametrize("options", [dict(rotate="hadamard"), dict(gamma_into_readers=True),
                                     dict(rotate="hadamard", gamma_into_readers=True)],
                         ids=["hadamard", "gamma-into-readers", "both"])
def test_new_biases_in_both_branches_of_an_if(options):
    m = merged_model()
    r = lnfold.fold_onnx(m, **options)  # (verifies in float64; raises where it is not exact)
    # the heads of both branches took W β as a new bias, each in its own branch
    for a in r.model.graph.node[0].attribute:
        producer = {o: n for n in a.g.node for o in n.output}
        adds = [n for n in a.g.node if n.op_type == "Add" and any("/lnfold_bias" in i for i in n.input)]
        assert [producer[n.input[0]].name.startswith("/lm_head/MatMul") for n in adds] == [True], a.name
    for use_cache in (False, True):
        want, got = _outputs(m, use_cache), _outputs(r.model, use_cache)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), use_cache


def test_a_new_bias_left_without_beta_fails_verification(monkeypatch):
    from lnfold.onnx_rewrite import crms
    monkeypatch.setattr(crms, "compute_new_bias", lambda nb, get: np.zeros(V, np.float32))
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(merged_model(), rotate="hadamard")


def corpus_feeds(model: onnx.ModelProto, use_cache: bool, n: int = 2, past: int = 3) -> dict:
    """Rows of one branch of an Optimum merged decoder: no past (the branch without cache still takes
    the past inputs, empty) or `past` cached positions. Tokens: 16 without cache, 1 with (Whisper's
    export fixed both lengths: a Reshape to [16, 1] in one branch, to [1, 1] in the other)."""
    rng = np.random.default_rng(0)
    t, p = (1, past) if use_cache else (16, 0)
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 100, (n, t)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((n, p + t), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(p, p + t), (n, t)).astype(np.int64).copy()
        elif i.name == "encoder_hidden_states":
            feeds[i.name] = rng.standard_normal((n, 6, dims[2])).astype(np.float32)
        elif i.name.startswith("past_key_values"):
            length = 6 if ".encoder." in i.name else p
            feeds[i.name] = rng.standard_normal((n, dims[1], length, dims[3])).astype(np.float32)
        elif i.name == "use_cache_branch":
            feeds[i.name] = np.array([use_cache])
        else:
            raise AssertionError(f"no rows for input {i.name}")
    return feeds


OPT, WHISPER = "optimum_opt_decoder_model_merged.onnx", "optimum_whisper_decoder_model_merged.onnx"
CASES = [(name, "hadamard", dict(rotate="hadamard")) for name in MERGED if "llama" not in name]  # (Llama's:
CASES += [(name, label, options) for name in (OPT, WHISPER)  # test_llm_files)
          for label, options in (("gamma-into-readers", dict(gamma_into_readers=True)), ("crms", dict(mode="crms")))]


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [pytest.param(n, o, id=f"{n.split('_decoder')[0]}-{label}")
                                           for n, label, o in CASES])
def test_an_optimum_merged_decoder_folds_exactly_in_both_branches(name, options):
    if not (CORPUS / name).exists():
        pytest.skip(f"{name} not in tests/corpus")
    m = onnx.load(str(CORPUS / name))
    r = lnfold.fold_onnx(m, **options)
    assert r.criterion == "float64; verified on both branches of If `optimum::if` (use_cache_branch False and True)" \
        and r.exact_err <= 1e-5, r  # the fold's own gate (now on rows of both branches: verify.branch_inputs)
    a, b = (ort.InferenceSession(x.SerializeToString(), providers=["CPUExecutionProvider"]) for x in (m, r.model))
    for use_cache in (False, True):
        feeds = corpus_feeds(m, use_cache)
        for w, g in zip(a.run(None, feeds), b.run(None, feeds)):  # (Whisper's cached branch: empty present.encoder.*)
            assert g.shape == w.shape and (not w.size or np.abs(g - w).max() <= 1e-5 * np.abs(w).max()), use_cache
