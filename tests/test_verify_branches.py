"""Verification covers both branches of an If that a bool graph input decides (Optimum's merged
decoders: `If(use_cache_branch)`, verify.branch_inputs). Made-up inputs took one branch (a random
bool: False at seed 0), so a fold wrong in the other passed its own float64 gate; now the gate runs
once per value of that input and the criterion says so. Planted bug: the new bias `W β` of the head
left out in ONE branch (its β contribution lost there only): refused for either branch. Given
inputs are used as given; where they take one branch, the criterion says so (the hole is said).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import lnfold
from lnfold.onnx_rewrite import crms, sessions, verify
from lnfold.passes import LnfoldError, VerificationError
from tests import onnx_graphs as G
from tests.test_merged_new_biases import CORPUS, MERGED, V, merged_model
from tests.test_verify_cost import _count

BOTH = "verified on both branches of If `optimum::if` (use_cache_branch False and True)"


def _without_bias_in(monkeypatch, branch: str) -> None:
    """Plant: the head's new bias is zero in `branch` ("then_branch" or "else_branch") only."""
    real = crms.compute_new_bias
    monkeypatch.setattr(crms, "compute_new_bias", lambda nb, get: np.zeros(V, np.float32)
                        if f"/{branch}::" in nb.node else real(nb, get))


def _rows(use_cache: bool) -> dict:
    return {"input_ids": np.random.default_rng(1).integers(0, V, (2, 5)).astype(np.int64),
            "use_cache_branch": np.array([use_cache])}


def test_both_branches_are_verified_and_said():
    r = lnfold.fold_onnx(merged_model(), rotate="hadamard")
    assert r.criterion == f"float64; {BOTH}", r.criterion
    ref = verify.reference(merged_model())
    assert [run.takes for run in ref.runs] == [{"use_cache_branch": False}, {"use_cache_branch": True}]
    # both runs made in the original's one session, released before the float64 runs (issue 47)
    assert ref.runner.sess is sessions.RELEASED and all(run.exact is not None for run in ref.runs)


# then_branch: the one seed 0's made-up bool did not take (the old gate passed this fold)
@pytest.mark.parametrize("branch", ["then_branch", "else_branch"])
def test_a_fold_wrong_in_one_branch_only_fails_verification(branch, monkeypatch):
    _without_bias_in(monkeypatch, branch)
    value = branch == "then_branch"
    with pytest.raises(VerificationError, match=f"on inputs with use_cache_branch {value}"):
        lnfold.fold_onnx(merged_model(), rotate="hadamard")


def test_given_inputs_of_one_branch_are_used_as_given_and_said(monkeypatch):
    """The user's rows take the else_branch: the fold wrong in the then_branch passes (they cannot
    judge it), and the criterion says the other branch was not verified."""
    _without_bias_in(monkeypatch, "then_branch")
    r = lnfold.fold_onnx(merged_model(), rotate="hadamard", inputs=_rows(False))
    assert r.criterion == "float64; the given inputs take one branch only of If `optimum::if` " \
                          "(use_cache_branch False)", r.criterion
    with pytest.raises(VerificationError):  # rows of the wrong branch catch it
        lnfold.fold_onnx(merged_model(), rotate="hadamard", inputs=_rows(True))


def test_the_original_and_folded_sessions_are_built_once(tmp_path, monkeypatch):
    """Two runs, one after the other: one session of the original (released before the float64
    copy runs), one of the folded model, one of the float64 copy."""
    original, folded = tmp_path / "merged.onnx", tmp_path / "merged.folded.onnx"
    onnx.save(merged_model(), original)
    onnx.save(lnfold.fold_onnx(merged_model(), rotate="hadamard", verify=False).model, folded)
    _, built = _count(monkeypatch)
    verdict = verify.check(original, folded)
    assert verdict.ok and verdict.criterion == f"float64; {BOTH}", verdict
    assert built.count(str(original)) == 1 and built.count(str(folded)) == 1 and len(built) == 3, built


