"""Issue 43 items 1, 8, 10 (and 6): paths that an index or a folder names, and safetensors headers.

A checkpoint's index is input: every `weight_map` value is a path that must stay inside its
folder (passes/outputs.py `inside`) before a byte is read or written through it. A folder's other
files are copied only when they are regular files, or symlinks to regular files inside the
folder; anything else (a link out, a dangling link, a link to a folder, a FIFO, a socket) is a
one-line refusal before anything is written. Subfolders that stay inside are valid layouts.

Each hostile case runs the command in-process and checks: exit 2, one line on stderr, no file
anywhere in the sandbox changed or created (the output folder and `.lnfold-*` included).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import stat
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.passes import LnfoldError
from tests import onnx_graphs as G

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

INDEX = "model.safetensors.index.json"


# --- harness ---------------------------------------------------------------------------------------------------

def _digest(p: Path) -> str:
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return "link->" + os.readlink(p)
    if not stat.S_ISREG(st.st_mode):  # a FIFO, a socket: never opened
        return f"special:{oct(st.st_mode)}"
    return hashlib.sha256(p.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every file (sha256), link, special file and folder under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        for name in dirnames:
            p = d / name
            out[str(p.relative_to(root)) + "/"] = "link->" + os.readlink(p) if p.is_symlink() else "dir"
        for name in filenames:
            out[str((d / name).relative_to(root))] = _digest(d / name)
    return out


def cli(capfd, *args) -> tuple[int, str, str]:
    capfd.readouterr()
    try:
        rc = cli_main([str(a) for a in args])
    except SystemExit as e:  # pragma: no cover - argparse
        rc = e.code
    out, err = capfd.readouterr()
    return rc, out, err


def refused(rc: int, err: str, *needles: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lnfold: error: "), (rc, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def gpt2_checkpoint(folder: Path, shard: str = "40KB") -> Path:
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    from lnfold.zoo import adversarial

    adversarial(transformers.GPT2LMHeadModel(cfg)).save_pretrained(folder, max_shard_size=shard)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return gpt2_checkpoint(tmp_path_factory.mktemp("gpt2") / "ck")


@pytest.fixture
def ck(built, tmp_path) -> Path:
    """A fresh copy of the checkpoint at tmp_path/in; tmp_path is the sandbox every test snapshots."""
    return Path(shutil.copytree(built, tmp_path / "in"))


def shard_files(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def remap(folder: Path, old: str, new) -> None:
    """The index says every tensor of shard `old` is in `new`."""
    data = json.loads((folder / INDEX).read_text())
    data["weight_map"] = {k: (new if v == old else v) for k, v in data["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(data))


# --- item 1: index paths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", "/abs", "../x.safetensors", "a/../b.safetensors", "a/./b", "a//b", "x\0y",
                                 "sub/", 7, None, ["a"]])
def test_inside_refuses_every_path_that_is_not_plain_names(tmp_path, bad):
    from lnfold.passes.outputs import inside

    with pytest.raises(LnfoldError) as e:
        inside(tmp_path, bad, "the index")
    assert len(str(e.value).splitlines()) == 1 and "the index" in str(e.value)


def test_inside_follows_symlinks_and_takes_subfolders(tmp_path):
    from lnfold.passes.outputs import inside

    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    (tmp_path / "in" / "out.bin").symlink_to(tmp_path / "secret")
    (tmp_path / "in" / "ok.bin").symlink_to("sub/real.bin")
    (tmp_path / "in" / "sub" / "real.bin").write_text("y")
    assert inside(tmp_path / "in", "sub/real.bin", "i") == tmp_path / "in" / "sub" / "real.bin"
    assert inside(tmp_path / "in", "ok.bin", "i") == tmp_path / "in" / "ok.bin"
    assert inside(tmp_path / "in", "sub/new/file.bin", "i") == tmp_path / "in" / "sub" / "new" / "file.bin"
    with pytest.raises(LnfoldError, match="out.bin"):
        inside(tmp_path / "in", "out.bin", "i")
    (tmp_path / "in" / "sub2").symlink_to(tmp_path)
    with pytest.raises(LnfoldError, match="sub2/secret"):
        inside(tmp_path / "in", "sub2/secret", "i")


@pytest.mark.parametrize("case", ["absolute", "../victim", "../input's own shard", "symlink out", "a number"])
def test_a_hostile_index_path_is_refused_before_any_byte_moves(ck, tmp_path, capfd, case):
    """Before: an absolute path or `../` truncated the file it named (read, then opened "wb"), the
    input's own shard included; a shard linked out of the folder was read and written to OUT;
    a number as a path exited 3."""
    first = shard_files(ck)[0]
    out, args = tmp_path / "out", ["-o", tmp_path / "out"]
    if case == "absolute":
        (tmp_path / "outside").mkdir()
        target = tmp_path / "outside" / "secret.safetensors"
        shutil.copy(ck / first, target)
        remap(ck, first, str(target))
    elif case == "../victim":
        shutil.copy(ck / first, tmp_path / "victim.safetensors")
        remap(ck, first, "../victim.safetensors")
    elif case == "../input's own shard":
        remap(ck, first, f"../in/{first}")
        out, args = tmp_path / "in.folded", []
    elif case == "symlink out":
        shutil.move(ck / first, tmp_path / "outside.safetensors")
        (ck / first).symlink_to(tmp_path / "outside.safetensors")
    else:
        remap(ck, first, 7)
    before = snapshot(tmp_path)
    rc, _, err = cli(capfd, "fold", ck, *args)
    line = refused(rc, err)
    assert INDEX in line or case == "symlink out", line
    assert snapshot(tmp_path) == before and not out.exists()


def test_restore_rmsnorm_reads_no_tensor_out_of_its_folder(ck, tmp_path):
    """handoff._read_tensors joined index paths unchecked: `../` read a file beside the folder."""
    from lnfold.fx_rewrite.handoff import _read_tensors

    first = shard_files(ck)[0]
    shutil.copy(ck / first, tmp_path / "victim.safetensors")
    remap(ck, first, "../victim.safetensors")
    key = next(k for k, v in json.loads((ck / INDEX).read_text())["weight_map"].items()
               if v == "../victim.safetensors")
    with pytest.raises(LnfoldError, match="victim") as e:
        _read_tensors(str(ck), [key])
    assert len(str(e.value).splitlines()) == 1


# --- item 10: subfolders that stay inside ----------------------------------------------------------------------

def test_shards_in_a_subfolder_fold_verified_into_the_same_layout(ck, tmp_path, capfd):
    (ck / "shards").mkdir()
    for f in shard_files(ck):
        shutil.move(ck / f, ck / "shards" / f)
        remap(ck, f, f"shards/{f}")
    rc, out, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    assert rc == 0 and "Traceback" not in err, err
    done = tmp_path / "out"
    assert shard_files(done) == shard_files(ck) and all((done / f).is_file() for f in shard_files(done))
    assert sorted(p.name for p in done.iterdir()) == sorted(p.name for p in ck.iterdir())
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = transformers.GPT2LMHeadModel.from_pretrained(ck).eval()(ids).logits
        b = transformers.GPT2LMHeadModel.from_pretrained(done).eval()(ids).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


# --- item 8: a folder's other files ----------------------------------------------------------------------------

def _plant(folder: Path, tmp_path: Path, kind: str) -> str:
    """Put a `kind` entry in `folder`; returns its name."""
    if kind == "file symlink out":
        (tmp_path / "secret.txt").write_text("do not publish")
        (folder / "notes.txt").symlink_to(tmp_path / "secret.txt")
        return "notes.txt"
    if kind == "dangling symlink":
        (folder / "gone.txt").symlink_to(folder / "nothing-here")
        return "gone.txt"
    if kind == "folder symlink":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "secret.txt").write_text("do not publish")
        (folder / "more").symlink_to(tmp_path / "elsewhere")
        return "more"
    if kind == "fifo":
        os.mkfifo(folder / "pipe")
        return "pipe"
    if kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        name = folder / "sock"
        if len(str(name)) > 100:  # pragma: no cover - AF_UNIX's path limit
            pytest.skip("socket path too long")
        s.bind(str(name))
        s.close()
        return "sock"
    raise AssertionError(kind)


KINDS = ["file symlink out", "dangling symlink", "folder symlink", "fifo", "socket"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoints_other_files_that_are_not_plain_are_refused(ck, tmp_path, capfd, kind):
    """Before: a link out was copied as its target's content into OUT; the others skipped silently."""
    name = _plant(ck, tmp_path, kind)
    before = snapshot(tmp_path)
    rc, _, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    refused(rc, err, name)
    assert snapshot(tmp_path) == before


