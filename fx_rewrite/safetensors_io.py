"""Reading and writing safetensors files a tensor at a time (a checkpoint fold in bounded memory).

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, [begin, end) data offsets; `__metadata__`), then the data. A file is
written from its header and then one tensor's bytes after another, so that writing a shard never
holds the shard in memory.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import torch

from ..passes import LnfoldError
from ..passes.edits import row_blocks
from ..passes.errors import first_line

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
DTYPES.update({code: getattr(torch, name) for code, name in (
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E8M0", "float8_e8m0fnu"), ("C64", "complex64")) if hasattr(torch, name)})
# bytes per element of every whole-byte safetensors dtype (the format's own list; a tensor of one
# torch lacks is still copied as bytes); sub-byte ones (F4, F6_*) are refused
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
         "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}
COPY_BLOCK = 64 << 20


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple
    begin: int  # data offsets, relative to the end of the header
    end: int


@dataclass
class Header:
    data_start: int  # where the data begins in the file
    entries: dict[str, Entry]  # in file order
    metadata: dict


def read_header(path: Path) -> Header:
    """The header of a safetensors file, checked as safetensors checks it before anything is
    written: a JSON object of entries with a known dtype, a shape of naturals and the [begin, end)
    offsets of exactly its bytes, the entries tiling the data from 0 to the file's end without gap
    or overlap, `__metadata__` an object of strings. Anything else is a one-line LnfoldError naming
    the file (a truncated file says so)."""
    def bad(why: str) -> LnfoldError:
        return LnfoldError(f"{path}: not a readable safetensors file ({why})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise ValueError("header longer than the file")
            raw = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise LnfoldError(f"{path}: not a readable safetensors file ({first_line(e)}); truncated?") from None
    if not isinstance(raw, dict):
        raise bad(f"its header is a JSON {type(raw).__name__}, not an object")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not an object of strings")
    entries = {name: _entry(v, lambda why: bad(f"tensor {name}: {why}")) for name, v in raw.items()}
    entries = dict(sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)))
    end = 0
    for name, e in entries.items():
        if e.begin != end:
            raise bad(f"tensor {name} begins at {e.begin}, where {end} was due: offsets overlap or leave a gap")
        end = e.end
    data = size - 8 - n
    if end > data:
        raise LnfoldError(f"{path}: truncated: its header describes {end} bytes of data, the file holds {data}")
    if end < data:
        raise bad(f"{data - end} bytes after its last tensor")
    return Header(8 + n, entries, meta)


def _entry(v, bad: Callable[[str], LnfoldError]) -> Entry:
    natural = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    if not isinstance(v, dict):
        raise bad(f"a {type(v).__name__}, not an object")
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SIZES:
        raise bad(f"dtype {dtype!r} is none of safetensors' whole-byte dtypes")
    if not isinstance(shape, list) or not all(natural(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of naturals")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(natural(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    if offsets[1] - offsets[0] != nbytes(dtype, shape):
        raise bad(f"its offsets hold {offsets[1] - offsets[0]} bytes, its dtype and shape {nbytes(dtype, shape)}")
    return Entry(dtype, tuple(shape), *offsets)


def nbytes(code: str, shape: tuple) -> int:
    """The size of a tensor of safetensors dtype `code` (read_header refused any other code)."""
    return SIZES[code] * math.prod(shape)


class ShardWriter:
    """Writes one safetensors file: the header first (every tensor's name, dtype and shape are
    known before any data is), then `put` / `copy` each tensor in that order."""

    def __init__(self, path: Path, layout: list[tuple[str, str, tuple]], metadata: dict) -> None:
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self.order = []
        for name, code, shape in layout:
            size = nbytes(code, shape)
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.order.append((name, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.f: BinaryIO = open(path, "wb")
        self.f.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def _expect(self, name: str, nbytes: int) -> None:
        want, size = self.order[self.next]
        if (want, size) != (name, nbytes):  # pragma: no cover - the writer's own bookkeeping
            raise RuntimeError(f"shard writer: {name} ({nbytes} bytes) where {want} ({size}) was due")
        self.next += 1

    def put(self, name: str, pieces: Iterable[bytes | memoryview], nbytes: int) -> None:
        self._expect(name, nbytes)
        for p in pieces:
            self.f.write(p)

    def copy(self, name: str, src: BinaryIO, start: int, nbytes: int) -> None:
        """The tensor's bytes from `src` as they are (os.sendfile where the system has it)."""
        self._expect(name, nbytes)
        self.f.flush()
        done = 0
        with contextlib.suppress(AttributeError, OSError):  # (no sendfile, or it stopped: read and write the rest)
            while done < nbytes:
                sent = os.sendfile(self.f.fileno(), src.fileno(), start + done, nbytes - done)
                if sent == 0:
                    raise OSError("short read")
                done += sent
        self.f.seek(0, os.SEEK_END)
        src.seek(start + done)
        while done < nbytes:
            block = src.read(min(COPY_BLOCK, nbytes - done))
            if not block:
                raise LnfoldError(f"{getattr(src, 'name', 'input')}: ended early (truncated?)")
            self.f.write(block)
            done += len(block)

    def close(self) -> None:
        """Finish the file, on disk: a shard written while the next is edited goes to the disk
        then, not all at the end (the fold fsyncs its folder before publishing it anyway)."""
        if self.next != len(self.order):  # pragma: no cover
            raise RuntimeError("shard writer: closed before every tensor was written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (bf16 and bool included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def edited_pieces(t, axis, edit: Callable[[torch.Tensor], torch.Tensor], budget: int):
    """`edit` applied to blocks of rows of `t` (`Rows` of a tensor in its file) of about `budget`
    float64 bytes each, or to all of it where axis is None, each block's bytes as soon as it is done.
    `axis` is 0 or None (passes/edits.chunk_axis): the file's bytes are contiguous only along the first axis."""
    for lo, hi in row_blocks(tuple(t.shape), budget) if axis is not None else [(None, None)]:
        yield tensor_bytes(edit(t[lo:hi]))


def read_into(f: BinaryIO, t: torch.Tensor, offset: int) -> None:
    """Fill contiguous `t` with the file's bytes from `offset`, read straight into its memory
    (pread: no file position, no intermediate copy, no mapping that would count in RSS)."""
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:]], offset + done)
        if n <= 0:
            raise LnfoldError(f"{getattr(f, 'name', 'input')}: ends {len(view) - done} bytes before a tensor does "
                              "(truncated?)")
        done += n


class Rows:
    """A tensor still in its file: its shape, and blocks of its first axis read on demand
    (`rows[lo:hi]`, `rows[:]` for all of it), so that a big tensor is never in memory whole."""

    def __init__(self, f: BinaryIO, start: int, dtype: torch.dtype, shape: tuple) -> None:
        self.f, self.start, self.dtype, self.shape = f, start, dtype, tuple(shape)
        self.row_bytes = dtype.itemsize * math.prod(self.shape[1:])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not self.shape:
            out, offset = torch.empty((), dtype=self.dtype), self.start
        else:
            lo, hi, _ = rows.indices(self.shape[0])
            out = torch.empty((max(0, hi - lo),) + self.shape[1:], dtype=self.dtype)
            offset = self.start + lo * self.row_bytes
        read_into(self.f, out, offset)
        return out
