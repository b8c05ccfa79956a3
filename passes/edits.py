"""Constant edits: what a plan does to a constant (a list of ops, applied left to right to the
original array), and `apply_ops`, their one interpreter, over an `Algebra` per backend (DESIGN §2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import numpy as np

from . import orthogonal, weights
from .frozen import FrozenList
from .view import ConstRef, View


class Op:
    """An edit op: data, and the answers every walker of the ops needs (DESIGN §2: `apply`,
    `constants`, `renamed`, `without_axis`, `mixes`), so that nothing else walks them."""

    def apply(self, a: Any, source: Callable[[str], Any], alg: "Algebra") -> Any:  # pragma: no cover
        raise NotImplementedError

    def constants(self) -> tuple[str, ...]:
        return ()

    def renamed(self, names: Mapping[str, str]) -> "Op":
        return self

    def without_axis(self, gone: int) -> "Op":
        """This op on the tensor with axis `gone` removed (its own axis shifted down past it)."""
        if getattr(self, "axis", None) is None:
            return self
        return replace(self, axis=self.axis if self.axis < gone else self.axis - 1)

    def mixes(self, ndim: int) -> Optional[frozenset]:
        return None


@dataclass(frozen=True)
class Center(Op):
    axis: Optional[int]  # None: uniform along the features, centers to zero
    # center each run of `block` entries on its own (per-head q/k norms), only in entries
    # [lo, hi) of the axis (hi None: to the end)
    block: Optional[int] = None
    lo: int = 0
    hi: Optional[int] = None
    stride: Optional[int] = None  # runs every `stride` entries from lo (None: back to back)

    def apply(self, a, source, alg):
        if self.block is None:
            return alg.center(a, self.axis)
        return alg.center_blocks(a, self.axis, self.block, self.lo, self.hi, self.stride)

    def mixes(self, ndim):
        return frozenset() if self.axis is None else frozenset([self.axis % ndim])


@dataclass(frozen=True)
class Scale(Op):
    """Multiply along `axis` by the vector that constant `by` holds along its axis `by_axis`."""

    by: str
    by_axis: int
    axis: int

    def apply(self, a, source, alg):
        return alg.scale(a, source(self.by), self.by_axis, self.axis)

    def constants(self):
        return (self.by,)

    def renamed(self, names):
        return replace(self, by=names.get(self.by, self.by))

    def mixes(self, ndim):
        return frozenset([self.axis % ndim])


@dataclass(frozen=True)
class Ones(Op):
    """The LayerScale vector once folded into its sources: becomes all ones."""

    def apply(self, a, source, alg):
        return alg.ones(a)

    def mixes(self, ndim):
        return frozenset()


@dataclass(frozen=True)
class Seeded:
    """A basis drawn from a seed: `orthogonal.matrix(kind, dim, seed)` (a stream rotation)."""

    kind: str
    dim: int
    seed: int = 0
    spared: tuple = ()  # channels left as they are (orthogonal.matrix)

    def matrix(self) -> Optional[np.ndarray]:
        return orthogonal.matrix(self.kind, self.dim, self.seed, self.spared)


@dataclass(frozen=True)
class KroneckerHadamard:
    """H = A ⊗ B = hadamard(dim)/√dim, no random signs (orthogonal.hadamard_kronecker): a basis that
    can be applied to a tensor as two small products (`factors`), the online Hadamard's."""

    dim: int
    kind: str = "hadamard"

    def factors(self) -> tuple[np.ndarray, np.ndarray]:
        return orthogonal.hadamard_kronecker(self.dim)

    def matrix(self) -> np.ndarray:
        return np.kron(*self.factors())


@dataclass(frozen=True)
class Identity:
    """The stream's own basis: projecting onto it keeps the first entries (CRMSNorm's d−1)."""

    dim: int

    def matrix(self) -> Optional[np.ndarray]:
        return None


@dataclass(frozen=True)
class DataBasis:
    """A basis computed from data (a calibrated matrix), owned by the plan; equal by `key`."""

    key: str
    array: np.ndarray = field(compare=False, repr=False, hash=False)

    @property
    def dim(self) -> int:
        return int(self.array.shape[0])

    def matrix(self) -> Optional[np.ndarray]:
        return self.array


Basis = Union[Seeded, KroneckerHadamard, Identity, DataBasis]


def dense(basis: Basis) -> np.ndarray:
    """The basis as a float64 square matrix (the identity's too)."""
    q = basis.matrix()
    return np.eye(basis.dim) if q is None else q


