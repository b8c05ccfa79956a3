"""Hostile inputs (issue 4): every bad file, bad graph and bad path the CLI and the API can be given.

Each case checks the error contract of issue 2: one line on stderr starting `lnfold: error:`,
never a traceback, exit code 2 for bad input or nothing to fold (1 for a failed verification,
130 for an interrupt), the input byte-identical, and no output file nor temporary folder
(`.lnfold-*`) left behind. Cases that should fold check that the result is verified equal.

The CLI runs in-process (`onnx_rewrite.cli.main`, with file-descriptor capture so that anything
onnxruntime prints is seen too) to keep the suite fast; set LNFOLD_TEST_SUBPROCESS=1 to run
every case as a real `python -m onnx_rewrite.cli` process instead. A few cases always run as a
subprocess (the entry point, usage errors, a closed pipe).

Cases named `test_regression_*` reproduce bugs these tests found (see the docstrings).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests import onnx_graphs as G
from tests.sandbox import snapshot
from lnfold import onnx_rewrite
import lnfold.onnx_rewrite.api  # noqa: F401  (imported before any fork: see as_nobody)
import lnfold.onnx_rewrite.verify  # noqa: F401
from lnfold.onnx_rewrite import LnfoldError, NothingToFold, VerificationError, analyze_model, fold_model
from lnfold.onnx_rewrite import validate, write
from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.onnx_rewrite.verify import compare
from lnfold.passes import gate

try:  # shape inference may import it lazily; a forked child running as nobody could not
    import onnxruntime.tools.symbolic_shape_infer  # noqa: F401
except Exception:  # pragma: no cover
    pass

SUBPROCESS = bool(os.environ.get("LNFOLD_TEST_SUBPROCESS"))
REPO = Path(__file__).resolve().parents[1]


# --- harness ------------------------------------------------------------------------------------

@dataclass
class Run:
    rc: int
    out: str
    err: str


def _subprocess_cli(args, cwd) -> Run:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LNFOLD_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "lnfold", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=180)
    return Run(r.returncode, r.stdout, r.stderr)


@pytest.fixture
def cli(capfd, monkeypatch):
    """cli(*args, cwd=dir) -> Run: the command, in-process (or as a subprocess, see the module doc)."""
    monkeypatch.delenv("LNFOLD_DEBUG", raising=False)

    def run(*args, cwd) -> Run:
        if SUBPROCESS:
            return _subprocess_cli(args, cwd)
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        try:
            rc = cli_main([str(a) for a in args])
        except SystemExit as e:  # argparse
            rc = e.code
        out, err = capfd.readouterr()
        return Run(rc, out, err)

    return run


def expect_error(r: Run, code: int, *needles: str) -> str:
    """One line on stderr, `lnfold: error: ...` with every needle, no traceback, exit `code`."""
    assert "Traceback" not in r.err, r.err
    lines = r.err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.err}"
    assert r.rc == code, f"exit {r.rc}, expected {code}: {r.err}"
    assert lines[0].startswith("lnfold: error: "), lines[0]
    assert "internal error" not in lines[0]
    for n in needles:
        assert n.lower() in lines[0].lower(), f"{n!r} not in {lines[0]!r}"
    return lines[0]


def expect_folded(r: Run, out: Path) -> onnx.ModelProto:
    assert r.rc == 0, r.err
    assert "Traceback" not in r.err and r.err.strip() == "", r.err
    assert "verification: max relative output difference" in r.out, r.out
    assert out.is_file()
    return onnx.load(str(out))


@pytest.fixture
def work(tmp_path):
    """A folder holding `model.onnx`; `.put(model)` writes it; `.check()` asserts nothing changed."""

    class Work:
        dir = tmp_path
        model = tmp_path / "model.onnx"
        out = tmp_path / "out.onnx"
        before: dict = {}

        def put(self, model=None, name="model.onnx", external=False, raw: bytes | None = None) -> Path:
            p = tmp_path / name
            if raw is not None:
                p.write_bytes(raw)
            else:
                G.save_model(model if model is not None else G.pre_ln(), p, external=external)
            self.before = snapshot(tmp_path)
            return p

        def freeze(self):
            self.before = snapshot(tmp_path)

        def check(self, new: tuple = ()) -> None:
            """The folder is as before (input byte-identical, no temp dir), plus exactly `new`."""
            after = snapshot(tmp_path)
            added = sorted(set(after) - set(self.before))
            assert added == sorted(new), f"left behind: {added}"
            for k, v in self.before.items():
                assert after.get(k) == v, f"{k} changed or vanished"

    return Work()


def run_fails(cli, work, code, *needles, args=(), out="out.onnx", input="model.onnx"):
    r = cli("fold", input, "-o", out, *args, cwd=work.dir)
    line = expect_error(r, code, *needles)
    work.check()
    return line


# --- unreadable files -----------------------------------------------------------------------------

def test_empty_file(cli, work):
    work.put(raw=b"")
    run_fails(cli, work, 2, "model.onnx", "empty")


def test_truncated_model(cli, work):
    data = G.pre_ln().SerializeToString()
    work.put(raw=data[: len(data) // 2])
    run_fails(cli, work, 2, "model.onnx", "truncated or corrupt")


def test_random_bytes(cli, work):
    work.put(raw=np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    run_fails(cli, work, 2, "model.onnx", "onnx")


def test_text_file(cli, work):
    work.put(raw=b"this is not an onnx model\n" * 10)
    run_fails(cli, work, 2, "model.onnx", "onnx")


def test_model_without_graph(cli, work):
    """A well-formed ModelProto holding no graph (as a bare metadata export would)."""
    work.put(raw=onnx.ModelProto(ir_version=10, producer_name="x").SerializeToString())
    run_fails(cli, work, 2, "not an onnx model")


def test_directory_as_input(cli, work):
    (work.dir / "model.onnx").mkdir()
    work.freeze()
    run_fails(cli, work, 2, "is a directory")


def test_missing_input(cli, work):
    work.freeze()
    run_fails(cli, work, 2, "no such file", input="nope.onnx")


def test_device_file_does_not_hang(cli, work):
    work.freeze()
    run_fails(cli, work, 2, "not a regular file", input="/dev/zero")


def test_fifo_does_not_hang(cli, work):
    os.mkfifo(work.dir / "model.onnx")
    work.freeze()
    run_fails(cli, work, 2, "not a regular file")


def test_report_on_truncated_model(cli, work):
    data = G.pre_ln().SerializeToString()
    work.put(raw=data[: len(data) // 3])
    expect_error(cli("report", "model.onnx", "--json", cwd=work.dir), 2, "truncated or corrupt")
    work.check()


# --- permissions (the suite runs as root, which reads anything: drop to `nobody` in a fork) --------

NOBODY = 65534


def as_nobody(fn, timeout: float = 120.0) -> Run:
    """Run `fn()` (returning an exit code) in a forked child with uid/gid nobody; stderr captured.

    A real permission check by the kernel, not a simulation. Root's `chmod 000` is no obstacle,
    and the Python install under /root is not readable by nobody, so everything the child runs
    must be imported before the fork (this module does so at the top).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.close(r)
            sys.stderr = os.fdopen(w, "w", buffering=1)
            sys.stdout = open(os.devnull, "w")
            if os.geteuid() == 0:  # unprivileged already: the files' modes do the work
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            code = fn()
        except BaseException:  # the test reads this as a traceback on stderr
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 98)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        chunks.append(f.read())
    _, status = os.waitpid(pid, 0)
    return Run(os.waitstatus_to_exitcode(status), "", b"".join(chunks).decode(errors="replace"))


