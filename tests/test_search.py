"""passes/search.py and passes/metric.py on a fake session: plain callables over known error tables,
with neither onnx nor torch imported (the engine's decisions are IR-neutral)."""
import itertools
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from lnfold.passes import metric, search

NAN, INF = float("nan"), float("inf")


def test_neither_onnx_nor_torch_is_imported():
    code = ("import sys, lnfold.passes.search, lnfold.passes.metric; "
            "bad = [m for m in ('onnx', 'onnxruntime', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# -- greedy -----------------------------------------------------------------------------------------

def _old_choose(candidates, error, budget):
    """The approximate swap's choice as passes/approx.choose made it before passes/search (finite
    tables): (the chosen in order, the refused in order)."""
    chosen, refused, total = [], [], 0.0
    alone = {n: error(frozenset([n])) for n in candidates}
    for n in sorted(candidates, key=lambda n: alone[n]):
        if not alone[n] <= budget:
            refused.append(n)
            continue
        t = alone[n] if not chosen else error(frozenset(chosen + [n]))
        if t <= budget:
            chosen.append(n)
            total = t
        else:
            refused.append(n)
    return chosen, refused, total


def _table(rng, k):
    names = [f"n{i}" for i in range(k)]
    cost = {n: rng.choice([0.0, 1e-4, 1e-3, 1e-2, 0.5]) * rng.random() for n in names}
    pair = {frozenset(p): rng.random() * 3e-3 for p in itertools.combinations(names, 2)}

    def error(s):  # not additive: pairs interact
        return sum(cost[n] for n in sorted(s)) + sum(pair[frozenset(p)] for p in itertools.combinations(sorted(s), 2))
    return names, error


def test_greedy_picks_what_the_old_choose_picked():
    rng = random.Random(0)
    for _ in range(200):
        names, error = _table(rng, rng.randint(1, 7))
        budget = rng.choice([1e-3, 5e-3, 2e-2, 1.0])
        found = search.greedy(names, error, budget)
        chosen, refused, total = _old_choose(names, error, budget)
        assert list(found.chosen) == chosen and [s.name for s in found.refused] == refused
        assert found.total == total <= budget
        assert found.total == pytest.approx(error(frozenset(chosen)) if chosen else 0)
        assert all(s.kept == (s.name in chosen) for s in found.steps)


def test_greedy_records_say_why():
    alone = {"a": 0.001, "b": 0.002, "c": 0.5, "d": 0.003}
    found = search.greedy("abcd", lambda s: sum(alone[n] for n in s) * (2 if len(s) > 2 else 1), 0.01,
                          chosen_word="swapped")
    assert found.chosen == ("a", "b")
    by = {s.name: s for s in found.steps}
    assert by["a"].kept and by["b"].added == pytest.approx(0.002) and by["b"].total == pytest.approx(0.003)
    assert by["c"].outcome == search.OVER_ALONE and by["c"].reason == "alone it costs 0.5 > budget 0.01"
    assert by["d"].outcome == search.OVER_TOGETHER and by["d"].total == pytest.approx(0.012)
    assert by["d"].reason == "with the 2 swapped before it the error would be 0.012 > budget 0.01"


def test_greedy_budget_zero_measures_nothing():
    calls = []
    found = search.greedy(["a", "b", "a"], lambda s: calls.append(s) or 0.0, 0.0)
    assert calls == [] and found.chosen == () and found.total == 0.0
    assert [s.name for s in found.steps] == ["a", "b"]  # each once
    assert all(s.outcome == search.ZERO_BUDGET and math.isnan(s.alone) for s in found.steps)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, None])
def test_greedy_refuses_non_finite_candidates(bad):
    alone = {"a": 0.004, "x": bad, "b": 0.002}
    found = search.greedy(["a", "x", "b"], lambda s: alone[next(iter(s))] if len(s) == 1 else 0.006, 0.01)
    assert found.chosen == ("b", "a") and found.total == 0.006
    (x,) = found.refused
    assert x.name == "x" and x.outcome == search.NOT_FINITE and "not a finite number" in x.reason


