"""Publishing a model and its external-data file as one unit (issue 43, items 3 and 9).

An output is a pair, `out.onnx` and `out.onnx.data`; a reader must never find the model of one
fold beside the weights of another (it loads, and computes wrong outputs). These tests check
that a second writer to the same target is refused while the first runs, that a process killed
at any rename leaves either the old pair, no model, or the new pair, that what such a kill leaves
behind (`.lnfold-<name>.*` folders) is cleaned by the next run, and that the files reach the
disk (fsync) before they are renamed into place.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from tests import onnx_graphs as G
from tests.test_hostile import cli, expect_error, snapshot  # noqa: F401  (cli: a fixture)
from lnfold.onnx_rewrite import write
from lnfold.onnx_rewrite.verify import compare

REPO = Path(__file__).resolve().parents[1]
D = 64  # wide enough that every weight goes to the data file


def _model(seed: int) -> onnx.ModelProto:
    """Two different models (seed 1: two layers, seed 2: three): the weights of one, read at the
    other's offsets, are wrong weights, as between two real models."""
    return G.pre_ln(d=D, seed=seed, layers=1 + seed)


def _matches(seed: int, out: Path) -> bool:
    """Does the model at `out` (with its data file) compute what the model of `seed` computes?
    (A fold is exact up to the float32 tolerance; a model beside another fold's weights is off
    by O(1), or cannot be loaded at all.)"""
    try:
        err, tol = compare(_model(seed), out)
    except Exception:  # (a model whose data file is missing or too short)
        return False
    return err <= tol


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".lnfold-"))


def _inputs(d: Path) -> None:
    for seed in (1, 2):
        G.save_model(_model(seed), d / f"m{seed}.onnx", external=True)


# --- a concurrent writer -------------------------------------------------------------------------------

def test_a_second_writer_to_the_same_output_is_refused(tmp_path, cli):  # noqa: F811
    """While one writer is inside `staged` for out.onnx, `lnfold fold -o out.onnx` exits 2 with one
    line naming the writer; the first then publishes its own consistent pair. (Before: both exit 0
    and the last rename of each file wins: the model of one beside the weights of the other.)"""
    _inputs(tmp_path)
    out = tmp_path / "out.onnx"
    with write.staged(_model(1), out, external=True) as staged_file:
        assert staged_file.is_file() and not out.exists()
        r = cli("fold", "m2.onnx", "-o", "out.onnx", cwd=tmp_path)
        line = expect_error(r, 2, "out.onnx", "another lnfold is writing it", f"pid {os.getpid()}")
        assert len(line) < 300
        assert not out.exists() and not (tmp_path / "out.onnx.data").exists()
    assert {"out.onnx", "out.onnx.data"} <= set(os.listdir(tmp_path))
    assert _matches(1, out)
    assert _leftovers(tmp_path) == []


