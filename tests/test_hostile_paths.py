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
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.passes import LnfoldError
from tests import onnx_graphs as G
from tests.sandbox import digest, snapshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

INDEX = "model.safetensors.index.json"


# --- harness ---------------------------------------------------------------------------------------------------

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


def shard_files(folder: Path) -> list:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()), key=str)


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
    assert digest(out / "sub" / "plain.data") == before["sub/plain.data"]
    assert digest(out / "plain.onnx") == before["plain.onnx"]
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


# --- item 6: safetensors headers -------------------------------------------------------------------------------

def read_raw(path: Path) -> tuple[dict, bytes]:
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def write_raw(path: Path, header, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def with_tensor(folder: Path, name: str, t: torch.Tensor) -> None:
    """Add tensor `name` to the first shard (and the index), as safetensors writes it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    first = shard_files(folder)[0]
    with safe_open(str(folder / first), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({**tensors, name: t}, str(folder / first), metadata=meta)
    data = json.loads((folder / INDEX).read_text())
    data["weight_map"][name] = first
    (folder / INDEX).write_text(json.dumps(data))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn])
def test_tensors_of_every_safetensors_dtype_are_copied_as_they_are(ck, tmp_path, capfd, dtype):
    """Before: `nbytes` counted 1 byte an element for dtypes missing from DTYPES: exit 3."""
    from safetensors import safe_open

    t = torch.arange(6, dtype=torch.int64).reshape(2, 3).to(torch.float32).to(dtype)
    with_tensor(ck, "extra.buffer", t)
    rc, _, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    assert rc == 0, err
    with safe_open(str(tmp_path / "out" / shard_files(ck)[0]), framework="pt") as f:
        got = f.get_tensor("extra.buffer")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def _corrupt(header: dict, how: str):
    tensors = [k for k in header if k != "__metadata__"]
    by_start = sorted(tensors, key=lambda k: header[k]["data_offsets"][0])
    a, b = by_start[0], by_start[1]
    if how == "metadata a list":
        header["__metadata__"] = ["pt"]
    elif how == "metadata values not strings":
        header["__metadata__"] = {"format": 1}
    elif how == "overlapping offsets":
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0]
                                     + header[b]["data_offsets"][1] - header[b]["data_offsets"][0]]
    elif how == "reversed offsets":
        header[a]["data_offsets"] = header[a]["data_offsets"][::-1]
    elif how == "offsets not the tensor's size":
        header[a]["shape"] = [1]
    elif how == "unknown dtype":
        header[a]["dtype"] = "Q7"
    elif how == "negative shape":
        header[a]["shape"] = [-1] + header[a]["shape"][1:]
    elif how == "float offsets":
        header[a]["data_offsets"] = [float(x) for x in header[a]["data_offsets"]]
    elif how == "header a list":
        return json.dumps([1, 2]).encode()
    elif how == "deep nesting":
        return b"[" * 100_000 + b"]" * 100_000
    elif how == "not utf-8":
        return b'{"\xff": 1}'
    elif how == "entry a string":
        header[a] = "F32"
    elif how == "bytes past the last tensor":
        pass  # (the test appends them)
    else:
        raise AssertionError(how)
    return header


HEADER_CASES = ["metadata a list", "metadata values not strings", "overlapping offsets", "reversed offsets",
                "offsets not the tensor's size", "unknown dtype", "negative shape", "float offsets", "header a list",
                "deep nesting", "not utf-8", "entry a string", "bytes past the last tensor"]


@pytest.mark.parametrize("how", HEADER_CASES)
def test_a_malformed_header_is_refused_with_one_line(ck, tmp_path, capfd, how):
    """Before: some exited 3 (a list header, deep nesting), some 0 with an output safetensors refuses
    (a list as __metadata__, overlapping offsets): safetensors' own rules, checked before writing."""
    first = max(shard_files(ck), key=lambda f: len(read_raw(ck / f)[0]))
    header, data = read_raw(ck / first)
    write_raw(ck / first, _corrupt(header, how), data + (b"\0" * 8 if how == "bytes past the last tensor" else b""))
    before = snapshot(tmp_path)
    rc, _, err = cli(capfd, "fold", ck, "-o", tmp_path / "out")
    refused(rc, err, first)
    assert snapshot(tmp_path) == before


# --- the fuzz: random index paths, headers, offsets, dtypes, links --------------------------------------------

def _mutate(rng: random.Random, sandbox: Path, src: Path) -> list[str]:
    """1-3 random hostile edits of the checkpoint `src` in `sandbox`; what was done, for the message."""
    done, hostile = [], rng.random() < 0.7
    def readable(f) -> bool:  # (a shard an earlier edit left whole)
        try:
            return (src / f).is_file() and not (src / f).is_symlink() and bool(read_raw(src / f)[0])
        except (ValueError, TypeError, struct.error):
            return False

    for _ in range(rng.randint(1, 3)):
        files = [f for f in shard_files(src) if isinstance(f, str) and f and readable(f)]
        kind = rng.choice(["path", "path", "header", "header", "truncate", "other", "valid"] if hostile else ["valid"])
        if kind == "path" and files:
            f = rng.choice(files)
            choice = rng.choice(["abs", "../victim", "../in", "sub", "sub/..", "", "./", "trailing/", 7, None,
                                 "link out", "link in", "fifo", "dir"])
            if choice == "abs":
                remap(src, f, str(sandbox / "outside" / "secret.safetensors"))
            elif choice == "../victim":
                remap(src, f, "../victim.safetensors")
            elif choice == "../in":
                remap(src, f, f"../in/{f}")
            elif choice == "sub":  # (valid: the file moved with it)
                (src / "sub").mkdir(exist_ok=True)
                shutil.move(src / f, src / "sub" / Path(f).name)
                remap(src, f, f"sub/{Path(f).name}")
            elif choice == "sub/..":
                remap(src, f, f"sub/../{f}")
            elif choice in ("", "./", "trailing/"):
                remap(src, f, {"": "", "./": f"./{f}", "trailing/": f"{f}/"}[choice])
            elif choice in (7, None):
                remap(src, f, choice)
            elif choice == "link out":
                (src / f).unlink()
                (src / f).symlink_to(sandbox / "outside" / "secret.safetensors")
            elif choice == "link in":
                (src / "alias.safetensors").symlink_to(f)
                remap(src, f, "alias.safetensors")
            elif choice == "fifo":
                os.mkfifo(src / "pipe.safetensors")
                remap(src, f, "pipe.safetensors")
            else:
                remap(src, f, "sub" if (src / "sub").is_dir() else ".")
            done.append(f"{f}: {choice!r}")
        elif kind == "valid" and files:  # (layouts safetensors writes too: the fold must take them)
            f = rng.choice(files)
            header, data = read_raw(src / f)
            how = rng.choice(["reorder", "metadata", "same-size dtype", "sub"])
            if how == "reorder":
                header = dict(rng.sample(list(header.items()), len(header)))
            elif how == "metadata":
                header["__metadata__"] = {"format": "pt", "note": "x" * rng.randint(0, 300)}
            elif how == "same-size dtype":
                a = rng.choice([k for k in header if k != "__metadata__"])
                size = {"F32": 4, "F16": 2, "BF16": 2}.get(header[a]["dtype"], 0)
                header[a]["dtype"] = {4: "U32", 2: "U16"}.get(size, header[a]["dtype"])
            if how == "sub" and "/" not in f:
                (src / "sub").mkdir(exist_ok=True)
                shutil.move(src / f, src / "sub" / f)
                remap(src, f, f"sub/{f}")
            else:
                write_raw(src / f, header, data)
            done.append(f"{f}: valid {how}")
        elif kind in ("header", "truncate") and files:
            f = rng.choice(files)
            header, data = read_raw(src / f)
            if kind == "truncate":
                cut = rng.randint(1, len(data) + 16)
                (src / f).write_bytes((src / f).read_bytes()[:-cut])
                done.append(f"{f}: truncated by {cut}")
                continue
            names = [k for k in header if k != "__metadata__"]
            how = rng.choice(["swap", "reverse", "overlap", "dtype", "shape", "drop", "beyond", "flip", "meta",
                              "length", "garbage"])
            a, b = rng.choice(names), rng.choice(names)
            if how == "swap":
                header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], \
                    header[a]["data_offsets"]
            elif how == "reverse":
                header[a]["data_offsets"] = header[a]["data_offsets"][::-1]
            elif how == "overlap":
                header[a]["data_offsets"] = list(header[b]["data_offsets"])
            elif how == "dtype":
                header[a]["dtype"] = rng.choice(["U32", "U16", "U64", "F8_E4M3", "I8", "BOOL", "F4", "X", 3])
            elif how == "shape":
                header[a]["shape"] = rng.choice([[], [0], [-2, 3], [1 << 40], ["2"], header[a]["shape"] + [1]])
            elif how == "drop":
                del header[a]
            elif how == "beyond":
                header[a]["data_offsets"][1] += rng.choice([1, 1 << 20, 1 << 62])
            elif how == "meta":
                header["__metadata__"] = rng.choice([[], 5, "pt", {"k": 1}, None])
            if how in ("flip", "length", "garbage"):
                raw = bytearray((src / f).read_bytes())
                if how == "flip":
                    for _ in range(rng.randint(1, 4)):
                        raw[rng.randrange(8, 8 + struct.unpack("<Q", raw[:8])[0])] = rng.randrange(256)
                elif how == "length":
                    raw[:8] = struct.pack("<Q", rng.choice([0, 1, 7, len(raw), 1 << 63, rng.randrange(len(raw))]))
                else:
                    raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
                (src / f).write_bytes(bytes(raw))
            else:
                write_raw(src / f, header, data)
            done.append(f"{f}: header {how}")
        else:
            plant = rng.choice(["file symlink out", "dangling symlink", "folder symlink", "fifo"])
            if not any(d.startswith("planted") for d in done):  # (one at most)
                done.append(f"planted {_plant(src, sandbox, plant)}")
    return done


