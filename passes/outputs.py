"""Where a fold writes an output folder by default, and where it may: decided once for every entry
point that writes one (`lnfold fold DIR`, `fold_checkpoint`); which paths an index may name
(`inside`), which files of a folder are taken (`folder_files`), and what is on disk before a
rename publishes it (`fsync_file`, `fsync_folder`, `flush_tree`)."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover  (Windows: staging folders without a lock)
    fcntl = None

from .errors import LnfoldError

FOLDED_SUFFIX = ".folded"


def default_output_folder(src: Path) -> Path:
    """A folder `DIR` -> `DIR.folded` beside it (`lnfold fold .` has no name of its own: resolved)."""
    full = src.resolve()
    return full.parent / (full.name + FOLDED_SUFFIX)


def check_output_folder(src: Path, dst: Path) -> None:
    """A one-line error unless `dst` is outside the input folder `src`, absent or an empty folder,
    in a directory that exists (the fold writes beside it, then renames into place)."""
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise LnfoldError(f"{dst}: the output folder would be inside the input folder; choose another path")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise LnfoldError(f"{dst}: exists; choose another output folder or remove it")
    if not dst.parent.is_dir():
        raise LnfoldError(f"{dst.parent}: output directory does not exist")


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def pickled_checkpoint(folder) -> str:
    """"" for any folder but a `transformers` checkpoint whose weights are pickled (`pytorch_model.bin`,
    sharded or not); for one, what lnfold does not read and how to make what it does."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in PICKLED_WEIGHTS):
        return ""
    cls = "AutoModel"  # (the class config.json names keeps the model's head; AutoModel would drop it)
    try:
        with open(folder / "config.json", encoding="utf-8") as f:
            named = (json.loads(f.read(1 << 20)).get("architectures") or [None])[0]
        cls = named if isinstance(named, str) and named.isidentifier() else cls
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        pass
    return (f"{folder}: a transformers checkpoint whose weights are pickled (pytorch_model.bin); lnfold reads "
            "safetensors only (a pickle can run code when loaded): convert it with `python -c \"from transformers "
            f"import {cls}; {cls}.from_pretrained('{folder}').save_pretrained('OUT')\"` (it writes safetensors) "
            "and fold OUT")


def inside(folder, relative, what: str) -> Path:
    """`folder / relative` for a path that an index or a manifest (`what`) names, or a one-line
    LnfoldError: it must be a relative path of plain names (no `..`, `.`, empty name, NUL, absolute
    path) whose resolved path, symlinks followed, stays inside `folder` (a subfolder is fine; one
    still to be written is checked through its existing parents). Checked before any byte is read
    or written through it: an index is input, and `out / name` for `name = /etc/x` or `../x` would
    write where it says."""
    if not isinstance(relative, str):
        raise LnfoldError(f"{what}: names {relative!r} as a file; a file's path is a string")
    parts = relative.split("/")
    if "\0" in relative or relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise LnfoldError(f"{what}: names {relative!r} as a file; only a relative path of plain names inside "
                          f"{folder} is read or written")
    base = Path(folder)
    path = base.joinpath(*parts)
    try:
        ok = _within(path, base)
    except (OSError, RuntimeError) as e:  # (a symlink loop: RuntimeError before Python 3.13)
        raise LnfoldError(f"{what}: names {relative!r}, which cannot be resolved: {e}") from None
    if not ok:
        raise LnfoldError(f"{what}: names {relative!r}, which resolves to {path.resolve()}, outside {folder}")
    return path


def _within(path: Path, folder: Path) -> bool:
    """`path`, symlinks followed, is inside `folder` (resolved), or inside the `blobs/` folder of the
    Hugging Face hub cache repository that `folder` is a snapshot of (`models--X/snapshots/REV/`,
    whose files the hub client makes as links to `../../blobs/HASH`; `blobs` itself no link)."""
    root, target = folder.resolve(), path.resolve()
    if target != root and root in target.parents:
        return True
    repo = root.parent.parent
    blobs = repo / "blobs"
    return (root.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--"))
            and blobs.is_dir() and not blobs.is_symlink() and target.parent == blobs)


