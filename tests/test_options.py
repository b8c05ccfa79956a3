"""One options policy (passes/options.py) and one tolerance table (passes/gate.py) for both
frontends and the torch.compile backend; importing the ONNX frontend changes nothing global."""
from __future__ import annotations

import inspect
import pathlib
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import lnfold  # noqa: E402
from lnfold.passes import LnfoldError, VerificationError, gate  # noqa: E402
from lnfold.passes.options import FoldOptions  # noqa: E402

from . import onnx_graphs as G  # noqa: E402

BAD = [("mode", "layer", "unknown mode 'layer'"), ("defer", "sometimes", "unknown defer policy 'sometimes'"),
       ("target", "tpu", "unknown target 'tpu'"), ("device", "npu", "unknown device 'npu'"),
       ("verify", "yes", "verify must be True or False")]


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text.strip() == text
    return text


@pytest.mark.parametrize("key,value,message", BAD)
def test_fold_onnx_bad_option_is_one_line_lnfold_error(key, value, message):
    model = G.pre_ln()
    before = model.SerializeToString()
    with pytest.raises(LnfoldError) as e:
        lnfold.fold_onnx(model, **{key: value})
    assert message in _one_line(e)
    assert model.SerializeToString() == before


def test_analyze_onnx_bad_mode():
    with pytest.raises(LnfoldError, match="unknown mode 'layer' .expected one of rms, crms."):
        lnfold.analyze_onnx(G.pre_ln(), mode="layer")


def test_make_plan_bad_mode_is_lnfold_error():
    """passes/ itself says it the same way (it raised ValueError before)."""
    from lnfold.passes import View, make_plan

    with pytest.raises(LnfoldError, match="unknown mode 'x'"):
        make_plan(View(), "x")


def test_fold_options_are_frozen_and_normalized():
    opts = FoldOptions(mode="crms", verify=1)
    assert opts.verify is True
    with pytest.raises(AttributeError):
        opts.mode = "rms"


def test_shared_keywords_in_the_same_order():
    """fold_onnx and fold_module take their common options under the same names, in the same order."""
    def kwonly(f):
        return [p.name for p in inspect.signature(f).parameters.values() if p.kind is p.KEYWORD_ONLY]

    a, b = kwonly(lnfold.fold_onnx), kwonly(lnfold.fold_module)
    shared = [k for k in a if k in b]
    assert shared == [k for k in b if k in a] and shared[:3] == ["mode", "defer", "verify"]


def test_the_option_keywords_are_derived_from_the_declarations():
    """Every FoldOptions field is a keyword of fold_onnx and fold_module, with its declared default,
    and documented with its declared help (passes/options.takes_options): a new option needs no edit
    of the API; a value is checked into FoldOptions, a name nobody declared is a TypeError."""
    from dataclasses import fields

    from lnfold.passes.options import OPTIONS

    for f in (lnfold.fold_onnx, lnfold.fold_module):
        params = inspect.signature(f).parameters
        for field in fields(FoldOptions):
            assert params[field.name].default == OPTIONS[field.name].default, (f, field.name)
            assert OPTIONS[field.name].help in f.__doc__, (f, field.name)
        assert "options" not in params
    with pytest.raises(LnfoldError, match="give --rotate too"):
        lnfold.fold_onnx(G.pre_ln(), gamma_in_float=True)
    with pytest.raises(TypeError):
        lnfold.fold_onnx(G.pre_ln(), rotation="hadamard")


def test_verify_outputs_still_works():
    with pytest.warns(DeprecationWarning, match="verify="):
        res = lnfold.fold_onnx(G.pre_ln(), verify_outputs=False)
    assert res.report.folded == 3 and res.criterion is None and "verification" not in res.timings


# --- the torch frontend and the backend ----------------------------------------------------------

class _PreLN(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.ln1, self.fc, self.ln2, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 3)
        lnfold.zoo.adversarial(self)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(torch.tanh(self.ln1(h)))
        return self.head(self.ln2(h))


IDS = (torch.randint(0, 11, (2, 5)),)


@pytest.mark.parametrize("key,value,message", [b for b in BAD if b[0] in ("mode", "defer", "verify")]
                         + [("norm", "fused", "unknown norm 'fused'")])
def test_fold_module_bad_option_is_one_line_lnfold_error(key, value, message):
    with pytest.raises(LnfoldError) as e:
        lnfold.fold_module(_PreLN(), IDS, **{key: value})
    assert message in _one_line(e)


def test_analyze_module_and_training_fold_bad_mode():
    with pytest.raises(LnfoldError, match="unknown mode 'x'"):
        lnfold.analyze_module(_PreLN(), IDS, mode="x")
    with pytest.raises(LnfoldError, match="unknown mode 'x'"):
        lnfold.fold_for_training(_PreLN(), IDS, mode="x")


def _eager(gm, example_inputs):
    return gm.forward


def _compile_error(module, **compile_kw) -> BaseException:
    """What torch.compile raised, unwrapped from Dynamo's BackendCompilerFailed."""
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        with torch.no_grad():
            torch.compile(module, **compile_kw)(*IDS)
    torch._dynamo.reset()
    err = e.value
    while not isinstance(err, LnfoldError) and (err.__cause__ or getattr(err, "inner_exception", None)):
        err = err.__cause__ or err.inner_exception
    return err


