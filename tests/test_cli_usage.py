"""The command line as a new user first meets it: bare `lnfold`, `--version`, every option's help,
and help texts that say what the command really emits."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import lnfold
from lnfold.onnx_rewrite.cli import _parser


def _lnfold(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfold", *argv], capture_output=True, text=True)


def _parsers(p: argparse.ArgumentParser, path: str = "lnfold"):
    """(command path, parser) for the top-level parser and every subcommand's, recursively."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_bare_lnfold_prints_the_help_and_a_hint():
    run = _lnfold()
    assert run.returncode == 2
    assert "required" not in run.stderr, run.stderr  # not argparse's "the following arguments are required: cmd"
    assert run.stderr.startswith("usage: lnfold"), run.stderr
    for command in ("fold", "report", "bench", "demo"):
        assert f"\n    {command} " in run.stderr, command  # the command list with its one-line help
    assert run.stderr.rstrip().splitlines()[-1].startswith("lnfold: give a command:")


def test_version_is_the_installed_distributions():
    run = _lnfold("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"lnfold {version('lnfold')}"
    assert lnfold.__version__ == version("lnfold")


def test_every_option_of_every_command_has_help():
    missing = [f"{path} {action.option_strings or action.dest}"
               for path, p in _parsers(_parser()) for action in p._actions if not (action.help or "").strip()]
    assert not missing, missing
    assert {path for path, _ in _parsers(_parser())} == {"lnfold", "lnfold fold", "lnfold report", "lnfold bench",
                                                      "lnfold quantize", "lnfold slice", "lnfold check", "lnfold demo"}


def test_target_help_names_the_ops_each_target_emits(zoo_onnx):
    """The CPU emission is Add + SimplifiedLayerNormalization, not a fused op: the help says so,
    and the fold does what the help says."""
    fold = dict(_parsers(_parser()))["lnfold fold"]
    (target,) = [a for a in fold._actions if "--target" in a.option_strings]
    assert "fused" not in target.help, target.help
    for op in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"):
        assert op in target.help, op
    _, _, model = zoo_onnx("gpt2")
    for device, want in (("cpu", "SimplifiedLayerNormalization"), ("cuda", "SkipSimplifiedLayerNormalization")):
        ops = {n.op_type for n in lnfold.fold_onnx(model, target="ort", device=device).model.graph.node}
        assert want in ops and "LayerNormalization" not in ops, (device, sorted(ops))
        if device == "cpu":
            assert "SkipSimplifiedLayerNormalization" not in ops, sorted(ops)
