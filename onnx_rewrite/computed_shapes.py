"""Shape vectors computed at run time, read as far as they can be read.

Exporters compute a Reshape's or Expand's target (and Resize's sizes) from other tensors' shapes
when a size is dynamic: TorchScript's `x.flatten(2)` is `Reshape(x, Concat(Slice(Shape(x), 0, 2),
[-1]))`. `shape_entries` reads such a vector entry by entry: a known int, `SizeOf(t, a)` (entry a of
`Shape(t)`; whether it follows a narrowed stream is passes/compress.py's call), or None.
`computed_axis_map` places a Reshape's axes where shape inference leaves the target symbolic: a
prefix (or suffix) of the target that provably repeats the input's first (last) dims keeps its place.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes.view import SizeOf
from .norms import const_values

Entry = Union[int, SizeOf, None]
ShapeOf = Callable[[object], Optional[tuple]]  # a tensor -> its shape (ints, names, None), or None
_MAX_DEPTH = 24
_MAX_ENTRIES = 64  # a longer vector is no shape
_VECTOR_OPS = ("Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape")  # a vector's entries, kept


def _known(e: Entry) -> Optional[int]:
    return e.known if isinstance(e, SizeOf) else e


def _constant(v) -> list[Entry]:
    v = np.asarray(v).reshape(-1)
    if v.dtype.kind in "iub":
        return [int(a) for a in v]
    return [int(a) if v.dtype.kind == "f" and float(a).is_integer() else None for a in v]


def shape_entries(t, shape_of: ShapeOf, depth: int = 0) -> Optional[list[Entry]]:
    """The entries of the 0-D or 1-D integer tensor `t` (a 0-D one as one entry), as far as they
    are known (where only their number is, that many unknowns); None where not even that is."""
    if t is None or not t.name:
        return None
    got = _read(t, shape_of, depth) if depth <= _MAX_DEPTH else None
    if got is None:
        s = shape_of(t)
        if s is not None and len(s) <= 1 and all(isinstance(n, int) for n in s):
            return [None] * (s[0] if s else 1)
    return got


def _read(t, shape_of: ShapeOf, depth: int) -> Optional[list[Entry]]:
    s = shape_of(t)
    if s is not None and (len(s) > 1 or (len(s) == 1 and isinstance(s[0], int) and s[0] > _MAX_ENTRIES)):
        return None  # no shape vector (and no weight read)
    v = const_values(t)
    if v is not None:
        return _constant(v) if np.size(v) <= _MAX_ENTRIES else None
    if len(t.inputs) != 1:
        return None  # a graph input
    p = t.inputs[0]
    if p.op == "Shape":
        src = shape_of(p.inputs[0])
        if src is None:
            return None
        start, end = int(p.attrs.get("start", 0)), p.attrs.get("end")
        dims = list(range(len(src)))[start: None if end is None else int(end)]
        return [SizeOf(p.inputs[0].name, k, src[k] if isinstance(src[k], int) else None) for k in dims]
    ins = [shape_entries(i, shape_of, depth + 1) for i in p.inputs]
    if not ins or ins[0] is None:
        return None
    if p.op in _VECTOR_OPS:
        if p.op == "Cast" and p.attrs.get("to") == onnx.TensorProto.BOOL:
            return [int(bool(e)) if _plain(e) else None for e in ins[0]]
        return ins[0]
    if p.op == "Concat":
        return None if any(got is None for got in ins) else [e for got in ins for e in got]
    if p.op == "Gather":
        idx = const_values(p.inputs[1])
        if idx is None or int(p.attrs.get("axis", 0)) != 0:
            return None
        idx = [int(i) for i in np.asarray(idx).reshape(-1)]
        n = len(ins[0])
        return None if any(not -n <= i < n for i in idx) else [ins[0][i] for i in idx]
    if p.op == "Slice":
        return _slice(p, ins[0])
    if p.op == "ConstantOfShape":
        return _constant_of_shape(p, ins[0])
    if len(ins) == 2 and ins[1] is not None and p.op in ("Add", "Sub", "Mul", "Div", "Equal"):
        return _broadcast(lambda a, b: _arithmetic(p.op, a, b), ins[0], ins[1])
    if p.op == "Where" and len(ins) == 3 and None not in ins:
        return _where(*ins)
    return None


def _slice(p: gs.Node, data: list[Entry]) -> Optional[list[Entry]]:
    starts, ends, axes, steps = (const_values(i) for i in (list(p.inputs) + [None] * 4)[1:5])
    if starts is None or ends is None:
        return None
    if axes is not None and [int(a) for a in np.asarray(axes).reshape(-1)] not in ([0], [-1]):
        return None
    step = 1 if steps is None else int(np.asarray(steps).reshape(-1)[0])
    start, end = int(np.asarray(starts).reshape(-1)[0]), int(np.asarray(ends).reshape(-1)[0])
    return data[slice(start, end, step)]


def _constant_of_shape(p: gs.Node, shape: list[Entry]) -> Optional[list[Entry]]:
    """A vector of n copies of the node's value, n known."""
    n = _known(shape[0]) if len(shape) == 1 else None
    if n is None:
        return None
    value = p.attrs.get("value")
    fill = _constant(value.values)[0] if isinstance(value, gs.Constant) else 0
    return [fill] * n


