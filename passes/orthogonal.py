"""The orthogonal matrices a stream rotation applies (passes/rotate.py), in float64, from a seed:
`matrix(kind, d, seed)`, the Q of a rotation kind, and `hadamard(n)`, a Hadamard matrix of order
n = 2ᵏ·m (Sylvester doublings of a Paley I or II base; None where none is known here). The kinds
and their constructions: DESIGN §6b, *Q.* and "Keep-LN rotations".
"""
from __future__ import annotations

from functools import lru_cache
from math import isqrt
from typing import Optional

import numpy as np

from .options import ROTATIONS as KINDS


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % k for k in range(2, isqrt(q) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = χ(j − i), χ the quadratic character of the prime field GF(q)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _bordered(q: int, column: int) -> np.ndarray:
    """[[0, 1ᵀ], [column·1, Q]] of order q + 1, Q the Jacobsthal matrix of GF(q)."""
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:] = 1
    s[1:, 0] = column
    s[1:, 1:] = _jacobsthal(q)
    return s


def _paley1(q: int) -> np.ndarray:
    """Order q + 1, q ≡ 3 mod 4 prime: H = I + S, S = [[0, 1ᵀ], [−1, Q]] (skew)."""
    return np.eye(q + 1, dtype=np.int64) + _bordered(q, -1)


def _paley2(q: int) -> np.ndarray:
    """Order 2(q + 1), q ≡ 1 mod 4 prime: C = [[0, 1ᵀ], [1, Q]] (symmetric conference matrix),
    H = C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]."""
    return (np.kron(_bordered(q, 1), np.array([[1, 1], [1, -1]]))
            + np.kron(np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]])))


def _base(m: int) -> Optional[np.ndarray]:
    if m == 1:
        return np.ones((1, 1), dtype=np.int64)
    if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if m % 4 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    return None


def hadamard_factors(n: int) -> Optional[tuple[int, int]]:
    """(2ᵏ, m) with n = 2ᵏ·m and a Hadamard matrix of order m constructible here; the largest
    power of two that works. None: no known construction for n."""
    if n < 1:
        return None
    k = (n & -n).bit_length() - 1  # 2ᵏ: the largest power of two dividing n
    return next(((2 ** j, n // 2 ** j) for j in range(k, -1, -1) if _base(n // 2 ** j) is not None), None)


@lru_cache(maxsize=16)
def hadamard(n: int) -> Optional[np.ndarray]:
    """A Hadamard matrix of order n (float64 ±1, H Hᵀ = n I), or None where none is known here."""
    f = hadamard_factors(n)
    if f is None:
        return None
    p, m = f
    h = _base(m).astype(np.float64)
    syl = np.ones((1, 1))
    while syl.shape[0] < p:
        syl = np.block([[syl, syl], [syl, -syl]])
    return np.kron(syl, h)


def hadamard_kronecker(n: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(A, B), orthogonal (p × p and m × m, n = p·m) with A ⊗ B = hadamard(n)/√n: the Sylvester
    part and the Paley base `hadamard` builds it from. u·H applied as two small products costs
    n·(p + m) multiply-adds instead of n². None where no Hadamard of order n is known here."""
    f = hadamard_factors(n)
    if f is None:
        return None
    p, m = f
    if m == 1:  # a Sylvester matrix: S_p = S_q ⊗ S_(p/q) for any power of two q, here q ≈ √p
        p, m = 2 ** (p.bit_length() // 2), p // 2 ** (p.bit_length() // 2)
        return hadamard(p) / np.sqrt(p), hadamard(m) / np.sqrt(m)
    return hadamard(p) / np.sqrt(p), _base(m).astype(np.float64) / np.sqrt(m)


def resolved_kind(kind: str, d: int) -> str:
    """The kind a rotation of width d gets: "hadamard" where no Hadamard order fits d is "orthogonal"."""
    if kind.startswith("hadamard") and hadamard(d) is None:
        return kind.replace("hadamard", "orthogonal")
    return kind


@lru_cache(maxsize=16)
def _matrix(kind: str, d: int, seed: int, spared: tuple = ()) -> np.ndarray:
    if spared:  # the identity on the spared channels, a rotation of the kind on the others
        rest = [c for c in range(d) if c not in set(spared)]
        q = np.eye(d)
        q[np.ix_(rest, rest)] = _matrix(resolved_kind(kind, len(rest)), len(rest), seed)
        q.setflags(write=False)
        return q
    rng = np.random.default_rng([seed, d])
    base = kind.replace("-keep-ln", "")
    h = hadamard(d) if base == "hadamard" else None
    if h is not None:
        signs = rng.choice([-1.0, 1.0], size=d)
        q = signs[:, None] * h / np.sqrt(d)  # D H / √d: orthogonal, entries ±1/√d
    else:
        g = rng.standard_normal((d, d))
        q, r = np.linalg.qr(g)
        q = q * np.sign(np.diag(r))[None, :]
    if kind.endswith("-keep-ln"):
        q = _keep_ones(q)
    q.setflags(write=False)
    return q


def _keep_ones(q: np.ndarray) -> np.ndarray:
    """R·Q with R the Householder reflection taking w = Q·u to u = 1/√d (so (R·Q)·1 = 1)."""
    d = q.shape[0]
    u = np.full(d, 1.0 / np.sqrt(d))
    w = q @ u
    z = w - u
    nz = float(z @ z)
    if nz < 1e-30:  # Q already maps 1 to itself
        return q
    return q - np.outer(z, (2.0 / nz) * (z @ q))


def can_spare(d: int, spared) -> bool:
    """Whether a rotation of width d can leave the channels `spared` as they are: each one of its
    channels, and at least two others left to rotate."""
    return not spared or (min(spared) >= 0 and max(spared) < d and len(set(spared)) <= d - 2)


def matrix(kind: str, d: int, seed: int = 0, spared: tuple = ()) -> np.ndarray:
    """The rotation Q (d × d, float64, read-only) of `kind` for a stream of width d: a row x of the
    stream becomes x·Q. Deterministic in (kind, d, seed, spared). `spared`: channels Q leaves as they
    are (Q is the identity on them and rotates the others among themselves; a -keep-ln kind still
    maps 1 to 1, its rotation of the others mapping their ones to themselves)."""
    if kind not in KINDS:
        raise ValueError(f"unknown rotation {kind!r}")
    spared = tuple(sorted({int(c) for c in spared}))
    if not can_spare(d, spared):
        raise ValueError(f"spared channels {spared} must leave at least two of the {d} channels to rotate")
    return _matrix(resolved_kind(kind, d) if not spared else kind, int(d), int(seed), spared)
