"""The ONNX path end to end: real architectures, hand-written graphs, the CLI, and a planted bug."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lnfold import onnx_rewrite
from lnfold.onnx_rewrite import NothingToFold, VerificationError, fold_model
from lnfold.onnx_rewrite.verify import compare

from .conftest import missing_one_centering

RTOL = 1e-5


def _ops(model):
    return [n.op_type for n in model.graph.node]


# --- real architectures ----------------------------------------------------------------------

@pytest.mark.parametrize("target", ["ort", "onnx", "portable"])
def test_gpt2_every_layernorm_folds(zoo_onnx, target):
    _, _, model = zoo_onnx("gpt2")
    res = fold_model(model, target=target)
    layers = 2
    assert res.report.folded == 2 * layers + 1 and res.report.kept == 0
    assert res.max_rel_err < RTOL
    assert "LayerNormalization" not in _ops(res.model)
    expected = {"ort": "SimplifiedLayerNormalization", "onnx": "RMSNormalization", "portable": "Sqrt"}[target]
    assert expected in _ops(res.model)


def test_gpt2_ort_target_fuses_residual_adds_for_cuda_only(zoo_onnx):
    _, _, model = zoo_onnx("gpt2")
    # CPU: Add + SimplifiedLayerNormalization (onnxruntime's fused Skip kernel is slower there)
    ops = _ops(fold_model(model).model)
    assert ops.count("SimplifiedLayerNormalization") == 5 and "SkipSimplifiedLayerNormalization" not in ops
    # CUDA: every norm but the first (fed by token + position embeddings) reads a residual Add
    ops = _ops(fold_model(model, device="cuda").model)
    assert ops.count("SkipSimplifiedLayerNormalization") >= 4
    assert ops.count("SimplifiedLayerNormalization") + ops.count("SkipSimplifiedLayerNormalization") == 5


def test_vit_every_layernorm_folds(zoo_onnx):
    _, _, model = zoo_onnx("vit")
    res = fold_model(model)
    assert (res.report.folded, res.report.kept) == (5, 0)
    assert res.max_rel_err < RTOL


def test_bert_only_embeddings_layernorm_folds(zoo_onnx):
    _, _, model = zoo_onnx("bert")
    res = fold_model(model)
    verdicts = [n.verdict for n in res.report.norms]
    assert verdicts == ["fold"] + ["keep"] * 4
    for n in res.report.norms[1:]:
        assert "read by MatMul" in n.reason and "Post-LN block" in n.reason and "shift-invariant" not in n.reason
    assert res.max_rel_err < RTOL


@pytest.mark.slow  # an opset-23 dynamo export (~15 s of CPU); the fast tier folds opset 18, and the slow tier's
# corpus (tests/test_corpus.py) folds the committed opset-23 GPT-2, ViT and Whisper exports with their hand counts
def test_opset23_export_folds_too(zoo_onnx):
    _, _, model = zoo_onnx("gpt2", opset=23)
    res = fold_model(model)
    assert res.report.folded == 5 and res.max_rel_err < RTOL


def test_input_model_is_not_modified(zoo_onnx):
    _, _, model = zoo_onnx("vit")
    before = model.SerializeToString()
    fold_model(model)
    assert model.SerializeToString() == before


# --- the tests can fail -------------------------------------------------------------------------

def test_planted_bug_skipped_centering_fails_verification(zoo_onnx, monkeypatch):
    """Drop one centering edit from the plan: the equivalence check must catch it."""
    _, _, model = zoo_onnx("gpt2")
    sabotaged = missing_one_centering(onnx_rewrite.api.make_plan)

    monkeypatch.setattr(onnx_rewrite.api, "make_plan", sabotaged)
    with pytest.raises(VerificationError):
        fold_model(model)


def test_swap_without_centering_is_not_equivalent(zoo_onnx):
    """The adversarial weights make an unfolded LayerNorm -> RMSNorm swap visibly wrong."""
    _, _, model = zoo_onnx("gpt2")
    swapped = onnx.ModelProto()
    swapped.CopyFrom(model)
    for n in swapped.graph.node:
        if n.op_type == "LayerNormalization":
            n.op_type = "SimplifiedLayerNormalization"
            del n.input[2:]
    err, _ = compare(model, swapped)
    assert err > 1e-2


# --- hand-written graphs -----------------------------------------------------------------------

D, T = 16, 5


def _const(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _model(nodes, inits, inputs, outputs, opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ln(i, x, out, rng, inits):
    inits += [_const(f"g{i}", 1 + 0.5 * rng.standard_normal(D)), _const(f"b{i}", 0.5 * rng.standard_normal(D))]
    return helper.make_node("LayerNormalization", [x, f"g{i}", f"b{i}"], [out], name=f"ln{i}", axis=-1, epsilon=1e-5)


def _block(i, h, rng, nodes, inits):
    """h + W_i · LN_i(h) + b_i  (a Pre-LN residual block with a large-mean writer)."""
    nodes.append(_ln(i, h, f"n{i}", rng, inits))
    inits += [_const(f"W{i}", rng.standard_normal((D, D)) + 3.0), _const(f"c{i}", rng.standard_normal(D) + 5.0)]
    nodes += [
        helper.make_node("MatMul", [f"n{i}", f"W{i}"], [f"m{i}"], name=f"mm{i}"),
        helper.make_node("Add", [f"m{i}", f"c{i}"], [f"o{i}"], name=f"bias{i}"),
        helper.make_node("Add", [h, f"o{i}"], [f"h{i}"], name=f"res{i}"),
    ]
    return f"h{i}"


def _nonlinear_start_model(blocks: int):
    """A stream started by a Tanh (opaque: only a Recenter can center it), read by LayerNorms."""
    rng = np.random.default_rng(1)
    nodes, inits = [helper.make_node("Tanh", ["x"], ["t"], name="act")], []
    inits.append(_const("shift", np.full(D, 2.0)))
    nodes.append(helper.make_node("Add", ["t", "shift"], ["h"], name="shift_add"))
    h = "h"
    for i in range(blocks):
        h = _block(i, h, rng, nodes, inits)
    nodes.append(_ln(99, h, "y", rng, inits))
    return _model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", T, D])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


def test_nonlinear_stream_start_folds_with_one_recenter():
    model = _nonlinear_start_model(blocks=2)  # 3 norms for 1 recenter: pays
    res = fold_model(model)
    assert (res.report.folded, res.report.kept, res.report.recentered) == (3, 0, 1)
    assert all(n.recentered for n in res.report.norms)
    assert res.max_rel_err < RTOL
    assert _ops(res.model).count("ReduceMean") == 2  # the recenter's two passes (DESIGN §4)


def test_lone_norm_behind_nonlinearity_is_not_worth_a_recenter():
    model = _nonlinear_start_model(blocks=0)  # 1 norm for 1 recenter: does not pay
    report = onnx_rewrite.analyze_model(model)
    assert report.kept == 1 and report.recentered == 0
    assert "Tanh `act`" in report.norms[0].reason and "recenter" in report.norms[0].reason
    with pytest.raises(NothingToFold):
        fold_model(model)


def test_stream_as_graph_output_blocks_with_reason():
    rng = np.random.default_rng(2)
    nodes, inits = [], [_const("E", rng.standard_normal((11, D)) + 4.0)]
    nodes.append(helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"))
    h = _block(0, "h", rng, nodes, inits)
    nodes.append(_ln(1, h, "y", rng, inits))
    model = _model(nodes, inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", T])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info(h, TensorProto.FLOAT, None)])
    report = onnx_rewrite.analyze_model(model)
    assert report.kept == 2
    assert f"`{h}`, which is a graph output" in report.norms[0].reason
    assert f"`{h}` is a graph output (the model's output would see the mean)" in report.norms[0].blockers


def test_tied_embedding_is_cloned_not_edited():
    """Embedding table shared with a transposed lm_head: the head must still read the original."""
    rng = np.random.default_rng(3)
    V = 13
    nodes, inits = [], [_const("E", rng.standard_normal((V, D)) + 4.0), _const("P", rng.standard_normal((T, D)) + 2.0)]
    nodes += [helper.make_node("Gather", ["E", "ids"], ["tok"], name="embed"),
              helper.make_node("Add", ["tok", "P"], ["h"], name="add_pos")]
    h = _block(0, "h", rng, nodes, inits)
    nodes.append(_ln(1, h, "f", rng, inits))
    nodes += [helper.make_node("Transpose", ["E"], ["Et"], name="tie", perm=[1, 0]),
              helper.make_node("MatMul", ["f", "Et"], ["logits"], name="lm_head")]
    model = _model(nodes, inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", T])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)])
    res = fold_model(model)
    assert res.report.folded == 2 and res.max_rel_err < RTOL
    by_name = {i.name: numpy_helper.to_array(i) for i in res.model.graph.initializer}
    np.testing.assert_array_equal(by_name["E"], numpy_helper.to_array(inits[0]))  # the head's copy is untouched
    centered = [v for k, v in by_name.items() if k.startswith("E/")]
    assert len(centered) == 1 and np.abs(centered[0].mean(axis=1)).max() < 1e-5


def test_layerscale_is_folded_into_its_source():
    """h + γ_ls ⊙ (W·LN(h) + b): the per-channel scale goes into W and b before centering."""
    rng = np.random.default_rng(4)
    nodes, inits = [], [_const("E", rng.standard_normal((11, D)) + 4.0)]
    nodes.append(helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"))
    nodes.append(_ln(0, "h", "n0", rng, inits))
    inits += [_const("W", rng.standard_normal((D, D)) + 3.0), _const("c", rng.standard_normal(D) + 5.0),
              _const("ls", 0.1 + rng.random(D))]
    nodes += [helper.make_node("MatMul", ["n0", "W"], ["m"], name="mm"),
              helper.make_node("Add", ["m", "c"], ["o"], name="bias"),
              helper.make_node("Mul", ["o", "ls"], ["s"], name="layerscale"),
              helper.make_node("Add", ["h", "s"], ["h1"], name="res")]
    nodes.append(_ln(1, "h1", "y", rng, inits))
    model = _model(nodes, inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", T])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    res = fold_model(model)
    assert res.report.folded == 2 and res.max_rel_err < RTOL
    assert "layerscale" not in [n.name for n in res.model.graph.node]  # Mul by ones dropped


# --- the command line ---------------------------------------------------------------------------

def _lnfold(*args):
    return subprocess.run([sys.executable, "-m", "lnfold", *args], capture_output=True, text=True)


def test_cli_fold_and_report(zoo_onnx, tmp_path):
    _, _, model = zoo_onnx("bert")
    src, dst = tmp_path / "bert.onnx", tmp_path / "out" / "bert.folded.onnx"
    dst.parent.mkdir()
    onnx.save(model, src)
    r = _lnfold("fold", str(src), "-o", str(dst))
    assert r.returncode == 0, r.stderr
    assert "5 LayerNorm(s): 1 folded, 4 kept, 0 recenter(s)" in r.stdout
    assert "max relative output difference" in r.stdout
    err, _ = compare(src, dst)
    assert err < RTOL

    r = _lnfold("report", str(src), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["folded"], data["kept"], data["recentered"]) == (1, 4, 0)
    assert [n["verdict"] for n in data["norms"]] == ["fold"] + ["keep"] * 4
    assert all(n["reason"] for n in data["norms"] if n["verdict"] == "keep")

    r = _lnfold("report", str(src))
    assert r.returncode == 0 and "keep" in r.stdout and "Post-LN" in r.stdout


def test_cli_refuses_model_with_nothing_to_fold(tmp_path):
    model = _nonlinear_start_model(blocks=0)
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(model, src)
    r = _lnfold("fold", str(src), "-o", str(dst))
    assert r.returncode == 2 and not dst.exists()
    assert r.stderr.count("\n") == 1 and "no LayerNorm can be folded" in r.stderr


@pytest.mark.parametrize("name,folded", [("vit", 5), ("bert", 1)])
def test_legacy_exporter_decomposed_layernorms(name, folded, zoo_module):
    """torch's TorchScript exporter at opset 14 emits LayerNorm as ReduceMean/Sub/Pow/.../Add."""
    from lnfold import zoo

    from .conftest import export_quiet

    module, args = zoo_module(name)  # (the worker's, shared with the other files)
    model = export_quiet(module, args, zoo.INPUT_NAMES[name], opset=14, dynamo=False)
    assert "LayerNormalization" not in _ops(model)
    res = fold_model(model)
    assert len(res.report.norms) == 5 and res.report.folded == folded
    assert res.max_rel_err < RTOL
    assert _ops(res.model).count("ReduceMean") == 2 * (5 - folded)  # kept norms keep their two


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("large", [True, False], ids=["data-file-out", "inline-out"])
def test_cli_folds_external_data_lazily(tmp_path, monkeypatch, capsys, target, large):
    """An external-data model is folded with its big weights left in the input's data file:
    read only where the fold edits them, copied (not loaded) into the output. Thresholds are
    lowered so that a small model takes the path a multi-GB one does."""
    import hashlib

    from lnfold.onnx_rewrite import read, write
    from lnfold.onnx_rewrite.cli import main as cli_main
    from tests import onnx_graphs as G

    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    G.save_model(G.pre_ln(d=64), src, external=True)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    monkeypatch.setattr(read, "_EAGER_BYTES", 4096)  # the 64x256 matrices stay on disk
    if large:
        monkeypatch.setattr(write, "_PROTO_LIMIT", 2**16)  # the output gets a data file
    lazy = read.load(src, lazy=True)
    assert any(read.is_lazy(t) for t in lazy.graph.initializer)
    assert all(t.HasField("raw_data") for t in lazy.graph.initializer if not read.is_lazy(t))

    assert cli_main(["fold", str(src), "-o", str(dst), "--target", target]) == 0
    assert "max relative output difference" in capsys.readouterr().out
    data = tmp_path / "out.onnx.data"
    assert data.is_file()  # the input's layout, large or not: its weights in a data file beside it
    skeleton = onnx.load(str(dst), load_external_data=False)
    for t in skeleton.graph.initializer:  # every reference is to the output's own file
        locs = {e.value for e in t.external_data if e.key == "location"}
        assert locs <= {"out.onnx.data"} and not any(e.key == "basepath" for e in t.external_data)
    assert any(t.data_location == TensorProto.EXTERNAL for t in skeleton.graph.initializer)
    err, tol = compare(src, dst)
    assert err <= tol and err < RTOL
    # the same values as a fold of the fully loaded model
    ref = fold_model(onnx.load(str(src)), target=target, verify=False).model
    got = onnx.load(str(dst))
    want = {t.name: numpy_helper.to_array(t) for t in ref.graph.initializer}
    have = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    assert want.keys() == have.keys() and len(got.graph.initializer) == len(ref.graph.initializer)
    for k in want:
        assert want[k].dtype == have[k].dtype and np.array_equal(want[k], have[k]), k
    # the input's files are untouched
    for name, h in digest.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == h, name


