"""Where a feature axis lands after a reshape, for both frontends.

Shapes are tuples of ints, strings (symbolic sizes) or None (unknown); a shape of None: rank unknown too.
"""
from __future__ import annotations

from math import prod
from typing import Optional

Shape = Optional[tuple]


def _static(dims) -> bool:
    return all(isinstance(d, int) for d in dims)


def _axes_before(dst: tuple, tail_size: int):
    """The axes j of `dst`, last first, whose later dims are static and hold `tail_size` elements."""
    for j in range(len(dst) - 1, -1, -1):
        later = dst[j + 1:]
        if not _static(later) or prod(later) > tail_size:
            return
        if prod(later) == tail_size:
            yield j


def reshape_axis(src: Shape, dst: Shape, axis: int) -> Optional[int]:
    """The axis of `dst` that holds `src`'s axis whole after a reshape, or None: one that keeps
    its size and the product of the dims after it (GPT-2's [B,T,D] -> [B*T,D])."""
    if src is None or dst is None or not 0 <= axis < len(src):
        return None
    size = src[axis]
    tail = src[axis + 1:]
    if not isinstance(size, int):
        return None
    # the same dims up to and including the axis, symbols too (ViT's [B,D,h,w] -> [B,D,h*w], h, w dynamic)
    head = src[:axis + 1]
    if len(dst) > axis and all(d is not None for d in head) and tuple(dst[:axis + 1]) == tuple(head):
        return axis
    if not _static(tail):
        return None
    tail_prod = prod(tail)
    # row-major, the dims before it may change as they like
    for j in range(len(dst) - 1, -1, -1):
        if dst[j] == size and _static(dst[j + 1:]) and prod(dst[j + 1:]) == tail_prod:
            return j
    return None


def same_axes_rules(data: list[int], outs: list[int], excluded: Optional[set]) -> dict:
    """Ops that keep every axis in place and act only along `excluded` (slice, concat, split,
    pad): transparent for any feature axis outside it."""
    if excluded is None or not data:
        return {}

    def transfer(i, b):
        return [(o, b) for o in outs] if i in data and b not in excluded else None

    def backward(o, a):
        return [(i, a) for i in data] if o in outs and a not in excluded else None

    return dict(transfer=transfer, backward=backward)


def reshape_block_axis(src: Shape, dst: Shape, axis: int, block: Optional[int]) -> Optional[tuple[int, int]]:
    """(axis of `dst`, block) that holds `src`'s runs of `block` entries along `axis` (None: the
    whole axis) after a reshape that splits or merges that axis, or None. Row-major, with static
    dims after the axis of product t, a run is the entries p*block*t + e*t + r for e < block: the
    runs of `block` along the axis j of `dst` whose later dims also multiply to t, where block
    divides dst[j] ((H*hd) -> (H, hd): the whole hd axis; (H, hd) -> (H*hd): blocks of hd)."""
    if src is None or dst is None or not 0 <= axis < len(src):
        return None
    size, tail = src[axis], src[axis + 1:]
    block = size if block is None else block
    if not isinstance(size, int) or not _static(tail) or block < 2 or size % block:
        return None
    return next(((j, block) for j in _axes_before(dst, prod(tail)) if isinstance(dst[j], int) and dst[j] % block == 0),
                None)