def _if_on(cond_nodes: list, cond: str, shape: list) -> onnx.ModelProto:
    """x -> If(cond) -> x + 1 or x - 1, `cond` made by `cond_nodes` from the bool input `flag`."""
    def branch(label, op):
        return helper.make_graph([helper.make_node(op, ["x", "one"], [f"{label}_y"])], label, [],
                                 [helper.make_tensor_value_info(f"{label}_y", TensorProto.FLOAT, None)])
    nodes = cond_nodes + [helper.make_node("If", [cond], ["y"], name="pick", then_branch=branch("t", "Add"),
                                           else_branch=branch("e", "Sub"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
                               helper.make_tensor("yes", TensorProto.BOOL, [], [True])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("nodes, cond, shape, found", [
    ([], "flag", [], True),
    ([helper.make_node("Not", ["flag"], ["c"])], "c", [1], True),
    ([helper.make_node("Cast", ["flag"], ["f"], to=TensorProto.BOOL), helper.make_node("Identity", ["f"], ["c"])],
     "c", [1], True),
    ([helper.make_node("Equal", ["flag", "yes"], ["c"])], "c", [1], True),
    ([helper.make_node("Xor", ["flag", "flag"], ["c"])], "c", [1], False),  # (computed: not covered)
    ([], "flag", [2], False),  # (not a scalar)
], ids=["direct-0d", "not", "cast-identity", "equal", "xor", "two-flags"])
def test_which_conditions_are_covered(nodes, cond, shape, found):
    model = _if_on(nodes, cond, shape)
    assert verify.branch_inputs(model) == ({"flag": ["pick"]} if found else {})


def _reshaped_in(branch: str) -> onnx.ModelProto:
    """`_if_on` with x reshaped to [3, 7] in `branch` ("t", "e", or both): no made-up x has 21 elements."""
    model = _if_on([], "flag", [1])
    model.graph.initializer.append(helper.make_tensor("odd", TensorProto.INT64, [2], [3, 7]))
    for a in model.graph.node[0].attribute:
        if a.g.name in branch:
            n = a.g.node[0]
            a.g.node.insert(0, helper.make_node("Reshape", ["x", "odd"], [f"{a.g.name}_x"]))
            n.input[0] = f"{a.g.name}_x"
    return model


def test_a_branch_no_made_up_input_runs_is_said():
    verdict = verify.check(_reshaped_in("t"), _reshaped_in("t"))
    assert verdict.ok and "verified on some branches only of If `pick` (flag False): made-up inputs with flag " \
                          "True do not run it (If `pick`" in verdict.criterion and "requested shape:{3,7}" in verdict.criterion \
        and verdict.criterion.endswith("give inputs for the others with --inputs FILE.npz (API: inputs=)"), verdict.criterion
    with pytest.raises(LnfoldError, match="cannot verify: onnxruntime cannot run the input model on made-up inputs"):
        verify.check(_reshaped_in("te"), _reshaped_in("te"))  # no branch runs: as without an If


def test_a_model_without_if_is_verified_as_before():
    model = G.pre_ln()
    ref = verify.reference(model)
    assert len(ref.runs) == 1 and not ref.runs[0].takes and not ref.branches
    _, feeds, outputs = verify.original_run(model)  # the inputs made up as before
    assert feeds.keys() == ref.feeds.keys() and all(np.array_equal(feeds[k], ref.feeds[k]) for k in feeds)
    assert lnfold.fold_onnx(model).criterion == "float64"


@pytest.mark.slow
@pytest.mark.parametrize("name", MERGED)
def test_corpus_merged_decoders_verify_both_branches(name, tmp_path):
    """The committed Optimum/onnxslim merged decoders fold with --rotate hadamard (the CLI), verified
    on both branches (GPT-2's and Llama's cached branch on an empty past: their mask's length is
    named as the sequence's)."""
    if not (CORPUS / name).exists():
        pytest.skip(f"{name} not in tests/corpus")
    out = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(CORPUS / name), "--rotate", "hadamard",
                          "-o", str(tmp_path / name)], capture_output=True, text=True)
    assert out.returncode == 0 and BOTH in out.stdout + out.stderr, out.stdout + out.stderr
