"""Inputs that a model accepts, made up from its graph (DESIGN §4), or given by the user.

Made-up inputs must fit: sizes that agree across inputs sharing a symbolic dim (Optimum's
`past_sequence_length`, and `past_sequence_length + sequence_length` for the mask), masks of ones,
`position_ids = arange(past, past + seq)`, widths fixed by the first MatMul/Gemm/Conv reading an
input, indices inside every table they reach, lengths that keep computed indices (Range, CumSum,
position inputs) inside the smallest table they index. `candidates` yields a few such assignments,
most likely first; the caller runs the model on each until one works.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..passes import LnfoldError
from ..passes.calibration import Rows
from ..passes.outputs import folder_files
from .shapes import dims_of

# ops that pass an index tensor through unchanged in value (maybe reshaped)
_INDEX_PASSTHROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand", "Slice",
                      "Concat", "Transpose", "Tile"}
# ops that keep an input's dims in place, so a width fixed after them is the input's width
_DIM_PASSTHROUGH = {"Cast", "Identity", "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Dropout"}
# ops whose output indices are computed from sizes: these must stay inside the tables they index
_COMPUTED_INDEX_OPS = {"Range", "CumSum"}

_BATCH = 2
# An image already gives the float64 run hundreds of rows (a ViT-base: 197 tokens): one is enough
# to judge the fold, and its float64 run costs half of two.
_IMAGE_BATCH = 1
_SEQ, _PAST = 5, 3  # default sequence and past lengths; past + seq fits a position table of 8
_BAKED_SIZES = [(7, 7), (1, 1), (16, 16), (8, 8), (16, 1), (7, 1)]  # (sequence, past) tried next

# Made-up inputs of one run (all inputs together) above this are refused before anything is
# allocated (a fixed shape of a billion rows, `--dim batch=100000000`): verification's activations
# grow with its inputs, so this bounds them for a given model. The user's own --inputs are not bounded.
MAX_INPUT_BYTES = 256 << 20

_NP = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.INT16: np.int16,
}


@dataclass
class InputSpec:
    name: str
    elem: int
    dims: list  # int (static), str (symbolic name or expression) or None (unnamed)


@dataclass
class GraphFacts:
    """What the graph says about its inputs' values and sizes."""

    specs: list[InputSpec]
    index_bound: dict[str, int] = field(default_factory=dict)  # input -> values must be < this
    fixed: dict[tuple[str, int], int] = field(default_factory=dict)  # (input, axis) -> size a weight fixes
    length_limit: Optional[int] = None  # past + seq must stay <= this (smallest computed-index table)
    image_sides: list[int] = field(default_factory=list)  # spatial sizes that fit a conv stem + position table


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    return [InputSpec(vi.name, vi.type.tensor_type.elem_type, list(dims_of(vi.type.tensor_type)))
            for vi in model.graph.input if vi.name not in inits and vi.type.HasField("tensor_type")]


def _attr(n: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in n.attribute if a.name == name), default)


def _small_array(t: onnx.TensorProto) -> Optional[np.ndarray]:
    if t.data_location == onnx.TensorProto.EXTERNAL or np.prod(t.dims, dtype=np.int64) > 4096:
        return None
    try:
        return numpy_helper.to_array(t)
    except Exception:
        return None


