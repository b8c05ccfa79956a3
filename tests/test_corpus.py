"""Issue 10's corpus: ONNX files other people's tools made (tests/corpus/, see its README).

Each committed file is folded with the command line (`lnfold fold F -o OUT --json`, run in
process: the same `main` as `python -m lnfold`), and checked against manifest.json's hand-derived
counts (folded, recentered, LayerNorms found), the command's own verification, and the report
(every kept norm says why). A file with nothing to fold must be refused with exit code 2.
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

# What the command says when it cannot run the *original* model (inputs it cannot make up, a file
# onnxruntime refuses to load): verification, not the fold, is missing (issue 10, parts 1-2).
_CANNOT_VERIFY = ("cannot verify", "onnxruntime cannot run the input", "onnxruntime cannot load",
                  "onnxruntime refuses")


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


@pytest.mark.slow
@pytest.mark.skipif(not ENTRIES, reason=f"no corpus at {CORPUS}")
@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_corpus_file_folds_with_the_hand_count(entry, tmp_path):
    src, out = CORPUS / entry["file"], tmp_path / "folded.onnx"
    rc, stdout, stderr = lnfold("fold", str(src), "-o", str(out), "--json")
    if entry["expected_folded"] == 0:
        assert rc == 2 and not out.exists(), stderr
        assert ("no LayerNorm found" if entry["layernorms"] == 0 else "no LayerNorm can be folded") in stderr
        return
    gap = rc == 2 and any(s in stderr for s in _CANNOT_VERIFY)
    # fp16 inside, fp32 outputs (onnxruntime's fp16 converters keep the I/O types): a gate that
    # compares with the original at a fixed fp32 tolerance refuses fp16 rounding (issue 10, part 2)
    fp16_gate = rc == 1 and entry["dtype"] == "fp16" and "verification failed: outputs differ" in stderr
    if gap or fp16_gate:
        # the fold itself must still be the hand count; verification waits for inputs/loading
        why = stderr.strip().splitlines()[-1][:200]
        rc, stdout, stderr = lnfold("fold", str(src), "-o", str(out), "--json", "--no-verify")
        assert rc == 0, stderr
        _check_report(json.loads(stdout), entry)
        pytest.xfail("folded with the hand count, not verified: " + why)
    assert rc == 0, stderr
    doc = json.loads(stdout)
    _check_report(doc, entry)
    assert doc["verified"] and doc["max_rel_err"] is not None
    assert out.exists()
