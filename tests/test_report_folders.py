"""`lnfold report DIR` takes every input `lnfold fold` takes (issue 45 item 11): a transformers
checkpoint folder (its plan from the structure alone, the same verdicts the fold reports) and an
exporter's folder of ONNX files (a report per file); what it cannot read, the one line fold says."""
from __future__ import annotations

import json
import shutil

import onnx
import pytest

from lnfold.onnx_rewrite.cli import main as cli_main

from . import onnx_graphs as G


def test_report_on_an_exporters_folder_reports_each_file(tmp_path, capsys):
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    onnx.save(G.pre_ln(1), folder / "encoder.onnx")
    onnx.save(G.pre_ln(2), folder / "sub" / "decoder.onnx")
    (folder / "tokenizer.json").write_text("{}")
    assert cli_main(["report", str(folder), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert sorted(reports) == ["encoder.onnx", "sub/decoder.onnx"]
    assert [reports[f]["folded"] for f in sorted(reports)] == [2, 3]  # (pre_ln(n): n blocks and the final norm)
    assert cli_main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "encoder.onnx:" in out and "sub/decoder.onnx:" in out
    assert cli_main(["report", str(folder), "--calibrate", "x.npz"]) == 2
    assert "give the file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing written


def _checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.test_checkpoint import build

    return build(tmp_path / "opt", torch.float32)


def test_report_on_a_checkpoint_folder(tmp_path, capsys):
    src = _checkpoint(tmp_path)
    before = sorted(p.name for p in src.iterdir())
    assert cli_main(["report", str(src), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["folded"], report["kept"]) == (5, 0)  # (2 blocks' two norms and the final one)
    assert sorted(p.name for p in src.iterdir()) == before and sorted(p.name for p in tmp_path.iterdir()) == ["opt"]


@pytest.mark.slow
def test_report_on_a_checkpoint_folder_matches_the_fold(tmp_path, capsys):
    src = _checkpoint(tmp_path)
    assert cli_main(["report", str(src), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert cli_main(["fold", str(src), "-o", str(tmp_path / "out"), "--json", "--no-verify"]) == 0
    folded = json.loads(capsys.readouterr().out)["report"]
    assert report["folded"] == folded["folded"] == 5 and report["norms"] == folded["norms"]
    shutil.rmtree(tmp_path / "out")
