"""Branches of the ONNX frontend the rest of the suite does not reach: what the verification gate
refuses (a fold onnxruntime cannot load, an output more, no float64 copy; an off-center Skip sum
without float64), the float64 reference and the reference evaluator it falls back on (a wrong
referee misjudges every fold), and what a user meets: one-line errors for bad input or options
(exit 2, the input untouched, nothing written), reports that say what they measured.
Every model is hand-built and tiny: the whole file runs in seconds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import lnfold
from lnfold.onnx_rewrite.cli import main
from lnfold.onnx_rewrite.exact import exact_run
from tests.onnx_graphs import D, IR_VERSION, Builder, no_layernorm, pre_ln, save_model


def _refused(argv: list[str], capsys, *words: str) -> str:
    """Run the CLI in-process; it must fail with exit 2 and one line on stderr holding `words`."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("lnfold: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def _untouched(path: Path, before: bytes, *outputs: Path) -> None:
    assert path.read_bytes() == before
    for out in outputs:
        assert not out.exists(), out


# --- the float64 reference (exact.py): attributes that make float tensors become double ----------

def _stream_offset_by(op: onnx.NodeProto) -> onnx.ModelProto:
    """x [2, D] + the float tensor `op` makes -> LayerNorm with random γ, β."""
    b = Builder(5)
    x = b.input("x", TensorProto.FLOAT, [2, D])
    b.nodes.append(op)
    b.output(b.layernorm(b.op("Add", [x, op.output[0]])), shape=[2, D])
    return b.model(17)


@pytest.mark.parametrize("op", [
    helper.make_node("Constant", [], ["c"], value_float=0.3),
    helper.make_node("Constant", [], ["c"], value_floats=[0.5, -1.0, 2.0, 0.25, 3.0, -0.5, 1.5, 0.75]),
    helper.make_node("EyeLike", ["x"], ["c"], dtype=TensorProto.FLOAT),
], ids=["value_float", "value_floats", "EyeLike-dtype"])
def test_the_float64_reference_makes_attribute_floats_double_and_runs_in_onnxruntime(op):
    model = _stream_offset_by(op)
    x = (np.random.default_rng(0).standard_normal((2, D)) + 40).astype(np.float32)
    (got,), how = exact_run(model, {"x": x})
    assert how == "onnxruntime"  # a float constant left float32 makes onnxruntime refuse the double copy
    assert got.dtype == np.float64
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    ln = model.graph.node[-1]
    if op.op_type == "EyeLike":
        c = np.eye(2, D)
    else:
        c = np.array(helper.get_attribute_value(op.attribute[0]), dtype=np.float32).astype(np.float64)
    s = x.astype(np.float64) + c
    centered = s - s.mean(-1, keepdims=True)
    want = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + 1e-5) * inits[ln.input[1]] + inits[ln.input[2]]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_float64_reference_makes_a_default_constant_of_shape_double():
    """ConstantOfShape with no `value` makes float32 zeros (the op's default; issue 45 item 1: a
    graph network's message passing scatters into them): in the copy they must be double, or
    onnxruntime refuses ScatterElements (T bound to two types), the reference evaluator the Add, and
    the fold is judged by a tolerance only."""
    b = Builder(5)
    x = b.input("x", TensorProto.FLOAT, [2, D])
    zeros = lambda: b.op("ConstantOfShape", [b.op("Shape", [x])])  # noqa: E731 (no value attribute)
    order = np.stack([np.random.default_rng(k).permutation(D) for k in range(2)]).astype(np.int64)
    scattered = b.op("ScatterElements", [zeros(), b.const("idx", order), x], axis=1)
    b.output(b.layernorm(b.linear(b.op("Add", [scattered, zeros()]), D, D)), shape=[2, D])
    model = b.model(17)
    x_val = (np.random.default_rng(0).standard_normal((2, D)) + 40).astype(np.float32)
    (got,), how = exact_run(model, {"x": x_val})
    assert how == "onnxruntime" and got.dtype == np.float64
    (fp32,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x_val})
    np.testing.assert_allclose(got, fp32, rtol=1e-4, atol=1e-4)
    assert lnfold.fold_onnx(model).verdict.criterion.startswith("float64")  # not the tolerance fallback


# --- bad input: one line, exit 2, the input untouched, nothing written ---------------------------

