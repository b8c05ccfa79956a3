"""passes/metric.RunningError / RunningErrors (issue 47, memory): the error accumulated batch by batch
is IDENTICAL, to the bit, to the one-shot metric on the batches joined — relative RMS, max relative
error, the non-finite counts and the top-1 agreement — however the rows are cut, with NaN / ±inf
planted in the reference and in the candidate, magnitudes that overflow a plain sum of squares, and
rows longer than one segment."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lnfold.passes import metric
from lnfold.passes import quantize as pq

NAN, INF = float("nan"), float("inf")


def _pair(rng, shape, *, plant_ref=0, plant_got=0, scale=1.0):
    ref = rng.normal(size=shape) * scale * 10 ** rng.uniform(-2, 2, size=shape[:1] + (1,) * (len(shape) - 1))
    got = ref + rng.normal(size=shape) * 1e-2 * np.abs(ref).mean()
    for arr, n in ((ref, plant_ref), (got, plant_got)):
        flat = arr.reshape(-1)
        flat[rng.choice(flat.size, n, replace=False)] = rng.choice([NAN, INF, -INF], n)
    return ref.astype(np.float32) if scale == 1.0 else ref, got.astype(np.float32) if scale == 1.0 else got


def _cuts(rng, n):
    """The first axis [0, n) cut at random places into batches (one batch of one row at least)."""
    inner = sorted(rng.choice(np.arange(1, n), rng.integers(0, n), replace=False).tolist()) if n > 1 else []
    return list(zip([0] + inner, inner + [n]))


def _running(ref, got, cuts, scores=True):
    running = metric.RunningError(scores)
    for lo, hi in cuts:
        running.add(ref[lo:hi], got[lo:hi])
    return running


def _top1(ref, got):  # the one-shot top-1 agreement output_errors computed before the accumulator
    rows_ok = np.isfinite(ref).all(axis=-1)
    return float((ref.argmax(-1) == got.argmax(-1))[rows_ok].mean()) if rows_ok.any() else None


@pytest.mark.parametrize("segment", [metric.SEGMENT, 7])  # 7: rows cut into segments, and segments of rows
@pytest.mark.parametrize("case", [
    dict(shape=(9, 5, 11)),                                   # logits-like: rows x tokens x classes
    dict(shape=(9, 5, 11), plant_ref=6),                      # NaN / inf in the float model: left out, counted
    dict(shape=(9, 5, 11), plant_got=2),                      # non-finite only in the candidate: inf
    dict(shape=(6, 40), plant_ref=3, plant_got=1),
    dict(shape=(7, 3), scale=1e300),                          # a plain Σx² overflows
    dict(shape=(12,)),                                        # one value per row
])
def test_accumulated_is_identical_to_one_shot_however_the_rows_are_batched(case, segment, monkeypatch):
    monkeypatch.setattr(metric, "SEGMENT", segment)
    rng = np.random.default_rng(len(case) * 100 + segment + case["shape"][0])
    ref, got = _pair(rng, case["shape"], plant_ref=case.get("plant_ref", 0), plant_got=case.get("plant_got", 0),
                     scale=case.get("scale", 1.0))
    one_shot = metric.compare(ref, got)
    one_top1 = _running(ref, got, [(0, len(ref))]).top1()
    for _ in range(6):
        running = _running(ref, got, _cuts(rng, len(ref)))
        assert running.error() == one_shot  # every field, to the bit
        assert running.top1() == one_top1
    if ref.ndim >= 2:
        assert one_top1 == _top1(ref, got)
    # and the one-shot numbers are the metric's definition (float64, finite reference positions)
    ok = np.isfinite(ref)
    assert (one_shot.nonfinite_ref, one_shot.compared) == (int((~ok).sum()), int(ok.sum()))
    assert one_shot.nonfinite_got == int((ok & ~np.isfinite(got)).sum())
    if one_shot.nonfinite_got:
        assert one_shot.rel_rms == one_shot.max_rel == INF
    else:
        r, g = ref[ok].astype(np.float64) / np.abs(ref[ok]).max(), got[ok].astype(np.float64) / np.abs(ref[ok]).max()
        assert one_shot.rel_rms == pytest.approx(np.linalg.norm(g - r) / np.linalg.norm(r), rel=1e-13)
        assert one_shot.max_rel == pytest.approx(np.abs(g - r).max() / np.abs(r).max(), rel=1e-15)
        assert math.isfinite(one_shot.rel_rms)


def test_every_output_accumulated_as_output_errors_reports_it():
    """passes/quantize.streamed_errors over batches == output_errors on the joined outputs (the
    report's dict: rel. RMS, max, nonfinite_ref, top1_agreement), a non-float output left out."""
    rng = np.random.default_rng(3)
    logits_ref, logits_got = _pair(rng, (10, 4, 9), plant_ref=3)
    hidden_ref, hidden_got = _pair(rng, (10, 4, 6))
    ids = np.arange(40).reshape(10, 4)
    names = ["logits", "hidden", "ids"]
    one_shot = pq.output_errors(names, [logits_ref, hidden_ref, ids], [logits_got, hidden_got, ids])
    assert set(one_shot) == {"logits", "hidden"} and "top1_agreement" in one_shot["logits"]
    assert one_shot["logits"]["nonfinite_ref"] == 3 and "top1_agreement" not in one_shot["hidden"]
    for _ in range(5):
        batches = [([logits_ref[lo:hi], hidden_ref[lo:hi], ids[lo:hi]], [logits_got[lo:hi], hidden_got[lo:hi], ids[lo:hi]])
                   for lo, hi in _cuts(rng, 10)]
        assert pq.streamed_errors(names, iter(batches)) == one_shot


def test_streamed_errors_holds_one_batch_of_outputs_at_a_time():
    """The consumer drops each batch's outputs before the next batch is made (a generator's rows:
    a model run per batch), so at most one batch's outputs are alive however many rows."""
    import weakref

    rng = np.random.default_rng(5)
    alive: list = []
    seen = []

    def batches():
        for _ in range(6):
            seen.append(sum(r() is not None for r in alive))  # earlier batches' outputs still alive
            ref = rng.normal(size=(2, 3, 8)).astype(np.float32)
            got = ref + np.float32(1e-3)
            alive.extend([weakref.ref(ref), weakref.ref(got)])
            yield [ref], [got]
            del ref, got

    errors = pq.streamed_errors(["logits"], batches())
    assert seen == [0] * 6 and 0 < errors["logits"]["rel_rms"] < 1


def test_unmeasurable_batches_stay_unmeasurable():
    running = metric.RunningErrors(lambda k: True)
    running.add([np.ones((2, 3))], [np.ones((2, 3))])
    running.add([np.ones((2, 3))], [np.ones((3, 2))])  # a later batch of another shape: inf, no top-1
    running.add([np.ones((2, 3))], [np.ones((2, 3))])
    (e,), (top1,) = running.errors(), running.top1()
    assert e.rel_rms == e.max_rel == INF and "shape [3, 2]" in e.why and top1 is None
    missing = metric.RunningErrors().add([np.ones(2), np.ones(2)], [np.ones(2)]).errors()
    assert missing[0].rel_rms == 0.0 and missing[1].rel_rms == INF


def test_the_kl_of_logits_is_the_mean_row_divergence_however_batched():
    """RunningError(scores=True).kl(): mean over rows of KL(softmax ref ‖ softmax got), in float64,
    the same bits in any batching; inf where a candidate row is not finite; only for logits in
    quantize's errors, where it is what auto ranks by."""
    rng = np.random.default_rng(4)
    ref = rng.normal(size=(6, 3, 11)) * 4
    got = ref + rng.normal(size=ref.shape) * 0.3
    lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    lq = got - np.log(np.exp(got - got.max(-1, keepdims=True)).sum(-1, keepdims=True)) - got.max(-1, keepdims=True)
    want = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    values = set()
    for cut in (1, 2, 5):
        running = metric.RunningError(scores=True)
        for i in range(0, 6, cut):
            running.add(ref[i:i + cut], got[i:i + cut])
        values.add(running.kl())
    assert len(values) == 1 and abs(values.pop() - want) < 1e-12 * max(1.0, want)
    bad = got.copy()
    bad[2, 1, 4] = np.inf
    running = metric.RunningError(scores=True)
    running.add(ref, bad)
    assert running.kl() == math.inf
    assert metric.RunningError().kl() is None
    errors = pq.streamed_errors(["logits", "hidden"], [((ref, ref), (got, got * 1.01))])
    assert abs(errors["logits"]["kl"] - want) < 1e-12 and "kl" not in errors["hidden"]
    # what auto ranks by: the logits' KL (not their relative RMS), the others' relative RMS
    assert pq.score(errors) == max(errors["logits"]["kl"], errors["hidden"]["rel_rms"])
    assert pq.score({"hidden": errors["hidden"]}) == errors["hidden"]["rel_rms"]