@pytest.fixture
def shared_dir(tmp_path):
    """A folder nobody can traverse (pytest's own tmp root is 0700)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"lnfold-hostile-{os.getpid()}-{tmp_path.name}"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    yield d
    for p in [d, *d.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o700)
    shutil.rmtree(d, ignore_errors=True)


def test_unreadable_input(shared_dir):
    p = G.save_model(G.pre_ln(), shared_dir / "model.onnx")
    p.chmod(0)
    before = snapshot(shared_dir)
    r = as_nobody(lambda: cli_main(["fold", str(p), "-o", str(shared_dir / "out.onnx")]))
    expect_error(r, 2, "permission denied")
    assert snapshot(shared_dir) == before


def test_regression_input_in_untraversable_folder(shared_dir):
    """Bug: `Path.exists()` raises PermissionError for a file in a folder the user cannot enter;
    the CLI reported it as an internal error (exit 3)."""
    inner = shared_dir / "private"
    inner.mkdir()
    p = G.save_model(G.pre_ln(), inner / "model.onnx")
    inner.chmod(0o700)
    before = snapshot(shared_dir)
    r = as_nobody(lambda: cli_main(["report", str(p)]))
    expect_error(r, 2, "permission denied")
    assert snapshot(shared_dir) == before


def test_regression_unwritable_output_folder(shared_dir):
    """Bug: the temporary folder was created outside write.save's error handling, so a read-only
    output folder gave `internal error: PermissionError` (exit 3) instead of exit 2."""
    p = G.save_model(G.pre_ln(), shared_dir / "model.onnx")
    ro = shared_dir / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    before = snapshot(shared_dir)
    r = as_nobody(lambda: cli_main(["fold", str(p), "-o", str(ro / "out.onnx"), "--no-verify"]))
    expect_error(r, 2, "cannot write")
    assert snapshot(shared_dir) == before


# --- external data ----------------------------------------------------------------------------------

def test_regression_missing_external_data(cli, work):
    """Bug: onnx raises ValidationError (not OSError) for a missing data file: exit 3."""
    work.put(external=True)
    (work.dir / "model.onnx.data").unlink()
    work.freeze()
    run_fails(cli, work, 2, "external data")
    expect_error(cli("report", "model.onnx", cwd=work.dir), 2, "external data")


def test_truncated_external_data(cli, work):
    work.put(external=True)
    data = work.dir / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    work.freeze()
    run_fails(cli, work, 2, "external data", "exceeds")


def test_regression_external_data_outside_the_model_folder(cli, work):
    """A location that climbs out of the model's folder (`../secret`) is refused, not followed.
    Bug: onnx's ValidationError escaped as an internal error (exit 3)."""
    m = G.pre_ln()
    G.save_model(m, work.dir / "model.onnx", external=True)
    m2 = onnx.load(str(work.dir / "model.onnx"), load_external_data=False)
    for t in m2.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../model.onnx.data"
    work.put(raw=m2.SerializeToString())
    run_fails(cli, work, 2, "external data")


