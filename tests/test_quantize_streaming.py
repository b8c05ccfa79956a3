"""lnfold quantize measures a candidate run by run (issue 47, memory): the original and the candidate
run in lockstep on each run of the rows (onnx_rewrite/calibration.paired_runs) and the error is
accumulated (passes/quantize.streamed_errors): the same numbers, to the bit, as on every row's
outputs joined, with one run's outputs alive at a time."""
from __future__ import annotations

import weakref

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from lnfold.onnx_rewrite import calibration as calibration_io, quantize as q
from lnfold.passes import quantize as pq
from lnfold.passes.calibration import RUN_ROWS, Rows


def _lm(rng) -> onnx.ModelProto:
    """x [N, 4, 16] -> MatMul -> Relu -> MatMul -> logits [N, 4, 24] (and the hidden state)."""
    w1 = numpy_helper.from_array(rng.normal(size=(16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(32, 24)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"), helper.make_node("Relu", ["h0"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["logits"], name="fc2")], "lm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4, 24]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", 4, 32])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_measured_run_by_run_equals_every_row_at_once_and_holds_one_run():
    rng = np.random.default_rng(0)
    model = _lm(rng)
    quantized = q.run_quantizer(model, "int8", None)
    rows = Rows({"x": rng.normal(size=(2 * RUN_ROWS + 5, 4, 16)).astype(np.float32)})
    assert len(rows.runs()) == 3
    names = [o.name for o in model.graph.output]
    ref, got = (calibration_io.run(m, rows.runs()) for m in (model, quantized))  # every row's outputs, joined
    one_shot = pq.output_errors(names, ref, got)
    assert "top1_agreement" in one_shot["logits"] and 0 < one_shot["logits"]["rel_rms"] < 0.1
    assert q.measure(model, quantized, rows) == one_shot

    alive, seen = [], []

    def watched(pairs):  # what streamed_errors gets, watched: earlier runs' outputs still alive?
        for pair in pairs:
            seen.append(sum(r() is not None for r in alive))
            alive.extend(weakref.ref(a) for outs in pair for a in outs)
            yield pair
            del pair

    streamed = pq.streamed_errors(names, watched(calibration_io.paired_runs(model, quantized, rows.runs())))
    assert streamed == one_shot and seen == [0, 0, 0] and len(alive) == 12


def test_rows_whose_outputs_are_big_run_a_few_at_a_time(monkeypatch):
    """A row's outputs over RUN_OUTPUT_BYTES / RUN_ROWS (an LM's logits): fewer rows per run, so a run's
    outputs stay about RUN_OUTPUT_BYTES whatever the row count; the fold is verified on the first such
    run; the numbers are those of every row at once (the metric's accumulation is exact)."""
    from lnfold.passes import calibration as pc

    rng = np.random.default_rng(1)
    model = _lm(rng)
    rows = Rows({"x": rng.normal(size=(11, 4, 16)).astype(np.float32)})
    row_bytes = calibration_io.row_output_bytes(model, rows)
    assert row_bytes == 4 * (24 + 32) * 4
    monkeypatch.setattr(pc, "RUN_OUTPUT_BYTES", 3 * row_bytes)
    m = pq.bounded(pq.measurement(None, rows, False, lambda: None), row_bytes)
    assert [len(f["x"]) for f in m.rows.runs()] == [3, 3, 3, 2] and len(m.verification["x"]) == 3
    assert [len(f["x"]) for f in rows.runs()] == [11]  # (the rows given: one run)
    quantized = q.run_quantizer(model, "int4", None, block_size=16)
    names = [o.name for o in model.graph.output]
    assert q.measure(model, quantized, m.rows) == pq.output_errors(names, calibration_io.run(model, rows.runs()),
                                                                   calibration_io.run(quantized, rows.runs()))
    assert pq.bounded(m, None) is m and rows.bounded(1).per_run == pc.RUN_ROWS
