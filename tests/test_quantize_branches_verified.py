"""`lnfold quantize --calibrate rows.npz` on a merged decoder verifies its exact steps on every
branch of the If that `use_cache_branch` decides, not only the one the rows take.

The fold inside quantize is verified on the user's rows (`Measured.verification`); a merged
decoder's rows all take one branch (`use_cache_branch` has no batch axis), so the fold's gate saw
that branch only ("the given inputs take one branch only"). Now quantize verifies on the rows AND,
for each branch value they do not take, on made-up inputs with that value (verify.reference's
`other_branches`), and the report's fold line says which. Planted bug (as tests/test_verify_branches
plants it): the head's new bias `W β` zero in the then_branch only, which the calibration rows
(use_cache_branch False) do not take: before this change quantize passed it and wrote the model.
"""
from __future__ import annotations

import numpy as np
import pytest

import lnfold
from lnfold.onnx_rewrite import verify
from lnfold.passes import VerificationError
from tests import onnx_graphs as G
from tests.test_merged_new_biases import merged_model
from tests.test_verify_branches import _reshaped_in, _rows, _without_bias_in

BOTH = ("verified on both branches of If `optimum::if` (use_cache_branch False and True): the given inputs take "
        "use_cache_branch False, made-up inputs use_cache_branch True")


def test_both_branches_verified_and_said_in_the_fold_line():
    r = lnfold.quantize_onnx(merged_model(), weights="int8", rotate="hadamard", calibrate=_rows(False))
    assert r.fold.criterion == f"float64; {BOTH}", r.fold.criterion
    assert BOTH in r.report.fold_line(), r.report.fold_line()


def test_a_fold_wrong_in_the_branch_the_rows_do_not_take_is_refused(monkeypatch):
    """(before: passed, the then_branch never run by the fold's gate)"""
    _without_bias_in(monkeypatch, "then_branch")
    with pytest.raises(VerificationError, match="on inputs with use_cache_branch True"):
        lnfold.quantize_onnx(merged_model(), weights="int8", rotate="hadamard", calibrate=_rows(False))


def test_rotate_auto_verifies_the_chosen_fold_on_every_branch(monkeypatch):
    """rotate=auto's chosen fold (check_exact_steps on the rows' verification inputs), planted alike."""
    r = lnfold.quantize_onnx(merged_model(), weights="int8", rotate="auto", calibrate=_rows(False))
    assert r.fold.criterion == f"float64; {BOTH}", r.fold.criterion
    _without_bias_in(monkeypatch, "then_branch")
    with pytest.raises(VerificationError, match="on inputs with use_cache_branch True"):
        lnfold.quantize_onnx(merged_model(), weights="int8", rotate="auto", calibrate=_rows(False))


def test_a_model_without_if_is_verified_on_the_rows_as_before():
    model = G.pre_ln()
    rows = {"ids": np.random.default_rng(0).integers(0, G.VOCAB, (2, G.T)).astype(np.int64)}
    r = lnfold.quantize_onnx(model, weights="int8", calibrate=rows)
    assert r.fold.criterion == "float64", r.fold.criterion
    assert r.report.fold_line() == "fold: 3 LayerNorm(s) folded, 0 kept: exact, verified (float64, max rel. diff " \
        f"{r.fold.max_rel_err:.1e})"  # (as before this change)


def test_a_branch_no_made_up_input_runs_is_said_beside_the_rows():
    """The then_branch reshapes x to [3, 7]: the rows (flag False) verify, no made-up input runs flag True."""
    model = _reshaped_in("t")
    rows = {"x": np.ones((2, 4), np.float32), "flag": np.array([False])}
    verdict = verify.check(model, model, inputs=rows, other_branches=True)
    assert verdict.ok and "the given inputs take flag False; verified on some branches only of If `pick` (flag " \
        "False): made-up inputs with flag True do not run it (If `pick`" in verdict.criterion, verdict.criterion
    # without other_branches (the fold's own --inputs): as before
    assert verify.check(model, model, inputs=rows).criterion.endswith("the given inputs take one branch only of If "
                                                                      "`pick` (flag False)")