def test_regression_output_over_the_inputs_external_data(cli, work):
    """Bug: `-o model.onnx.data` (the input's own weights file) was accepted and replaced the
    input's weights with the folded model, destroying the input."""
    work.put(external=True)
    run_fails(cli, work, 2, "which the input model reads", out="model.onnx.data")


def test_external_data_model_folds(cli, work):
    work.put(external=True)
    r = cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir)
    expect_folded(r, work.out)
    work.check(new=("out.onnx", "out.onnx.data"))  # the input's layout: weights beside the model


# --- opsets and domains -----------------------------------------------------------------------------

def test_opset_too_old(cli, work):
    work.put(G.pre_ln(opset=6))
    run_fails(cli, work, 2, "unsupported opset 6")


def test_opset_too_new(cli, work):
    work.put(G.pre_ln(opset=99))
    run_fails(cli, work, 2, "unsupported opset 99")


def test_no_standard_opset(cli, work):
    m = G.pre_ln()
    m.opset_import[0].domain = "com.example"
    work.put(m)
    run_fails(cli, work, 2, "no standard onnx opset")


def test_regression_opset_newer_than_onnxruntime(cli, work):
    """Bug: an opset onnx knows but onnxruntime does not (28) made verification crash (exit 3).
    Now: a clean 'cannot verify' (exit 2), and --no-verify writes the fold."""
    work.put(G.pre_ln(opset=onnx.defs.onnx_opset_version()))
    try:
        compare(work.model, work.model)
    except LnfoldError:
        pass
    else:
        pytest.skip("this onnxruntime runs the newest opset onnx knows")
    run_fails(cli, work, 2, "cannot verify", "--no-verify")
    r = cli("fold", "model.onnx", "-o", "out.onnx", "--no-verify", cwd=work.dir)
    assert r.rc == 0 and "skipped" in r.out, r.err
    work.check(new=("out.onnx",))


def test_unknown_domain_op_on_the_stream(cli, work):
    work.put(G.unknown_domain_op())
    r = cli("report", "model.onnx", cwd=work.dir)
    assert r.rc == 0 and "Frob" in r.out, r.err
    run_fails(cli, work, 2, "no layernorm can be folded")


def test_regression_no_stray_file_in_the_current_folder(cli, work, tmp_path_factory):
    """Bug: onnxruntime's symbolic shape inference, when incomplete (an op it does not know),
    saves `sym_shape_infer_temp.onnx` into the current folder: lnfold left it in the user's."""
    cwd = tmp_path_factory.mktemp("cwd")
    work.put(G.unknown_domain_op())
    assert cli("report", work.model, cwd=cwd).rc == 0
    expect_error(cli("fold", work.model, "-o", work.out, cwd=cwd), 2)
    assert snapshot(cwd) == {}
    work.check()