def test_greedy_refuses_a_non_finite_set():
    alone = {"a": 0.001, "b": 0.002}
    found = search.greedy("ab", lambda s: alone[next(iter(s))] if len(s) == 1 else NAN, 0.01)
    assert found.chosen == ("a",) and found.total == 0.001
    (b,) = found.refused
    assert b.outcome == search.OVER_TOGETHER and math.isnan(b.total) and "not a finite number" in b.reason


# -- largest within ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 9))
def test_largest_within_finds_the_boundary_of_every_monotone_table(n):
    for boundary in range(-1, n):  # within up to `boundary`, over after it (-1: none within)
        calls = []

        def within(i):
            calls.append(i)
            return i <= boundary

        found = search.largest_within(n, within)
        assert (found.fits, found.fails) == (boundary, boundary + 1)
        assert found.found == (boundary >= 0)
        assert len(calls) <= math.ceil(math.log2(n)) + 2, (n, boundary, calls)
        assert len(set(calls)) == len(calls) and [i for i, _ in found.tried] == calls
        assert all(ok == (i <= boundary) for i, ok in found.tried)


@pytest.mark.parametrize("boundary, order", [(-1, [0]), (7, [0, 7]), (3, [0, 7, 3, 5, 4]), (0, [0, 7, 3, 1])])
def test_largest_within_tries_the_smallest_then_the_largest_then_bisects(boundary, order):
    assert [i for i, _ in search.largest_within(8, lambda i: i <= boundary).tried] == order


def test_largest_within_ends_on_a_measured_boundary_of_any_table():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 12)
        table = [rng.random() < 0.5 for _ in range(n)]
        found = search.largest_within(n, table.__getitem__)
        said = dict(found.tried)
        assert found.fails == found.fits + 1
        assert found.fits == -1 or said[found.fits] is True
        assert found.fails == n or said[found.fails] is False


def test_largest_within_of_nothing_measures_nothing():
    found = search.largest_within(0, lambda i: pytest.fail("measured"))
    assert (found.fits, found.fails, found.tried) == (-1, 0, ())


# -- best of ----------------------------------------------------------------------------------------

def test_best_of_keeps_the_simpler_within_the_margin():
    scores = [1.0, 0.97, 0.5, 0.49]
    best = search.best_of(range(4), scores.__getitem__, margin=0.05)
    assert best.index == 2 and best.finite  # 0.97 is within 5 % of 1.0; 0.49 within 5 % of 0.5
    assert "the simpler kept" in best.trials[1].why
    assert "beats the best so far" in best.trials[2].why
    assert search.best_of(range(4), scores.__getitem__, margin=0.0).index == 3


def test_best_of_ties_keep_the_earlier():
    assert search.best_of("abc", {"a": 0.2, "b": 0.2, "c": 0.2}.__getitem__).index == 0


@pytest.mark.parametrize("bad", [NAN, INF])
def test_best_of_never_prefers_a_non_finite_score(bad):
    assert search.best_of(range(3), [bad, 0.3, 0.2].__getitem__, 0.05).index == 2  # a finite one replaces it
    best = search.best_of(range(3), [0.3, bad, 0.29].__getitem__, 0.05)
    assert best.index == 0 and "not a finite number" in best.trials[1].why
    best = search.best_of(range(2), [bad, bad].__getitem__, 0.05)
    assert best.index == 0 and not best.finite and "no score is a finite number" in best.why


def test_best_of_all_skipped_but_the_first():
    def score(c):
        if c:
            raise search.Skip(f"candidate {c} changes nothing")
        return 0.7

    best = search.best_of(range(4), score, 0.05)
    assert best.index == 0 and best.trials[0].score == 0.7 and len(best.scored) == 1
    assert [t.skipped for t in best.trials[1:]] == [f"candidate {c} changes nothing" for c in (1, 2, 3)]
    assert "of 1 scored" in best.why