def _corrupt(tmp_path: Path, edit) -> tuple[Path, bytes, Path]:
    """pre_ln with `edit(model)` applied, saved unchecked; (its path, its bytes, an output path)."""
    m = pre_ln(layers=1)
    edit(m)
    p = save_model(m, tmp_path / "m.onnx")
    return p, p.read_bytes(), tmp_path / "out.onnx"


def _embedding(m: onnx.ModelProto) -> onnx.TensorProto:
    return next(t for t in m.graph.initializer if t.name.startswith("emb"))


def _negative_dim(m: onnx.ModelProto) -> None:
    _embedding(m).dims[0] = -_embedding(m).dims[0]


def _typed_data_short(m: onnx.ModelProto) -> None:
    t = _embedding(m)
    values = numpy_helper.to_array(t).ravel()
    t.ClearField("raw_data")
    t.float_data.extend(values[:-1].tolist())


def _output_of_no_node(m: onnx.ModelProto) -> None:
    m.graph.output.append(helper.make_tensor_value_info("nobody_writes_this", TensorProto.FLOAT, [2]))


@pytest.mark.parametrize("edit, words", [
    (_negative_dim, ["has a negative dimension"]),
    (_typed_data_short, ["holds", "values, but its shape", "truncated or corrupt weights"]),
    (_output_of_no_node, ["graph output `nobody_writes_this` is produced by no node"]),
], ids=["negative-dim", "typed-data-short", "output-of-no-node"])
def test_a_corrupt_model_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, edit, words):
    p, before, out = _corrupt(tmp_path, edit)
    _refused(["fold", str(p), "-o", str(out)], capsys, *words)
    _untouched(p, before, out)


def _with_big_external_weight(tmp_path: Path) -> tuple[Path, Path, onnx.ModelProto]:
    """pre_ln plus an unused 1 MiB initializer (big enough to be read lazily), saved with every
    tensor in m.onnx.data, the big one last; (model path, data path, the model as saved)."""
    m = pre_ln(layers=1)
    m.graph.initializer.append(numpy_helper.from_array(np.ones((512, 512), np.float32), "big"))
    p = save_model(m, tmp_path / "m.onnx", external=True)
    return p, tmp_path / "m.onnx.data", onnx.load(str(p), load_external_data=False)


def _big_offset(m: onnx.ModelProto) -> int:
    t = next(t for t in m.graph.initializer if t.name == "big")
    return int({e.key: e.value for e in t.external_data}["offset"])


@pytest.mark.parametrize("cut, words", [
    ("before-the-tensor", ["External data offset", "exceeds file size", "'big'"]),
    ("inside-the-tensor", ["External data length", "exceeds available data", "'big'"]),
], ids=["before-the-tensor", "inside-the-tensor"])
def test_a_truncated_weights_file_is_refused_in_one_line(tmp_path, capsys, cut, words):
    p, data, saved = _with_big_external_weight(tmp_path)
    offset = _big_offset(saved)
    with open(data, "r+b") as f:
        f.truncate(offset - 4 if cut == "before-the-tensor" else offset + 1000)
    before = p.read_bytes()
    _refused(["fold", str(p), "-o", str(tmp_path / "out.onnx")], capsys, "cannot read its external data", *words)
    _untouched(p, before, tmp_path / "out.onnx", tmp_path / "out.onnx.data")


def test_an_external_record_shorter_than_the_tensors_shape_is_refused(tmp_path, capsys):
    p, _, saved = _with_big_external_weight(tmp_path)
    t = next(t for t in saved.graph.initializer if t.name == "big")
    for e in t.external_data:
        if e.key == "length":
            e.value = str(int(e.value) - 4)
    onnx.save_model(saved, str(p))  # (the record alone changes; the data file stays)
    before = p.read_bytes()
    _refused(["fold", str(p), "-o", str(tmp_path / "out.onnx")], capsys,
             "initializer `big` holds 1048572 bytes, but its shape [512, 512] needs 1048576")
    _untouched(p, before, tmp_path / "out.onnx")


# --- folders: what is copied, what is refused ----------------------------------------------------