def test_regression_unknown_domain_op_off_the_stream(cli, work):
    """Bug: the fold is fine but onnxruntime cannot load the model to verify it: the
    session error escaped as an internal error (exit 3) with onnxruntime's log on stderr."""
    work.put(G.unknown_domain_off_stream())
    run_fails(cli, work, 2, "cannot verify", "Frob")
    r = cli("fold", "model.onnx", "-o", "out.onnx", "--no-verify", cwd=work.dir)
    assert r.rc == 0, r.err
    assert "SimplifiedLayerNormalization" in {n.op_type for n in onnx.load(str(work.out)).graph.node}
    work.check(new=("out.onnx",))


# --- norms lnfold must not fold, or must fold carefully --------------------------------------------

def test_layernorm_over_multiple_axes(cli, work):
    work.put(G.ln_over_axis(1))
    run_fails(cli, work, 2, "normalizes over axes [1, 2]")


def test_layernorm_over_a_non_last_axis_folds(cli, work):
    work.put(G.ln_non_last_axis())
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    assert "Sqrt" in {n.op_type for n in m.graph.node}  # the portable form: ort's op is last-axis only
    work.check(new=("out.onnx",))
    assert compare(work.model, work.out)[0] < 1e-5


def test_gamma_and_beta_are_graph_inputs(cli, work):
    """Non-constant γ/β: nothing of them is edited, so the fold stands (β stays an Add)."""
    work.put(G.gamma_input())
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    assert {i.name for i in m.graph.input} == {"x", "gamma", "beta"}
    work.check(new=("out.onnx",))


def test_layernorm_inside_a_loop_body(cli, work):
    work.put(G.ln_in_subgraph("Loop"))
    run_fails(cli, work, 2, "inside if/loop/scan subgraphs")
    expect_error(cli("report", "model.onnx", cwd=work.dir), 2, "subgraph")


def test_layernorm_inside_an_if_branch_is_analyzed(cli, work):
    """If branches are folded with the main graph (subgraphs.py); here the other branch hands
    the stream itself out of the If, so the norm is kept, with that reason."""
    work.put(G.ln_in_subgraph("If"))
    run_fails(cli, work, 2, "else_branch::else_y`", "is a graph output")


def test_subgraph_reading_the_stream_blocks_it(cli, work):
    work.put(G.subgraph_reads_stream())
    r = cli("report", "model.onnx", "--json", cwd=work.dir)
    assert r.rc == 0 and '"keep"' in r.out and "If" in r.out, r.out + r.err
    # the branches are inlined: the then branch hands the stream out of the If (an Identity)
    run_fails(cli, work, 2, "then_branch::then_y`", "is a graph output")


def test_int8_qdq_model(cli, work):
    """A MatMul on dequantized int8 weights writes to the stream: its weights are not constants
    lnfold may center (that would break the quantization), so the stream is recentered."""
    work.put(G.qdq_stream())
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    wq = [t for t in m.graph.initializer if t.name.startswith("Wq")]
    assert wq and wq[0].data_type == onnx.TensorProto.INT8  # untouched
    work.check(new=("out.onnx",))


def test_regression_dynamic_feature_size_in_verification(cli, work):
    """Bug: a graph input whose feature dim is symbolic got a made-up size the model's MatMul
    rejects; onnxruntime's failure escaped as an internal error (exit 3) plus its log line.
    Then: a clean 'cannot verify'. Now the MatMul's weight fixes the size, and the fold verifies."""
    work.put(G.float_input_pre_ln(dynamic=True))
    expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    work.check(new=("out.onnx",))


def test_regression_dynamic_feature_size_without_gamma(cli, work):
    """Bug: a γ-less decomposed LayerNorm over a feature axis of unknown size crashed the
    emitter (ValueError: no γ to take the size from; exit 3). Now it becomes a γ-less RMSNorm."""
    work.put(G.dynamic_feature_no_gamma())
    expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    work.check(new=("out.onnx",))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_weights(cli, work, value):
    """NaN/Inf in an embedding row: the fold keeps them where they were (that row's outputs are
    NaN before and after), verification passes, and numpy's warnings stay off stderr."""
    work.put(G.nonfinite_weights(value))
    expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    work.check(new=("out.onnx",))