def _broadcast(f, a: list[Entry], b: list[Entry]) -> Optional[list[Entry]]:
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    return [f(a[k % len(a)], b[k % len(b)]) for k in range(max(len(a), len(b)))]


def _plain(e: Entry) -> bool:
    """A number that no tensor's size decides (a `SizeOf`'s static value is no such number: the
    size may change when a stream narrows, and what is computed from it with it)."""
    return isinstance(e, int)


def _arithmetic(op: str, a: Entry, b: Entry) -> Entry:
    if op == "Equal":
        return _equal(a, b)
    if not (_plain(a) and _plain(b)):
        return None
    if op == "Div":  # exact quotients only: integer Div truncates, a float one need not be whole
        return a // b if b and a % b == 0 else None
    return a + b if op == "Add" else a - b if op == "Sub" else a * b


def _equal(a: Entry, b: Entry) -> Entry:
    """1, 0, or None, decided only where no size's value decides it: a size is never negative
    (torch's Where(Equal(s, -1), 1, s) keeps every size of s)."""
    if a is not None and a == b:
        return 1
    if _plain(a) and _plain(b):
        return int(a == b)
    if (isinstance(a, SizeOf) and _plain(b) and b < 0) or (isinstance(b, SizeOf) and _plain(a) and a < 0):
        return 0
    return None


def _where(cond: list[Entry], x: list[Entry], y: list[Entry]) -> Optional[list[Entry]]:
    picked = _broadcast(lambda c, a: (c, a), cond, x)
    if picked is None:
        return None
    return _broadcast(lambda ca, b: (ca[1] if ca[0] else b) if ca[0] is not None else (b if ca[1] == b else None),
                      picked, y)


# where a shape entry lands as an op's output size (the op's rule judges it: passes/compress.py)
_SIZE_SLOTS = {"Reshape": 1, "Expand": 1, "Resize": 3}
# ops whose output holds some of their first input's entries, unchanged (Where: of inputs 1 and 2)
_CARRIERS = ("Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Identity", "Reshape", "Where")


def read_axes(shape: gs.Node, shape_of: ShapeOf, outputs: frozenset) -> tuple[Optional[set[int]], set[int]]:
    """(the axes of `Shape(x)`'s input whose sizes the graph uses other than as an op's output size
    or in a sign test (torch's Equal(s, -1)), None where not known; the axes whose sizes it uses as
    an op's output size, which the analysis judges as `SizeOf`s), followed forward through the ops
    that carry entries unchanged. `outputs`: the graph's output names."""
    x = shape.inputs[0].name
    held = shape_entries(shape.outputs[0], shape_of)
    if held is None:
        return None, set()
    read: set[int] = set()
    sizes: set[int] = set()
    stack, seen = [(shape.outputs[0], held)], set()
    while stack:
        t, held = stack.pop()
        carried = {e.axis for e in held if isinstance(e, SizeOf) and e.value == x}
        if not carried or id(t) in seen:
            continue
        seen.add(id(t))
        if t.name in outputs:
            read |= carried
        for c in t.outputs:
            slots = [i for i, i_t in enumerate(c.inputs) if i_t is t]
            if c.op in _SIZE_SLOTS and slots == [_SIZE_SLOTS[c.op]]:
                sizes |= carried
                continue
            out = shape_entries(c.outputs[0], shape_of) if c.op in _CARRIERS + ("Equal",) else None
            if c.op == "Equal" and out is not None and all(_plain(e) for e in out):
                continue  # the test's outcome does not depend on the size
            lost = out is None or all(e is None for e in out) or (c.op == "Where" and None in out)
            carries = c.op in _CARRIERS and (c.op != "Where" or 0 not in slots) and not (
                c.op == "Cast" and c.attrs.get("to") == onnx.TensorProto.BOOL)
            if carries and not lost:
                stack.append((c.outputs[0], out))
                continue
            read |= carried  # used, or carried where its entries can no longer be told apart
    return read, sizes


def _is_dim(e: Entry, x: str, k: int, pos: int, src_shape, allowzero: bool) -> bool:
    """Is target entry `e` (at position `pos`) provably input `x`'s dim k?"""
    if isinstance(e, SizeOf) and (e.value, e.axis) == (x, k):
        return True
    if e == 0 and not allowzero and pos == k:
        return True
    n = _known(e)
    return n is not None and isinstance(src_shape[k], int) and n == src_shape[k] and n > 0


def computed_axis_map(node, src_shape, shape_of: ShapeOf) -> dict[int, int]:
    """input axis -> output axis for every axis the prefix or suffix rule places."""
    if len(node.inputs) < 2 or src_shape is None:
        return {}
    elems = shape_entries(node.inputs[1], shape_of)
    if elems is None:
        return {}
    x = node.inputs[0].name
    allowzero = bool(int(node.attrs.get("allowzero", 0)))
    r, q = len(src_shape), len(elems)
    out: dict[int, int] = {}
    k = 0
    while k < min(r, q) and _is_dim(elems[k], x, k, k, src_shape, allowzero):
        out[k] = k
        k += 1
    s = 1
    while s <= min(r, q) and _is_dim(elems[q - s], x, r - s, q - s, src_shape, allowzero):
        out.setdefault(r - s, q - s)
        s += 1
    return out