def _outside_out(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if not k.startswith("out/") and k != "out/"}


@pytest.mark.slow
def test_fuzzed_checkpoint_folders_never_touch_a_file_outside_the_output(built, tmp_path_factory, capfd):
    """~50 seeded cases: exit 0, 1 or 2 (never 3), no file outside OUT changed or created, and an
    output (exit 0) whose every shard safetensors opens, tensor by tensor."""
    import signal

    from safetensors import safe_open

    def hung(*_):  # (a FIFO opened would block forever)
        raise TimeoutError("a fold took over 60 s: blocked on a FIFO?")

    codes = []
    for seed in range(50):
        rng = random.Random(seed)
        sandbox = tmp_path_factory.mktemp(f"fuzz{seed}")
        src = Path(shutil.copytree(built, sandbox / "in"))
        (sandbox / "outside").mkdir()
        first = shard_files(src)[0]
        shutil.copy(src / first, sandbox / "outside" / "secret.safetensors")
        shutil.copy(src / first, sandbox / "victim.safetensors")
        done = _mutate(rng, sandbox, src)
        before = snapshot(sandbox)
        old = signal.signal(signal.SIGALRM, hung)
        signal.alarm(60)
        try:
            rc, _, err = cli(capfd, "fold", src, "-o", sandbox / "out", "--jobs", "1",
                             *(["--no-verify"] if rng.random() < 0.3 else []))
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        what = f"seed {seed}: {done}: exit {rc}: {err.strip()}"
        codes.append(rc)
        assert rc in (0, 1, 2) and "Traceback" not in err, what
        after = snapshot(sandbox)
        assert _outside_out(after) == before, what
        assert not [k for k in after if ".lnfold-" in k], what
        if rc:
            assert len(err.strip().splitlines()) == 1 and not (sandbox / "out").exists(), what
            continue
        for shard in (sandbox / "out").rglob("*.safetensors"):
            with safe_open(str(shard), framework="pt") as f:
                for k in f.keys():
                    f.get_tensor(k)
        shutil.rmtree(sandbox)
    assert codes.count(2) > 10 and codes.count(0) > 5, codes  # (the fuzz reaches both: it is not all refusals)
