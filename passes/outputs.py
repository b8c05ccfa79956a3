"""Where a fold writes an output folder by default, and where it may: decided once for every entry
point that writes one (`lnfold fold DIR`, `fold_checkpoint`)."""
from __future__ import annotations

from pathlib import Path

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