def test_backend_bad_options_are_lnfold_errors():
    """Before: a bad "lnfold.mode" reached make_plan inside the backend's catch-all and the model
    was compiled unfolded without a word; a bad defer policy or option name was a ValueError."""
    with pytest.raises(LnfoldError, match="unknown mode 'x'"):
        lnfold.lnfold_backend_with(mode="x")
    with pytest.raises(LnfoldError, match="unknown defer policy 'x'"):
        lnfold.lnfold_backend_with(defer="x")
    for options, message in [({"lnfold.mode": "x"}, "unknown mode 'x'"),
                             ({"lnfold.defer": "x"}, "unknown defer policy 'x'"),
                             ({"lnfold.nope": 1}, "unknown lnfold option")]:
        err = _compile_error(_PreLN(), backend="lnfold", options=options)
        assert isinstance(err, LnfoldError) and message in str(err), repr(err)


def test_one_tolerance_table_for_both_frontends_and_the_backend(monkeypatch):
    """Each verifier judges with passes/gate.py's table, read when it judges: a gate that allows
    no error at all refuses the same folds in fold_onnx, fold_module and the backend, which pass
    with the table as it is."""
    model, module = G.pre_ln(), _PreLN()
    lnfold.fold_onnx(model)
    lnfold.fold_module(module, IDS)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=lnfold.lnfold_backend_with(inner=_eager, verify=True))(*IDS)

    monkeypatch.setattr(gate, "FACTOR", 0.0)
    for table in (gate.FLOOR, gate.TOLERANCE):
        for dtype in table:
            monkeypatch.setitem(table, dtype, -1.0)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(model)
    with pytest.raises(VerificationError):
        lnfold.fold_module(module, IDS)
    err = _compile_error(module, backend=lnfold.lnfold_backend_with(inner=_eager, verify=True))
    assert isinstance(err, VerificationError), repr(err)


# --- no import-time side effects ------------------------------------------------------------------
def test_importing_and_folding_leave_graphsurgeons_logger_alone():
    """`import lnfold.onnx_rewrite` set onnx-graphsurgeon's process-wide log severity to ERROR;
    now it is ERROR only while a fold runs, and put back after."""
    code = textwrap.dedent("""
        import onnx_graphsurgeon as gs
        log = gs.logger.G_LOGGER
        log.severity = log.VERBOSE
        import lnfold.onnx_rewrite
        assert log.severity == log.VERBOSE, log.severity
        from tests import onnx_graphs as G
        lnfold.onnx_rewrite.fold_model(G.pre_ln())
        lnfold.onnx_rewrite.analyze_model(G.pre_ln())
        assert log.severity == log.VERBOSE, log.severity
    """)
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_option_declared_once_reaches_the_fold_command_and_the_api():
    """passes/options.OPTIONS declares each FoldOptions field once: `lnfold fold` has its flag, a
    non-default value on the command line comes back in FoldOptions (options_from), and the one
    check refuses a bad value alike on the command line (usage error, exit 2) and in the API."""
    import dataclasses

    from lnfold.onnx_rewrite import cli
    from lnfold.passes.options import OPTIONS, options_from

    assert [f.name for f in dataclasses.fields(FoldOptions)] == list(OPTIONS)
    args = cli.parse_args(["fold", "m.onnx", "--mode", "crms", "--defer", "auto", "--no-verify", "--seed", "7",
                           "--gamma-into-readers"])
    assert options_from(args) == FoldOptions(mode="crms", defer="auto", verify=False, seed=7, gamma_into_readers=True)
    assert options_from(cli.parse_args(["fold", "m.onnx"])) == FoldOptions()
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["fold", "m.onnx", "--seed", "-1"])
    assert e.value.code == 2
    with pytest.raises(LnfoldError, match="seed must be a non-negative integer"):
        FoldOptions(seed=-1)
    # the same declaration reaches the slice command (the emission target) and report (a subset of modes)
    assert cli.parse_args(["slice", "m.onnx", "-o", "s.onnx", "--fraction", "0.2", "--target", "portable"]).target == "portable"
    with pytest.raises(SystemExit):
        cli.parse_args(["report", "m.onnx", "--mode", "rms-approx"])


def test_slice_emits_the_target_asked_for(tmp_path, capsys):
    """`lnfold slice --target portable`: the sliced model's norms are primitive ops, no onnxruntime contrib op."""
    import onnx

    from lnfold.onnx_rewrite import cli

    from .test_slice import _files, stream_model

    src, cal, out = _files(tmp_path, stream_model(span=12))
    for target, op in (("ort", "SimplifiedLayerNormalization"), ("portable", None)):
        assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal),
                         "--target", target, "--json"]) == 0
        ops = {n.op_type for n in onnx.load(str(out)).graph.node}
        assert (op in ops) if op else not ops & {"SimplifiedLayerNormalization", "LayerNormalization"}, ops
    capsys.readouterr()
