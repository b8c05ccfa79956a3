"""Reshapes whose target shape is computed at run time from the input's own shape.

TorchScript exports `x.flatten(2)` on dynamic sizes as `Reshape(x, Concat(Slice(Shape(x), 0, 2), [-1]))`
(Optimum's CLIP vision embeddings: the conv stem's [B, C, h, w] -> [B, C, h*w] with h, w symbolic).
Shape inference cannot give the target's dims numbers, so `reshape_axis` (which needs the dims
after the feature axis to be static) cannot place the feature axis. Reading the shape's
computation can, soundly:

- prefix rule: if the target's first p entries are provably the input's first p dims, every
  axis a < p stays at a (row-major: the same prefix indices leave the same element blocks);
- suffix rule: if the target's last s entries are provably the input's last s dims, every axis
  among those keeps its place counted from the end.

"Provably the input's dim k": `Shape(x)[k]` (through Slice/Gather/Concat/Unsqueeze/Squeeze/Cast of
int64 shape tensors), a 0 at the same position (Reshape's copy-the-dim, when allowzero is 0), or a
constant equal to the input's static dim k.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .norms import const_values

# One entry of a computed shape: an int (a constant), ("dim", k): the reshaped input's dim k,
# or None: unknown.
_Elem = object
_MAX_DEPTH = 16


def _elements(t, x, rank_of, depth: int = 0) -> Optional[list]:
    """The entries of the 1-D int tensor `t`, as far as they are known, relative to tensor `x`."""
    if depth > _MAX_DEPTH:
        return None
    v = const_values(t)
    if v is not None:
        return [int(a) for a in np.asarray(v).reshape(-1)]
    if len(t.inputs) != 1:
        return None
    p = t.inputs[0]
    if p.op == "Shape":
        src = p.inputs[0]
        rank = rank_of(src)
        if rank is None:
            return None
        start, end = int(p.attrs.get("start", 0)), p.attrs.get("end")
        dims = list(range(rank))[start: None if end is None else int(end)]
        return [("dim", k) if src is x else None for k in dims]
    if p.op in ("Cast", "Identity", "Unsqueeze", "Squeeze"):  # (Un)Squeeze of a shape: 0-D <-> 1-D
        return _elements(p.inputs[0], x, rank_of, depth + 1)
    if p.op == "Concat":
        out: list = []
        for i in p.inputs:
            got = _elements(i, x, rank_of, depth + 1)
            if got is None:
                return None
            out += got
        return out
    if p.op == "Gather":
        data, idx = _elements(p.inputs[0], x, rank_of, depth + 1), const_values(p.inputs[1])
        if data is None or idx is None or int(p.attrs.get("axis", 0)) != 0:
            return None
        idx = [int(i) for i in np.asarray(idx).reshape(-1)]
        if any(not -len(data) <= i < len(data) for i in idx):
            return None
        return [data[i] for i in idx]
    if p.op == "Slice":
        data = _elements(p.inputs[0], x, rank_of, depth + 1)
        ins = list(p.inputs) + [None] * 5
        vals = [const_values(i) if i is not None and i.name else None for i in ins[1:5]]
        if data is None or vals[0] is None or vals[1] is None:
            return None
        if vals[2] is not None and [int(a) for a in np.asarray(vals[2]).reshape(-1)] not in ([0], [-1]):
            return None
        step = 1 if vals[3] is None else int(np.asarray(vals[3]).reshape(-1)[0])
        start, end = int(np.asarray(vals[0]).reshape(-1)[0]), int(np.asarray(vals[1]).reshape(-1)[0])
        return data[slice(start, end, step)]
    return None


def _is_dim(e, k: int, pos: int, src_shape, allowzero: bool) -> bool:
    """Is target entry `e` (at position `pos`) provably the input's dim k?"""
    if e == ("dim", k):
        return True
    if isinstance(e, int):
        if e == 0 and not allowzero and pos == k:
            return True
        return src_shape is not None and isinstance(src_shape[k], int) and e == src_shape[k] and e > 0
    return False


def computed_axis_map(node, src_shape, rank_of) -> dict[int, int]:
    """input axis -> output axis for every axis the prefix or suffix rule places."""
    x = node.inputs[0]
    if len(node.inputs) < 2 or src_shape is None:
        return {}
    elems = _elements(node.inputs[1], x, rank_of)
    if elems is None:
        return {}
    allowzero = bool(int(node.attrs.get("allowzero", 0)))
    r, q = len(src_shape), len(elems)
    out: dict[int, int] = {}
    k = 0
    while k < min(r, q) and _is_dim(elems[k], k, k, src_shape, allowzero):
        out[k] = k
        k += 1
    s = 1
    while s <= min(r, q) and _is_dim(elems[q - s], r - s, q - s, src_shape, allowzero):
        out.setdefault(r - s, q - s)
        s += 1
    return out
