"""`--plot` where a user compares candidates (issue 46): `lnfold slice --budget` draws its search and
`lnfold quantize --rotate auto` its candidates (passes/plots.py; `report --plot` draws the geometry).
The path is checked before any work; a --plot with nothing to compare is a one-line error."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest

from lnfold.onnx_rewrite import cli

pytest.importorskip("matplotlib")

from tests.test_quantize_rows import rows, stand_in  # noqa: E402
from tests.test_slice import _files, stream_model  # noqa: E402


def _svg(path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    return root


@pytest.mark.slow  # (5 s: a budget search; the quantize chart below is the fast tier's)
def test_slice_budget_draws_its_search(tmp_path, capsys):
    src, cal, out = _files(tmp_path, stream_model(span=12))
    plot = tmp_path / "budget.svg"
    assert cli.main(["slice", str(src), "-o", str(out), "--budget", "1e-9", "--calibrate", str(cal), "--plot",
                     str(plot), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tries = report["budget_tries"]
    assert report["budget"] == 1e-9 and len(tries) >= 3 and [report["fraction"], report["error"]] in [t[:2] for t in tries]
    assert _svg(plot) is not None and not list(tmp_path.glob(".budget.svg.*"))  # written whole, no temporary left


def test_quantize_auto_draws_its_candidates(tmp_path, capsys):
    src, plot = tmp_path / "m.onnx", tmp_path / "auto.png"
    onnx.save(stand_in(1, outliers=True), src)
    np.savez(tmp_path / "in.npz", **rows(4, seed=7))
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--weights", "int8", "--rotate", "auto",
                     "--inputs", str(tmp_path / "in.npz"), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()


@pytest.mark.parametrize("argv, says", [
    (["slice", "M", "-o", "OUT", "--fraction", "0.2", "--calibrate", "CAL", "--plot", "p.svg"], "--plot draws a --budget search"),
    (["slice", "M", "-o", "OUT", "--budget", "0.1", "--calibrate", "CAL", "--plot", "p.txt"], "--plot writes .svg"),
    (["quantize", "M", "-o", "OUT", "--weights", "int8", "--plot", "p.svg"], "--plot draws --rotate auto's candidates"),
])
def test_a_plot_with_nothing_to_compare_or_a_bad_path_is_one_line_before_any_work(tmp_path, capsys, argv, says):
    src, cal, out = _files(tmp_path, stream_model(span=12))
    argv = [str(src) if a == "M" else str(out) if a == "OUT" else str(cal) if a == "CAL" else
            str(tmp_path / a) if a.startswith("p.") else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob("p.*"))
