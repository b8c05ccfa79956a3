"""Loading and saving ONNX models: clear errors for bad files, atomic writes, external data."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import onnx
from google.protobuf.message import DecodeError

from passes import LnfoldError

# Protobuf cannot serialize a message over 2 GiB: such models keep their weights beside them.
_PROTO_LIMIT = 2**31 - 2**20
MIN_OPSET = 9


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise LnfoldError("the model imports no standard ONNX opset")


def check_opset(model: onnx.ModelProto) -> int:
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise LnfoldError(f"unsupported opset {opset} (lnfold supports opsets {MIN_OPSET} to {newest})")
    return opset


def load(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX model (and its external data), or raise LnfoldError saying what is wrong."""
    p = Path(path)
    if not p.exists():
        raise LnfoldError(f"{p}: no such file")
    if p.is_dir():
        raise LnfoldError(f"{p}: is a directory, not an ONNX file")
    if not os.access(p, os.R_OK):
        raise LnfoldError(f"{p}: permission denied")
    if p.stat().st_size == 0:
        raise LnfoldError(f"{p}: empty file, not an ONNX model")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise LnfoldError(f"{p}: not a readable ONNX model (truncated or corrupt?): {_first_line(e)}") from None
    if not model.graph.node or not model.opset_import:
        raise LnfoldError(f"{p}: not an ONNX model (no graph or no opset)")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError) as e:
        raise LnfoldError(f"{p}: cannot read its external data: {_first_line(e)}") from None
    return model


def is_large(model: onnx.ModelProto) -> bool:
    return model.ByteSize() > _PROTO_LIMIT if _cheap_size_ok(model) else True


def _cheap_size_ok(model: onnx.ModelProto) -> bool:
    # ByteSize() on a >2 GiB message works, but summing raw data first avoids the walk when huge.
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    return total < _PROTO_LIMIT


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool | None = None,
         check: Callable[[Path], None] | None = None) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` beside it when large.

    Everything is written into a temporary folder beside the target, handed to `check` (which
    may raise to refuse it) and only then renamed into place, so an error, a failed check or an
    interrupt never leaves a half-written model. Saving with external data empties `model`'s
    in-memory weights (onnx moves them out).
    """
    p = Path(path)
    out_dir = p.parent if str(p.parent) else Path(".")
    if not out_dir.is_dir():
        raise LnfoldError(f"{out_dir}: output directory does not exist")
    if external is None:
        external = is_large(model)
    tmp = Path(tempfile.mkdtemp(prefix=".lnfold-", dir=out_dir))
    try:
        target = tmp / p.name
        if external:
            location = p.name + ".data"
            onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=location, size_threshold=1024)
        else:
            onnx.save_model(model, str(target))
        if check is not None:
            check(target)
        if external:
            os.replace(tmp / location, out_dir / location)
        os.replace(target, p)
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write: {_first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