def test_a_second_writer_as_a_process_is_refused(tmp_path):
    """The same across processes (flock, not a lock of this process): a real `lnfold fold`."""
    _inputs(tmp_path)
    out = tmp_path / "out.onnx"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LNFOLD_DEBUG", None)
    with write.staged(_model(1), out, external=True):
        r = subprocess.run([sys.executable, "-m", "lnfold", "fold", "m2.onnx", "-o", "out.onnx", "--no-verify"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
        assert "another lnfold is writing it" in r.stderr and f"pid {os.getpid()}" in r.stderr, r.stderr
    assert _matches(1, out)
    assert _leftovers(tmp_path) == []


# --- kill -9 in the middle of publishing ----------------------------------------------------------------

_DRIVER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
out_dir = os.path.realpath({out_dir!r})
kill_at = int(sys.argv[1])
real = os.replace
seen = [0]

def replace(src, dst, **kw):
    real(src, dst, **kw)
    near = {{os.path.dirname(os.path.realpath(os.fspath(p))) for p in (src, dst)}}
    if out_dir in near:  # a rename into or out of the output folder: one step of publishing
        seen[0] += 1
        if seen[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
from lnfold.onnx_rewrite.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_kill_between_the_renames_never_leaves_a_mixed_pair(tmp_path, cli, kill_at):  # noqa: F811
    """A fold over an earlier output pair, SIGKILLed right after its `kill_at`-th rename into or out of
    the output folder: the output is the old pair, no model, or the new pair, never a model beside
    the other fold's weights; the next run cleans what the kill left and publishes. (Before: the
    weights were renamed in first, then the model: a kill after the second rename left the old
    model beside the new weights, and the 4th rename never came.)"""
    _inputs(tmp_path)
    out = tmp_path / "out.onnx"
    r = cli("fold", "m1.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert r.rc == 0 and _matches(1, out), r.err
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(_DRIVER.format(repo=str(REPO), out_dir=str(tmp_path))))
    env = dict(os.environ)
    env.pop("LNFOLD_DEBUG", None)
    p = subprocess.run([sys.executable, str(driver), str(kill_at), "fold", "m2.onnx", "-o", "out.onnx"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    if out.exists():
        assert _matches(1, out) or _matches(2, out), "a model beside the weights of another fold"
    r = cli("fold", "m2.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert _matches(2, out)
    assert _leftovers(tmp_path) == []


# --- what a killed run left ------------------------------------------------------------------------------

def test_stale_folders_of_a_killed_run_are_cleaned(tmp_path, cli):  # noqa: F811
    """A killed writer's staging folder (its lock file free, partial weights inside), a half-removed
    one, and a folder whose creator died before locking it are removed by the next run, which
    folds; a temporary folder of another kind (another command's, named at random) is left alone."""
    _inputs(tmp_path)
    writing = tmp_path / ".lnfold-out.onnx.writing"
    (writing / "new").mkdir(parents=True)
    (writing / "lock").write_text("999999\n")
    (writing / "new" / "out.onnx.data").write_bytes(b"\1" * 1000)
    trash = tmp_path / ".lnfold-out.onnx.stale-0123abcd"
    (trash / "new").mkdir(parents=True)
    (trash / "new" / "out.onnx").write_bytes(b"half")
    fresh = tmp_path / ".lnfold-out.onnx.new-x1y2z3"
    fresh.mkdir()
    (fresh / "lock").write_text("")
    other = tmp_path / ".lnfold-k2j4h5g6"  # (tempfile.mkdtemp's name: a folder fold's, maybe running)
    other.mkdir()
    (other / "x.onnx").write_bytes(b"theirs")
    r = cli("fold", "m2.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert _matches(2, tmp_path / "out.onnx")
    assert _leftovers(tmp_path) == [other.name]
    assert (other / "x.onnx").read_bytes() == b"theirs"


def test_a_staging_folder_without_a_lock_file_is_stale(tmp_path):
    """A live writer holds its lock from before its folder has the public name; a folder there
    without a lock file (an older lnfold's, a user's copy) is no one's."""
    writing = tmp_path / ".lnfold-out.onnx.writing"
    writing.mkdir()
    (writing / "out.onnx").write_bytes(b"partial")
    write.save(_model(1), tmp_path / "out.onnx", external=True)
    assert _matches(1, tmp_path / "out.onnx")
    assert _leftovers(tmp_path) == []


# --- durability -----------------------------------------------------------------------------------------

def test_files_are_fsynced_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    """The model and its data file are fsynced before their renames, and the output folder after
    them: a power loss cannot leave a renamed file with no bytes."""
    out = tmp_path / "out.onnx"
    write.save(_model(1), out, external=True)  # an earlier pair, replaced below
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        st = os.lstat(src)
        events.append(("replace", (st.st_dev, st.st_ino), Path(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write.save(_model(2), out, external=True)
    monkeypatch.undo()
    assert _matches(2, out)
    placed = {e[2].name: i for i, e in enumerate(events) if e[0] == "replace" and e[2].parent == tmp_path}
    assert set(placed) == {"out.onnx", "out.onnx.data"}, events
    for name, i in placed.items():
        inode = events[i][1]
        assert ("fsync", inode) in events[:i], f"{name} renamed into place before an fsync: {events}"
    folder = os.stat(tmp_path)
    assert ("fsync", (folder.st_dev, folder.st_ino)) in events[max(placed.values()):], events


def test_a_failed_rename_puts_the_old_pair_back(tmp_path, monkeypatch):
    """An error at the data file's rename (after the old model has been moved away): the old model
    and its weights are back, and the error is one LnfoldError."""
    out = tmp_path / "out.onnx"
    write.save(_model(1), out, external=True)
    before = snapshot(tmp_path)
    real = os.replace
    failed = []

    def replace(src, dst, **kw):
        if Path(dst) == tmp_path / "out.onnx.data" and Path(src).parent != tmp_path and not failed:
            failed.append(src)  # (once: putting the old file back is a rename to the same place)
            raise OSError(28, "No space left on device")
        return real(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(write.LnfoldError, match="No space left"):
        write.save(_model(2), out, external=True)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    assert _matches(1, out)


def _onnx_folder(tmp_path: Path) -> Path:
    src = tmp_path / "export"
    src.mkdir()
    G.save_model(G.pre_ln(layers=1), src / "model.onnx")
    (src / "config.json").write_text("{}")
    return src


def test_a_folder_output_has_one_writer_and_a_killed_ones_leftovers_go(tmp_path, cli):  # noqa: F811
    """Folder outputs (`lnfold fold DIR`, checkpoints) are built in the same locked staging folder as
    file outputs (passes/outputs.Staging): a second writer of the same output folder is refused in one
    line, and what a killed writer left there is removed by the next run (issue 43 item 9: random
    `.lnfold-XXXXXXXX` folders of folder outputs were never cleaned)."""
    from lnfold.passes.outputs import Staging

    src = _onnx_folder(tmp_path)
    out = tmp_path / "out"
    held = Staging.acquire(out)
    try:
        r = cli("fold", "export", "-o", "out", cwd=tmp_path)
        expect_error(r, 2, "out", "another lnfold is writing it", f"pid {os.getpid()}")
        assert not out.exists()
    finally:
        held.release()
    writing = tmp_path / ".lnfold-out.writing"  # (a killed run's: its lock free, a partial output inside)
    (writing / "new").mkdir(parents=True)
    (writing / "lock").write_text("999999\n")
    (writing / "new" / "model.onnx").write_bytes(b"half")
    r = cli("fold", "export", "-o", "out", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert (out / "model.onnx").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "out"]
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.onnx"]  # (the input untouched)
