"""Issue 45 items 6, 7 and 9: `lnfold quantize` on the weight layouts real exporters write.

6. A linear layer's weight reached through Transpose / Identity / Cast / Reshape of an initializer
   is a constant weight (ALBERT's MatMuls read `Transpose(initializer)`: "linear layers quantized: 1").
7. A weight read through an Identity alias (TorchScript's shared weights) is quantized once, and the
   float copy goes: the quantized file was 1.25x the float one, both copies kept.
9. `--rotate auto`'s first candidate is lnfold's selection without the fold, not plain onnxruntime:
   named for what it is, with plain `quantize_dynamic(model, weight_type=QInt8)` reported beside it.

Small onnx.helper graphs, the stand-in's shape (tests/test_quantize_rows.py): x -> linear -> LayerNorm
-> linear -> y.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.onnx_rewrite import cli, quantize as q
from lnfold.passes import quantize as pq
from lnfold.onnx_rewrite.linear_layers import linear_layers
from tests.test_quantize_rows import stand_in

D = 64  # wide enough that the weights are most of the file


def _weight(rng, shape, scale=0.2) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def through(kind: str) -> onnx.ModelProto:
    """x [1, 4, D] -> MatMul(x, W1) + b1 -> LayerNormalization -> MatMul(n, B2) -> y, where B2 is the
    [D, 8] weight reached from an initializer through `kind`: Transpose of a stored [8, D] (ALBERT,
    torch's exporters for nn.Linear), Identity (TorchScript's aliases), Cast of a float16 tensor,
    Reshape of a flat one, or Identity then Transpose."""
    rng = np.random.default_rng(0)
    w1, w2 = _weight(rng, (D, D)), _weight(rng, (D, 8))
    b1 = (rng.standard_normal(D) + 3.0).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, D).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(D) * 0.2).astype(np.float32), "beta")]
    chain = []
    if kind == "Transpose":
        inits.append(numpy_helper.from_array(w2.T.copy(), "w2_stored"))
        chain.append(helper.make_node("Transpose", ["w2_stored"], ["w2"], perm=[1, 0]))
    elif kind == "Identity":
        inits.append(numpy_helper.from_array(w2, "w2_stored"))
        chain.append(helper.make_node("Identity", ["w2_stored"], ["w2"]))
    elif kind == "Cast":
        inits.append(numpy_helper.from_array(w2.astype(np.float16), "w2_stored"))
        chain.append(helper.make_node("Cast", ["w2_stored"], ["w2"], to=TensorProto.FLOAT))
    elif kind == "Reshape":
        inits += [numpy_helper.from_array(w2.reshape(-1), "w2_stored"),
                  numpy_helper.from_array(np.array([D, 8], np.int64), "w2_shape")]
        chain.append(helper.make_node("Reshape", ["w2_stored", "w2_shape"], ["w2"]))
    elif kind == "Identity+Transpose":
        inits.append(numpy_helper.from_array(w2.T.copy(), "w2_stored"))
        chain += [helper.make_node("Identity", ["w2_stored"], ["w2_alias"]),
                  helper.make_node("Transpose", ["w2_alias"], ["w2"], perm=[1, 0])]
    nodes = chain + [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h"]),
                     helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
                     helper.make_node("MatMul", ["n", "w2"], ["y"])]
    g = helper.make_graph(nodes, "through", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def shared_through_identity() -> onnx.ModelProto:
    """TorchScript's shared weight: one [D, D] initializer read by a MatMul directly and by another
    through an Identity alias (x -> MatMul W -> LayerNorm -> MatMul Identity(W) -> y)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(_weight(rng, (D, D)), "w"),
             numpy_helper.from_array((rng.standard_normal(D) + 3.0).astype(np.float32), "b"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, D).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(D) * 0.2).astype(np.float32), "beta")]
    nodes = [helper.make_node("Identity", ["w"], ["onnx::MatMul_7"]),
             helper.make_node("MatMul", ["x", "w"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n", "onnx::MatMul_7"], ["y"])]
    g = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def tied_table() -> onnx.ModelProto:
    """A tied embedding: ids -> Gather(E) -> MatMul W -> LayerNorm -> MatMul(n, Transpose(E)) -> logits.
    E is read as given by the Gather: a transposed copy for the MatMul would store it twice."""
    rng = np.random.default_rng(2)
    vocab = 256
    inits = [numpy_helper.from_array(_weight(rng, (vocab, D), 1.0), "emb"),
             numpy_helper.from_array(_weight(rng, (D, D)), "w"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, D).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(D) * 0.2).astype(np.float32), "beta")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e0"]), helper.make_node("MatMul", ["e0", "w"], ["e"]),
             helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["n", "emb_t"], ["logits"])]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, vocab])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def rows(n: int = 3, seed: int = 5) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((n, 4, D)).astype(np.float32)}


