"""`lnfold check ORIGINAL OTHER` (issue 46, onnx_rewrite/check.py): anyone's transformed model
judged by the fold's gate, its error per output, the first shared tensor where the two part.

Each test is a planted case with a known answer: a correct fold (exit 0, and no tensor blamed
although the fold changes the stream's values on purpose), a wrong one (exit 1, blamed at or
after the edited weight's reader), different names (exit 2), int8 and fp16 copies (exit 1, finite
figures) and onnxruntime's optimizer (exit 0).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import lnfold
from lnfold.onnx_rewrite import api, fold_model
from lnfold.onnx_rewrite.check import CheckResult, check_onnx
from lnfold.onnx_rewrite.cli import main as cli_main
from tests import onnx_graphs as G
from tests.conftest import missing_one_centering


@pytest.fixture
def pair(tmp_path):
    """A two-block Pre-LN model and its correct fold, as files."""
    model = G.pre_ln()
    src, dst = tmp_path / "m.onnx", tmp_path / "m.folded.onnx"
    onnx.save(model, src)
    onnx.save(fold_model(model).model, dst)
    return src, dst


def _check(capsys, *argv):
    code = cli_main(["check", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _descendants(model: onnx.ModelProto, node: onnx.NodeProto) -> set[str]:
    """`node`'s outputs and every tensor computed from them."""
    seen = set(node.output)
    for n in model.graph.node:  # (topological order)
        if any(i in seen for i in n.input):
            seen.update(n.output)
    return seen


def test_a_correct_fold_is_equivalent(pair, capsys):
    """The fold centers the stream and moves β: shared tensors differ on the way, yet none is
    blamed (they agree again downstream), and the verdict is fold's own float64 line."""
    code, out, _ = _check(capsys, *pair)
    assert code == 0, out
    assert "lnfold: verification: max relative output difference" in out and "error vs float64:" in out
    assert "first tensor where they part: none" in out
    assert out.rstrip().endswith("EQUIVALENT (the gate of `lnfold fold` passes)")


def test_a_wrong_weight_is_blamed_at_or_after_its_reader(pair, tmp_path, capsys):
    """One weight of the fold scaled by 1.01: exit 1, and the first divergence is computed from
    the node that reads that weight."""
    folded = onnx.load(pair[1])
    readers = [n for n in folded.graph.node if n.op_type == "MatMul"
               and any(i in {t.name for t in folded.graph.initializer} for i in n.input)]
    reader = readers[len(readers) // 2]
    weight = next(t for t in folded.graph.initializer if t.name in reader.input)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1.01), weight.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(folded, bad)
    code, out, _ = _check(capsys, pair[0], bad, "--json")
    got = json.loads(out)
    assert code == 1 and got["exit_code"] == 1 and not got["equivalent"]
    assert "NOT exact: verification failed" in got["verdict"]["line"]
    blamed = got["first_divergence"]["tensor"]
    assert blamed in _descendants(folded, reader), (blamed, reader.output)


def test_a_skipped_centering_is_not_blamed_on_the_stream_before_it(monkeypatch):
    """A fold with one centering dropped (conftest.missing_one_centering, the middle one):
    NOT equivalent; the tensor named is not the first stream tensor, which a correct fold changes
    too (the naive 'first tensor that differs' would name it)."""
    model = G.pre_ln()
    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan))
    bad = fold_model(model, verify=False).model
    result = check_onnx(model, bad)
    assert isinstance(result, CheckResult) and result.exit_code == 1 and not result.equivalent
    first_stream = next(o for n in model.graph.node for o in n.output if o in {i for m in model.graph.node
                                                                                  for i in m.input})
    assert result.divergence is not None and result.divergence.tensor != first_stream
    assert result.divergence.max_rel > result.allowed


