"""`python -m benchmarks gpu` (issue 35): the GPU script's smoke mode on CPU runs every group with
tiny shapes, and its rows say what a GPU run will write; a variant that fails and a spent budget
are rows of their own, and lose none of the others."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_failing_variant_is_its_row_and_the_others_are_measured(tmp_path):
    run = gpu.Run(tmp_path / "rows.jsonl", smoke=True, rounds=2, budget_s=60)
    ref = torch.arange(4.0)

    def works(scale):
        return lambda: (lambda: ref * scale, ref * scale)

    def fails():
        raise RuntimeError("planted: this variant cannot compile\nsecond line")

    gpu.group(run, "g", "bfloat16", {"original": works(1.0), "broken": fails, "other": works(1.5)}, ref,
              {"case": "c"})
    run.file.close()
    got = {r["variant"]: r for r in rows(tmp_path / "rows.jsonl")}
    assert got["broken"]["error"] == "RuntimeError: planted: this variant cannot compile"
    assert got["original"]["ratio"] == 1.0 and got["original"]["err_vs_fp32"] == 0.0
    assert got["other"]["err_vs_fp32"] == pytest.approx(0.5) and got["other"]["original_err_vs_fp32"] == 0.0
    assert len(got["other"]["times_ms"]) == 2 and "error" not in got["other"]


def test_a_spent_budget_writes_the_rows_left_as_skipped(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert gpu.main(["--smoke", "--only", "kernels", "--budget-s", "0", "--out", str(out)]) == 0
    got = rows(out)
    assert [r["group"] for r in got] == ["meta", "kernels", "kernels", "meta"]
    assert all("budget" in r["skipped"] for r in got[1:-1])


def test_an_unknown_group_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--smoke", "--only", "kernel", "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2 and "unknown group(s) kernel" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # every group compiled (Dynamo, lnfold's fold, fold_to_rmsnorm's export): ~30 s of CPU
def test_smoke_runs_every_group_and_every_lnfold_row_is_as_exact_as_the_original(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert gpu.main(["--smoke", "--out", str(out)]) == 0
    got = [r for r in rows(out) if r["group"] != "meta"]
    assert not [r for r in got if "error" in r or "skipped" in r]
    by = {}
    for r in got:
        by.setdefault((r["group"], r["case"], r.get("pass")), {})[r["variant"]] = r
    assert {g for g, _, _ in by} == {"kernels", "infer", "train"}
    assert len([k for k in by if k[0] == "infer"]) == 3 and len([k for k in by if k[0] == "kernels"]) == 2
    for key, variants in by.items():
        assert "original (A/A)" in variants and variants["original"]["ratio"] == 1.0, key
        original = variants["original"]["err_vs_fp32"]
        for name, r in variants.items():
            assert r["original_err_vs_fp32"] == original and r["ms"] > 0
            if "swap" in name:  # not exact: its error is the swap's, far beyond the dtype's
                assert r["err_vs_fp32"] > 10 * original, (key, name)
            else:  # exact folds: the dtype's rounding, as the original's (a loss: one scalar, within bf16's 2^-8)
                floor = 2 ** -8 if key[0] == "train" else 1e-6
                assert r["err_vs_fp32"] <= 3 * original + floor, (key, name, r["err_vs_fp32"], original)
    assert set(by[next(k for k in by if k[0] == "infer")]) == {
        "original", "original (A/A)", "backend lnfold", "backend lnfold, defer on", "backend lnfold, defer auto",
        "fold_to_rmsnorm", "LN->RMS swap (not exact)"}