@dataclass(frozen=True)
class Project(Op):
    """`a ×_axis B[:, :keep]`: entry j < keep along `axis` becomes Σᵢ aᵢ B[i, j] (B orthogonal; the
    identity basis keeps the first `keep` entries, without arithmetic). One op for every change of
    a stream's basis, on a writer's output side and a reader's input side alike (DESIGN §2)."""

    axis: int
    basis: Basis
    keep: int

    def apply(self, a, source, alg):
        return alg.project(a, self.basis.matrix(), self.keep, self.axis)


@dataclass(frozen=True)
class FoldDecompression(Op):
    """`a[:n-1] - a[n-1:]` along `axis`: a reader's weight absorbs `concat(z, -Σz)` (CRMSNorm)."""

    axis: int

    def apply(self, a, source, alg):
        return alg.fold_decompression(a, self.axis)


@dataclass(frozen=True)
class AddWeightTimes(Op):
    """`a + W v` where constant `weight` holds its input features on `axis` (β into a bias)."""

    weight: str
    axis: int
    vector: str

    def apply(self, a, source, alg):
        return alg.add_weight_times(a, source(self.weight), self.axis, source(self.vector))

    def constants(self):
        return (self.weight, self.vector)

    def renamed(self, names):
        return replace(self, weight=names.get(self.weight, self.weight), vector=names.get(self.vector, self.vector))

    def without_axis(self, gone):
        return self  # its axis is the weight's own, which W v does not change


def chunk_axis(ops: Iterable[Op], ndim: int) -> Optional[int]:
    """0 where `ops` treat every slice along the first axis on its own, so that a tensor can be
    edited a block of rows at a time (an embedding table centered along its features); None
    otherwise (the whole tensor at once)."""
    if ndim < 2:
        return None
    mixed = [op.mixes(ndim) for op in ops]
    return None if any(m is None or 0 in m for m in mixed) else 0


def centers_rows(ops: Iterable[Op], axis: int) -> bool:
    """`ops` are exactly one centering of every slice along `axis`, whole (no blocks): a 2-D table's
    rows when `axis` is 1, which the torch.compile backend then centers after each lookup."""
    ops = tuple(ops)
    return len(ops) == 1 and isinstance(ops[0], Center) and ops[0].axis == axis and ops[0].block is None


def only_centers(ops: Iterable[Op]) -> bool:
    """`ops` only center (no scale, projection or sum): each computes a mean and a difference in
    float64 and rounds once, so a tensor can go in as stored (no float64 copy of it)."""
    return all(isinstance(op, Center) for op in ops)


def centers_first_axis(ops: Iterable[Op], ndim: int) -> bool:
    """`ops` are one plain centering along the first axis of an `ndim`-D tensor (an output projection
    centered over its output features): its mean can be summed a block of rows at a time."""
    ops = tuple(ops)
    return (ndim >= 2 and len(ops) == 1 and isinstance(ops[0], Center) and ops[0].block is None
            and ops[0].axis is not None and ops[0].axis % ndim == 0)


@dataclass(frozen=True)
class ConstEdit:
    value: str
    ops: tuple  # of Op, applied left to right to the original array
    users: tuple[tuple[str, int], ...]  # (node, input index) that must read the edited tensor
    clone: bool  # other readers exist: write a new constant and rewire `users` to it

    def sources(self) -> list[str]:
        return [self.value] + [n for op in self.ops for n in op.constants()]

    @property
    def sets_ones(self) -> bool:
        """The edit replaces the constant by ones (a γ moved into the readers leaves a unit weight)."""
        return self.ops == (Ones(),)


def const_edits(view: View, uses: Iterable[tuple[str, tuple, tuple[str, int]]]) -> list[ConstEdit]:
    """One ConstEdit per constant and ops, from (constant, ops, (node, input) that reads the edited
    tensor) triples; cloned where other nodes read the constant too (they keep the original)."""
    wanted: dict[tuple, set] = {}
    for value, ops, user in uses:
        wanted.setdefault((value, ops), set()).add(user)
    return [ConstEdit(value, ops, FrozenList(sorted(users)), set(view.values[value].consumers) != users)
            for (value, ops), users in wanted.items()]