def test_lazy_load_ignores_a_basepath_in_the_input(tmp_path, monkeypatch):
    """`basepath` is how a lazy load remembers the input's folder; one written in the input
    itself (onnx's loader would follow it) must not send the reads elsewhere."""
    from lnfold.onnx_rewrite import read
    from lnfold.onnx_rewrite.cli import main as cli_main
    from tests import onnx_graphs as G

    clean = tmp_path / "clean"
    clean.mkdir()
    G.save_model(G.pre_ln(d=64), clean / "m.onnx", external=True)
    src = tmp_path / "m.onnx"
    G.save_model(G.pre_ln(d=64), src, external=True)
    m = onnx.load(str(src), load_external_data=False)
    for t in m.graph.initializer:
        t.external_data.add(key="basepath", value="/nonexistent")
    onnx.save(m, str(src))
    monkeypatch.setattr(read, "_EAGER_BYTES", 4096)
    lazy = read.load(src, lazy=True)
    for t in lazy.graph.initializer:
        bases = [e.value for e in t.external_data if e.key == "basepath"]
        assert bases in ([], [str(tmp_path.resolve())])
    assert fold_model(read.load(src), verify=False).report.folded == 3
    dst = tmp_path / "out.onnx"  # (onnxruntime refuses the input's unknown key: no verification)
    assert cli_main(["fold", str(src), "-o", str(dst), "--no-verify"]) == 0
    assert compare(clean / "m.onnx", dst)[0] < RTOL