# --- malformed graphs ----------------------------------------------------------------------------------

def test_regression_graph_with_a_cycle(cli, work):
    """Bug: reported as 'rank of its input is unknown' (and a cycle off the norms' path would
    have reached graphsurgeon's toposort): now named as a cycle up front."""
    work.put(G.with_cycle())
    run_fails(cli, work, 2, "cycle")
    expect_error(cli("report", "model.onnx", cwd=work.dir), 2, "cycle")


def test_regression_dangling_input(cli, work):
    """Bug: reported as 'rank of its input is unknown'; now names the missing tensor."""
    work.put(G.dangling_input())
    run_fails(cli, work, 2, "nobody_makes_this", "dangling")


def test_regression_tensor_written_twice(cli, work):
    """Bug: only onnxruntime noticed, at verification: internal error (exit 3)."""
    work.put(G.duplicate_producer())
    run_fails(cli, work, 2, "produced twice")


def test_regression_initializer_shorter_than_its_shape(cli, work):
    """Bug: numpy's reshape error escaped from the analysis: internal error (exit 3)."""
    work.put(G.short_initializer())
    run_fails(cli, work, 2, "emb", "truncated or corrupt")


def test_model_without_layernorm(cli, work):
    work.put(G.no_layernorm())
    run_fails(cli, work, 2, "no layernorm found")
    expect_error(cli("report", "model.onnx", "--json", cwd=work.dir), 2, "no layernorm found")


# --- output paths -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["model.onnx", "./model.onnx", "sub/../model.onnx", "ABS"])
def test_output_equal_to_input(cli, work, spelling):
    (work.dir / "sub").mkdir()
    work.put()
    out = str(work.model) if spelling == "ABS" else spelling
    run_fails(cli, work, 2, "overwrite the input", out=out)


def test_output_is_a_symlink_to_the_input(cli, work):
    work.put()
    (work.dir / "link.onnx").symlink_to("model.onnx")
    work.freeze()
    run_fails(cli, work, 2, "overwrite the input", out="link.onnx")


def test_output_is_a_hard_link_to_the_input(cli, work):
    work.put()
    os.link(work.model, work.dir / "hard.onnx")
    work.freeze()
    run_fails(cli, work, 2, "overwrite the input", out="hard.onnx")


def test_output_folder_does_not_exist(cli, work):
    work.put()
    run_fails(cli, work, 2, "does not exist", out="no/such/dir/out.onnx")


def test_output_is_an_existing_folder(cli, work):
    (work.dir / "outdir").mkdir()
    work.put()
    run_fails(cli, work, 2, "is a directory", out="outdir")


def test_output_parent_is_a_file(cli, work):
    work.put()
    run_fails(cli, work, 2, "not a directory", out="model.onnx/out.onnx")


def test_failed_fold_leaves_an_existing_output_untouched(cli, work):
    work.put(G.no_layernorm())
    work.out.write_bytes(b"an earlier result")
    work.freeze()
    run_fails(cli, work, 2, "no layernorm")
    assert work.out.read_bytes() == b"an earlier result"


# --- interrupts ------------------------------------------------------------------------------------------

def _interrupt_in_process(work, capfd, monkeypatch, *args):
    monkeypatch.chdir(work.dir)
    capfd.readouterr()
    rc = cli_main(["fold", "model.onnx", "-o", "out.onnx", *args])
    _, err = capfd.readouterr()
    assert rc == 130, err
    assert err.strip().splitlines() == ["lnfold: interrupted; nothing written"], err
    work.check()


def test_interrupt_while_writing(work, capfd, monkeypatch):
    """^C halfway through writing the model: exit 130, no half file, no temp folder."""
    work.put()

    def half_then_interrupt(model, f, *a, **kw):
        data = model.SerializeToString()
        Path(f).write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save_model", half_then_interrupt)
    _interrupt_in_process(work, capfd, monkeypatch)


def test_interrupt_while_verifying(work, capfd, monkeypatch):
    """^C during verification (the folded model is already written to the temp folder)."""
    work.put()

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_rewrite.verify, "check_against", interrupted)
    _interrupt_in_process(work, capfd, monkeypatch)


def _rename_interrupted_at(monkeypatch, dst: Path):
    real = os.replace

    def replace(a, b):
        if Path(b) == dst:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)


