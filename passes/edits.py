"""Constant edits: what a plan does to a constant, and the one walk that executes them.

An edit is a list of ops applied left to right to the original array. `apply_ops` is the one
interpreter of them, over an `Algebra` per backend: numpy in float64 here (`NUMPY`, cast back
once by `compute_constants`); torch tensors in forward and FX graph nodes in fx_rewrite/edits.py
(training, where the edit is computed from the parameter itself). Nothing else walks the ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np

from . import orthogonal, weights
from .view import ConstRef


@dataclass(frozen=True)
class Center:
    axis: Optional[int]  # None: uniform along the features, centers to zero
    # center each run of `block` entries on its own (per-head q/k norms), only in entries
    # [lo, hi) of the axis (hi None: to the end)
    block: Optional[int] = None
    lo: int = 0
    hi: Optional[int] = None


@dataclass(frozen=True)
class Scale:
    """Multiply along `axis` by the vector that constant `by` holds along its axis `by_axis`."""

    by: str
    by_axis: int
    axis: int


@dataclass(frozen=True)
class Ones:
    """The LayerScale vector once folded into its sources: becomes all ones."""


@dataclass(frozen=True)
class Drop:
    """Keep the first n-1 entries along `axis` (CRMSNorm: a source's redundant last row)."""

    axis: int


@dataclass(frozen=True)
class FoldDecompression:
    """`a[:n-1] - a[n-1:]` along `axis`: a reader's weight absorbs `concat(z, -Σz)` (CRMSNorm)."""

    axis: int


@dataclass(frozen=True)
class AddWeightTimes:
    """`a + W v` where constant `weight` holds its input features on `axis` (β into a bias)."""

    weight: str
    axis: int
    vector: str


@dataclass(frozen=True)
class Rotate:
    """`a ×_axis Q`: entry j along `axis` becomes Σᵢ aᵢ Q[i, j], Q = orthogonal.matrix(kind, dim, seed)
    (passes/rotate.py). The same op rotates a writer's output side (its rows then write x·Q) and a
    reader's input side (W·Q reads x·Q as W read x)."""

    axis: int
    kind: str
    dim: int
    seed: int = 0


Op = Union[Center, Scale, Ones, Drop, FoldDecompression, AddWeightTimes, Rotate]


def op_sources(op) -> list[str]:
    """The constants besides the edited one that an op reads."""
    if isinstance(op, Scale):
        return [op.by]
    if isinstance(op, AddWeightTimes):
        return [op.weight, op.vector]
    return []


@dataclass(frozen=True)
class ConstEdit:
    value: str
    ops: tuple  # of Op, applied left to right to the original array
    users: tuple[tuple[str, int], ...]  # (node, input index) that must read the edited tensor
    clone: bool  # other readers exist: write a new constant and rewire `users` to it
    new_name: str = ""  # the name of the clone (or of the edited constant when not cloned)

    def sources(self) -> list[str]:
        return [self.value] + [n for op in self.ops for n in op_sources(op)]


@dataclass(frozen=True)
class Recenter:
    value: str
    axis: int


@dataclass(frozen=True)
class NewBias:
    """A linear reader with no bias absorbs a CRMS norm's β: add `W β` after `node`."""

    node: str
    op: AddWeightTimes
    dtype_of: str  # the constant whose dtype the new bias takes
    weight: Optional[ConstRef] = None  # the reader's weight (its source edits, if any, go to `then`)
    then: tuple = ()  # the reader is also a source of a stream: its centering (and drop), on W β


@dataclass(frozen=True)
class Algebra:
    """The array operations an edit is made of, over some array type (numpy, graph nodes)."""

    center: Callable  # (a, axis) -> a minus its mean along axis (axis None: zeros)
    center_blocks: Callable  # (a, axis, block, lo, hi)
    scale: Callable  # (a, by, by_axis, axis): a times the profile of `by` along by_axis
    ones: Callable  # (a,)
    drop: Callable  # (a, axis)
    fold_decompression: Callable  # (a, axis)
    add_weight_times: Callable  # (a, weight, axis, vector)
    # (a, q, axis) with q the float64 numpy matrix; None: this algebra cannot rotate (training)
    rotate: Optional[Callable] = None


def apply_ops(a: Any, ops: Iterable, source: Callable[[str], Any], alg: Algebra) -> Any:
    """`a` after `ops`; `source(name)` gives the other constants the ops read."""
    for op in ops:
        if isinstance(op, Center):
            a = alg.center(a, op.axis) if op.block is None else alg.center_blocks(a, op.axis, op.block, op.lo, op.hi)
        elif isinstance(op, Scale):
            a = alg.scale(a, source(op.by), op.by_axis, op.axis)
        elif isinstance(op, Ones):
            a = alg.ones(a)
        elif isinstance(op, Drop):
            a = alg.drop(a, op.axis)
        elif isinstance(op, FoldDecompression):
            a = alg.fold_decompression(a, op.axis)
        elif isinstance(op, AddWeightTimes):
            a = alg.add_weight_times(a, source(op.weight), op.axis, source(op.vector))
        elif isinstance(op, Rotate):
            if alg.rotate is None:
                raise TypeError("this algebra cannot rotate (the plan rotates no trained constant)")
            a = alg.rotate(a, orthogonal.matrix(op.kind, op.dim, op.seed), op.axis)
        else:  # pragma: no cover - Op is closed
            raise TypeError(op)
    return a


# (looked up at each call, so a test can plant a bug in passes/weights and see it caught)
NUMPY = Algebra(
    center=lambda a, axis: weights.center(a, axis),
    center_blocks=lambda a, axis, block, lo, hi: weights.center(a, axis, block, lo, hi),
    scale=lambda a, by, by_axis, axis: weights.scale(a, weights.vector_along(by, by_axis), axis),
    ones=np.ones_like,
    drop=lambda a, axis: weights.drop_last(a, axis),
    fold_decompression=lambda a, axis: weights.fold_decompression(a, axis),
    add_weight_times=lambda a, w, axis, v: weights.add_weight_times(a, w, axis, v),
    rotate=lambda a, q, axis: weights.rotate(a, q, axis),
)


def compute_constants(
    edits: list[ConstEdit], get_array: Callable[[str], np.ndarray]
) -> list[tuple[ConstEdit, np.ndarray]]:
    """The new value of every edited constant, computed from the originals in float64 and cast
    back once (a LayerScale fold and its centering round together, not one after the other)."""
    last_use: dict[str, int] = {}  # originals are dropped after their last reader: big models
    for k, edit in enumerate(edits):
        for name in edit.sources():
            last_use[name] = k
    cache: dict[str, np.ndarray] = {}

    def original(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = np.asarray(get_array(name))
        return cache[name]

    out = []
    for k, edit in enumerate(edits):
        src = original(edit.value)
        a = apply_ops(src.astype(np.float64), edit.ops, original, NUMPY)
        out.append((edit, a.astype(src.dtype)))
        for name in [n for n, last in last_use.items() if last == k]:
            cache.pop(name, None)
    return out


def compute_new_bias(nb: NewBias, get_array: Callable[[str], np.ndarray]) -> np.ndarray:
    """`W β` for a CRMS reader that has no bias to absorb β into (the weight's dtype), with the
    reader's own source edits when it writes a stream."""
    w = np.asarray(get_array(nb.op.weight))
    a = weights.weight_times(w, np.asarray(get_array(nb.op.vector)), nb.op.axis)
    return apply_ops(a, nb.then, lambda n: np.asarray(get_array(n)), NUMPY).astype(w.dtype)