def test_a_folders_unfoldable_model_is_copied_with_its_weights_file(tmp_path, capsys):
    """Its data file is no "other file" of the folder (a model reads it): copied with the model."""
    src = tmp_path / "exported"
    src.mkdir()
    save_model(pre_ln(layers=1), src / "decoder.onnx")
    save_model(no_layernorm(), src / "head.onnx", external=True)
    assert main(["fold", str(src), "-o", str(tmp_path / "folded")]) == 0, capsys.readouterr().err
    out = tmp_path / "folded"
    assert (out / "head.onnx.data").read_bytes() == (src / "head.onnx.data").read_bytes()
    copied = lnfold.load_onnx(out / "head.onnx")
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in copied.graph.initializer} == \
        {t.name: numpy_helper.to_array(t).tobytes() for t in lnfold.load_onnx(src / "head.onnx").graph.initializer}


def test_a_folder_with_nothing_to_fold_is_refused_and_nothing_written(tmp_path, capsys):
    src = tmp_path / "plain"
    src.mkdir()
    save_model(no_layernorm(), src / "a.onnx")
    save_model(no_layernorm(), src / "b.onnx")
    _refused(["fold", str(src), "-o", str(tmp_path / "out")], capsys,
             "nothing to fold in its 2 ONNX file(s); first: no LayerNorm found")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["plain"]  # (no staging folder left behind)


def test_a_checkpoint_folder_without_model_safetensors_is_refused_in_one_line(tmp_path, capsys):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_weights.safetensors").write_bytes(b"")
    _refused(["fold", str(src), "-o", str(tmp_path / "out")], capsys,
             "a transformers checkpoint (config.json, safetensors) with neither model.safetensors nor "
             "model.safetensors.index.json, and no ONNX files")
    assert not (tmp_path / "out").exists()


# --- bad options: refused before any work ---------------------------------------------------------

def test_budget_without_the_approximate_mode_is_refused(tmp_path, capsys):
    p = save_model(pre_ln(layers=1), tmp_path / "m.onnx")
    _refused(["fold", str(p), "-o", str(tmp_path / "out.onnx"), "--budget", "0.01"], capsys,
             "--calibrate and --budget belong to --mode rms-approx")
    assert not (tmp_path / "out.onnx").exists()


