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
    out = lnfold.onnx_rewrite.approx.run(result.model, Rows(calibration(2 * batch, seed=5), batch).runs())
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