def facts(model: onnx.ModelProto) -> GraphFacts:
    g = model.graph
    specs = graph_inputs(model)
    consts = {t.name: t for t in g.initializer}
    producer: dict[str, onnx.NodeProto] = {}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for o in n.output:
            producer[o] = n
        for i in n.input:
            consumers.setdefault(i, []).append(n)
        if n.op_type == "Constant":
            consts.update((n.output[0], a.t) for a in n.attribute if a.name == "value")
    shape = lambda name: list(consts[name].dims) if name in consts else None  # noqa: E731
    f = GraphFacts(specs)

    # index bounds: follow each integer input through value-preserving ops (and Add of a
    # non-negative constant, which shifts the bound) to every constant table it indexes
    for s in specs:
        frontier, seen, best = [(s.name, 0)], set(), None
        while frontier:
            name, offset = frontier.pop()
            if (name, offset) in seen:
                continue
            seen.add((name, offset))
            for n in consumers.get(name, []):
                if n.op_type in ("Gather", "GatherElements") and len(n.input) > 1 and n.input[1] == name \
                        and shape(n.input[0]):
                    rows = shape(n.input[0])[_attr(n, "axis", 0)] - offset
                    best = rows if best is None else min(best, rows)
                elif n.op_type in _INDEX_PASSTHROUGH and n.input and n.input[0] == name:
                    frontier.extend((o, offset) for o in n.output)
                elif n.op_type == "Add" and len(n.input) == 2:
                    other = n.input[1] if n.input[0] == name else n.input[0]
                    c = _small_array(consts[other]) if other in consts else None
                    if c is not None and c.size and np.issubdtype(c.dtype, np.integer) and c.min() >= 0:
                        frontier.append((n.output[0], offset + int(c.max())))
        if best is not None:
            f.index_bound[s.name] = max(best, 1)

    # tables indexed by computed positions bound the sequence (+ past) length
    position_inputs = {s.name for s in specs if "position" in s.name.lower()}
    f.length_limit = min((shape(n.input[0])[0] for n in g.node if n.op_type == "Gather" and len(n.input) >= 2
                          and len(shape(n.input[0]) or ()) == 2
                          and _computed_index(n.input[1], producer, position_inputs)), default=None)

    # widths fixed by the first weight an input meets
    for s in specs:
        frontier, seen = [(s.name, list(range(len(s.dims))))], set()
        while frontier:
            name, axes = frontier.pop()  # axes[k]: the input axis now at position k
            if name in seen:
                continue
            seen.add(name)
            for n in consumers.get(name, []):
                if n.op_type in _DIM_PASSTHROUGH and len(n.output) >= 1:
                    if n.op_type in ("Add", "Sub", "Mul", "Div"):
                        other = [i for i in n.input if i != name]
                        if other and other[0] in consts and len(shape(other[0])) > len(axes):
                            continue
                    frontier.append((n.output[0], axes))
                elif n.op_type == "Transpose":
                    perm = _attr(n, "perm", list(range(len(axes)))[::-1])
                    frontier.append((n.output[0], [axes[p] for p in perm]))
                elif n.op_type == "Conv" and n.input[0] == name and len(n.input) > 1 and shape(n.input[1]) and len(axes) > 1:
                    f.fixed.setdefault((s.name, axes[1]), shape(n.input[1])[1] * _attr(n, "group", 1))
                    f.image_sides.extend(_conv_sides(n, shape(n.input[1]), consts))
                elif n.op_type == "MatMul" and n.input[0] == name and shape(n.input[1]) and len(shape(n.input[1])) >= 2:
                    f.fixed.setdefault((s.name, axes[-1]), shape(n.input[1])[-2])
                elif n.op_type == "Gemm" and n.input[0] == name and shape(n.input[1]):
                    f.fixed.setdefault((s.name, axes[0 if _attr(n, "transA", 0) else -1]),
                                       shape(n.input[1])[1 if _attr(n, "transB", 0) else 0])
    return f


def _computed_index(name: str, producer: dict, position_inputs: set[str], depth: int = 0) -> bool:
    """Do the values of `name` come from a Range/CumSum or a position input (through any ops)?"""
    if name in position_inputs:
        return True
    n = producer.get(name)
    if n is None or depth > 12:
        return False
    if n.op_type in _COMPUTED_INDEX_OPS:
        return True
    return any(_computed_index(i, producer, position_inputs, depth + 1) for i in n.input if i)


def _conv_sides(conv: onnx.NodeProto, w_shape: list, consts: dict) -> list[int]:
    """Image sides for a patch-embedding conv whose token count a position table fixes:
    `stride * sqrt(N) + (kernel - stride)` for each square N (or N - 1, a cls token) among the
    row counts of the graph's 2-D/3-D tables, initializers or Constant nodes (onnxsim and
    onnxslim fold the position lookup into a [1, N, D] Constant)."""
    kernel = w_shape[2] if len(w_shape) > 2 else 1
    stride = (_attr(conv, "strides", None) or [1])[0]
    squares = [n for t in consts.values() if len(t.dims) in (2, 3) and t.dims[-2] > 1
               for n in (t.dims[-2], t.dims[-2] - 1) if math.isqrt(n) ** 2 == n]
    return sorted({stride * math.isqrt(n) + (kernel - stride) for n in squares} | {2 * stride + (kernel - stride)})


_EXPR = re.compile(r"^[\w.:/\- ]+(\s*[+]\s*[\w.:/\- ]+)+$")


