"""`lnfold quantize` on a merged decoder (issue 47): Optimum's `decoder_model_merged.onnx` holds the
decoder with and without past key/values in the two branches of an If on the bool input
`use_cache_branch` (shape [1], no batch axis), the branches sharing the main graph's weights.

onnxruntime's int8 dynamic quantizer (with EnableSubgraph) and its int4 MatMulNBits quantizer
quantize inside the branches; its static QDQ quantizer does not (1.32: the branches stay float,
EnableSubgraph or not), so W8A8 is refused in one line before any work. A small synthetic merged
model (two RMSNorm blocks and a head per branch, the weights shared but one) always runs; the
committed Optimum file runs where it is present.

Each test quantizes as given and rotated and checks, on rows of BOTH branches: the quantized
logits close to the float model's, and every linear layer of each branch quantized (counted per
branch). Planted bugs: the then_branch's head left in the old basis after the rotation (the bound
on the then_branch's rows fails, the else_branch's alone would pass); the branches left to the
quantizer's defaults (EnableSubgraph off: the per-branch counts fail).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.passes import LnfoldError
from lnfold.onnx_rewrite import cli, quantize as q
from lnfold.onnx_rewrite.inputs import load_rows
from lnfold.onnx_rewrite.linear_layers import graphs

from .test_llm_files import CORPUS, MERGED, rows as llm_rows

D, M, V, T, N = 32, 64, 48, 6, 8  # width, MLP width, vocabulary, tokens, rows
QUANTIZED_OPS = {"int8": "MatMulInteger", "int4": "MatMulNBits"}
# logits' relative RMS error, quantized against float, on each branch's rows (synthetic model):
# measured 0.9e-2..1.2e-2 (int8) and 0.09..0.10 (int4 b32); a reader left in the old basis: 1.2
BOUND = {"int8": 0.05, "int4": 0.3}


def _rms_block(nodes: list, x: str, gamma: str, tag: str) -> str:
    """RMSNorm as Optimum's Llama export writes it: x · 1/sqrt(mean(x²) + eps) · γ."""
    names = [f"{tag}/{k}" for k in ("pow", "mean", "add", "sqrt", "recip", "mul", "out")]
    nodes += [helper.make_node("Pow", [x, "two"], [names[0]], name=names[0]),
              helper.make_node("ReduceMean", [names[0], "last_axis"], [names[1]], name=names[1], keepdims=1),
              helper.make_node("Add", [names[1], "eps"], [names[2]], name=names[2]),
              helper.make_node("Sqrt", [names[2]], [names[3]], name=names[3]),
              helper.make_node("Reciprocal", [names[3]], [names[4]], name=names[4]),
              helper.make_node("Mul", [x, names[4]], [names[5]], name=names[5]),
              helper.make_node("Mul", [gamma, names[5]], [names[6]], name=names[6])]
    return names[6]


def _branch(label: str, down_1: str) -> onnx.GraphProto:
    """One decoder: embedding, two pre-norm MLP blocks on the residual stream, final norm, head.
    Node names are the same in both branches (the quantizers select by name: lnfold renames).
    `down_1`: the second block's down projection (the branches share every other weight)."""
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h0"], name="embed", axis=0)]
    h = "h0"
    for k, down in enumerate(("down_0", down_1)):
        n = _rms_block(nodes, h, f"gamma_{k}", f"layer{k}/norm")
        nodes += [helper.make_node("MatMul", [n, f"up_{k}"], [f"{label}_up{k}"], name=f"layer{k}/up"),
                  helper.make_node("Relu", [f"{label}_up{k}"], [f"{label}_act{k}"], name=f"layer{k}/act"),
                  helper.make_node("MatMul", [f"{label}_act{k}", down], [f"{label}_down{k}"], name=f"layer{k}/down"),
                  helper.make_node("Add", [h, f"{label}_down{k}"], [f"{label}_h{k + 1}"], name=f"layer{k}/residual")]
        h = f"{label}_h{k + 1}"
    n = _rms_block(nodes, h, "gamma_f", "final_norm")
    nodes.append(helper.make_node("MatMul", [n, "head"], [f"{label}_logits"], name="lm_head"))
    # (the graph's own names must not repeat across branches: prefix the tensors, not the nodes)
    for node in nodes:
        node.output[:] = [o if o.startswith(label) else f"{label}_{o}" for o in node.output]
        node.input[:] = [i if i.startswith(label) or i in _OUTER else f"{label}_{i}" for i in node.input]
    return helper.make_graph(nodes, label, [], [helper.make_tensor_value_info(f"{label}_logits", TensorProto.FLOAT,
                                                                              None)])