@dataclass(frozen=True)
class Recenter:
    """`x - mean(x)` along `axis` for a stream start no constant edit can center (an opaque op's
    output), inserted before every reader of `value`. `project`: the stream is carried in another
    basis (passes/rotate.py) and no constant writes this term, so the recentered tensor is projected
    by an emitted MatMul, `· B[:, :keep]` along `axis` (the last or the second-to-last axis)."""

    value: str
    axis: int
    project: Optional[Project] = None

    def matrix(self) -> Optional[np.ndarray]:
        """The float64 (d × keep) matrix the recentered tensor is multiplied by (None: not projected)."""
        return None if self.project is None else dense(self.project.basis)[:, :self.project.keep]


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
    center_blocks: Callable  # (a, axis, block, lo, hi, stride)
    scale: Callable  # (a, by, by_axis, axis): a times the profile of `by` along by_axis
    ones: Callable  # (a,)
    fold_decompression: Callable  # (a, axis)
    add_weight_times: Callable  # (a, weight, axis, vector)
    # (a, q, keep, axis): a ×_axis q[:, :keep], q the float64 numpy matrix or None (identity: the
    # first `keep` entries); q not None on an algebra that cannot multiply by it (training): TypeError
    project: Callable


def apply_ops(a: Any, ops: Iterable[Op], source: Callable[[str], Any], alg: Algebra) -> Any:
    """`a` after `ops`; `source(name)` gives the other constants the ops read."""
    for op in ops:
        a = op.apply(a, source, alg)
    return a


# (looked up at each call, so a test can plant a bug in passes/weights and see it caught)
NUMPY = Algebra(
    center=lambda a, axis: weights.center(a, axis),
    center_blocks=lambda a, axis, block, lo, hi, stride: weights.center(a, axis, block, lo, hi, stride),
    scale=lambda a, by, by_axis, axis: weights.scale(a, weights.vector_along(by, by_axis), axis),
    ones=np.ones_like,
    fold_decompression=lambda a, axis: weights.fold_decompression(a, axis),
    add_weight_times=lambda a, w, axis, v: weights.add_weight_times(a, w, axis, v),
    project=lambda a, q, keep, axis: weights.project(a, q, keep, axis),
)


def compute_constants(
    edits: list[ConstEdit], get_array: Callable[[str], np.ndarray]
) -> list[tuple[ConstEdit, np.ndarray]]:
    """The new value of every edited constant, computed from the originals in float64 and cast
    back once (a LayerScale fold and its centering round together, not one after the other)."""
    # originals are dropped after their last reader: big models
    last_use = {name: k for k, edit in enumerate(edits) for name in edit.sources()}
    done_after: dict[int, list[str]] = {}  # k -> the originals edit k reads last (one pass, not one per edit)
    for name, last in last_use.items():
        done_after.setdefault(last, []).append(name)
    cache: dict[str, np.ndarray] = {}

    def original(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = np.asarray(get_array(name))
        return cache[name]

    out = []
    for k, edit in enumerate(edits):
        out.append((edit, edited(original(edit.value), edit.ops, original)))
        for name in done_after.get(k, ()):
            cache.pop(name, None)
    return out


CACHE_BLOCK_BYTES = 1 << 20  # float64 working set per block of rows: stays in the CPU's cache


def edited(src: np.ndarray, ops: tuple, source: Callable[[str], Any]) -> np.ndarray:
    """`ops` on `src` in float64, cast back to its dtype. Where the ops treat each row alone
    (`chunk_axis`: an embedding table centered along its features), a block of rows at a time:
    the same values, but the float64 temporaries stay in cache instead of three passes over
    float64 copies of the whole tensor (the fold's editing stage is memory-bound)."""
    if chunk_axis(ops, src.ndim) is None or src.nbytes <= CACHE_BLOCK_BYTES:
        return apply_ops(src.astype(np.float64), ops, source, NUMPY).astype(src.dtype)
    out = None
    for lo, hi in row_blocks(src.shape, CACHE_BLOCK_BYTES):
        block = apply_ops(src[lo:hi].astype(np.float64), ops, source, NUMPY)
        if out is None:  # (a projection that keeps k features changes the other axes' sizes)
            out = np.empty((src.shape[0],) + block.shape[1:], src.dtype)
        out[lo:hi] = block
    return out


def row_blocks(shape: tuple, budget: int) -> list[tuple[int, int]]:
    """[lo, hi) blocks of the first axis whose float64 copies take about `budget` bytes."""
    step = max(1, budget // max(1, 8 * math.prod(shape[1:])))
    return [(lo, min(shape[0], lo + step)) for lo in range(0, shape[0], step)]


def compute_new_bias(nb: NewBias, get_array: Callable[[str], np.ndarray]) -> np.ndarray:
    """`W β` for a CRMS reader that has no bias to absorb β into (the weight's dtype), with the
    reader's own source edits when it writes a stream."""
    w = np.asarray(get_array(nb.op.weight))
    a = weights.weight_times(w, np.asarray(get_array(nb.op.vector)), nb.op.axis)
    return apply_ops(a, nb.then, lambda n: np.asarray(get_array(n)), NUMPY).astype(w.dtype)