def _is_batch(name: str) -> bool:
    low = name.lower()
    return low in ("n", "b", "bs", "batch") or low.startswith("batch")


def _is_past(name: str) -> bool:
    return "past" in name.lower()


def candidates(model: onnx.ModelProto, dims: Optional[dict[str, int]] = None, seed: int = 0,
               known: Optional[GraphFacts] = None, empty_past: bool = False) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """(description, feeds) for a few size assignments, most likely to run first. Sizes over
    MAX_INPUT_BYTES are not made: the first assignment's is a one-line LnfoldError, a later one's
    is skipped. `empty_past`: every past length 0 (verify.py's run of an Optimum merged decoder's
    cached branch whose mask's length is named as the sequence's: it runs only without a past)."""
    f = known or facts(model)
    for k, (what, sizes, past) in enumerate(_plans(f, dict(dims or {}), empty_past)):
        total = input_bytes(f, sizes)
        if total > MAX_INPUT_BYTES:
            if k == 0:
                raise LnfoldError(_too_big(f, sizes, total))
            continue
        yield what, _values(f, sizes, past, seed)


def check_size(model: onnx.ModelProto, dims: Optional[dict[str, int]] = None) -> None:
    """The inputs verification would make up first fit MAX_INPUT_BYTES, else a one-line
    LnfoldError: before any work (the fold runs before verification makes its inputs)."""
    f = facts(model)
    _, sizes, _ = next(_plans(f, dict(dims or {})))
    total = input_bytes(f, sizes)
    if total > MAX_INPUT_BYTES:
        raise LnfoldError(_too_big(f, sizes, total))