_OUTER = {"emb", "input_ids", "two", "last_axis", "eps", "head", "gamma_f", "down_past",
          *(f"{w}_{k}" for w in ("up", "down", "gamma") for k in range(2))}


def merged_model(seed: int = 0) -> onnx.ModelProto:
    """A small merged decoder: If(use_cache_branch) with the two decoders, weights in the main graph
    (random γ in ±[0.5, 2], an embedding of mean +3); the then_branch's second block has its own
    down projection."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)  # noqa: E731
    gamma = lambda: (rng.choice([-1, 1], D) * rng.uniform(0.5, 2, D)).astype(np.float32)  # noqa: E731
    inits = {"emb": (rng.standard_normal((V, D)) + 3).astype(np.float32), "head": w(D, V), "gamma_f": gamma(),
             "down_past": w(M, D), "two": np.array(2, np.float32), "last_axis": np.array([-1], np.int64),
             "eps": np.array(1e-5, np.float32)}
    for k in range(2):
        inits.update({f"up_{k}": w(D, M), f"down_{k}": w(M, D), f"gamma_{k}": gamma()})
    node = helper.make_node("If", ["use_cache_branch"], ["logits"], name="optimum::if",
                            then_branch=_branch("then", "down_past"), else_branch=_branch("else", "down_1"))
    graph = helper.make_graph(
        [node], "merged",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", V])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def merged_rows(use_cache: bool, n: int = N, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, V, (n, T)).astype(np.int64), "use_cache_branch": np.array([use_cache])}


def logits_error(model: onnx.ModelProto, quantized: onnx.ModelProto, feeds: dict) -> float:
    want = ort.InferenceSession(model.SerializeToString()).run(["logits"], feeds)[0]
    got = ort.InferenceSession(quantized.SerializeToString()).run(["logits"], feeds)[0]
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def per_branch(model: onnx.ModelProto) -> dict[str, Counter]:
    return {where.split()[-1]: Counter(n.op_type for n in g.node) for where, g, _ in graphs(model)[1:]}


def float_linear_layers(model: onnx.ModelProto) -> list[str]:
    """MatMuls that still read a constant 2-D float weight, in any graph."""
    return [n.name for _, g, inits in graphs(model) for n in g.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]


SCHEMES = [("int8", None), ("int4", None), ("int4", "int8")]


@pytest.mark.parametrize("rotate", [None, "hadamard"])
@pytest.mark.parametrize("weights,activations", SCHEMES)
def test_both_branches_quantized_and_close(weights, activations, rotate):
    m = merged_model()
    r = lnfold.quantize_onnx(m, weights=weights, activations=activations, rotate=rotate, block_size=32
                             if weights == "int4" else 128, calibrate=merged_rows(False))
    if rotate:
        # (the fold is verified on the --calibrate rows, which take one branch, and on made-up inputs for the other)
        assert r.report.rotated_streams == 2 and r.fold.criterion == "float64; verified on both branches of If " \
            "`optimum::if` (use_cache_branch False and True): the given inputs take use_cache_branch False, made-up " \
            "inputs use_cache_branch True", r.report.table()  # one stream per branch
    counts = per_branch(r.model)
    assert set(counts) == {"then_branch", "else_branch"}
    for branch, c in counts.items():  # 2 blocks x (up, down) + head, in each branch
        assert c[QUANTIZED_OPS[weights]] == 5, (branch, c)
    assert not float_linear_layers(r.model)
    assert r.report.linear_layers == 10 and "5 in If `optimum::if` then_branch" in " ".join(r.report.notes)
    names = [t.name for t in r.model.graph.initializer]
    assert len(names) == len(set(names))  # a weight the branches share: one quantized initializer
    for use_cache in (False, True):
        assert logits_error(m, r.model, merged_rows(use_cache, seed=2)) < BOUND[weights], use_cache
    # measured on the branch the rows take, and said so
    assert "every row takes the else_branch" in r.report.error_inputs, r.report.error_inputs
    assert 0 < r.report.rel_rms < BOUND[weights]


def test_a_then_branch_reader_left_in_the_old_basis_fails_the_bound(monkeypatch):
    """Planted: after the (verified) rotation, the then_branch's head reads its weight as given, in
    the old basis, while the stream it reads is rotated. The rows of the else_branch (what the
    report measures) do not see it; the bound on the then_branch's rows does."""
    m = merged_model()
    real = q.prepare

    def then_head_unrotated(model, **kw):
        prepared = real(model, **kw)
        if prepared.fold is not None and kw.get("rotate"):
            work = prepared.model
            then = next(g for where, g, _ in graphs(work) if where.endswith("then_branch"))
            head = next(n for n in then.node if n.name.startswith("lm_head"))
            old = next(t for t in m.graph.initializer if t.name == "head")
            work.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(old), "head_as_given"))
            head.input[1] = "head_as_given"
        return prepared

    monkeypatch.setattr(q, "prepare", then_head_unrotated)
    r = lnfold.quantize_onnx(m, weights="int8", rotate="hadamard", calibrate=merged_rows(False))
    assert logits_error(m, r.model, merged_rows(False, seed=2)) < BOUND["int8"]
    assert logits_error(m, r.model, merged_rows(True, seed=2)) > BOUND["int8"]