def folder_files(folder) -> list[str]:
    """Every file of `folder` and its subfolders (relative, `/`-separated, in a stable order): the
    regular files, and the symlinks to a regular file inside the folder (read as that file). Any
    other entry is a one-line LnfoldError naming it, raised before anything is written: a link out
    of the folder (its content would land in the output), a dangling link, a link to a folder (not
    followed: copying it would copy what it points to), a FIFO (opening one blocks), a socket, a
    device. Nothing is opened; what a user expects in OUT is what is in the folder, or a refusal."""
    folder = Path(folder)
    out: list[str] = []

    def refuse(rel: str, why: str):
        raise LnfoldError(f"{folder / rel}: {why}; lnfold takes a folder's own files only (regular files, "
                          "or links to one inside it): remove it, or put the file(s) themselves there")

    def walk(d: Path, prefix: str) -> None:
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise LnfoldError(f"{d}: cannot list it: {e.strerror or e}") from None
        for e in entries:
            rel = prefix + e.name
            if e.is_dir(follow_symlinks=False):
                walk(Path(e.path), rel + "/")
            elif e.is_file(follow_symlinks=False):
                out.append(rel)
            elif e.is_symlink():
                try:
                    mode = os.stat(e.path).st_mode
                    ok = _within(Path(e.path), folder)
                except (OSError, RuntimeError):
                    refuse(rel, f"a symlink to {os.readlink(e.path)!r}, which does not exist (or loops)")
                if not ok:
                    refuse(rel, f"a symlink to {Path(e.path).resolve()}, outside {folder}")
                if not stat.S_ISREG(mode):
                    refuse(rel, f"a symlink to {_kind(mode)}")
                out.append(rel)
            else:
                refuse(rel, _kind(e.stat(follow_symlinks=False).st_mode))

    walk(folder, "")
    return out


def _kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")


def fsync_file(path) -> None:
    """`path`'s bytes on disk (before a rename publishes it: a crash must not leave a published name
    whose data is still only in the page cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path) -> None:
    """The renames in folder `path` on disk; best effort: some file systems refuse to open or fsync
    a folder, and the renames are done (an error here must not unpublish a consistent output)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def flush_tree(folder) -> None:
    """Every file of `folder` and its subfolders on disk, then the folder itself (before it is
    renamed into place)."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file() and not p.is_symlink():
            fsync_file(p)
    fsync_folder(folder)


# Staging folders beside a target `NAME`: `.lnfold-NAME.writing` (a writer's, locked while it
# lives), `.lnfold-NAME.new-XXXXXXXX` (one being made, locked before it takes the name above) and
# `.lnfold-NAME.stale-XXXXXXXX` (one being removed). The '.' before the suffix keeps them apart
# from tempfile.mkdtemp's `.lnfold-XXXXXXXX` (letters, digits, '_'), used by other commands.
_PREFIX = ".lnfold-"
_WRITING, _NEW, _STALE = ".writing", ".new-", ".stale-"
_LOCK = "lock"
# A new folder with no lock file yet is given this long to lock it before it is taken for a leftover.
_UNLOCKED_GRACE_S = 60.0


def _stem(name: str) -> str:
    """The target's name as the staging folders carry it (short enough for NAME_MAX with a suffix)."""
    if len(name) <= 160:
        return name
    return name[:80] + "~" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class Staging:
    """The staging folder of one output (a file, or a folder), `.lnfold-<name>.writing` beside it,
    holding `lock` (a file this writer flocks, with its pid), `new/` (what is being written: the
    output folder itself, for a folder) and `old/` (what publishing moves out of the way). A second
    writer of the same output is refused in one line; what a killed writer left is removed by the
    next.

    The folder is made under a unique name, its lock file created and flocked there, and only then
    renamed to its public name (a rename onto a folder that is not empty fails): a writer holds the
    lock from the moment the name exists until the folder is renamed away at the end. So the name
    taken by another writer means: its lock is held (a live writer: refused), or free (a writer
    killed, whose folder is removed: renamed to a unique `.stale-` name, then deleted), or the
    folder has no lock file (not made by a live writer: removed the same way). Leftover `.stale-`
    folders are always garbage; `.new-` ones when their lock is free.

    Without fcntl (Windows), a plain mkdtemp folder, unlocked.
    """

    def __init__(self, root: Path, fd: "int | None"):
        self.root, self.fd = root, fd
        self.new, self.old = root / "new", root / "old"

    @classmethod
    def acquire(cls, target: Path) -> "Staging":
        out_dir, stem = target.parent, _stem(target.name)
        if fcntl is None:
            root = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=out_dir))
            staging = cls(root, None)
            staging.new.mkdir()
            staging.old.mkdir()
            return staging
        _sweep(out_dir, stem)
        public = out_dir / (_PREFIX + stem + _WRITING)
        for _ in range(20):
            fresh = Path(tempfile.mkdtemp(prefix=_PREFIX + stem + _NEW, dir=out_dir))
            fd = None
            try:
                fd = os.open(fresh / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a new file: no one else has it)
                os.write(fd, f"{os.getpid()}\n".encode())
                (fresh / "new").mkdir()
                (fresh / "old").mkdir()
                os.rename(fresh, public)
                return cls(public, fd)
            except OSError as e:
                if fd is not None:
                    os.close(fd)
                shutil.rmtree(fresh, ignore_errors=True)
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            _clear(public, target)  # (taken: refuse if its writer lives, else remove it and try again)
        raise LnfoldError(f"{target}: cannot take {public.name} (other lnfold processes keep making it); "
                          f"try again")

    @classmethod
    @contextlib.contextmanager
    def folder(cls, dst: Path):
        """A folder output: the folder to build it in (`new/` of `dst`'s staging folder, an ordinary
        folder); the caller renames it onto `dst` when it is complete. Removed in any case."""
        try:
            staging = cls.acquire(dst)
        except OSError as e:
            raise LnfoldError(f"{dst}: cannot write into {dst.parent}: {e.strerror or e}") from None
        try:
            yield staging.new
        finally:
            staging.release()

    def release(self) -> None:
        """Remove the folder (renamed away first, so its name is never seen unlocked), then unlock."""
        root = self.root
        try:
            if self.fd is not None:
                root = _unique(self.root.parent, self.root.name[: -len(_WRITING)] + _STALE)
                os.rename(self.root, root)
        except OSError:
            root = self.root
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _unique(folder: Path, prefix: str) -> Path:
    return folder / (prefix + secrets.token_hex(4))