def _plans(f: GraphFacts, dims: dict[str, int], empty_past: bool = False) -> Iterator[tuple[str, dict, int]]:
    """(description, sizes, past) of each size assignment `candidates` tries, in order."""
    seq, past = _SEQ, _PAST
    if f.length_limit is not None and past + seq > f.length_limit:
        past = max(1, f.length_limit // 3) if f.length_limit >= 2 else 0
        seq = max(1, f.length_limit - past)
    sides = f.image_sides or [None]
    plans = [(seq, past, side, _IMAGE_BATCH if side else _BATCH) for side in sides]
    # then sizes exporters often bake into a graph traced at them (a Reshape to [7, 1] in a
    # TorchScript export, `past + 16` in Optimum's), within the tables
    for s_, p_ in _BAKED_SIZES:
        if f.length_limit is None or s_ + p_ <= f.length_limit:
            plans.append((s_, p_, sides[0], plans[0][3]))
    plans.append((seq, past, sides[0], _BATCH))  # an image model that needs a batch of 2
    if empty_past:
        plans = [(s_, 0, side, batch) for s_, _, side, batch in plans]
    for seq_, past_, side, batch in dict.fromkeys(plans):  # each once, in order
        yield (f"sequence {seq_}, past {past_}" + (f", image side {side}" if side else "") + f", batch {batch}",
               _assign(f, dims, seq_, past_, side, batch), past_)


def _shapes(f: GraphFacts, sizes: dict) -> list[tuple[InputSpec, list[int], int]]:
    """(spec, shape, bytes) of each input under `sizes` (Python ints: no overflow, nothing allocated)."""
    out = []
    for s in f.specs:
        shape = [int(sizes[(s.name, k)]) for k in range(len(s.dims))]
        dt = _NP.get(s.elem)
        out.append((s, shape, math.prod(shape) * (np.dtype(dt).itemsize if dt is not None else 8)))
    return out


def input_bytes(f: GraphFacts, sizes: dict) -> int:
    return sum(n for _, _, n in _shapes(f, sizes))


def _human(n: float) -> str:
    unit = "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} {unit}" if unit == "bytes" or n == int(n) else f"{n:.1f} {unit}"


def _too_big(f: GraphFacts, sizes: dict, total: int) -> str:
    shapes = sorted(_shapes(f, sizes), key=lambda x: -x[2])
    s, shape, _ = shapes[0]
    dt = _NP.get(s.elem)
    what = f"{s.name} {shape} {np.dtype(dt).name if dt is not None else ''}".rstrip()
    more = f" and {len(shapes) - 1} more" if len(shapes) > 1 else ""
    return (f"cannot verify: made-up inputs would take {_human(total)} ({what}{more}), more than the "
            f"{_human(MAX_INPUT_BYTES)} verification makes up; give smaller sizes with --dim NAME=SIZE or real "
            "inputs with --inputs FILE.npz (API: dims=, inputs=), or skip verification with --no-verify "
            "(API: verify=False)")


def _assign(f: GraphFacts, user: dict[str, int], seq: int, past: int, side: Optional[int],
            batch: int) -> dict[tuple[str, int], int]:
    named: dict[str, int] = dict(user)
    # sizes the weights fix win over the name heuristics, and are shared by name
    for s in f.specs:
        for k, d in enumerate(s.dims):
            if isinstance(d, str) and (s.name, k) in f.fixed and d not in named:
                named[d] = f.fixed[(s.name, k)]

    def size_of(spec: InputSpec, k: int, d) -> int:
        if isinstance(d, int) and d > 0:
            return d
        if (spec.name, k) in f.fixed:
            return user[d] if isinstance(d, str) and d in user else f.fixed[(spec.name, k)]
        if isinstance(d, str):
            if d in named:
                return named[d]
            if _EXPR.match(d):  # Optimum: "past_sequence_length + sequence_length"
                return sum(int(part) if part.isdigit() else named.setdefault(part, past if _is_past(part) else seq)
                           for part in map(str.strip, d.split("+")))
            named[d] = batch if _is_batch(d) else past if _is_past(d) else seq
            return named[d]
        return seq

    sizes = {}
    for s in f.specs:
        image = any((s.name, 1) == key for key in f.fixed) and len(s.dims) == 4
        for k, d in enumerate(s.dims):
            if image and side is not None and k >= 2 and not (isinstance(d, int) and d > 0) \
                    and not (isinstance(d, str) and d in user):
                sizes[(s.name, k)] = side
            elif k == 0 and d is None and len(s.dims) > 1:
                sizes[(s.name, k)] = batch
            else:
                sizes[(s.name, k)] = size_of(s, k, d)
    return sizes


def _values(f: GraphFacts, sizes: dict, past: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for s, shape, _ in _shapes(f, sizes):
        dt = _NP.get(s.elem)
        if dt is None:
            raise LnfoldError(f"input {s.name!r} has type {onnx.TensorProto.DataType.Name(s.elem).lower()}, "
                              "which verification cannot make up; give it with --inputs FILE.npz")
        low = s.name.lower()
        if "mask" in low:  # attention/padding masks: all positions visible
            feeds[s.name] = np.ones(shape, dtype=dt)
        elif ("position_ids" in low or "cache_position" in low) and not np.issubdtype(dt, np.floating) and shape:
            start = past if any(_is_past(str(d)) for o in f.specs for d in o.dims) else 0
            pos = np.arange(start, start + shape[-1])
            feeds[s.name] = np.broadcast_to(pos, shape).astype(dt).copy()
        elif np.issubdtype(dt, np.floating):
            feeds[s.name] = rng.standard_normal(shape).astype(dt)
        elif dt is np.bool_:  # (np.asarray: a 0-D comparison is a numpy scalar, which onnxruntime refuses)
            feeds[s.name] = np.asarray(rng.random(shape) < 0.8)
        else:
            feeds[s.name] = rng.integers(0, f.index_bound.get(s.name, 2), size=shape).astype(dt)
    return feeds


def load_npz(path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """User inputs from an .npz file, checked against the model's input names."""
    return check_feeds(read_npz(path), model, str(path))


def read_npz(path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, unchecked (one-line LnfoldError where it cannot be read)."""
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise LnfoldError(f"{p}: no such inputs file") from None
    except Exception as e:
        raise LnfoldError(f"{p}: not a readable .npz file of arrays ({type(e).__name__})") from None


def check_feeds(feeds: dict, model: onnx.ModelProto, where: str = "inputs") -> dict[str, np.ndarray]:
    want = {s.name: s for s in graph_inputs(model)}
    unknown = sorted(set(feeds) - set(want))
    missing = sorted(set(want) - set(feeds))
    if unknown:
        raise LnfoldError(f"{where}: {', '.join(unknown)} {'is not an input' if len(unknown) == 1 else 'are not inputs'} "
                          f"of the model (its inputs: {', '.join(want) or 'none'})")
    if missing:
        raise LnfoldError(f"{where}: missing {', '.join(missing)} (the model's inputs: {', '.join(want)})")
    out = {}
    for name, arr in feeds.items():
        arr = np.asarray(arr)
        dt = _NP.get(want[name].elem)
        if dt is not None and arr.dtype != dt:
            raise LnfoldError(f"{where}: {name} is {arr.dtype}, the model takes {np.dtype(dt)}")
        dims = want[name].dims
        if len(dims) != arr.ndim or any(isinstance(d, int) and d > 0 and d != a for d, a in zip(dims, arr.shape)):
            raise LnfoldError(f"{where}: {name} has shape {list(arr.shape)}, the model takes "
                              f"{[d if d else '?' for d in dims]}")
        out[name] = arr
    return out


def model_batch(model: onnx.ModelProto) -> Optional[int]:
    """The batch size fixed by the model's export (every input's first dim, the same number), or None."""
    firsts = {s.dims[0] if s.dims else None for s in graph_inputs(model)}
    (b,) = firsts if len(firsts) == 1 else (None,)
    return b if isinstance(b, int) and b > 0 else None


def unbatched_inputs(model: onnx.ModelProto, feeds: dict) -> set[str]:
    """The inputs of `feeds` that carry no rows: the model fixes the input's whole shape (Optimum's
    merged decoder's `use_cache_branch`, a bool of shape [1]) while another input's first dim is
    free (the batch), and the array is that shape. They are fed whole with every run of the rows."""
    specs = graph_inputs(model)
    if not any(s.dims and not isinstance(s.dims[0], int) for s in specs):
        return set()
    return {s.name for s in specs if s.name in feeds and s.dims and all(isinstance(d, int) and d > 0 for d in s.dims)
            and list(np.shape(feeds[s.name])) == s.dims}


def _rows_of(feeds: dict, model: onnx.ModelProto, batch: Optional[int], what: str) -> Rows:
    """Rows.of over the batched inputs, the `unbatched_inputs` fed whole with every run; checked
    against the model's inputs (names, types and shapes) on one run."""
    whole = unbatched_inputs(model, feeds)
    rows = Rows.of({k: v for k, v in feeds.items() if k not in whole}, batch, what)
    rows = replace(rows, unbatched={k: feeds[k] for k in whole}) if whole else rows
    check_feeds(rows.runs()[0], model, what)
    return rows


def load_rows(src, model: onnx.ModelProto, what: str) -> Rows:
    """The user's rows (an .npz path, a folder of .npz files, or a dict of arrays) for `model`,
    checked against its inputs; a fixed batch b is fed b rows per run (passes/calibration.Rows).
    A folder's files need not share a shape (sequences of different lengths, which padding would
    change): each is fed on its own, in name order."""
    batch = model_batch(model)
    if isinstance(src, (str, os.PathLike)) and Path(src).is_dir():
        names = [n for n in folder_files(src) if n.endswith(".npz")]  # (links out of the folder refused)
        if not names:
            raise LnfoldError(f"{src}: a folder with no .npz file in it (give one .npz per row or per group of rows)")
        return Rows.of_pieces([_rows_of(read_npz(Path(src) / name), model, batch, f"{src}/{name}") for name in names])
    if isinstance(src, (str, os.PathLike)):
        return _rows_of(read_npz(src), model, batch, str(src))
    return _rows_of({k: np.asarray(v) for k, v in dict(src).items()}, model, batch, what)


def parse_dims(items) -> dict[str, int]:
    """`NAME=SIZE` strings (the CLI's --dim) into a dict; a bad one is a one-line error."""
    out = {}
    for item in items or ():
        name, sep, value = str(item).rpartition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise LnfoldError(f"--dim {item!r}: expected NAME=SIZE with a positive integer SIZE")
        out[name.strip()] = int(value)
    return out


def check_dims(dims: dict[str, int], model: onnx.ModelProto) -> dict[str, int]:
    """Every name in `dims` must be a symbolic dim of some input."""
    names = {d for s in graph_inputs(model) for d in s.dims if isinstance(d, str)}
    parts = names | {p.strip() for d in names if _EXPR.match(d) for p in d.split("+")}
    for name, size in dims.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise LnfoldError(f"dim {name}={size!r}: the size must be a positive integer")
        if name not in parts:
            raise LnfoldError(f"dim {name!r} is not a symbolic dim of the model's inputs "
                              f"(they have: {', '.join(sorted(parts)) or 'none'})")
    return dict(dims)