def test_bench_refuses_a_negative_thread_count(tmp_path, capsys):
    """Refused as the command line is read (passes/options.check_threads as the parser's type):
    the parser's one line, exit 2."""
    p = save_model(pre_ln(layers=1), tmp_path / "m.onnx")
    with pytest.raises(SystemExit) as usage:
        main(["bench", str(p), str(p), "--threads", "-1"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and err.startswith("lnfold: error: ") and err.count("\n") == 1, err
    assert "--threads" in err and "-1 threads: give 0 (onnxruntime's default)" in err, err


def test_quantize_refuses_a_directory_as_its_output(tmp_path, capsys):
    p = save_model(pre_ln(layers=1), tmp_path / "m.onnx")
    _refused(["quantize", str(p), "-o", str(tmp_path), "--weights", "int8"], capsys,
             f"{tmp_path}: is a directory; give a file name for the output")


def test_saving_into_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(lnfold.LnfoldError, match="nodir: output directory does not exist"):
        lnfold.save_onnx(pre_ln(layers=1), tmp_path / "nodir" / "m.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options, message", [
    (dict(activations="int16"), "activations='int16': int8, or none"),
    (dict(seed=-1), "seed -1: a non-negative integer"),
    (dict(rotate="hadamard", gamma_into_readers=False),
     "a rotation needs the norms' weights in their readers (gamma_into_readers=True)"),
    (dict(fold=False, rotate="hadamard"), "rotation, γ into the readers and the online Hadamard are part of the fold: "
                                          "they need fold=True"),
], ids=["activations", "seed", "rotate-without-gamma", "rotate-without-fold"])
def test_quantize_refuses_contradictory_options(options, message):
    with pytest.raises(lnfold.LnfoldError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lnfold.quantize_onnx(pre_ln(layers=1), weights="int8", **options)


def test_quantize_cannot_rotate_a_model_with_nothing_to_fold():
    with pytest.raises(lnfold.LnfoldError, match="cannot rotate: no LayerNorm found in the model"):
        lnfold.quantize_onnx(no_layernorm(), rotate="hadamard")


def test_quantize_refuses_a_model_without_a_linear_layer():
    b = Builder(1)
    x = b.input("x", TensorProto.FLOAT, [2, D])
    b.output(b.layernorm(b.op("Add", [x, b.weight("c", (D,), mean=3.0)])), shape=[2, D])
    with pytest.raises(lnfold.LnfoldError, match=r"no linear layer to quantize in the main graph \(no MatMul or Gemm"):
        lnfold.quantize_onnx(b.model())


# --- the referee where onnxruntime refuses a model: onnx's evaluator with our contrib ops ---------

@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_reference_evaluators_skip_rms_norm_computes_what_onnxruntime_does(with_bias):
    """sessions.contrib_ops: verification of a model onnxruntime refuses runs the folded model's
    SkipSimplifiedLayerNormalization here; every output must be onnxruntime's (before: a None for
    the two it leaves unnamed, which onnx's evaluator refuses, and verification failed)."""
    from lnfold.onnx_rewrite.sessions import reference, session

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, D)) * 2 + 30).astype(np.float32)
    skip = rng.standard_normal((2, 3, D)).astype(np.float32)
    weights = {"gamma": 1 + 0.3 * rng.standard_normal(D), "bias": rng.standard_normal(D) + 5}
    inits = [numpy_helper.from_array(weights[n].astype(np.float32), n) for n in ("gamma", "bias")[:1 + with_bias]]
    outputs = ["y", "mean", "inv_std_var", "sum"]
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"] + ["bias"] * with_bias,
                            outputs, domain="com.microsoft", epsilon=1e-5)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ["x", "skip"] + outputs]
    model = helper.make_model(helper.make_graph([node], "skip_rms", io[:2], io[2:], inits), ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    feeds = {"x": x, "skip": skip}
    ours = [np.asarray(a) for a in reference(model).run(None, feeds)]
    for name, got, onnxruntime_got in zip(outputs, ours, session(model).run(None, feeds), strict=True):
        assert got.dtype == onnxruntime_got.dtype and got.shape == onnxruntime_got.shape, name
        np.testing.assert_allclose(got, onnxruntime_got, rtol=1e-5, atol=1e-6, err_msg=name)
    s = x.astype(np.float64) + skip + (weights["bias"].astype(np.float32) if with_bias else 0)
    np.testing.assert_allclose(ours[3], s, rtol=1e-6)
    want = s / np.sqrt((s**2).mean(-1, keepdims=True) + 1e-5) * weights["gamma"].astype(np.float32)
    np.testing.assert_allclose(ours[0], want, rtol=1e-5)


def _with_tf2onnx_erfc() -> onnx.ModelProto:
    """pre_ln with tf2onnx's Erfc (no ONNX op) on its output: onnxruntime refuses it, onnx's reference
    evaluator runs it (sessions.contrib_ops)."""
    m = pre_ln(layers=2)
    m.graph.node.append(helper.make_node("Erfc", [m.graph.output[0].name], ["erfc_out"], name="erfc"))
    m.graph.output[0].name = "erfc_out"
    return m


def test_a_model_onnxruntime_refuses_folds_for_cuda_and_verifies_in_the_reference_evaluator():
    """tf2onnx's GELU writes Erfc, no ONNX op: onnxruntime refuses the model, onnx's evaluator (with
    our Erfc) runs it. Folded for CUDA, its norms become SkipSimplifiedLayerNormalization, which the
    evaluator must run too (before: "verification failed: the reference evaluator cannot run the
    folded model", a correct fold refused)."""
    result = lnfold.fold_onnx(_with_tf2onnx_erfc(), device="cuda")
    assert result.report.folded == 3
    assert "SkipSimplifiedLayerNormalization" in {n.op_type for n in result.model.graph.node}
    assert "onnxruntime refuses to load the model" in result.criterion and "reference evaluator" in result.criterion
    assert result.exact_err is not None and result.exact_err < 1e-5


# --- verification on the user's inputs ------------------------------------------------------------

def test_inputs_the_original_cannot_run_on_are_refused_naming_the_node(tmp_path, capsys):
    p = save_model(pre_ln(layers=1), tmp_path / "m.onnx")
    np.savez(tmp_path / "ids.npz", ids=np.full((2, 5), 100, np.int64))  # out of the 11-row table
    before = p.read_bytes()
    _refused(["fold", str(p), "-o", str(tmp_path / "out.onnx"), "--inputs", str(tmp_path / "ids.npz")], capsys,
             "cannot verify: Gather `Gather_", "(reached from input ids) on the given inputs",
             "indices element out of data bounds")
    _untouched(p, before, tmp_path / "out.onnx")


# --- the approximate mode on the command line: said to be approximate, in every line that counts ---

def _post_ln(d: int = 16, vocab: int = 32, seq: int = 6) -> onnx.ModelProto:
    """ids -> embedding (mean 3) -> LN (folds) -> h + Linear(h) -> LN (Post-LN: a linear layer reads
    its stream, so only the approximate swap can take it) -> head."""
    b = Builder(7)
    ids = b.input("ids", TensorProto.INT64, ["rows", seq])
    h = b.layernorm(b.op("Gather", [b.weight("emb", (vocab, d), mean=3.0), ids], axis=0), d,
                    beta=b.weight("beta0", (d,), scale=0.05))
    fc = b.op("Add", [b.op("MatMul", [h, b.weight("W", (d, d), scale=0.2)]), b.weight("b", (d,), scale=0.05)])
    h = b.layernorm(b.op("Add", [h, fc]), d, beta=b.weight("beta1", (d,), scale=0.05))
    b.output(b.op("MatMul", [h, b.weight("head", (d, vocab))]), shape=["rows", seq, vocab])
    return b.model(17)


@pytest.mark.parametrize("no_verify", [False, True], ids=["verified", "no-verify"])
def test_the_cli_says_an_approximate_fold_is_not_equivalent(tmp_path, capsys, no_verify):
    p = save_model(_post_ln(), tmp_path / "post.onnx")
    np.savez(tmp_path / "calib.npz", ids=np.random.default_rng(1).integers(0, 32, (8, 6)))
    out = tmp_path / "out.onnx"
    argv = ["fold", str(p), "-o", str(out), "--mode", "rms-approx", "--budget", "0.2", "--calibrate",
            str(tmp_path / "calib.npz")] + ["--no-verify"] * no_verify
    assert main(argv) == 0, capsys.readouterr().err
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("lnfold: verification: ")]
    said = line.removeprefix("lnfold: verification: ")
    assert said.startswith("APPROXIMATE, not equivalent: relative output error ") and "(budget 0.2), held-out " in said
    assert 0 < float(said.split("relative output error ")[1].split()[0]) <= 0.2
    assert said.endswith("; the exact fold not verified (--no-verify)" if no_verify
                         else "; the exact fold verified before the swap")
    meta = {e.key: e.value for e in lnfold.load_onnx(out).metadata_props}
    assert any("NOT exactly equivalent" in v for v in meta.values()), meta