def test_a_symlink_to_a_file_inside_is_copied_as_that_file(ck, tmp_path, capfd):
    (ck / "extra").mkdir()
    (ck / "extra" / "vocab.txt").write_text("a b c")
    (ck / "vocab.txt").symlink_to("extra/vocab.txt")
    rc, _, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    assert rc == 0, err
    copied = tmp_path / "out" / "vocab.txt"
    assert not copied.is_symlink() and copied.read_text() == "a b c"
    assert (tmp_path / "out" / "extra" / "vocab.txt").read_text() == "a b c"


def test_a_symlink_to_a_folder_inside_is_refused_too(ck, tmp_path, capfd):
    """Not followed (its files would be copied twice, or a link to `.` forever): said, not skipped."""
    (ck / "extra").mkdir()
    (ck / "extra" / "vocab.txt").write_text("a b c")
    (ck / "again").symlink_to("extra")
    before = snapshot(tmp_path)
    rc, _, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    refused(rc, err, "again: a symlink to a folder")
    assert snapshot(tmp_path) == before


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_folds(built, tmp_path, capfd):
    """The Hugging Face hub cache's layout (`models--X/snapshots/REV/` of links to `../../blobs/HASH`):
    a link out of the snapshot, into its own repository's blobs, is the file (passes/outputs._within)."""
    repo = tmp_path / "hub" / "models--me--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted(built.iterdir()):
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copy(p, repo / "blobs" / blob)
        (snap / p.name).symlink_to(f"../../blobs/{blob}")
    rc, _, err = cli(capfd, "fold", snap, "-o", tmp_path / "out")
    assert rc == 0, err
    assert all(not p.is_symlink() for p in (tmp_path / "out").iterdir())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in built.iterdir())