@pytest.mark.parametrize("kind", ["Transpose", "Identity", "Cast", "Reshape", "Identity+Transpose"])
def test_a_weight_through_transpose_identity_cast_or_reshape_is_a_constant_weight(kind):
    model = through(kind)
    onnx.checker.check_model(model, full_check=True)
    assert len(linear_layers(model)) == 1  # as given: only the direct read has an initializer weight
    for fold in (False, True):
        rep = lnfold.quantize_onnx(model, weights="int8", fold=fold, inputs=rows()).report
        assert rep.linear_layers == 2, (kind, fold, rep.table())
        assert rep.changed_ops().get("MatMulInteger", (0, 0))[1] == 2, rep.table()
        assert rep.rel_rms < 0.05, rep.errors
        assert any("constant weight" in n for n in rep.notes), rep.notes
    quantized = lnfold.quantize_onnx(model, weights="int8", fold=False, inputs=rows()).model
    left = [n.op_type for n in quantized.graph.node if set(n.output) & {"w2", "w2_alias"}]
    assert left == [] and "w2_stored" not in {t.name for t in quantized.graph.initializer}, left  # the chain went


def test_int4_and_static_take_the_weight_through_a_transpose_too(tmp_path):
    rep = lnfold.quantize_onnx(through("Transpose"), weights="int4", block_size=16, inputs=rows()).report
    assert rep.linear_layers == 2 and rep.changed_ops()["MatMulNBits"][1] == 2, rep.table()
    calib = tmp_path / "calib.npz"
    np.savez(calib, **rows(4, seed=9))
    rep = lnfold.quantize_onnx(through("Transpose"), weights="int8", activations="int8", calibrate=calib).report
    assert rep.linear_layers == 2, rep.table()


def test_a_weight_shared_through_an_identity_is_quantized_once_and_the_float_copy_goes():
    model = shared_through_identity()
    result = lnfold.quantize_onnx(model, weights="int8", fold=False, inputs=rows())
    rep = result.report
    print(f"as given: float {rep.bytes_before} B -> int8 {rep.bytes_after} B "
          f"({rep.bytes_after / rep.bytes_before:.2f}x)")
    assert rep.linear_layers == 2, rep.table()
    # one int8 copy of the D x D weight: about a quarter of the float file (before: float + int8, 1.25x)
    assert rep.bytes_after < 0.4 * rep.bytes_before, (rep.bytes_before, rep.bytes_after)
    floats = [t.name for t in result.model.graph.initializer
              if t.data_type == TensorProto.FLOAT and np.prod(t.dims) >= D * D]
    assert floats == [], floats
    # folded, the stream's source is centered (a copy of its own, the reader keeps W): two int8
    # matrices, still well under the float file (before: 1.30x)
    rep = lnfold.quantize_onnx(model, weights="int8", inputs=rows()).report
    print(f"folded: float {rep.bytes_before} B -> int8 {rep.bytes_after} B ({rep.bytes_after / rep.bytes_before:.2f}x)")
    assert rep.linear_layers == 2 and rep.bytes_after < 0.7 * rep.bytes_before, rep.table()