# --- the gate on folded models it must not accept -------------------------------------------------

def _with_extra_output(m: onnx.ModelProto, elem: int = TensorProto.FLOAT) -> None:
    m.graph.output.append(helper.make_tensor_value_info(m.graph.node[0].output[0], elem, None))


def _with_a_wrong_declared_type(m: onnx.ModelProto) -> None:
    """An intermediate tensor declared double: onnxruntime refuses the model; onnx's reference
    evaluator ignores the declaration and computes the same values."""
    m.graph.value_info.append(helper.make_tensor_value_info(m.graph.node[0].output[0], TensorProto.DOUBLE, None))


@pytest.mark.parametrize("break_it, message", [
    (_with_a_wrong_declared_type, "verification failed: onnxruntime cannot run the folded model"),
    (_with_extra_output, "verification failed: the folded model has 2 outputs, the original 1"),
], ids=["onnxruntime-cannot-load-it", "an-output-more"])
def test_verification_refuses_a_folded_model_that_does_not_stand_in_for_the_original(break_it, message):
    """A fold whose model onnxruntime cannot load (while it loads the original) is not run in onnx's
    reference evaluator instead (sessions.Runner without allow_reference: there it would pass), nor one with
    an output the original lacks."""
    from lnfold.onnx_rewrite.verify import check

    original = pre_ln(layers=1)
    folded = lnfold.fold_onnx(original).model
    assert check(original, folded).ok
    break_it(folded)
    with pytest.raises(lnfold.VerificationError, match=message):
        check(original, folded)


def _fp16_cast_typed_fp16() -> onnx.ModelProto:
    """onnxconverter-common's fp16 files: a Cast(to=FLOAT) whose output is declared float16.
    onnxruntime refuses to load it; onnx's reference evaluator meets float32 * float16: only float64
    copies of the original and the fold can be compared (verify._check_float64_copies)."""
    b = Builder(5, np.float16)
    ids = b.input("ids", TensorProto.INT64, [2, 5])
    h = b.embed(ids)
    half = b.op("Cast", [b.const("half", np.array(0.5, np.float16))], to=TensorProto.FLOAT)
    h = b.op("Add", [h, b.linear(b.op("Mul", [b.op("Relu", [b.linear(b.layernorm(h), D, D)]), half]), D, D)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 11))]), shape=[2, 5, 11])
    model = b.model(17)
    model.graph.value_info.append(helper.make_tensor_value_info(half, TensorProto.FLOAT16, []))
    return model


