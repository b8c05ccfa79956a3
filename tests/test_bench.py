"""A user's own speed figure (`lnfold bench`, issue 24) and the claim rule it shares with the demo:
one ratio (of the medians printed), and a difference claimed only outside the A/A spread."""
from __future__ import annotations

import random
import re

import numpy as np
import onnx
import pytest

from lnfold.onnx_rewrite import fold_model
from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.onnx_rewrite.timing import MARGIN, compare, compare_repeats, describe_ratio, interleaved, ratio
from tests import onnx_graphs as G


def _samples(center: float, spread: float, n: int = 200, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [center * (1 + rng.gauss(0, spread)) for _ in range(n)]


def test_the_ratio_is_the_ratio_of_the_medians():
    # rounds where one variant is slow and the other not (a shared machine): the median of
    # per-round ratios (the old definition) is then far from median(a)/median(b), which is what a
    # report prints next to the ratio
    noise = _samples(1.0, 0.01, n=200, seed=1)
    a = [x * [1, 1, 1, 4, 4][k % 5] for k, x in enumerate(noise)]
    b = [x * [1, 4, 4, 4, 1][k % 5] for k, x in enumerate(reversed(noise))]
    stats = {"a": {"samples": a}, "b": {"samples": b}}
    r = ratio(stats, "a", "b")
    assert r["ratio"] == pytest.approx(float(np.median(a) / np.median(b)))
    assert r["ratio"] == pytest.approx(0.25, rel=0.05)
    per_round = float(np.median([x / y for x, y in zip(a, b)]))
    assert per_round == pytest.approx(1.0, rel=0.05)
    assert r["lo"] <= r["ratio"] <= r["hi"]


def test_a_difference_inside_the_aa_spread_is_not_claimed():
    # B is 1.5% faster, the interval excludes 1, but A measured against itself moves 3%: noise
    base = _samples(1.0, 0.002, seed=2)
    again = _samples(1.03, 0.002, seed=3)  # the A/A pair disagrees by 3% in this run
    folded = _samples(0.985, 0.002, seed=4)
    stats = {"original": {"samples": base}, "again": {"samples": again}, "folded": {"samples": folded}}
    plain = ratio(stats, "folded", "original")
    assert not plain["within_noise"]  # the old rule (interval excludes 1) would claim 1.5%
    r = compare(stats, "folded", "original", "again")
    assert r["within_noise"] and r["spread"] >= 0.03
    assert "within noise" in describe_ratio(r) and "A/A ±" in describe_ratio(r)


def test_a_difference_beyond_the_aa_spread_is_claimed():
    base, again = _samples(1.0, 0.01, seed=5), _samples(1.0, 0.01, seed=6)
    folded = _samples(0.8, 0.01, seed=7)
    stats = {"original": {"samples": base}, "again": {"samples": again}, "folded": {"samples": folded}}
    r = compare(stats, "folded", "original", "again")
    assert not r["within_noise"] and r["hi"] < 1 - r["spread"]
    assert "less time" in describe_ratio(r)
    slower = compare({**stats, "folded": {"samples": _samples(1.25, 0.01, seed=8)}}, "folded", "original", "again")
    assert not slower["within_noise"] and "more time" in describe_ratio(slower)


def _block(original: float, again: float, folded: float, seed: int, noise: float = 0.003) -> dict:
    return {"original": {"samples": _samples(original, noise, seed=seed)},
            "again": {"samples": _samples(again, noise, seed=seed + 1)},
            "folded": {"samples": _samples(folded, noise, seed=seed + 2)}}


def test_a_claim_must_hold_in_every_repeat():
    # the second repeat's sessions happen to put the folded model 4% faster, the others see no
    # difference: a run made of that repeat alone claims 4%, a rerun would not see it again
    blocks = [_block(1.0, 1.001, 1.0, 10), _block(1.0, 0.999, 0.96, 20), _block(1.0, 1.0, 1.001, 30)]
    assert not compare(blocks[1], "folded", "original", "again")["within_noise"]
    r = compare_repeats(blocks, "folded", "original", "again")
    assert r["within_noise"] and len(r["repeats"]) == 3 and "repeats 1.00" in describe_ratio(r)
    # a difference every repeat sees, far beyond MARGIN x the A/A spread: claimed
    steady = [_block(1.0, 1.0, 0.9, s) for s in (40, 50, 60)]
    r = compare_repeats(steady, "folded", "original", "again")
    assert not r["within_noise"] and r["hi"] < 1 - MARGIN * r["spread"]
    # every repeat claims it, but the pooled interval is not MARGIN x beyond the spread: not claimed
    near = [_block(1.0, 1.02, 0.97, s) for s in (70, 80, 90)]
    assert all(not compare(b, "folded", "original", "again")["within_noise"] for b in near)
    assert compare_repeats(near, "folded", "original", "again")["within_noise"]


def test_interleaved_rotates_the_order():
    seen = []
    interleaved({k: (lambda k=k: seen.append(k)) for k in "abc"}, rounds=3, warmup=0)
    assert seen == list("abcbcacab")


# --- lnfold bench ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    model = G.pre_ln(layers=2)
    onnx.save(model, d / "m.onnx")
    onnx.save(fold_model(model).model, d / "m.folded.onnx")
    return d


def test_bench_prints_kernels_and_end_to_end_ratios(pair, capsys):
    rc = cli_main(["bench", str(pair / "m.onnx"), str(pair / "m.folded.onnx"), "--seconds", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "onnxruntime" in out and "1 intra-op thread" in out and "interleaved rounds" in out
    # onnxruntime fuses one of the original's LayerNorms with its residual Add: both are counted
    assert re.search(r"original:\s+[\d.]+ µs per run, [\d.]+% of all kernels' time \(2 LayerNormalization, "
                     r"1 SkipLayerNormalization\)", out), out
    assert re.search(r"folded:\s+[\d.]+ µs per run, [\d.]+% of all kernels' time \(3 SimplifiedLayerNormalization\)", out), out
    medians = {m[0]: float(m[1]) for m in re.findall(r"^  (original|folded)\s+wall\s+([\d.]+) [µm]s", out, re.M)}
    wall = float(re.search(r"wall: ([\d.]+) \(95% CI", out).group(1))
    # the ratio printed is the ratio of the medians printed (to their rounding)
    assert wall == pytest.approx(medians["folded"] / medians["original"], rel=0.02, abs=2e-3)
    assert "original again" in out and "A/A ±" in out


def test_bench_bad_input_is_one_line(pair, tmp_path, capsys):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    other = tmp_path / "other.onnx"
    onnx.save(G.float_input_pre_ln(), other)
    cases = [([str(tmp_path / "missing.onnx"), str(pair / "m.folded.onnx")], "no such file"),
             ([str(pair / "m.onnx"), str(junk)], "not a readable ONNX model"),
             ([str(pair / "m.onnx"), str(other)], "take different inputs")]
    for argv, says in cases:
        rc = cli_main(["bench", *argv])
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert says in err and len(err.strip().splitlines()) == 1, err