def test_different_input_names_are_bad_input(pair, tmp_path, capsys):
    other = onnx.load(pair[1])
    old = other.graph.input[0].name
    for n in other.graph.node:
        n.input[:] = ["tokens" if i == old else i for i in n.input]
    other.graph.input[0].name = "tokens"
    path = tmp_path / "renamed.onnx"
    onnx.save(other, path)
    code, out, err = _check(capsys, pair[0], path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "differ in their inputs" in err and "only in OTHER: tokens" in err


def test_an_int8_model_is_not_equivalent_with_finite_errors(pair, tmp_path, capsys):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    q = tmp_path / "q.onnx"
    quantize_dynamic(str(pair[0]), str(q), weight_type=QuantType.QInt8)
    code, out, _ = _check(capsys, pair[0], q, "--json")
    got = json.loads(out)
    assert code == 1 and not got["equivalent"]
    errs = [o for o in got["outputs"] if o["compared"]]
    assert errs and all(0 < o["rel_rms"] < 1 and 0 < o["max_rel"] < 1 for o in errs)
    assert got["first_divergence"] is not None


def test_json_is_one_object(pair, capsys):
    code, out, _ = _check(capsys, *pair, "--json")
    got = json.loads(out)
    assert code == 0 and got["equivalent"] and got["verdict"]["criterion"] == "float64"
    assert got["first_divergence"] is None and got["compared_tensors"] > 0
    assert [o["name"] for o in got["outputs"]] == [o.name for o in onnx.load(pair[0]).graph.output]


def test_no_shared_names_is_said(pair, tmp_path):
    other = onnx.load(pair[1])
    keep = {o.name for o in other.graph.output} | {i.name for i in other.graph.input} | \
        {t.name for t in other.graph.initializer}
    rename = {o: f"renamed_{k}" for k, o in enumerate(o for n in other.graph.node for o in n.output if o not in keep)}
    for n in other.graph.node:
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    del other.graph.value_info[:]
    result = lnfold.check_onnx(str(pair[0]), other)
    assert result.exit_code == 0 and result.divergence is None
    assert result.divergence_note == "no shared intermediate names"


def test_onnxruntime_optimizer_output_is_equivalent(pair, tmp_path):
    """onnxruntime's transformer optimizer fuses SkipLayerNormalization and Gemm: exact, exit 0."""
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(pair[0]), model_type="bert", num_heads=0, hidden_size=0, opt_level=1)
    assert any(n.op_type == "SkipLayerNormalization" for n in opt.model.graph.node)
    result = check_onnx(pair[0], opt.model)
    assert result.exit_code == 0, result.verdict_line()


def test_an_fp16_conversion_is_not_exact_at_fp32(pair):
    """An fp16 copy of an fp32 model (onnxruntime's converter, fp32 inputs and outputs kept) is
    held to the fp32 original's own error against float64: its fp16 rounding (~1e-3) is above
    that, so it is NOT equivalent (exit 1), with the fp16-sized error per output as the report."""
    float16 = pytest.importorskip("onnxruntime.transformers.float16")
    half = float16.convert_float_to_float16(onnx.load(pair[0]), keep_io_types=True)
    result = check_onnx(pair[0], half)
    assert result.exit_code == 1 and "NOT exact" in result.verdict_line()
    (name, err), = result.outputs
    assert 1e-5 < err.max_rel < 1e-2 and err.finite
    assert result.divergence is not None  # the first tensor computed in fp16


def test_given_inputs_are_used_and_wrong_ones_are_bad_input(pair, tmp_path, capsys):
    good, wrong = tmp_path / "in.npz", tmp_path / "wrong.npz"
    np.savez(good, ids=np.array([[1, 2, 3, 4, 5], [0, 1, 2, 3, 9]], dtype=np.int64))
    np.savez(wrong, x=np.zeros(3, np.float32))
    code, out, _ = _check(capsys, *pair, "--inputs", good, "--json")
    assert code == 0 and json.loads(out)["equivalent"]
    code, out, err = _check(capsys, *pair, "--inputs", wrong)
    assert code == 2 and out == "" and "x is not an input of the model" in err