def test_best_of_all_skipped():
    def score(c):
        raise search.Skip("no")

    best = search.best_of("ab", score)
    assert best.index is None and not best.finite and best.why == "all 2 candidate(s) skipped"


def test_best_of_refuses_a_bad_margin():
    with pytest.raises(ValueError, match="margin"):
        search.best_of("a", lambda c: 0.0, margin=NAN)


# -- metric -----------------------------------------------------------------------------------------

def test_metric_leaves_out_and_counts_non_finite_reference_values():
    ref = np.array([[1.0, NAN, 2.0], [INF, 3.0, 4.0]])
    got = np.array([[1.0, 5.0, 2.0], [0.0, 3.0, 4.4]])
    e = metric.compare(ref, got)
    assert (e.nonfinite_ref, e.nonfinite_got, e.compared) == (2, 0, 4)
    assert e.rel_rms == pytest.approx(0.4 / np.linalg.norm([1, 2, 3, 4])) and e.max_rel == pytest.approx(0.1)
    assert e.finite and "2 non-finite in the reference" in e.line()


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_metric_non_finite_only_in_the_candidate_is_inf(bad):
    e = metric.compare(np.ones(5), np.array([1.0, 1.0, bad, 1.0, 1.0]))
    assert e.rel_rms == INF and e.max_rel == INF and e.nonfinite_got == 1 and not e.finite
    assert metric.worst([e]) == INF and metric.relative_error([np.ones(5)], [np.array([1, 1, bad, 1, 1.0])]) == INF


def test_metric_other_shapes_or_a_missing_output_are_inf():
    e = metric.compare(np.ones((2, 3)), np.ones((3, 2)))
    assert e.rel_rms == e.max_rel == INF and "shape [3, 2]" in e.why
    errors = metric.compare_outputs([np.ones(2), np.arange(3), np.ones(2)], [np.ones(2), np.arange(3)])
    assert errors[0].rel_rms == 0.0 and errors[1] is None and errors[2].rel_rms == INF


def test_metric_worst_is_never_nan():
    nan = metric.OutputError(NAN, NAN)
    assert metric.worst([nan, metric.OutputError(0.1, 0.2)]) == INF
    assert metric.worst([None, metric.OutputError(0.1, 0.2), metric.OutputError(0.3, 0.05)]) == 0.3
    assert metric.worst([metric.OutputError(0.1, 0.2), metric.OutputError(0.3, 0.05)], of="max_rel") == 0.2
    assert metric.worst([]) == 0.0


def test_metric_equals_the_old_relative_error_on_finite_data():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ref = [rng.normal(size=(3, 5)) * 10 ** rng.uniform(-3, 3) for _ in range(rng.integers(1, 4))]
        got = [r + rng.normal(size=r.shape) * 10 ** rng.uniform(-6, 0) for r in ref]
        old = max(float(np.linalg.norm(g - r) / np.linalg.norm(r)) for r, g in zip(ref, got))  # approx.py before
        # (to the last bits: the metric adds per-row sums exactly, math.fsum, to be the same however
        # the rows are batched: passes/metric.RunningError)
        assert metric.relative_error(ref, got) == pytest.approx(old, rel=1e-14, abs=0)
        assert metric.relative_error(ref + [np.arange(4)], got + [np.arange(4) + 1]) == metric.relative_error(ref, got)
        errors = metric.compare_outputs(ref, got)
        assert [e.max_rel for e in errors] == [np.abs(g - r).max() / np.abs(r).max() for r, g in zip(ref, got)]


def test_metric_zero_reference_is_the_absolute_error_and_overflow_is_no_nan():
    assert metric.compare(np.zeros(4), np.full(4, 0.5)).rel_rms == 1.0  # ‖got‖ (as approx.relative_error)
    e = metric.compare(np.full(4, 1e300), np.full(4, -1e300))
    assert e.rel_rms == pytest.approx(2.0) and not math.isnan(e.max_rel)
