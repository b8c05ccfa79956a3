"""Calibration rows in the model's own batch (issue 44): one `Rows` type and one held-out rule
(passes/calibration.py) for slicing, the approximate swap and quantization.

A model whose export fixed its batch (Whisper's encoder as Optimum exports it: [1, 80, 3000];
tests/onnx_graphs.pre_ln: 2) used to be refused by `lnfold slice` ("cal.npz: ids has shape [8, 5],
the model takes [1, 5]") while `lnfold quantize` took the same file; the halving split also made a
1-row batch of a batch-2 model. Now every calibrated command feeds whole batches, holds out the
second half of them (rounded down), and drops — and says so — the rows after the last whole batch.
"""
from __future__ import annotations

import numpy as np
import pytest

import lnfold
from lnfold.onnx_rewrite import cli
from lnfold.passes import LnfoldError
from lnfold.passes.calibration import Rows, deciding_units

from tests.test_slice import T, calibration, stream_model

# rows given -> (rows that decide, rows held out) for batch 1 and 2: whole batches, half of them held out
EXPECTED = {(1, 2): (1, 1), (1, 3): (2, 1), (1, 4): (2, 2), (1, 8): (4, 4),
            (2, 2): (2, 0), (2, 3): (2, 0), (2, 4): (2, 2), (2, 8): (4, 4)}


def test_the_one_rule():
    assert [deciding_units(n) for n in range(6)] == [0, 1, 1, 2, 2, 3]
    rows = Rows.of({"x": np.arange(7 * 3).reshape(7, 3)}, 2, "cal")
    assert rows.count == 6 and rows.dropped == 1 and "the last 1 row(s) dropped" in rows.describe()
    deciding, held = rows.split()
    assert (deciding.count, held.count) == (4, 2)  # 3 batches: 2 decide, 1 held out
    assert [r["x"].shape[0] for r in rows.runs()] == [2, 2, 2]
    assert [r["x"].shape[0] for r in Rows({"x": np.zeros((40, 3))}).runs()] == [16, 16, 8]  # free batch
    with pytest.raises(LnfoldError, match="1 row.*batches of 2.*at least 2"):
        Rows.of({"x": np.zeros((1, 3))}, 2, "cal")
    with pytest.raises(LnfoldError, match="different first axes"):
        Rows.of({"x": np.zeros((4, 3)), "y": np.zeros((2, 3))}, 2, "cal")


@pytest.mark.parametrize("batch, n", sorted(EXPECTED))
def test_a_fixed_batch_model_slices_from_any_count_of_rows(batch, n):
    model = stream_model(span=12, batch=batch)
    result = lnfold.slice_onnx(model, calibration(n), fraction=0.25)
    deciding, held = EXPECTED[(batch, n)]
    rows = result.report.error_rows
    assert (f"{held} held-out row(s)" in rows) if held else ("none held out" in rows), rows
    assert ("the last 1 row(s) dropped" in rows) == (n % batch == 1), rows
    assert result.report.streams[0].keep == 12
    if deciding * T >= 12:  # the deciding tokens span the stream's 12 directions: nothing is lost
        assert result.report.error < 1e-10, result.report.error
    # the sliced model runs in the model's batch
    out = lnfold.onnx_rewrite.calibration.run(result.model, Rows(calibration(2 * batch, seed=5), batch).runs())
    assert np.all(np.isfinite(out[0])) and out[0].shape[0] == 2 * batch


@pytest.mark.parametrize("batch", [1, 2])
def test_slice_and_quantize_take_the_same_file(tmp_path, capsys, batch):
    src, cal = tmp_path / "m.onnx", tmp_path / "cal.npz"
    import onnx

    onnx.save(stream_model(span=12, batch=batch), src)
    np.savez(cal, **calibration(8))
    assert cli.main(["slice", str(src), "-o", str(tmp_path / "s.onnx"), "--fraction", "0.25", "--calibrate",
                     str(cal)]) == 0, capsys.readouterr().err
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--weights", "int8", "--calibrate",
                     str(cal)]) == 0, capsys.readouterr().err


def test_fewer_rows_than_one_batch_is_one_line(tmp_path, capsys):
    import onnx

    src, cal = tmp_path / "m.onnx", tmp_path / "cal.npz"
    onnx.save(stream_model(batch=2), src)
    np.savez(cal, **calibration(1))
    assert cli.main(["slice", str(src), "-o", str(tmp_path / "s.onnx"), "--fraction", "0.25", "--calibrate",
                     str(cal)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model takes batches of 2" in err[0], err
    assert not (tmp_path / "s.onnx").exists()


def test_the_approximate_swap_takes_a_fixed_batch_model():
    model = stream_model(batch=1)
    result = lnfold.fold_onnx(model, mode="rms-approx", calibration=calibration(4), budget=1.0)
    assert result.report.folded >= 1


# --- a folder of .npz files: rows that share no shape, fed one file at a time (issue 45 item 10) ----

def _sequence_model():
    """x [batch, seq, d] (float64, seq free) -> Relu(linear) -> 2 pre-LN blocks -> final LN -> head:
    a stream whose rows may have any length, as a text or speech encoder's."""
    from tests.onnx_graphs import Builder, VOCAB
    import onnx

    d = 16
    b = Builder(5, np.float64)
    x = b.input("x", onnx.TensorProto.DOUBLE, ["batch", "seq", d])
    h = b.op("Relu", [b.linear(x, d, d)])
    for _ in range(2):
        u = b.op("Relu", [b.linear(b.layernorm(h, d), d, 2 * d)])
        h = b.op("Add", [h, b.linear(u, 2 * d, d)])
    y = b.op("MatMul", [b.layernorm(h, d), b.weight("head", (d, VOCAB))])
    b.output(y, shape=["batch", "seq", VOCAB])
    return b.model(17)


def _rows(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, n, 16)) * 2.0 + 1.5} for n in lengths]


