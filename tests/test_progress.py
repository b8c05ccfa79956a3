"""What a command shows while it works (onnx_rewrite/progress.py, issue 46): on a terminal a status
line on stderr with the current stage, erased before the report; nothing of it with --json or when
stderr is not a terminal. stderr is made a real terminal here (a pseudo-terminal, 120 columns), and
the command is the console script's own `main`, in this process."""
from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import sys
import termios
from pathlib import Path

import pytest

from lnfold.onnx_rewrite.cli import main

GPT2 = Path(__file__).resolve().parent / "corpus" / "dynamo_op18_fp32_gpt2.onnx"  # 327 kB: well below 300 MB


def _run(argv: list[str], monkeypatch, capsys, *, terminal: bool) -> tuple[int, str, str]:
    """`lnfold ARGV` in a terminal (stdout and stderr both the pseudo-terminal, read back as one text,
    in the order written: returned as stderr, stdout "") or in pipes (captured apart)."""
    capsys.readouterr()
    if not terminal:
        code = main(argv)
        out = capsys.readouterr()
        return code, out.out, out.err
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 0-column pty shows nothing
    with os.fdopen(secondary, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        monkeypatch.setattr(sys, "stdout", tty)
        assert sys.stderr.isatty()
        code = main(argv)
        tty.flush()
        monkeypatch.undo()
    os.set_blocking(primary, False)
    err = b""
    try:
        while chunk := os.read(primary, 65536):
            err += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(primary)
    return code, capsys.readouterr().out, err.decode()


def test_a_terminal_shows_the_stages_and_erases_them(tmp_path, monkeypatch, capsys):
    code, _, screen = _run(["fold", str(GPT2), "-o", str(tmp_path / "f.onnx")], monkeypatch, capsys, terminal=True)
    status, _, report = screen.partition("norm ")  # the report's table starts with its header
    assert code == 0 and "lnfold: wrote" in report and "stage(s)" not in report, repr(screen)
    assert "lnfold: editing (5 norms" in status, repr(status)
    assert re.search(r"\r +\r$", status), repr(status[-80:])  # blanked before the report: it starts clean
    code, out, err = _run(["slice", str(GPT2), "-o", str(tmp_path / "s.onnx"), "--fraction", "0.25", "--calibrate",
                           str(_rows(tmp_path))], monkeypatch, capsys, terminal=True)
    assert code == 0 and "stage(s)" in err, repr(err)


def _rows(tmp_path: Path) -> Path:
    import numpy as np

    np.savez(tmp_path / "cal.npz", input_ids=np.random.default_rng(0).integers(0, 32, (16, 8)))
    return tmp_path / "cal.npz"


@pytest.mark.parametrize("terminal", [True, False], ids=["json-on-a-terminal", "json-in-a-pipe"])
def test_json_output_has_no_progress(tmp_path, monkeypatch, capsys, terminal):
    code, out, err = _run(["fold", str(GPT2), "-o", str(tmp_path / "f.onnx"), "--json"], monkeypatch, capsys,
                          terminal=terminal)
    assert code == 0 and json.loads(out or err)["output"] == str(tmp_path / "f.onnx")  # (a terminal: all in err)
    assert "stage(s)" not in err and "lnfold: " not in err, repr(err)


def test_a_pipe_gets_no_stages_for_a_small_model(tmp_path, monkeypatch, capsys):
    code, out, err = _run(["fold", str(GPT2), "-o", str(tmp_path / "f.onnx")], monkeypatch, capsys, terminal=False)
    assert code == 0 and err == "", repr(err)


def test_bench_shows_its_phases_between_its_header_and_its_figures(tmp_path, monkeypatch, capsys):
    assert main(["fold", str(GPT2), "-o", str(tmp_path / "f.onnx")]) == 0
    code, _, screen = _run(["bench", str(GPT2), str(tmp_path / "f.onnx"), "--seconds", "1"], monkeypatch, capsys,
                           terminal=True)
    header, _, figures = screen.partition("budget: --seconds")  # the figures start there
    status = header.split("\n", 2)[-1]  # (after the two header lines)
    assert code == 0 and "timing end to end: repeat 1 of 3" in status and "stage(s)" not in figures, repr(screen)
    assert re.search(r"\r +\r", status), repr(status[-80:])


@pytest.mark.slow  # (15 s: seven candidates twice; the fold's and the slice's status lines are the fast tier's)
def test_quantize_rotate_auto_shows_each_candidate_on_a_terminal_and_nothing_in_json(tmp_path, monkeypatch, capsys):
    """`lnfold quantize --rotate auto` measures seven candidates: on a terminal the status line names
    each one as it goes, erased before the report; with --json nothing of it is printed."""
    argv = ["quantize", str(GPT2), "-o", str(tmp_path / "q.onnx"), "--weights", "int8", "--rotate", "auto"]
    code, _, screen = _run(argv, monkeypatch, capsys, terminal=True)
    assert code == 0, repr(screen[-400:])
    from lnfold.passes.quantize import AUTO_CANDIDATES

    n = len(AUTO_CANDIDATES)
    assert f"rotate auto: candidate 1 of {n}" in screen and f"rotate auto: candidate {n} of {n}" in screen, \
        repr(screen[:400])
    assert "chosen, quantized again" in screen
    code, out, err = _run(argv + ["--json"], monkeypatch, capsys, terminal=False)
    assert code == 0 and "rotate auto: candidate" not in out + err and json.loads(out)["exact"] is False