def test_a_tied_table_read_as_given_elsewhere_stays_float_and_is_said():
    model = tied_table()
    ids = {"ids": np.random.default_rng(0).integers(0, 256, (3, 4)).astype(np.int64)}
    rep = lnfold.quantize_onnx(model, weights="int8", fold=False, inputs=ids).report
    # quantizing its transposed copy would keep the float table and add an int8 one: bigger than the float file
    assert rep.bytes_after <= rep.bytes_before * 1.01, (rep.bytes_before, rep.bytes_after, rep.table())
    assert any("kept float" in n and "emb" in n and "Gather" in n for n in rep.notes), rep.notes


def test_the_prepared_model_computes_what_the_original_does():
    from lnfold.onnx_rewrite.verify import session

    for kind in ("Transpose", "Cast", "Reshape", "Identity+Transpose"):
        model = through(kind)
        prepared = q.prepare(model, fold=False).model
        assert len(linear_layers(prepared)) == 2
        x = rows(1)["x"]
        a, = session(model).run(None, {"x": x})
        b, = session(prepared).run(None, {"x": x})
        assert np.array_equal(a, b), kind


# --- item 9: the baseline named for what it is, plain onnxruntime beside it -------------------------

def attention_like() -> onnx.ModelProto:
    """The stand-in with an activation x activation MatMul (attention's scores) and an embedding
    Gather: plain quantize_dynamic quantizes those too, lnfold's selection leaves them float."""
    model = stand_in(1)
    g = model.graph
    rng = np.random.default_rng(3)
    g.initializer.append(numpy_helper.from_array(_weight(rng, (10, 8), 1.0), "table"))
    g.initializer.append(numpy_helper.from_array(np.arange(4, dtype=np.int64).reshape(1, 4), "pos"))
    g.node.extend([helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1]),
                   helper.make_node("MatMul", ["y", "yt"], ["scores"]),
                   helper.make_node("Gather", ["table", "pos"], ["posemb"]),
                   helper.make_node("Add", ["y", "posemb"], ["z"])])
    g.output.extend([helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 4, 4]),
                     helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 8])])
    return model


def test_auto_names_its_baseline_and_reports_plain_onnxruntime_beside_it():
    model = attention_like()
    given = {"x": np.random.default_rng(7).standard_normal((3, 4, 16)).astype(np.float32)}
    rep = lnfold.quantize_onnx(model, weights="int8", rotate="auto", inputs=given).report
    labels = [t["candidate"] for t in rep.candidates]
    assert not any("onnxruntime alone" in label for label in labels), labels
    base = rep.candidates[0]
    assert "not folded" in base["candidate"] and "linear layers" in base["candidate"], base
    plain = [t for t in rep.candidates if t.get("plain")]
    assert len(plain) == 1 and "quantize_dynamic" in plain[0]["candidate"] and "weight_type=QInt8" in \
        plain[0]["candidate"], rep.candidates
    assert not plain[0].get("chosen") and np.isfinite(plain[0]["score"])
    # plain onnxruntime quantizes more than lnfold's selection (the embedding table: a quantized
    # Gather, dequantized after), and says so in its op changes
    assert plain[0]["changed_ops"]["DequantizeLinear"] == [0, 1] and "DequantizeLinear" not in base["ops"], \
        (plain[0], base)
    assert plain[0]["bytes"] > 0
    table = rep.table()
    assert "plain onnxruntime" in table and "reference, never chosen" in table, table
    assert "onnxruntime alone" not in table and "onnxruntime alone" not in (rep.chosen or "")


def test_cli_auto_prints_plain_onnxruntime(tmp_path, capsys):
    path, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(stand_in(1), path)
    assert cli.main(["quantize", str(path), "-o", str(out), "--weights", "int4", "--block-size", "16",
                     "--rotate", "auto"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("auto: ")]
    assert len(lines) == len(pq.AUTO_CANDIDATES) + 1, lines
    assert any("plain onnxruntime" in line and "MatMulNBitsQuantizer" in line for line in lines), lines