def test_a_folder_of_single_rows_slices_as_the_same_rows_stacked(tmp_path):
    """Four files of one row each are the rows of one stacked .npz: the same held-out rule (two decide,
    two report) and the same bases, so the same sliced model to float64 precision. Fails where a
    folder's pieces were split by rows, or a piece was lost or fed twice."""
    from lnfold.passes.approx import relative_error
    from lnfold.onnx_rewrite import calibration as calibration_io

    model = _sequence_model()
    rows = _rows([5, 5, 5, 5])
    folder = tmp_path / "rows"
    folder.mkdir()
    for k, r in enumerate(rows):
        np.savez(folder / f"row{k}.npz", **r)
    stacked = {"x": np.concatenate([r["x"] for r in rows])}
    by_files = lnfold.slice_onnx(model, str(folder), fraction=0.25)
    by_stack = lnfold.slice_onnx(model, stacked, fraction=0.25)
    fresh = _rows([5, 5], seed=9)
    assert relative_error(calibration_io.run(by_stack.model, fresh), calibration_io.run(by_files.model, fresh)) < 1e-12
    assert by_files.report.error == pytest.approx(by_stack.report.error, rel=1e-9)


def test_rows_of_different_lengths_slice_and_quantize_from_a_folder(tmp_path, capsys):
    """Sequences of 3, 7, 5 and 4 positions cannot share one .npz (and padding changes what some
    models compute): as a folder, each is fed on its own, half the files decide and half report."""
    import onnx

    src, out, folder = tmp_path / "m.onnx", tmp_path / "s.onnx", tmp_path / "rows"
    onnx.save(_sequence_model(), src)
    folder.mkdir()
    for k, r in enumerate(_rows([3, 7, 5, 4])):
        np.savez(folder / f"row{k}.npz", **r)
    rows = lnfold.onnx_rewrite.inputs.load_rows(str(folder), _sequence_model(), "calibration")
    assert rows.count == 4 and [r["x"].shape[1] for r in rows.runs()] == [3, 7, 5, 4]
    deciding, held = rows.split()
    assert [r["x"].shape[1] for r in deciding.runs()] == [3, 7] and [r["x"].shape[1] for r in held.runs()] == [5, 4]
    assert "4 files of 4 row(s), fed one file at a time" in rows.describe()
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(folder),
                     "--json"]) == 0
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--weights", "int8",
                     "--calibrate", str(folder)]) == 0
    capsys.readouterr()


def test_a_folder_without_rows_or_with_a_link_out_is_one_line(tmp_path, capsys):
    import onnx

    src, out, folder = tmp_path / "m.onnx", tmp_path / "s.onnx", tmp_path / "rows"
    onnx.save(_sequence_model(), src)
    folder.mkdir()
    (folder / "notes.txt").write_text("no rows here")
    argv = ["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(folder)]
    assert cli.main(argv) == 2
    assert "a folder with no .npz file in it" in capsys.readouterr().err
    np.savez(tmp_path / "outside.npz", **_rows([4])[0])
    (folder / "row.npz").symlink_to(tmp_path / "outside.npz")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "lnfold takes a folder's own files only" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_capture_runs_only_what_the_captured_tensors_need():
    """onnxruntime runs every node of a graph: a capture runs the model pruned to the captured
    tensors. Here the node after `y` fails at run time (a Reshape that cannot fit 6 values into
    rows of 4); capturing `y` never runs it, and gives the values the full model computes."""
    from onnx import TensorProto, helper

    from lnfold.onnx_rewrite import calibration as calibration_io

    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("Reshape", ["y", "shape"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)
    got = calibration_io.capture(model, ["y"], [{"x": x}])
    assert np.array_equal(got["y"][0], np.maximum(x, 0))
    with pytest.raises(Exception):  # (the whole model cannot run)
        calibration_io.capture(model, ["y", "z"], [{"x": x}])
    assert [n.op_type for n in model.graph.node] == ["Relu", "Reshape"]  # (the model as given, untouched)


def test_a_pruned_capture_keeps_what_an_if_branch_reads_from_outside():
    """A node holding subgraphs (an If, as Optimum's merged decoder) reads outer values that are not
    its inputs: the pruned capture keeps them (the weight `w` its branches multiply by) and drops
    only what follows the captured tensor."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from lnfold.onnx_rewrite import calibration as calibration_io

    w = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)

    def branch(name: str, op: str) -> onnx.GraphProto:
        node = helper.make_node(op, ["x", "w"] if op == "MatMul" else ["x"], [f"{name}_y"])
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)])

    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "MatMul"),
                              else_branch=branch("else", "MatMul")),
             helper.make_node("Reshape", ["y", "shape"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"),
                               helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = calibration_io.capture(model, ["y"], [{"x": x, "cond": np.array(True)}])
    assert np.allclose(got["y"][0], x @ w)
    with pytest.raises(Exception):  # (the whole model cannot run: 4 values in rows of 3)
        calibration_io.capture(model, ["y", "z"], [{"x": x, "cond": np.array(True)}])
