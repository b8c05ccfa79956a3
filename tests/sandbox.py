"""What a hostile-input test compares before and after a command: every file, link, special file
and folder under a root (tests/test_hostile.py, tests/test_hostile_paths.py)."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def digest(p: Path) -> str:
    """A file's sha256; a link's target; a FIFO's, socket's or device's mode (never opened: opening
    a FIFO blocks); an unreadable file's size and time."""
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return "link->" + os.readlink(p)
    if not stat.S_ISREG(st.st_mode):
        return f"special:{oct(st.st_mode)}"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except PermissionError:
        return f"unreadable:{st.st_size}:{st.st_mtime_ns}"


def snapshot(root: Path) -> dict[str, str]:
    """Every file (`digest`), link, special file and folder under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        for name in dirnames:
            p = d / name
            out[str(p.relative_to(root)) + "/"] = "link->" + os.readlink(p) if p.is_symlink() else "dir"
        for name in filenames:
            out[str((d / name).relative_to(root))] = digest(d / name)
    return out
