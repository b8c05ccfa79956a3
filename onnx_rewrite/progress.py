"""What a command shows while it works: the one place that decides. On a terminal without `--json`,
the pipeline's stages show as one status line on stderr, erased before the report; elsewhere only a
model above PROGRESS_BYTES prints its stages, one line each.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

Progress = Optional[Callable[[str], None]]
PROGRESS_BYTES = 300 * 2**20  # below this a fold takes a few seconds: no stage lines off a terminal


class StatusLine:
    """One line on stderr showing the latest stage; `close` erases it."""

    def __init__(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(file=sys.stderr, desc="starting", leave=False, dynamic_ncols=True, mininterval=0,
                        bar_format="lnfold: {desc} ({n_fmt} stage(s), {elapsed})")

    def __call__(self, msg: str) -> None:
        self.bar.set_description_str(msg, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def model_bytes(path: Path) -> int:
    """An ONNX file's size with its external data files (`NAME*.data`), or a folder's files."""
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size + sum(f.stat().st_size for f in path.parent.glob(path.name + "*.data"))
    except OSError:
        return 0


@contextlib.contextmanager
def reporting(path: Path, *, json: bool = False) -> Iterator[Progress]:
    """The Progress for a command working on `path`; a status line is erased on leaving."""
    status = None
    if not json and sys.stderr.isatty():
        try:
            status = StatusLine()
        except ImportError:  # tqdm comes with transformers, not with the ONNX-only install
            pass
    from .api import stderr_progress  # one "lnfold: STAGE" line each

    try:
        yield status if status is not None else (stderr_progress if model_bytes(Path(path)) > PROGRESS_BYTES else None)
    finally:
        if status is not None:
            status.close()