def _fp16_output_through_fast_gelu(m: onnx.ModelProto) -> None:
    """The output through com.microsoft's FastGelu: float-only in onnxruntime, unknown to onnx's
    evaluator, so no float64 copy of the model can run."""
    out = m.graph.output[0]
    m.graph.node.append(helper.make_node("FastGelu", [out.name], ["gelu_out"], name="gelu", domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out.name = "gelu_out"


@pytest.mark.parametrize("break_it, message", [
    (lambda m: _with_extra_output(m, TensorProto.FLOAT16), "the folded model has 2 outputs, the original 1"),
    (_fp16_output_through_fast_gelu, "verification failed: cannot run a float64 copy of the folded model"),
], ids=["an-output-more", "no-float64-copy-of-the-fold"])
def test_the_float64_copies_verdict_refuses_a_fold_it_cannot_compare(break_it, message):
    from lnfold.onnx_rewrite.verify import check

    original = _fp16_cast_typed_fp16()
    folded = lnfold.fold_onnx(original).model
    verdict = check(original, folded)
    assert verdict.ok and verdict.criterion.startswith("float64 copies")
    break_it(folded)
    with pytest.raises(lnfold.VerificationError, match=message):
        check(original, folded)


def test_quantize_auto_on_a_model_with_nothing_to_fold_says_why_each_fold_candidate_was_skipped():
    table = lnfold.quantize_onnx(no_layernorm(), rotate="auto").report.table()
    auto = [line for line in table.splitlines() if line.startswith("auto: ")]
    assert auto[0].startswith("auto: not folded (onnxruntime's quantizer on lnfold's linear layers): rel. RMS error") and auto[0].endswith("<- chosen")
    skipped = [line for line in auto if ": skipped: " in line]
    assert len(skipped) == len(auto) - 3  # all but the model not folded, the plain fold (quantized as given) and plain onnxruntime
    assert all(line.endswith(("skipped: cannot rotate: no LayerNorm found in the model: nothing to fold",
                              "skipped: cannot apply the online Hadamard: no LayerNorm found in the model: nothing to fold"))
               for line in skipped), skipped
    assert sum("skipped: cannot apply the online Hadamard" in line for line in skipped) == 1  # (with hadamard: rotate)


def test_a_quantized_model_says_what_was_done_once_replacing_a_stale_entry():
    from lnfold.onnx_rewrite.quantize import METADATA_KEY

    model = pre_ln(layers=1)
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value="stale: from an earlier run"))
    quantized = lnfold.quantize_onnx(model, weights="int8").model
    said = [p.value for p in quantized.metadata_props if p.key == METADATA_KEY]
    assert len(said) == 1 and "stale" not in said[0] and "NOT exact" in said[0], said


# --- the gate's fallback without float64 reads the sum a Skip RMSNorm normalizes -------------------

def _skip_ln_with_its_sum_read() -> onnx.ModelProto:
    """A pre-LN block ending in onnxruntime's SkipLayerNormalization whose sum (4th output) carries the
    residual on; its MLP's FastGelu (com.microsoft) has no float64 kernel anywhere (onnxruntime's is
    float-only, onnx's evaluator has none): verification falls back to checks without float64."""
    b = Builder(4)
    h = b.embed(b.input("ids", TensorProto.INT64, [2, 5]))
    r = b.linear(b.op("FastGelu", [b.linear(b.layernorm(h), D, D)], domain="com.microsoft"), D, D)
    g, be = b.affine()
    out, _, _, s = b.op("SkipLayerNormalization", [r, h, g, be, b.weight("skip_bias", (D,), mean=1.5)], n_out=4,
                        domain="com.microsoft", epsilon=1e-5)
    b.nodes[-1].output[1:3] = ["", ""]
    h = b.op("Add", [s, b.linear(b.op("Relu", [b.linear(out, D, D)]), D, D)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 11))]), shape=[2, 5, 11])
    return b.model(17, extra_opsets=[("com.microsoft", 1)])


