"""Weight math of the fold, in float64, cast back to each tensor's dtype (DESIGN §4).

Frontends hand over numpy arrays (bf16 as float32 or ml_dtypes) and write the results back.
"""
from __future__ import annotations

import numpy as np

from .metric import SEGMENT


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def center(a: np.ndarray, axis, block=None, lo: int = 0, hi=None, stride=None, mean=None) -> np.ndarray:
    """`a` minus its mean along `axis`: the weight-centering of Lemma 3.1.

    `axis=None` is a tensor that lacks the feature axis (a scalar, or a table broadcast along the
    features): it is uniform along them, so centering leaves nothing. `block`: each run of
    `block` entries along `axis` minus its own mean (the rows of one head for a per-head norm),
    only the runs in entries [lo, hi) (the q rows of a fused q/k/v projection); `stride`: the
    runs start every `stride` entries from `lo` (Persimmon's q rows, every third head_dim).
    `mean`: the float64 mean along `axis`, where it was computed elsewhere (a tensor centered a
    block of rows at a time: fx_rewrite/checkpoint_fold.py), for the plain case only.
    """
    if mean is not None and block is not None:
        raise ValueError("a given mean centers a whole axis, not blocks of it")
    if axis is None:
        return np.zeros_like(a)
    n = a.shape[axis]
    if block is not None and n == 1 and (lo or hi is not None or stride not in (None, block)):
        raise ValueError("cannot center part of an axis a constant is broadcast along")
    if block is not None and stride not in (None, block) and n != 1:
        if n % stride or lo + block > stride or hi is not None:
            raise ValueError(f"cannot center runs of {block} every {stride} from {lo} along an axis of {n}")
        out = a.copy()
        periods = out.reshape(a.shape[:axis] + (n // stride, stride) + a.shape[axis + 1:])  # a view of `out`
        runs = (slice(None),) * (axis + 1) + (slice(lo, lo + block),)
        periods[runs] = center(periods[runs], axis + 1)
        return out
    if block is not None and n != 1 and (block, lo, hi) != (n, 0, None):
        hi = n if hi is None else hi
        if n % block or lo % block or hi % block or not 0 <= lo < hi <= n:
            raise ValueError(f"cannot center blocks of {block} in [{lo}, {hi}) along an axis of {n}")
        out = a.copy()
        window = (slice(None),) * axis + (slice(lo, hi),)
        part = a[window]
        runs = part.reshape(part.shape[:axis] + ((hi - lo) // block, block) + part.shape[axis + 1:])
        out[window] = center(runs, axis + 1).reshape(part.shape)
        return out
    # the mean in float64 without a float64 copy of `a`; the subtraction upcasts element-wise
    if mean is None:
        mean = a.mean(axis=axis, dtype=np.float64, keepdims=True)
    return (a - mean).astype(a.dtype, copy=False)  # (a float64 `a`: the difference is the result, not copied)


def vector_along(a: np.ndarray, axis: int) -> np.ndarray:
    """The 1-D profile of a tensor that varies only along `axis` (a LayerScale vector)."""
    return np.moveaxis(_f64(a), axis, -1).reshape(-1, np.shape(a)[axis])[0]


def scale(a: np.ndarray, vec: np.ndarray, axis: int) -> np.ndarray:
    """`a` multiplied along `axis` by `vec` (broadcast when `a` has size 1 there)."""
    x = _f64(a)
    shape = [1] * x.ndim
    shape[axis] = -1
    v = _f64(vec).reshape(shape)
    if x.shape[axis] == 1 and v.shape[axis] != 1:
        raise ValueError("cannot fold a per-channel scale into a tensor constant along channels")
    return (x * v).astype(a.dtype)


def project(a, q, keep: int, axis: int, matmul=None):
    """`a ×_axis q[:, :keep]` (passes/edits.Project): along `axis`, entry j becomes Σᵢ aᵢ q[i, j]; q None:
    the identity, i.e. the first `keep` entries (CRMSNorm's drop of the last one), no arithmetic.
    numpy in float64 by default; `matmul` is the array library's own (`torch.matmul`)."""
    if q is None:
        return _first(a, axis, keep)
    if keep != q.shape[1]:
        q = q[:, :keep]
    if matmul is None:
        a, q = _f64(a), _f64(q)
        return np.moveaxis(np.moveaxis(a, axis, -1) @ q, -1, axis)
    return matmul(a.movedim(axis, -1), q).movedim(-1, axis)


def beta_into_bias(weight: np.ndarray, beta: np.ndarray, bias, in_axis: int, out_dtype) -> np.ndarray:
    """`W β + b` (β into a reader's bias) for a weight with its input features on `in_axis`."""
    out = weight_times(weight, beta, in_axis)
    if bias is not None:
        out = out + _f64(bias).reshape(out.shape)
    return out.astype(out_dtype)


# --- the CRMS weight math, over any array with numpy-style indexing and `reshape` (numpy in float64
# here; torch tensors in a graph that computes it, fx_rewrite/edits.py): written once ----------------

def _first(a, axis: int, stop: int, start: int = 0):
    """`a[start:stop]` along `axis` (a view for numpy and torch alike)."""
    return a[(slice(None),) * axis + (slice(start, stop),)]


def fold_decompression(a, axis: int):
    """`a[:n-1] - a[n-1]` along `axis`: a weight that reads z ∈ R^{n-1} as if it read
    concat(z, -Σz) (seed 001 eq. 6)."""
    n = a.shape[axis]
    return _first(a, axis, n - 1) - _first(a, axis, n, n - 1)


def weight_times(weight, vec, in_axis: int, tensordot=None):
    """`W v` for a weight holding its input features on `in_axis`: the other axes remain. numpy in
    float64 by default; `tensordot` is the array library's own (`torch.tensordot`)."""
    if tensordot is None:
        weight, vec, tensordot = _f64(weight), _f64(vec), np.tensordot
    return tensordot(vec.reshape(-1), weight, ([0], [in_axis]))


def add_weight_times(a, weight, in_axis: int, vec, tensordot=None):
    """`a + W v` (β into a bias: the reader's bias, shaped as `W v`)."""
    return a + weight_times(weight, vec, in_axis, tensordot).reshape(a.shape)


def max_rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    """max |ref - got| / max |ref|: the equivalence measure of every verification. Computed on
    pieces of at most metric.SEGMENT values (float64 temporaries of a few MiB, whatever the
    outputs' size: an LM's logits were a GiB of them); maxima are exact, so the pieces change no bit."""
    r, g = np.asarray(ref), np.asarray(got)
    if r.shape != g.shape:
        return float("inf")
    if r.size == 0:
        return 0.0
    denom = d = 0.0
    for r, g in flat_pieces(r, g):
        r, g = _f64(r), _f64(g)
        both_nan = np.isnan(r) & np.isnan(g)
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are no difference
            diff = np.where(both_nan | (r == g), 0.0, np.abs(r - g))
        if np.isnan(diff).any():
            return float("inf")
        finite = np.isfinite(r)
        special = ~finite & ~both_nan  # r's infinities: g must have the same ones
        if not np.array_equal(np.isinf(r), np.isinf(g)) or not np.array_equal(r[special], g[special]):
            return float("inf")
        if finite.any():
            denom, d = max(denom, float(np.abs(r[finite]).max())), max(d, float(diff[finite].max()))
    return d / denom if denom > 0 else d


def flat_pieces(*arrays: np.ndarray):
    """The arrays (of one shape) flattened, in aligned pieces of at most metric.SEGMENT values: views
    where they are contiguous."""
    flat = [np.reshape(a, -1) for a in arrays]
    for i in range(0, flat[0].size, SEGMENT):
        yield tuple(f[i:i + SEGMENT] for f in flat)