def onnx_folder(tmp_path: Path, data: str = "sub/plain.data") -> Path:
    """One model to fold, one with nothing to fold whose weights are in `data` (in `sub/`: item 10), a config."""
    src = tmp_path / "onnx_in"
    (src / "sub").mkdir(parents=True)
    G.save_model(G.pre_ln(), src / "model.onnx")
    onnx.save_model(G.no_layernorm(), str(src / "plain.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=data, size_threshold=0)
    (src / "config.json").write_text("{}")
    return src


def test_an_onnx_folder_whose_unfolded_file_keeps_its_data_in_a_subfolder(tmp_path, capfd):
    """Before: the data file's folder was not made in the output: `cannot write`, exit 2."""
    src = onnx_folder(tmp_path)
    before = snapshot(src)
    rc, _, err = cli(capfd, "fold", src, "-o", tmp_path / "out")
    assert rc == 0, err
    out = tmp_path / "out"
    assert _digest(out / "sub" / "plain.data") == before["sub/plain.data"]
    assert _digest(out / "plain.onnx") == before["plain.onnx"]
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out / "plain.onnx"), providers=["CPUExecutionProvider"])
    x = np.ones(sess.get_inputs()[0].shape, np.float32)
    ref = ort.InferenceSession(str(src / "plain.onnx"), providers=["CPUExecutionProvider"])
    assert np.array_equal(sess.run(None, {sess.get_inputs()[0].name: x})[0],
                          ref.run(None, {ref.get_inputs()[0].name: x})[0])


@pytest.mark.parametrize("kind", KINDS)
def test_an_onnx_folders_other_files_that_are_not_plain_are_refused(tmp_path, capfd, kind):
    src = onnx_folder(tmp_path, data="plain.data")
    name = _plant(src, tmp_path, kind)
    before = snapshot(tmp_path)
    rc, _, err = cli(capfd, "fold", src, "-o", tmp_path / "out")
    refused(rc, err, name)
    assert snapshot(tmp_path) == before