def test_the_fallback_gate_checks_the_centered_sum_of_a_skip_rms_norm(monkeypatch):
    from lnfold.onnx_rewrite import api
    from lnfold.onnx_rewrite.sessions import session, with_outputs
    from lnfold.onnx_rewrite.verify import _new_rms_inputs
    from lnfold.passes import gate
    from tests.conftest import missing_one_centering

    model = _skip_ln_with_its_sum_read()
    skip_sum = next(n for n in model.graph.node if n.op_type == "SkipLayerNormalization").output[3]
    feeds = {"ids": np.random.default_rng(0).integers(0, 11, (2, 5))}

    def off_center_norm_input(folded: onnx.ModelProto):
        names = [name for name, _ in _new_rms_inputs(model, folded)]
        assert skip_sum in names, names  # the Skip variant's input is its sum, its 4th output
        return gate.off_center(dict(zip(names, session(with_outputs(folded, names)).run(names, feeds))), "float32")

    result = lnfold.fold_onnx(model, device="cuda")
    assert result.criterion == "tolerance"
    assert "SkipSimplifiedLayerNormalization" in {n.op_type for n in result.model.graph.node}
    assert off_center_norm_input(result.model) is None
    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=2))  # one of the sum's sources
    assert off_center_norm_input(lnfold.fold_onnx(model, device="cuda", verify=False).model)[0] == skip_sum


# --- writing what a lazy load left on disk ----------------------------------------------------------

def test_a_lazily_loaded_model_saved_as_one_file_keeps_every_weight(tmp_path):
    """load_onnx(lazy=True) leaves the big weight in the input's data file; saving the model inline
    streams those bytes from there into the one output file."""
    p, data, _ = _with_big_external_weight(tmp_path)
    with open(data, "r+b") as f:  # the big weight distinct from a constant, to catch any misplaced byte
        f.seek(_big_offset(onnx.load(str(p), load_external_data=False)))
        f.write(np.random.default_rng(0).standard_normal(512 * 512).astype(np.float32).tobytes())
    lazy = lnfold.load_onnx(p, lazy=True)
    assert any(t.data_location == TensorProto.EXTERNAL for t in lazy.graph.initializer)
    (tmp_path / "out").mkdir()
    lnfold.save_onnx(lazy, tmp_path / "out" / "m.onnx")
    assert [f.name for f in (tmp_path / "out").iterdir()] == ["m.onnx"]  # one file: 1 MiB is not large
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(p)).graph.initializer}
    saved = onnx.load(str(tmp_path / "out" / "m.onnx"))
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in saved.graph.initializer} == \
        {name: w.tobytes() for name, w in weights.items()}


# --- timing: what too few samples can claim ---------------------------------------------------------

def test_one_round_is_its_own_median_and_quartiles():
    from lnfold.onnx_rewrite.timing import interleaved

    stats = interleaved({"a": lambda: None}, rounds=1, warmup=0)["a"]
    assert stats["n"] == 1 and stats["q1"] == stats["median"] == stats["q3"] == stats["samples"][0]
    assert stats["cpu_q1"] == stats["cpu_median"] == stats["cpu_q3"] == stats["cpu_samples"][0]


@pytest.mark.parametrize("den", [[], [0.0, 0.0, 0.0]], ids=["no-samples", "a-zero-baseline"])
def test_a_ratio_without_a_measurable_baseline_claims_nothing(den):
    from lnfold.onnx_rewrite.timing import ratio

    r = ratio({"folded": {"samples": [1.0, 1.1, 0.9]}, "original": {"samples": den}}, "folded", "original")
    assert r["within_noise"] is True and all(np.isnan(r[k]) for k in ("ratio", "lo", "hi"))


def test_bench_refuses_a_model_onnxruntime_cannot_load_in_one_line(tmp_path, capsys):
    p = save_model(_with_tf2onnx_erfc(), tmp_path / "m.onnx")
    _refused(["bench", str(p), str(p), "--seconds", "0.1"], capsys, f"{p}: onnxruntime cannot load it (",
             "Erfc")


def test_quantize_with_too_few_calibration_rows_to_hold_any_out_says_it_measured_on_them():
    rows = {"ids": np.random.default_rng(0).integers(0, 11, (2, 5))}  # one batch of the model's 2 rows
    table = lnfold.quantize_onnx(pre_ln(layers=1), weights="int8", activations="int8", calibrate=rows).report.table()
    assert ("NOT exact (quantization): against the float model on the calibration rows themselves (ids [2, 5]; "
            "too few to hold any out: give --inputs for an independent figure)") in table, table
