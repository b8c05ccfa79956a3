"""Loading and saving ONNX models: clear errors for bad files, atomic writes, external data."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import _get_all_tensors, _open_external_data_fd, uses_external_data

from ..passes import LnfoldError

# Protobuf cannot serialize a message over 2 GiB: such models keep their weights beside them.
_PROTO_LIMIT = 2**31 - 2**20
MIN_OPSET = 9
# A lazy load (`load(..., lazy=True)`) reads external tensors below this size (γ/β, shape
# constants, axes: what the analysis reads) and leaves bigger weights in the input's data file,
# read one at a time where the fold edits them (`read_external`) and copied by `save`.
_EAGER_BYTES = 2**20
# Written into a lazily loaded tensor's external_data: the input's folder, where its location is
# resolved. Any `basepath` the input itself carries is dropped (a model may not point us elsewhere).
_BASEPATH = "basepath"
# onnx's external-data threshold (`save_model(size_threshold=1024)`): smaller tensors stay inline.
_EXTERNAL_THRESHOLD = 1024
_COPY_CHUNK = 16 * 2**20


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


def load(path: str | os.PathLike, *, data_files: set | None = None, lazy: bool = False) -> onnx.ModelProto:
    """Read an ONNX model (and its external data), or raise LnfoldError saying what is wrong.

    `data_files`, when given, receives the resolved paths of the external-data files read.
    `lazy` leaves the main graph's big external weights (over `_EAGER_BYTES`) in their file:
    the model then refers to the input's folder, is read through `read_external` and is meant
    for `save` (which copies those weights from the input); onnx and onnxruntime cannot use it
    as it is.
    """
    p = Path(path)
    if not p.exists():
        raise LnfoldError(f"{p}: no such file")
    if p.is_dir():
        raise LnfoldError(f"{p}: is a directory, not an ONNX file")
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
        raise LnfoldError(f"{p}: not a readable ONNX model (truncated or corrupt?): {_first_line(e)}") from None
    if not model.graph.node or not model.opset_import:
        raise LnfoldError(f"{p}: not an ONNX model (no graph or no opset)")
    if data_files is not None:
        data_files |= external_files(p, model)
    _drop_basepaths(model)
    try:
        if lazy:
            _keep_big_on_disk(model, p.parent)
        for t in _get_all_tensors(model):
            if uses_external_data(t) and not is_lazy(t):
                onnx.external_data_helper.load_external_data_for_tensor(t, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        # onnx raises ValidationError for a missing data file or a location outside the folder
        raise LnfoldError(f"{p}: cannot read its external data: {_first_line(e)}") from None
    return model


# Types whose external bytes are the array itself (little-endian, as ONNX stores raw data).
_PLAIN_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
                onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
                onnx.TensorProto.BOOL}


def _ext_info(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def is_lazy(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL and any(e.key == _BASEPATH for e in t.external_data)


def _drop_basepaths(model: onnx.ModelProto) -> None:
    """External data is read relative to the model's folder, as onnxruntime reads it: a
    `basepath` the input carries (onnx's loader would follow it anywhere) is dropped."""
    for t in _get_all_tensors(model):
        if any(e.key == _BASEPATH for e in t.external_data):
            keep = [(e.key, e.value) for e in t.external_data if e.key != _BASEPATH]
            del t.external_data[:]
            for k, v in keep:
                t.external_data.add(key=k, value=v)


def _keep_big_on_disk(model: onnx.ModelProto, folder: Path) -> None:
    """Mark the main graph's big external initializers to stay on disk: their location, offset
    and length are checked now (as a full load would), their bytes are read only when used."""
    base = str(folder.resolve())
    if sys.byteorder != "little":
        return
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in _PLAIN_TYPES:
            continue
        n = 1
        for d in t.dims:
            if d < 0:
                raise LnfoldError(f"initializer `{t.name}` has a negative dimension {list(t.dims)}")
            n *= d
        need = n * _ITEM_BYTES[t.data_type]
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


def _source(t: onnx.TensorProto) -> tuple[int, int, int]:
    """(an open fd, offset, length) of a lazily loaded tensor's bytes in the input's data file."""
    info = _ext_info(t)
    fd = _open_external_data_fd(info[_BASEPATH], info["location"], t.name, True)
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else os.fstat(fd).st_size - offset
    return fd, offset, length


def read_external(t: onnx.TensorProto) -> np.ndarray:
    """The array of a tensor a lazy load left on disk (the tensor is not changed).

    A read-only map of the input's data file: its pages are read by whatever uses the array
    (the fold converts weights to float64 anyway), with no anonymous copy, and released with it.
    """
    fd, offset, length = _source(t)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    try:
        if length == 0:
            return np.zeros(tuple(t.dims), dtype)
        with os.fdopen(os.dup(fd), "rb") as f:
            a = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(length // dtype.itemsize,))
    finally:
        os.close(fd)
    return a.reshape(tuple(t.dims))


def external_files(path: str | os.PathLike, model: onnx.ModelProto) -> set[Path]:
    """The external-data files that `model`, read from `path` without its data, refers to."""
    p = Path(path)
    files = set()
    for t in list(model.graph.initializer) + [s.values for s in model.graph.sparse_initializer]:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                files.add((p.parent / loc).resolve())
    return files


# Bytes per element of the types whose raw data can be checked against their dims.
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2,
               17: 1, 18: 1, 19: 1, 20: 1, 24: 1}


def check_tensors(model: onnx.ModelProto) -> None:
    """Every initializer holds as many elements as its dims say (a truncated weight file or a
    corrupt proto otherwise fails much later, deep inside numpy)."""
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue  # not loaded (load_external_data=False): checked where it is read
        n = 1
        for d in t.dims:
            if d < 0:
                raise LnfoldError(f"initializer `{t.name}` has a negative dimension {list(t.dims)}")
            n *= d
        if t.HasField("raw_data"):
            size = _ITEM_BYTES.get(t.data_type)
            if size is not None and len(t.raw_data) != n * size:
                raise LnfoldError(f"initializer `{t.name}` holds {len(t.raw_data)} bytes, but its shape "
                                  f"{list(t.dims)} needs {n * size} (truncated or corrupt weights)")
        elif t.data_type in _ITEM_BYTES:
            have = len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data) + len(t.uint64_data)
            if have != n:
                raise LnfoldError(f"initializer `{t.name}` holds {have} values, but its shape {list(t.dims)} "
                                  f"needs {n} (truncated or corrupt weights)")


