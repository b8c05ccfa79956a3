"""Issue 10's corpus: ONNX files other people's tools made (tests/corpus/, see its README).

Each committed file is folded with the command line (`lnfold fold F -o OUT --json`, run in
process: the same `main` as `python -m lnfold`), and checked against manifest.json's hand-derived
counts (folded, recentered, LayerNorms found), the command's own verification, and the report
(every kept norm says why), with no option given. A file with nothing to fold must be refused with
exit code 2. Files onnxruntime refuses to load are verified too: onnxconverter-common's fp16 files
by float64 copies of both models, tf2onnx's (which write the non-ONNX op Erfc) by onnx's reference
evaluator.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from lnfold.onnx_rewrite.cli import main as lnfold_main

CORPUS = Path(os.environ.get("LNFOLD_CORPUS", Path(__file__).parent / "corpus"))
_MANIFEST = CORPUS / "manifest.json"
ENTRIES = [e for e in json.loads(_MANIFEST.read_text())["files"] if e.get("committed", True)] \
    if _MANIFEST.exists() else []


def lnfold(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = lnfold_main(list(args))
    return rc, out.getvalue(), err.getvalue()


def _check_report(doc: dict, entry: dict) -> None:
    rep = doc["report"]
    got = (rep["folded"], rep["recentered"], len(rep["norms"]))
    want = (entry["expected_folded"], entry["expected_recentered"], entry["layernorms"])
    assert got == want, f"(folded, recentered, norms) {got} != hand count {want}: {entry['why']}"
    assert all(n["reason"] for n in rep["norms"] if n["verdict"] == "keep")


def _report_predicts_fold(src: Path, rc: int, stdout: str, stderr: str) -> None:
    """Issue 34: `lnfold report` says exactly what `lnfold fold` does: every norm it calls foldable
    is folded with the same edits (the same per-norm verdicts and stream edits), and a refusal names
    the first kept norm and its cause."""
    rrc, rout, rerr = lnfold("report", str(src), "--json")
    if rrc != 0:  # nothing to analyze (no LayerNorm): fold refuses the same way
        assert rc == 2 and rerr.strip() == stderr.strip(), (rerr, stderr)
        return
    said = json.loads(rout)
    assert rc != 1, f"report says {said['folded']} fold, fold refused by verification: {stderr}"
    if rc == 2:
        assert said["folded"] == 0, stderr
        kept = next((n for n in said["norms"] if n["verdict"] == "keep"), None)
        if kept is None:  # RMSNorms as given only (issue 47's LLM files): they rotate, nothing folds
            assert "RMSNorms already" in stderr, stderr
            return
        assert kept["name"] in stderr and kept["reason"] in stderr, (kept, stderr)
        return
    done = json.loads(stdout)["report"]
    assert done["norms"] == said["norms"] and done["streams"] == said["streams"]


@pytest.mark.slow
@pytest.mark.skipif(not ENTRIES, reason=f"no corpus at {CORPUS}")
@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_corpus_file_folds_with_the_hand_count(entry, tmp_path):
    src, out = CORPUS / entry["file"], tmp_path / "folded.onnx"
    rc, stdout, stderr = lnfold("fold", str(src), "-o", str(out), "--json")
    _report_predicts_fold(src, rc, stdout, stderr)
    if entry["expected_folded"] == 0:
        assert rc == 2 and not out.exists(), stderr
        assert ("no LayerNorm found" if entry["layernorms"] == 0 else "no LayerNorm can be folded") in stderr
        assert entry.get("expected_reason", "") in stderr  # issue 34: the cause a person can act on
        return
    assert rc == 0, stderr
    doc = json.loads(stdout)
    _check_report(doc, entry)
    assert doc["verified"] and doc["max_rel_err"] is not None
    assert entry.get("expected_criterion", "") in doc["criterion"]  # issue 34: "pinned seeds"
    assert out.exists()


# The files onnxruntime refuses to load, each through its own path: float64 copies (onnxconverter-
# common's fp16) and the reference evaluator with Erfc (tf2onnx). A missed centering must fail.
_REFUSED = ["occfp16_ts_op17_fp32_vit.onnx", "occfp16_gpt2_model.onnx", "tf2onnx_op17_keras_block.onnx",
            "torchscript_op17_fp16_fp32ln_gpt2.onnx", "occfp16_ts_op17_fp32_clip.onnx"]


@pytest.mark.slow
@pytest.mark.parametrize("name", _REFUSED)
def test_corpus_file_onnxruntime_refuses_planted_bug_fails(name, monkeypatch):
    import onnx

    from lnfold.onnx_rewrite import api, fold_model
    from lnfold.passes import VerificationError
    from tests.conftest import missing_one_centering

    if not (CORPUS / name).exists():
        pytest.skip(f"{name} not in {CORPUS}")
    model = onnx.load(str(CORPUS / name))
    monkeypatch.setattr(api, "make_plan", missing_one_centering(api.make_plan, index=0))
    with pytest.raises(VerificationError, match="float64"):
        fold_model(model)


# Issue 34: random ops. Verification pins the same seeds in the original and folded copies; a fold
# that skips the recenter of the noise-started stream must still be refused (pinned seeds make the
# runs reproducible, they must not make them agree), and the written model keeps its nodes unseeded.
_RANDOM = ["hand_random_RandomNormalLike.onnx", "hand_random_Dropout.onnx", "hand_random_Bernoulli.onnx"]


@pytest.mark.parametrize("name", _RANDOM)
def test_random_op_stream_without_its_recenter_is_refused(name, monkeypatch):
    import onnx

    from lnfold.onnx_rewrite import api, fold_model
    from lnfold.passes import VerificationError

    if not (CORPUS / name).exists():
        pytest.skip(f"{name} not in {CORPUS}")
    make_plan = api.make_plan

    def without_recenters(view, mode="rms", **kw):
        from dataclasses import replace

        plan = make_plan(view, mode, **kw)
        assert plan.recenters, "the planted bug needs a recenter to drop"
        return replace(plan, recenters=[])

    monkeypatch.setattr(api, "make_plan", without_recenters)
    with pytest.raises(VerificationError, match="float64"):
        fold_model(onnx.load(str(CORPUS / name)))


@pytest.mark.parametrize("name", _RANDOM)
def test_random_op_fold_verifies_with_pinned_seeds_and_writes_them_unseeded(name):
    import onnx

    from lnfold.onnx_rewrite import fold_model

    if not (CORPUS / name).exists():
        pytest.skip(f"{name} not in {CORPUS}")
    result = fold_model(onnx.load(str(CORPUS / name)))
    assert result.report.recentered == 1 and "pinned seeds" in result.criterion
    random = [n for n in result.model.graph.node if n.op_type in ("RandomNormalLike", "Dropout", "Bernoulli")]
    assert random and not any(a.name == "seed" for n in random for a in n.attribute)
