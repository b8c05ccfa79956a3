"""Reading ONNX models: clear errors for bad files, external data, and lazy loading.

A lazy load leaves a big model's large external weights in the input's data file: the fold reads
each weight it edits (`read_external`), and saving copies the others from the input (write.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
# onnx's private helpers, used here only (the rest of lnfold imports them from this module)
from onnx.external_data_helper import _get_all_tensors as all_tensors
from onnx.external_data_helper import _open_external_data_fd, uses_external_data

from ..passes import LnfoldError
from ..passes.errors import first_line
from ..passes.outputs import pickled_checkpoint
from .validate import ITEM_BYTES, element_count

# A lazy load (`load(..., lazy=True)`) reads external tensors below this size and leaves bigger
# weights in the input's data file.
_EAGER_BYTES = 2**20
# Written into a lazily loaded tensor's external_data: the input's folder, where its location is
# resolved. Any `basepath` the input itself carries is dropped (a model may not point us elsewhere).
_BASEPATH = "basepath"
# Types whose external bytes are the array itself (little-endian, as ONNX stores raw data).
PLAIN_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
                onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
                onnx.TensorProto.BOOL}


def load(path: str | os.PathLike, *, data_files: set | None = None, lazy: bool = False) -> onnx.ModelProto:
    """Read an ONNX model (and its external data), or raise LnfoldError saying what is wrong.

    `data_files`, when given, receives the resolved paths of the external-data files read.
    `lazy` leaves the main graph's big external weights (over `_EAGER_BYTES`) in their file: the
    model is then for `read_external` and `save`, not for onnx or onnxruntime as it is.
    """
    p = Path(path)
    if not p.exists():
        raise LnfoldError(f"{p}: no such file")
    if p.is_dir():
        raise LnfoldError(pickled_checkpoint(p) or f"{p}: is a directory, not an ONNX file (`lnfold fold` takes a "
                          "folder of ONNX files or a transformers checkpoint)")
    if not p.is_file():
        raise LnfoldError(f"{p}: not a regular file")
    if not os.access(p, os.R_OK):
        raise LnfoldError(f"{p}: permission denied")
    if p.stat().st_size == 0:
        raise LnfoldError(f"{p}: empty file, not an ONNX model")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except PermissionError:
        raise LnfoldError(f"{p}: permission denied") from None
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        raise LnfoldError(f"{p}: not a readable ONNX model (truncated or corrupt?): {first_line(e)}") from None
    if not model.graph.node or not model.opset_import:
        raise LnfoldError(f"{p}: not an ONNX model (no graph or no opset)")
    if data_files is not None:
        data_files |= external_files(p, model)
    _drop_basepaths(model)
    try:
        if lazy:
            _keep_big_on_disk(model, p.parent)
        for t in all_tensors(model):
            if uses_external_data(t) and not is_lazy(t):
                onnx.external_data_helper.load_external_data_for_tensor(t, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        # onnx raises ValidationError for a missing data file or a location outside the folder
        raise LnfoldError(f"{p}: cannot read its external data: {first_line(e)}") from None
    return model


def external_info(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def is_lazy(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL and any(e.key == _BASEPATH for e in t.external_data)


def _drop_basepaths(model: onnx.ModelProto) -> None:
    """External data is read relative to the model's folder, as onnxruntime reads it: a
    `basepath` the input carries (onnx's loader would follow it anywhere) is dropped."""
    for t in all_tensors(model):
        if any(e.key == _BASEPATH for e in t.external_data):
            keep = [(e.key, e.value) for e in t.external_data if e.key != _BASEPATH]
            del t.external_data[:]
            t.external_data.extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in keep)


def _keep_big_on_disk(model: onnx.ModelProto, folder: Path) -> None:
    """Mark the main graph's big external initializers to stay on disk: their location, offset
    and length are checked now (as a full load would), their bytes are read only when used."""
    if sys.byteorder != "little":
        return
    base = str(folder.resolve())
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in PLAIN_TYPES:
            continue
        need = element_count(t) * ITEM_BYTES[t.data_type]
        if need < _EAGER_BYTES:
            continue
        info = onnx.external_data_helper.ExternalDataInfo(t)
        fd = _open_external_data_fd(base, info.location, t.name, True)  # onnx's own path checks
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        offset = info.offset or 0
        if offset > size:
            raise ValueError(f"External data offset ({offset}) exceeds file size ({size}) for tensor {t.name!r}")
        length = size - offset if info.length is None else info.length
        if length > size - offset:
            raise ValueError(f"External data length ({length}) exceeds available data ({size - offset} bytes "
                             f"from offset {offset}) for tensor {t.name!r}")
        if length != need:
            raise LnfoldError(f"initializer `{t.name}` holds {length} bytes, but its shape {list(t.dims)} "
                              f"needs {need} (truncated or corrupt weights)")
        t.external_data.add(key=_BASEPATH, value=base)


def external_source(t: onnx.TensorProto) -> tuple[int, int, int]:
    """(an open fd, offset, length) of a lazily loaded tensor's bytes in the input's data file."""
    info = external_info(t)
    fd = _open_external_data_fd(info[_BASEPATH], info["location"], t.name, True)
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else os.fstat(fd).st_size - offset
    return fd, offset, length


def read_external(t: onnx.TensorProto) -> np.ndarray:
    """The array of a tensor a lazy load left on disk: a read-only map of the input's data file,
    read by whatever uses the array, with no anonymous copy."""
    fd, offset, length = external_source(t)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            a = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(length // dtype.itemsize,))
    finally:
        os.close(fd)
    return a.reshape(tuple(t.dims))


def external_files(path: str | os.PathLike, model: onnx.ModelProto) -> set[Path]:
    """The external-data files that `model`, read from `path` without its data, refers to."""
    tensors = list(model.graph.initializer) + [s.values for s in model.graph.sparse_initializer]
    external = [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]
    locations = (next((e.value for e in t.external_data if e.key == "location"), None) for t in external)
    return {(Path(path).parent / loc).resolve() for loc in locations if loc}