def test_without_enable_subgraph_the_branch_counts_fail(monkeypatch):
    """Planted: quantize_dynamic left at its default (EnableSubgraph off): nothing in the branches
    is quantized, which the per-branch counts see."""
    import onnxruntime.quantization as ort_quantization  # (what quantize._onnxruntime imports it from)

    real = ort_quantization.quantize_dynamic
    monkeypatch.setattr(ort_quantization, "quantize_dynamic", lambda *a, extra_options=None, **kw: real(
        *a, extra_options={k: v for k, v in (extra_options or {}).items() if k != "EnableSubgraph"}, **kw))
    r = lnfold.quantize_onnx(merged_model(), weights="int8", calibrate=merged_rows(False))
    assert all(c["MatMulInteger"] == 0 for c in per_branch(r.model).values())
    assert len(float_linear_layers(r.model)) == 10


def test_w8a8_on_branches_is_refused_in_one_line(tmp_path, capsys):
    src = tmp_path / "merged.onnx"
    onnx.save(merged_model(), str(src))
    np.savez(tmp_path / "rows.npz", **merged_rows(False))
    out = tmp_path / "out"
    out.mkdir()
    code = cli.main(["quantize", str(src), "-o", str(out / "q.onnx"), "--weights", "int8", "--activations", "int8",
                     "--calibrate", str(tmp_path / "rows.npz")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "W8A8" in err and "quantize_static" in err and "then_branch" in err and not any(out.iterdir())
    with pytest.raises(LnfoldError, match="W8A8"):  # before any work: no rows are read
        lnfold.quantize_onnx(merged_model(), weights="int8", activations="int8", calibrate=tmp_path / "none.npz")


def test_rows_feed_use_cache_branch_whole_with_every_run():
    """`use_cache_branch` has no batch axis: given once, fed with every run of the rows."""
    rows = load_rows(merged_rows(False, n=20), merged_model(), "rows")
    assert rows.count == 20 and set(rows.unbatched) == {"use_cache_branch"}
    runs = rows.runs()
    assert [len(r["input_ids"]) for r in runs] == [16, 4] and all(r["use_cache_branch"].shape == (1,) for r in runs)
    fit, held = rows.split()
    assert fit.count == 10 and held.runs()[0]["use_cache_branch"].tolist() == [False]


def test_both_branches_measured_are_said():
    m = merged_model()
    feeds = merged_rows(True)
    r = lnfold.quantize_onnx(m, weights="int8", inputs=feeds)
    assert "every row takes the then_branch" in r.report.error_inputs and "else_branch" in r.report.error_inputs


# --- Optimum's file ---------------------------------------------------------------------------------

def _merged_llm_rows(model: onnx.ModelProto, use_cache: bool) -> dict:
    """test_llm_files.rows (an empty past) for the no-past branch; a past of 3 for the other."""
    feeds = llm_rows(model, n=4, t=5)
    if use_cache:
        rng = np.random.default_rng(3)
        feeds.update({k: rng.standard_normal((4, 2, 3, 16)).astype(np.float32) for k in feeds if k.startswith("past")})
        feeds["attention_mask"] = np.ones((4, 8), np.int64)
        feeds["position_ids"] = feeds["position_ids"] + 3
    feeds["use_cache_branch"] = np.array([use_cache])
    return feeds


@pytest.mark.skipif(not (CORPUS / MERGED).exists(), reason="the Optimum corpus file is not here")
@pytest.mark.slow  # (1-3 s each; the synthetic model's tests above are the fast tier's)
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_optimums_merged_decoder_quantizes_rotated(tmp_path, capsys, weights):
    m = onnx.load(str(CORPUS / MERGED))
    np.savez(tmp_path / "rows.npz", **llm_rows(m))
    out = tmp_path / "q.onnx"
    assert cli.main(["quantize", str(CORPUS / MERGED), "-o", str(out), "--weights", weights, "--rotate", "hadamard",
                     "--calibrate", str(tmp_path / "rows.npz")]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out  # (measured on the rows' branch; the fold verified on both)
    assert "every row takes the else_branch" in said and "verified on both branches of If `optimum::if`" in said, said
    quantized = onnx.load(str(out))
    for branch, c in per_branch(quantized).items():  # 2 layers x 7 projections + lm_head
        assert c[QUANTIZED_OPS[weights]] == 15, (branch, c)
    for use_cache in (False, True):
        assert logits_error(m, quantized, _merged_llm_rows(m, use_cache)) < BOUND[weights], use_cache



def test_rotate_auto_and_its_plain_reference_quantize_the_branches():
    r = lnfold.quantize_onnx(merged_model(), weights="int8", rotate="auto", calibrate=merged_rows(False, n=16))
    plain = r.report.candidates[-1]
    assert plain.get("plain") and "EnableSubgraph" in plain["candidate"], plain
    assert plain["changed_ops"]["MatMulInteger"] == [0, 10], plain  # (not left float, as its default would)
    assert all(c["MatMulInteger"] == 5 for c in per_branch(r.model).values())


def test_gemms_in_both_branches_become_matmuls_reading_one_transposed_weight():
    """GPT-2's merged decoder: its Conv1D layers are Gemms (transB) inside the branches, reading the
    main graph's weights. Rewritten in both (else the quantizers skip them), one transposed copy of
    the shared weight, the untransposed one gone, the outputs as before."""
    from lnfold.onnx_rewrite.linear_layers import gemm_to_matmul

    rng = np.random.default_rng(0)
    branch = lambda label: helper.make_graph(  # noqa: E731
        [helper.make_node("Gemm", ["x", "w", "b"], [f"{label}_y"], name="conv1d", transB=1)], label, [],
        [helper.make_tensor_value_info(f"{label}_y", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("then"), else_branch=branch("else"))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, D]), helper.make_tensor_value_info("c", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [numpy_helper.from_array(rng.standard_normal((5, D)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(m)
    assert gemm_to_matmul(rewritten) == (2, [])
    assert [t.name for t in rewritten.graph.initializer] == ["b", "w__transposed"]
    assert all(c["MatMul"] == 1 and not c["Gemm"] for c in per_branch(rewritten).values())
    x = rng.standard_normal((3, D)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array([c])}
        want, got = (ort.InferenceSession(a.SerializeToString()).run(None, feeds)[0] for a in (m, rewritten))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