def check_graph(model: onnx.ModelProto) -> None:
    """The main graph is a DAG whose every input is provided, or raise LnfoldError naming why.

    Checked up front because a cycle or a dangling input otherwise surfaces as an unrelated
    failure (unknown shapes, a toposort error, onnxruntime refusing the folded model).
    """
    g = model.graph
    provided = {i.name for i in g.input} | {t.name for t in g.initializer}
    provided |= {t.values.name for t in g.sparse_initializer}
    producer: dict[str, int] = {}
    for k, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in producer or o in provided:
                raise LnfoldError(f"tensor `{o}` is produced twice (node `{n.name or n.op_type}`): not a valid ONNX graph")
            producer[o] = k
    for n in g.node:
        for i in n.input:
            if i and i not in provided and i not in producer:
                raise LnfoldError(f"node `{n.name or n.op_type}` reads `{i}`, which no node, graph input or "
                                  "initializer provides (dangling input)")
    for o in g.output:
        if o.name not in provided and o.name not in producer:
            raise LnfoldError(f"graph output `{o.name}` is produced by no node")
    # Kahn's algorithm: whatever is left unplaced lies on (or after) a cycle.
    waiting = [sum(1 for i in n.input if i in producer) for n in g.node]
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(g.node):
        for i in n.input:
            if i in producer:
                readers.setdefault(i, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    placed = 0
    while ready:
        k = ready.pop()
        placed += 1
        for o in g.node[k].output:
            for r in readers.get(o, ()):
                waiting[r] -= 1
                if waiting[r] == 0:
                    ready.append(r)
    if placed != len(g.node):
        stuck = next(n for k, n in enumerate(g.node) if waiting[k] > 0)
        raise LnfoldError(f"the graph has a cycle (through node `{stuck.name or stuck.op_type}`): not a valid ONNX graph")


def no_norm_message(model: onnx.ModelProto) -> str:
    inner = subgraph_norms(model)
    if inner:
        return (f"no LayerNorm found in the main graph ({inner} inside If/Loop/Scan subgraphs, "
                "which lnfold does not fold): nothing to fold")
    return "no LayerNorm found in the model: nothing to fold"


def subgraph_norms(model: onnx.ModelProto) -> int:
    """LayerNorms inside If/Loop/Scan bodies, which lnfold leaves alone."""
    def count(graph, top: bool) -> int:
        k = 0
        for n in graph.node:
            if not top and n.op_type in ("LayerNormalization", "SkipLayerNormalization"):
                k += 1
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    k += count(sub, False)
        return k

    return count(model.graph, True)


def has_lazy_tensors(model: onnx.ModelProto) -> bool:
    return any(is_lazy(t) for t in model.graph.initializer)


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor data in `model`: inline (raw or typed fields) and in external files."""
    total = 0
    for t in _get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = _ext_info(t)
            total += int(info.get("length", 0) or 0)
        elif t.HasField("raw_data"):
            total += len(t.raw_data)
        else:
            total += 8 * (len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data)
                          + len(t.uint64_data)) + sum(len(b) for b in t.string_data)
    return total


def is_large(model: onnx.ModelProto) -> bool:
    """Would `model`, with every tensor inline, pass protobuf's 2 GiB limit?

    Decided from the tensors' byte counts alone; only in the band where the rest of the proto
    (nodes, names) could matter is the serialized size computed, once (protobuf's ByteSize
    serializes the whole message, weights included).
    """
    data = tensor_bytes(model)
    if data >= _PROTO_LIMIT:
        return True
    if data < _PROTO_LIMIT // 2:
        return False
    external = sum(int(_ext_info(t).get("length", 0) or 0) for t in _get_all_tensors(model)
                   if t.data_location == onnx.TensorProto.EXTERNAL)
    return model.ByteSize() + external > _PROTO_LIMIT


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool | None = None,
         check: Callable[[Path], None] | None = None) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` beside it when large.

    Everything is written into a temporary folder beside the target, handed to `check` (which
    may raise to refuse it) and only then renamed into place, so an error, a failed check or an
    interrupt never leaves a half-written model. Saving with external data empties `model`'s
    in-memory weights (they move to the data file, one tensor at a time). Weights a lazy load
    left in the input's data file are copied from there, in chunks, or read in when the output
    holds its weights inline.
    """
    p = Path(path)
    out_dir = p.parent if str(p.parent) else Path(".")
    if not out_dir.is_dir():
        raise LnfoldError(f"{out_dir}: output directory does not exist")
    if external is None:
        external = is_large(model)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".lnfold-", dir=out_dir))
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write into {out_dir}: {_first_line(e)}") from None
    try:
        target = tmp / p.name
        location = p.name + ".data"
        wrote_data = False
        if external:
            wrote_data = _write_external(model, tmp / location, location)
            onnx.save_model(model, str(target))
        else:
            _write_inline(model, target)
        if check is not None:
            check(target)
        # (below onnx's size threshold every tensor stays inside the model: no weights file)
        _publish(tmp, target, p, out_dir / location if wrote_data else None)
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write: {_first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Initializers at least this big are streamed by _write_inline rather than serialized with the rest.
_STREAM_BYTES = 2**16
_RAW_DATA_FIELD = 9  # TensorProto.raw_data
_INITIALIZER_FIELD = 5  # GraphProto.initializer
_GRAPH_FIELD = 7  # ModelProto.graph


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    return _varint(number << 3 | 2) + _varint(length)


def _copy_fields(src, dst, skip: set[str]) -> None:
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _write_inline(model: onnx.ModelProto, target: Path) -> None:
    """Write `model` as one file without building its serialized bytes (or loading the weights
    a lazy load left on disk) in memory: everything but the big initializers is serialized,
    then each big initializer is appended as a field `graph { initializer { ... } }` of its own,
    its raw data streamed. Protobuf parsers merge repeated occurrences of an embedded message
    (onnx, onnxruntime: the same model); the big initializers come last in the list."""
    g = model.graph
    streamed = {i for i, t in enumerate(g.initializer)
                if is_lazy(t) or (t.HasField("raw_data") and len(t.raw_data) >= _STREAM_BYTES)}
    if not streamed:
        onnx.save_model(model, str(target))
        return
    big = [g.initializer[i] for i in sorted(streamed)]
    head = onnx.ModelProto()
    _copy_fields(model, head, {"graph"})
    _copy_fields(g, head.graph, {"initializer"})
    head.graph.initializer.extend(t for i, t in enumerate(g.initializer) if i not in streamed)
    with open(target, "wb") as f:
        f.write(head.SerializeToString())
        del head
        for t in big:
            meta = onnx.TensorProto()
            _copy_fields(t, meta, {"raw_data", "external_data", "data_location"})
            meta_bytes = meta.SerializeToString()
            if is_lazy(t):
                src, src_off, length = _source(t)
                data = None
            else:
                src, data = None, t.raw_data
                length = len(data)
            tensor_len = len(meta_bytes) + len(_len_field(_RAW_DATA_FIELD, length)) + length
            init = _len_field(_INITIALIZER_FIELD, tensor_len)
            f.write(_len_field(_GRAPH_FIELD, len(init) + tensor_len) + init + meta_bytes
                    + _len_field(_RAW_DATA_FIELD, length))
            if data is not None:
                f.write(data)
                del data
            else:
                try:
                    f.flush()
                    pos = f.tell()
                    _copy_range(src, f.fileno(), src_off, pos, length, t.name)
                finally:
                    os.close(src)
                f.seek(pos + length)


def _write_external(model: onnx.ModelProto, data_path: Path, location: str) -> bool:
    """Stream every tensor of `model` worth it into `data_path`, one at a time: inline ones
    (≥ 1 KiB of raw data) are written and dropped from the proto, lazily loaded ones copied from
    the input's data file; each gets external_data pointing at its new place. Returns whether
    a data file was written (not when every tensor is small)."""
    f = None
    offset = 0
    try:
        for t in _get_all_tensors(model):
            lazy = is_lazy(t)
            if not lazy and not (t.HasField("raw_data") and len(t.raw_data) >= _EXTERNAL_THRESHOLD):
                continue
            if f is None:
                f = open(data_path, "wb")
            pad = (-offset) % 64  # aligned, as onnxruntime may map the file
            if pad:
                f.write(b"\0" * pad)
                offset += pad
            if lazy:
                src, src_off, length = _source(t)
                try:
                    f.flush()
                    _copy_range(src, f.fileno(), src_off, offset, length, t.name)
                finally:
                    os.close(src)
                f.seek(offset + length)
            else:
                data = t.raw_data
                length = len(data)
                f.write(data)
                del data
                t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            offset += length
    finally:
        if f is not None:
            f.close()
    return f is not None


def _copy_range(src: int, dst: int, src_off: int, dst_off: int, length: int, name: str) -> None:
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        n = min(_COPY_CHUNK * 4, length - done)
        k = 0
        if use_cfr:
            try:
                k = os.copy_file_range(src, dst, n, src_off + done, dst_off + done)
            except OSError:
                use_cfr = False  # (another file system, an old kernel): plain reads and writes
        if not use_cfr:
            chunk = os.pread(src, min(n, _COPY_CHUNK), src_off + done)
            k = os.pwrite(dst, chunk, dst_off + done) if chunk else 0
        if k == 0:
            raise LnfoldError(f"initializer `{name}`: its external data changed while folding (short read)")
        done += k


def _publish(tmp: Path, model_file: Path, dst: Path, data_dst: Path | None) -> None:
    """Rename the checked files into place: the weights first, the model last.

    Until the model's rename, a failure or an interrupt puts back whatever weights file was
    at `data_dst` before (an earlier output's), so the target is either the old pair or the new.
    """
    if data_dst is None:
        os.replace(model_file, dst)
        return
    backup = tmp / (data_dst.name + ".old")
    had_old = data_dst.exists()
    if had_old:
        os.replace(data_dst, backup)
    try:
        os.replace(tmp / data_dst.name, data_dst)
        os.replace(model_file, dst)
    except BaseException:
        if had_old:
            os.replace(backup, data_dst)
        else:
            try:
                data_dst.unlink()
            except FileNotFoundError:
                pass
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