def _clear(public: Path, target: Path) -> None:
    """`public` was taken: raise if a live writer holds its lock; else remove it (when it still is
    the folder found: another process may be clearing or retaking it at the same time)."""
    try:
        fd = os.open(public / _LOCK, os.O_RDWR)
    except FileNotFoundError:
        fd = None  # (no lock file: no live writer's folder; or it vanished just now)
    except OSError:
        return  # (not a folder, or unreadable: the retry's rename says why)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise LnfoldError(f"{target}: another lnfold is writing it (pid {pid}); wait for it to end, "
                                  f"or write elsewhere") from None
            try:
                same = os.path.samestat(os.stat(public / _LOCK), os.fstat(fd))
            except OSError:
                same = False
            if not same:
                return  # (cleared, perhaps retaken, meanwhile: try again)
        trash = _unique(public.parent, public.name[: -len(_WRITING)] + _STALE)
        try:
            os.rename(public, trash)  # (one process wins; it holds the lock, if any)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)


def _sweep(out_dir: Path, stem: str) -> None:
    """Remove what killed writers of this target left: `.stale-` folders (always garbage) and
    `.new-` folders whose lock is free (or that never got one, after a grace period)."""
    stale, new = _PREFIX + stem + _STALE, _PREFIX + stem + _NEW
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return
    for e in entries:
        if not (e.name.startswith(stale) or e.name.startswith(new)) or not e.is_dir(follow_symlinks=False):
            continue
        path = Path(e.path)
        if e.name.startswith(stale):
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            fd = os.open(path / _LOCK, os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - e.stat(follow_symlinks=False).st_mtime > _UNLOCKED_GRACE_S:
                    shutil.rmtree(path, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.stat(path / _LOCK), os.fstat(fd)):  # (not renamed away meanwhile)
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # (its maker lives, and is about to rename it; or it is gone)
        finally:
            os.close(fd)