def test_regression_interrupt_between_weights_and_model_rename(tmp_path, monkeypatch):
    """Bug: with external data, write.save renamed `out.onnx.data` into place, then `out.onnx`; an
    interrupt between the two left the weights file behind with no model."""
    dst = tmp_path / "out.onnx"
    _rename_interrupted_at(monkeypatch, dst)
    with pytest.raises(KeyboardInterrupt):
        write.save(G.pre_ln(d=64), dst, external=True)
    assert snapshot(tmp_path) == {}


def test_regression_interrupt_keeps_an_earlier_external_output(tmp_path, monkeypatch):
    """Same bug, over an earlier output pair: it must survive intact, not get new weights
    under an old model."""
    dst = tmp_path / "out.onnx"
    write.save(G.pre_ln(d=64, seed=1), dst, external=True)
    before = snapshot(tmp_path)
    assert set(before) == {"out.onnx", "out.onnx.data"}
    _rename_interrupted_at(monkeypatch, dst)
    with pytest.raises(KeyboardInterrupt):
        write.save(G.pre_ln(d=64, seed=2), dst, external=True)
    assert snapshot(tmp_path) == before


def test_regression_external_save_of_a_small_model(tmp_path):
    """Bug: `save(model, path, external=True)` crashed (ENOENT renaming `.data`) when every
    tensor was below onnx's external-data threshold, so that no weights file was written."""
    write.save(G.pre_ln(), tmp_path / "out.onnx", external=True)
    assert set(snapshot(tmp_path)) == {"out.onnx"}
    assert compare(G.pre_ln(), tmp_path / "out.onnx")[0] == 0.0


# --- numerics and targets --------------------------------------------------------------------------------

def test_fp16_model(cli, work):
    work.put(G.pre_ln(dtype=np.float16))
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir), work.out)
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    err, tol = compare(work.model, work.out)
    assert err <= tol == gate.TOLERANCE["float16"]
    work.check(new=("out.onnx",))


def _skip_every_centering(monkeypatch):
    """The planted bug of DESIGN §5: leave the sources' means in place."""
    from lnfold.passes import weights as _weights

    monkeypatch.setattr(_weights, "center", lambda a, axis: np.array(a, copy=True))


def test_failed_verification_writes_nothing(work, capfd, monkeypatch):
    work.put()
    work.out.write_bytes(b"an earlier result")
    work.freeze()
    _skip_every_centering(monkeypatch)
    monkeypatch.chdir(work.dir)
    capfd.readouterr()
    rc = cli_main(["fold", "model.onnx", "-o", "out.onnx"])
    r = Run(rc, *capfd.readouterr())
    expect_error(r, 1, "verification failed")
    work.check()


def test_target_onnx_converts_opset_18(cli, work):
    work.put(G.pre_ln(opset=18))
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", "--target", "onnx", cwd=work.dir), work.out)
    assert validate.default_opset(m) >= 23
    assert "RMSNormalization" in {n.op_type for n in m.graph.node}
    work.check(new=("out.onnx",))


@pytest.mark.parametrize("target", ["ort", "onnx", "portable"])
def test_regression_skip_layernorm(cli, work, target):
    """Bug: a SkipLayerNormalization's bias (input 4) is a constant on the stream; the plan
    centered it, but the emitter rebuilt the node from the bias it had matched, so the folded
    model kept the uncentered bias (verification failed, exit 1). With --target portable the
    emitter also crashed (rank of its new sum tensor unknown; exit 3)."""
    work.put(G.skip_layernorm())
    m = expect_folded(cli("fold", "model.onnx", "-o", "out.onnx", "--target", target, cwd=work.dir), work.out)
    assert "SkipLayerNormalization" not in {n.op_type for n in m.graph.node}
    work.check(new=("out.onnx",))


@pytest.mark.parametrize("with_eps", [True, False], ids=["eps", "no-eps"])
@pytest.mark.parametrize("opset", [17, 18])
def test_decomposed_layernorm(cli, work, with_eps, opset):
    work.put(G.decomposed_ln(with_eps=with_eps, opset=opset))
    r = cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir)
    m = expect_folded(r, work.out)
    assert "3 folded, 0 kept" in r.out
    assert "Pow" not in {n.op_type for n in m.graph.node}
    work.check(new=("out.onnx",))