def split_periodic_runs(src: Shape, dst: Shape, axis: int, size: int, lo: int, stride: int) -> Optional[tuple[int, int, int]]:
    """(feature axis j of `dst`, row axis j - 1, row index) after a reshape that splits `src`'s
    `axis` so that its runs of `size` entries every `stride` from `lo` fill axis j whole, at one
    index of axis j - 1, or None (Persimmon: (B, T, H·3·hd) -> (B, T, H, 3, hd), q at index 0).
    Row-major, with static dims after `axis` of product t, entry e sits at (e // size) %
    (stride // size) along j - 1 and e % size along j when dst[j] = size, dst[j - 1] = stride //
    size and the dims after j multiply to t (the axis' size a multiple of `stride`, so that the
    entries before it do not shift that phase)."""
    if src is None or dst is None or not 0 <= axis < len(src) or stride % size or lo % size or lo + size > stride:
        return None
    n, tail = src[axis], src[axis + 1:]
    if not isinstance(n, int) or not _static(tail) or n % stride:
        return None
    j = next(_axes_before(dst, prod(tail)), 0)
    return (j, j - 1, lo // size) if j > 0 and dst[j] == size and dst[j - 1] == stride // size else None


def merge_row_runs(src: Shape, dst: Shape, axis: int, row: int, index: int) -> Optional[tuple[int, int, int]]:
    """(axis j of `dst`, lo, stride): where `src`'s `axis`, at `index` of the axis `row` just
    before it, lands after a reshape that merges the two (the inverse of `split_periodic_runs`)."""
    if src is None or dst is None or row != axis - 1 or not 0 < axis < len(src):
        return None
    size, k, tail = src[axis], src[row], src[axis + 1:]
    if not isinstance(size, int) or not isinstance(k, int) or not _static(tail):
        return None
    j = next(_axes_before(dst, prod(tail)), None)
    ok = j is not None and isinstance(dst[j], int) and dst[j] > 0 and dst[j] % (k * size) == 0
    return (j, index * size, k * size) if ok else None


# --- a feature axis merged with the axes before it, and split back out (MobileViT's unfolding) ----

def _depths(s: str):
    """(index, character, parenthesis depth after it) along `s`."""
    depth = 0
    for k, ch in enumerate(s):
        depth += (ch == "(") - (ch == ")")
        yield k, ch, depth


def _strip(s: str) -> str:
    """`s` without parentheses that enclose all of it."""
    s = s.strip()
    while s.startswith("(") and s.endswith(")"):
        if any(depth == 0 and k < len(s) - 1 for k, _, depth in _depths(s)):
            return s
        s = s[1:-1].strip()
    return s


def _product(dims) -> Optional[tuple[int, tuple]]:
    """A product of sizes as (integer coefficient, sorted symbolic factors), or None where one is
    unknown. Symbolic sizes are split at their top-level `*` ("128*batch": 128 and `batch`)."""
    coef, atoms = 1, []
    for d in dims:
        if isinstance(d, bool) or d is None:
            return None
        if isinstance(d, int):
            coef *= d
            continue
        text = _strip(str(d))
        cuts = [-1] + [k for k, ch, depth in _depths(text) if ch == "*" and depth == 0] + [len(text)]
        for a, b in zip(cuts, cuts[1:]):
            p = _strip(text[a + 1:b])
            if p.isdigit():
                coef *= int(p)
            elif p:
                atoms.append(p)
    return coef, tuple(sorted(atoms))


def _quotient(num, den) -> Optional[tuple[int, tuple]]:
    """num / den where it is a product again (den's factors among num's, coefficients dividing)."""
    if num is None or den is None or den[0] == 0 or num[0] % den[0]:
        return None
    atoms = list(num[1])
    for a in den[1]:
        if a not in atoms:
            return None
        atoms.remove(a)
    return num[0] // den[0], tuple(atoms)


def regroup_factor(src: Shape, dst: Shape, axis: int, size: int, spacing) -> Optional[tuple[int, Optional[tuple]]]:
    """(axis k of `dst`, spacing) that holds `src`'s feature entries after a reshape, where along
    `src`'s `axis` the feature index is (e // spacing) % size (spacing 1, size src[axis]: the axis
    itself); spacing None in the answer: dst[k] is the feature axis, whole again. A spacing is a
    `_product` (an int for a plain one: with dynamic image sizes MobileViT's nph is `s53//2`).

    Row-major order keeps the number of entries before a feature group, O = the product of the
    dims before `axis` times src[axis] / (size·spacing): the features are at dst axis k where the
    dims before k multiply to O and dst[k] = size, or inside it where those multiply to a divisor
    of O and dst[k] = (O / them)·size·s' for a whole s' (MobileViT: (B, C, H, W) -> (B·C·nph, ph,
    npw, pw) has O = B and s' = nph); equal element counts put each group at the same flat stride."""
    spacing = (spacing, ()) if isinstance(spacing, int) else spacing
    if src is None or dst is None or not 0 <= axis < len(src) or size < 2 or spacing[0] < 1:
        return None
    outer = _quotient(_product(list(src[:axis]) + [src[axis]]), (size * spacing[0], spacing[1]))
    if outer is None:
        return None
    for k in range(len(dst)):
        before = _product(dst[:k])
        rest = _quotient(outer, before)
        if before is None or rest is None:
            return None
        d = _product([dst[k]])
        if d is None:
            return None
        if rest == (1, ()) and d == (size, ()):
            return k, None
        s = _quotient(d, (rest[0] * size, rest[1]))
        if s is not None and s[0] >= 1:
            return k, s
        if _quotient(rest, d) is None:  # dst[k] holds more than the entries before the features
            return None
    return None
