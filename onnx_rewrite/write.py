"""Saving ONNX models atomically: a locked staging folder beside the target, a check, then
renames that publish a model and its weights file as one unit (`_publish`).

Weights go to `<name>.data` beside the model when it would pass protobuf's 2 GiB limit; weights a
lazy load left in the input's data file (onnx_rewrite/read.py) are copied from there in chunks.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import onnx

from ..passes import LnfoldError
from ..passes.errors import first_line
from ..passes.outputs import Staging, fsync_file, fsync_folder
from .read import all_tensors, external_info, external_source, is_lazy
from .validate import raw_bytes
from .wire import copy_fields, initializer_head

# Protobuf cannot serialize a message over 2 GiB: such models keep their weights beside them.
_PROTO_LIMIT = 2**31 - 2**20
# onnx's external-data threshold (`save_model(size_threshold=1024)`): smaller tensors stay inline.
_EXTERNAL_THRESHOLD = 1024
_COPY_CHUNK = 16 * 2**20
# Initializers at least this big are streamed by _write_inline rather than serialized with the rest.
_STREAM_BYTES = 2**16


def _external_bytes(t: onnx.TensorProto) -> int:
    return int(external_info(t).get("length", 0) or 0)


@dataclass(frozen=True)
class DataLayout:
    """Where a model keeps its weights beside it: the data file's name (relative to the model's
    folder) and the size from which a tensor goes there."""

    location: str
    threshold: int


def data_layout(model: onnx.ModelProto, src: Path, dst: Path) -> "DataLayout | None":
    """The layout of `model` (read from `src` without its data) for its fold written to `dst`:
    None when its weights are inside it. The data file keeps its name (`model.onnx_data`, as
    Optimum writes it), or, for an output named otherwise, takes the output's name in place of
    the input's (`model.onnx.data` -> `model.folded.onnx.data`); a model whose weights were spread
    over several files gets one, named after the first."""
    external = [t for t in all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    locations = [loc for t in external if (loc := external_info(t).get("location"))]
    if not locations:
        return None
    location = Path(locations[0]).name  # (a data file in a subfolder comes back beside the model)
    if dst.name != src.name:
        location = dst.name + location[len(src.name):] if location.startswith(src.name) \
            else f"{Path(dst.name).stem}.{location}"
    return DataLayout(location, min([_EXTERNAL_THRESHOLD] + [_external_bytes(t) for t in external]))


def is_large(model: onnx.ModelProto) -> bool:
    """Would `model`, with every tensor inline, pass protobuf's 2 GiB limit? Decided from the tensors'
    byte counts but in the band where the rest could matter: ByteSize serializes the whole message."""
    inline = external = 0
    for t in all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            external += _external_bytes(t)
        elif t.HasField("raw_data"):
            inline += raw_bytes(t)
        else:
            inline += 8 * (len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data)
                           + len(t.uint64_data)) + sum(len(b) for b in t.string_data)
    if inline + external >= _PROTO_LIMIT:
        return True
    if inline + external < _PROTO_LIMIT // 2:
        return False
    return model.ByteSize() + external > _PROTO_LIMIT


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool | None = None,
         layout: "DataLayout | None" = None) -> None:
    """Write `model` to `path` atomically (see `staged`)."""
    with staged(model, path, external=external, layout=layout):
        pass


@contextlib.contextmanager
def staged(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool | None = None,
           layout: "DataLayout | None" = None) -> Iterator[Path]:
    """Write `model` for `path` atomically; weights go to `<name>.data` beside it when large, or
    as `layout` says (the input's data file's name and threshold).

    Everything is written into a locked staging folder beside the target, whose model file the
    block receives (to check it from files), and published (`_publish`) only when the block exits
    without an error: an error, a failed check or an interrupt never leaves a half-written model,
    and a second lnfold writing the same path is refused. Saving with external data empties
    `model`'s in-memory weights (they move to the data file, one tensor at a time).
    """
    p = Path(path)
    out_dir = p.parent
    if not out_dir.is_dir():
        raise LnfoldError(f"{out_dir}: output directory does not exist")
    if layout is not None:
        external = True
    elif external is None:
        external = is_large(model)
    layout = layout or DataLayout(p.name + ".data", _EXTERNAL_THRESHOLD)
    try:
        staging = Staging.acquire(p)
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write into {out_dir}: {first_line(e)}") from None
    try:
        target = staging.new / p.name
        wrote_data = False
        if external:
            wrote_data = _write_external(model, staging.new / layout.location, layout.location, layout.threshold)
            onnx.save_model(model, str(target))
        else:
            _write_inline(model, target)
        yield target
        # (every tensor below the threshold stays inside the model: no weights file)
        _publish(staging.old, target, p, out_dir / layout.location if wrote_data else None)
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write: {first_line(e)}") from None
    finally:
        staging.release()


def _write_inline(model: onnx.ModelProto, target: Path) -> None:
    """Write `model` as one file without its serialized bytes (or the weights a lazy load left on
    disk) in memory: everything but the big initializers is serialized, then each big initializer
    is appended as a `graph { initializer { ... } }` field of its own (wire.py), its data streamed."""
    g = model.graph
    streamed = {i for i, t in enumerate(g.initializer)
                if is_lazy(t) or (t.HasField("raw_data") and raw_bytes(t) >= _STREAM_BYTES)}
    if not streamed:
        onnx.save_model(model, str(target))
        return
    big = [g.initializer[i] for i in sorted(streamed)]
    head = onnx.ModelProto()
    copy_fields(model, head, {"graph"})
    copy_fields(g, head.graph, {"initializer"})
    head.graph.initializer.extend(t for i, t in enumerate(g.initializer) if i not in streamed)
    with open(target, "wb") as f:
        f.write(head.SerializeToString())
        del head
        for t in big:
            meta = onnx.TensorProto()
            copy_fields(t, meta, {"raw_data", "external_data", "data_location"})
            if is_lazy(t):
                source = external_source(t)
                f.write(initializer_head(meta.SerializeToString(), source[2]))
                _append_lazy(f, source, t.name)
            else:
                data = t.raw_data  # (each read of the field copies the bytes)
                f.write(initializer_head(meta.SerializeToString(), len(data)))
                f.write(data)
                del data


def _write_external(model: onnx.ModelProto, data_path: Path, location: str, threshold: int) -> bool:
    """Stream every tensor of `model` worth it into `data_path`, one at a time: inline ones (≥ `threshold`
    bytes of raw data) are written and dropped from the proto, lazily loaded ones copied from the input's
    data file; each gets external_data pointing at its new place. Returns whether a data file was written."""
    f = None
    offset = 0
    try:
        for t in all_tensors(model):
            lazy = is_lazy(t)
            if not lazy and not (t.HasField("raw_data") and raw_bytes(t) >= max(threshold, 1)):
                continue
            if f is None:
                f = open(data_path, "wb")
            pad = (-offset) % 64  # aligned, as onnxruntime may map the file
            if pad:
                f.write(b"\0" * pad)
                offset += pad
            if lazy:
                length = _append_lazy(f, external_source(t), t.name)
            else:
                length = f.write(t.raw_data)
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


def _append_lazy(f, source: tuple[int, int, int], name: str) -> int:
    """Append a lazily loaded tensor's bytes (`source`: read.external_source's fd, closed here, offset
    and length) to the open file `f`; returns their length."""
    src, src_off, length = source
    try:
        f.flush()
        pos = f.tell()
        _copy_range(src, f.fileno(), src_off, pos, length, name)
    finally:
        os.close(src)
    f.seek(pos + length)
    return length


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


def _publish(old: Path, model_file: Path, dst: Path, data_dst: Path | None) -> None:
    """Move the checked files (`model_file` and, unless `data_dst` is None, the data file beside it)
    into place as one unit, crash-consistently: both fsynced first; a model at `dst` moved into `old`
    (the staging folder) and the folder fsynced, so there is no model at `dst` until the new data
    file and then the new model are renamed into place. A kill at any point leaves the old pair, no
    model, or the new pair, never a model beside another fold's weights; an error or an interrupt
    puts the old pair back. Without a data file the model's rename alone replaces the old one.
    """
    fsync_file(model_file)
    if data_dst is None:
        os.replace(model_file, dst)
        fsync_folder(dst.parent)
        return
    new_data = model_file.parent / data_dst.name
    fsync_file(new_data)
    if data_dst.is_dir() and not data_dst.is_symlink():
        raise LnfoldError(f"{data_dst}: is a directory; the weights file of {dst.name} cannot go there")
    old_model, old_data = old / "model", old / "data"
    moved_model = moved_data = placed_data = False
    try:
        if os.path.lexists(dst) and not (dst.is_dir() and not dst.is_symlink()):
            os.replace(dst, old_model)  # (a directory at dst: the model's rename below fails, as it did)
            moved_model = True
            fsync_folder(dst.parent)
        if os.path.lexists(data_dst):
            os.replace(data_dst, old_data)
            moved_data = True
        os.replace(new_data, data_dst)
        placed_data = True
        os.replace(model_file, dst)
    except BaseException:
        # (os.rename, the same call on POSIX: a test's failing os.replace must not stop the repair)
        with contextlib.suppress(OSError):
            if moved_data:
                os.rename(old_data, data_dst)
            elif placed_data:
                data_dst.unlink()
        with contextlib.suppress(OSError):
            if moved_model:
                os.rename(old_model, dst)
        fsync_folder(dst.parent)
        raise
    fsync_folder(dst.parent)