def test_regression_recentered_tensor_read_directly_by_norms(cli, work):
    """Bug: a LayerNorm reading an opaque stream start directly was rebuilt from its matched
    input, i.e. the tensor *before* the inserted Recenter: the RMSNorm saw uncentered data."""
    work.put(G.opaque_start())
    r = cli("fold", "model.onnx", "-o", "out.onnx", cwd=work.dir)
    expect_folded(r, work.out)
    assert "1 recenter(s)" in r.out
    work.check(new=("out.onnx",))


# --- always as a real process ------------------------------------------------------------------------------

def test_entry_point_folds(tmp_path):
    G.save_model(G.pre_ln(layers=1), tmp_path / "model.onnx")
    r = _subprocess_cli(["fold", "model.onnx", "-o", "out.onnx"], tmp_path)
    expect_folded(r, tmp_path / "out.onnx")


def test_regression_usage_error_is_one_line(tmp_path):
    """Bug: argparse printed its usage plus the error: two lines for a user error."""
    G.save_model(G.pre_ln(layers=1), tmp_path / "model.onnx")
    before = snapshot(tmp_path)
    expect_error(_subprocess_cli(["fold"], tmp_path), 2, "input")
    expect_error(_subprocess_cli(["fold", "model.onnx", "-o", "x.onnx", "--target", "tpu"], tmp_path), 2, "tpu")
    assert snapshot(tmp_path) == before


def test_empty_file_as_a_process(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    expect_error(_subprocess_cli(["fold", "model.onnx", "-o", "out.onnx"], tmp_path), 2, "empty")
    assert snapshot(tmp_path) == {"model.onnx": hashlib.sha256(b"").hexdigest()}


def test_regression_closed_pipe(tmp_path):
    """Bug: `lnfold report m.onnx | head -0` raised BrokenPipeError: 'internal error', exit 3."""
    G.save_model(G.pre_ln(layers=1), tmp_path / "model.onnx")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "lnfold", "report", "model.onnx"], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader leaves before the command prints
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


# --- the Python API ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["empty", "truncated", "random", "directory", "missing"])
def test_api_load_bad_files(tmp_path, kind):
    p = tmp_path / "bad.onnx"
    data = G.pre_ln().SerializeToString()
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated":
        p.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        p.write_bytes(os.urandom(1000))
    elif kind == "directory":
        p.mkdir()
    with pytest.raises(LnfoldError, match="bad.onnx"):
        onnx_rewrite.load(p)
    with pytest.raises(LnfoldError, match="bad.onnx"):
        fold_model(str(p))


def test_api_not_a_model():
    with pytest.raises(LnfoldError, match="expected an onnx.ModelProto"):
        fold_model(42)
    with pytest.raises(LnfoldError, match="expected an onnx.ModelProto"):
        analyze_model({"graph": None})


def test_api_malformed_graphs_raise_lnfold_error():
    for model, what in [(G.with_cycle(), "cycle"), (G.dangling_input(), "dangling"),
                        (G.duplicate_producer(), "produced twice"), (G.short_initializer(), "truncated")]:
        with pytest.raises(LnfoldError, match=what):
            analyze_model(model)
        with pytest.raises(LnfoldError, match=what):
            fold_model(model)


def test_api_nothing_to_fold():
    with pytest.raises(NothingToFold, match="no LayerNorm found"):
        fold_model(G.no_layernorm())
    with pytest.raises(NothingToFold, match="not one feature axis"):
        fold_model(G.ln_over_axis(1))
    assert isinstance(NothingToFold("x"), LnfoldError) and NothingToFold.exit_code == 2


def test_api_verification_error(monkeypatch):
    _skip_every_centering(monkeypatch)
    with pytest.raises(VerificationError, match="verification failed"):
        fold_model(G.pre_ln())
    assert VerificationError.exit_code == 1


def test_api_bad_mode_and_target():
    with pytest.raises(LnfoldError, match="unknown mode"):
        fold_model(G.pre_ln(), mode="layer")
    with pytest.raises(LnfoldError, match="unknown target"):
        fold_model(G.pre_ln(), target="tpu")


@pytest.mark.parametrize("builder", [G.skip_layernorm, G.opaque_start, G.qdq_stream, G.dynamic_feature_no_gamma,
                                     G.pre_ln])
def test_regression_api_leaves_the_input_model_unchanged(builder):
    """Bug: graphsurgeon appended `com.microsoft` (for the fused RMSNorm ops) to the *input*
    model's opset_import: fold_model edited the caller's model."""
    model = builder()
    before = model.SerializeToString()
    fold_model(model)
    assert model.SerializeToString() == before
