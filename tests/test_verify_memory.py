"""What verification holds in memory (issue 47): the gate measures outputs piece by piece (no
float64 copy of a whole output: an LM's logits made a GiB of them), an onnxruntime session keeps no
serialized copy of its model, and the original's session is released once its outputs are made,
before the folded model's is built. The models, sessions and runs are real; tracemalloc counts
numpy's allocations."""
from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest

from lnfold.onnx_rewrite import fold_model, sessions, verify
from lnfold.passes import gate, weights
from tests import onnx_graphs as G


def _outputs(n: int) -> list[gate.Output]:
    """One float32 output of `n` values, its fold a rounding away, its float64 run."""
    rng = np.random.default_rng(0)
    exact = rng.standard_normal(n)
    original = exact.astype(np.float32)
    folded = (exact * (1 + 1e-7 * rng.standard_normal(n))).astype(np.float32)
    return [gate.Output("logits", "float32", original, folded, exact)]


def test_the_gate_holds_pieces_of_an_output_not_float64_copies_of_it(monkeypatch):
    """Judging an output of 2^21 values (8 MiB in float32) allocates less than one float64 copy of
    it (16 MiB): the measures run on pieces of SEGMENT values (2^16 here, for a small output).
    Whole-array measures (gate._non_finite's float64 copy, max_rel_err's two) take several times that."""
    monkeypatch.setattr(weights, "SEGMENT", 1 << 16)
    outputs = _outputs(1 << 21)
    whole = outputs[0].original.size * 8
    tracemalloc.start()
    try:
        verdict = gate.judge(outputs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict.ok and verdict.method == gate.FLOAT64, verdict
    assert peak < whole / 2, f"the gate allocated {peak / 2**20:.1f} MiB judging a {whole / 2**20:.0f} MiB float64 output"


@pytest.mark.parametrize("segment", [1, 7, 64])
def test_the_pieces_change_no_bit(segment, monkeypatch):
    """max_rel_err over pieces is max_rel_err over the whole (one piece), NaN and infinities
    included (both NaN: agree; one NaN, or infinities that differ: inf)."""
    rng = np.random.default_rng(segment)
    for _ in range(50):
        a = rng.standard_normal((3, 5, 7)).astype(np.float32)
        b = a + (1e-5 * rng.standard_normal(a.shape)).astype(np.float32)
        for arr in (a, b):
            if rng.random() < 0.5:
                arr.reshape(-1)[rng.integers(0, arr.size)] = rng.choice([np.nan, np.inf, -np.inf])
        if rng.random() < 0.3:
            a[...], b[...] = np.nan, np.nan
        monkeypatch.setattr(weights, "SEGMENT", a.size)
        one_piece = weights.max_rel_err(a, b), weights.max_rel_err(a.T, b.T)  # (a.T: not contiguous)
        monkeypatch.setattr(weights, "SEGMENT", segment)
        assert (weights.max_rel_err(a, b), weights.max_rel_err(a.T, b.T)) == one_piece


def test_a_session_keeps_no_serialized_copy_of_its_model():
    """onnxruntime's Python session keeps the bytes it was made from for its whole life: a ModelProto
    is handed to it as a file, which it reads itself. Extra outputs come without a copy of the model,
    which is left as it was; errors read as they did of the bytes."""
    model = G.pre_ln(layers=1)
    size = model.ByteSize()
    before = model.SerializeToString()
    hidden = next(n.output[0] for n in model.graph.node if n.op_type == "Add")
    sess = sessions.session(model, outputs=[hidden])
    held = [k for k, v in vars(sess).items() if isinstance(v, (bytes, bytearray)) and len(v) >= size]
    assert not held, f"the session holds the model's bytes in {held}"
    assert [o.name for o in sess.get_outputs()][-1] == hidden
    assert model.SerializeToString() == before  # (the outputs were not added to the caller's model)
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    with pytest.raises(Exception) as e:
        sessions.session(bad)
    assert "Load model from" not in str(e.value) and "lnfold-" not in str(e.value), str(e.value)


def test_the_original_session_is_released_before_the_folded_model_runs(monkeypatch):
    """verify.reference drops the original's session once its outputs are made: it is not alive
    beside the folded model's. The verdict reads that it ran in onnxruntime all the same."""
    model = G.pre_ln(layers=2)
    folded = fold_model(model, verify=False).model
    alive = []
    real_runner = verify.Runner

    class Watched(real_runner):
        def __init__(self, *a, **kw):
            alive.append([r for r in made if not isinstance(r.sess, type(sessions.RELEASED))])
            super().__init__(*a, **kw)
            made.append(self)

    made: list = []
    monkeypatch.setattr(verify, "Runner", Watched)
    ref = verify.reference(model)
    assert ref.runner.sess is sessions.RELEASED
    verdict = verify.check_against(ref, folded)
    assert verdict.ok and verdict.method == gate.FLOAT64, verdict
    assert alive == [[], []], "the original's session was alive when the folded model's was made"
    with pytest.raises(RuntimeError, match="released"):
        ref.runner.run(ref.feeds)


def test_without_a_temporary_file_a_session_is_made_of_the_bytes(monkeypatch):
    """Where no temporary file can be written, onnxruntime gets the bytes, and does not keep them."""
    def unwritable(*a, **kw):
        raise PermissionError("read-only temporary folder")

    model = G.pre_ln(layers=1)
    monkeypatch.setattr(sessions.tempfile, "TemporaryDirectory", unwritable)
    sess = sessions.session(model)
    assert sess.get_outputs() and not any(isinstance(v, bytes) for v in vars(sess).values())
