"""The searches of every calibrated decision, over plain callables: the caller measures (folds,
runs, passes/metric); the order of the measurements and the choice are here, each with records that
say why a candidate was taken or not: `greedy` (a set within an error budget: the approximate
swap), `largest_within` (the largest grid index within a bound: slicing's fraction under
`--budget`) and `best_of` (the lowest score, simpler candidates kept unless beaten by a margin:
quantize's --rotate auto).

An error or score that is NaN or ±inf is never chosen over a finite one and never compared as a
number (a NaN compares False both ways: a search that lets it in keeps or drops it by accident).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Optional


def _finite(x) -> bool:
    """Whether x is a finite number (None and NaN are not), tested before any comparison."""
    try:
        return math.isfinite(x)
    except TypeError:
        return False


# -- greedy -----------------------------------------------------------------------------------------

# a Step's outcome
KEPT, ZERO_BUDGET, NOT_FINITE = "kept", "budget 0", "not finite"
OVER_ALONE, OVER_TOGETHER = "over alone", "over together"


@dataclass(frozen=True)
class Step:
    """One candidate of `greedy`: its error alone, the set's error when it was tried, and why it
    was kept or refused (`outcome`: one of KEPT, ZERO_BUDGET, NOT_FINITE, OVER_ALONE, OVER_TOGETHER)."""

    name: Hashable
    alone: float  # its error alone (NaN: not measured)
    added: float = 0.0  # kept: how much the set's error grew when it joined
    total: float = 0.0  # the set's error right after it joined, or when it was tried
    outcome: str = KEPT
    reason: str = ""  # refused: why, in words

    @property
    def kept(self) -> bool:
        return self.outcome == KEPT


@dataclass(frozen=True)
class Greedy:
    """What `greedy` chose, in the order they joined, and every candidate's Step in the order tried
    (those not finite alone last)."""

    chosen: tuple
    steps: tuple[Step, ...]
    total: float = 0.0  # the chosen set's measured error (<= budget)

    @property
    def kept(self) -> list[Step]:
        return [s for s in self.steps if s.kept]

    @property
    def refused(self) -> list[Step]:
        return [s for s in self.steps if not s.kept]


def greedy(candidates: Iterable[Hashable], error_of_set: Callable[[frozenset], float], budget: float,
           chosen_word: str = "chosen") -> Greedy:
    """Each candidate measured alone, then, smallest first, added while the error of the whole set
    (`error_of_set(frozenset of candidates)`, measured, not added up) stays <= budget. Budget 0:
    nothing measured. `chosen_word` names the kept ones in the reasons ("swapped"). Duplicates are
    tried once; candidates whose error alone is not finite are refused without being compared."""
    names = list(dict.fromkeys(candidates))
    if not budget > 0:  # 0 (or less): exact only, nothing measured
        return Greedy((), tuple(Step(n, math.nan, outcome=ZERO_BUDGET, reason="budget 0: nothing measured")
                                       for n in names))
    alone = {n: error_of_set(frozenset([n])) for n in names}
    steps: list[Step] = []  # in the order tried
    chosen: list = []
    total = 0.0
    for n in sorted((n for n in names if _finite(alone[n])), key=alone.__getitem__):  # stable: ties keep order
        if not alone[n] <= budget:
            steps.append(Step(n, alone[n], outcome=OVER_ALONE,
                              reason=f"alone it costs {alone[n]:.3g} > budget {budget:g}"))
            continue
        now = alone[n] if not chosen else error_of_set(frozenset(chosen + [n]))
        if _finite(now) and now <= budget:
            steps.append(Step(n, alone[n], now - total, now))
            total = now
            chosen.append(n)
        else:
            said = f"{now:.3g} > budget {budget:g}" if _finite(now) else f"{now}, not a finite number"
            steps.append(Step(n, alone[n], total=now, outcome=OVER_TOGETHER,
                              reason=f"with the {len(chosen)} {chosen_word} before it the error would be {said}"))
    steps += [Step(n, alone[n], outcome=NOT_FINITE,  # last, never compared
                   reason=f"alone its error is {alone[n]}, not a finite number")
              for n in names if not _finite(alone[n])]
    return Greedy(tuple(chosen), tuple(steps), total)


# -- largest within ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Boundary:
    """What `largest_within` found: `fits` the largest index found within (-1: none), `fails` the
    index after it, found over (n: none); `tried` every (index, within) in the order measured."""

    fits: int
    fails: int
    tried: tuple[tuple[int, bool], ...]

    @property
    def found(self) -> bool:
        return self.fits >= 0


def largest_within(n: int, within: Callable[[int], bool]) -> Boundary:
    """The largest i in 0..n-1 with `within(i)`, by the fewest calls where `within` holds up to a
    point and not after: 0 first (over: none fits), then n-1 (within: all fit), then bisection. On
    any other table it still ends at a boundary it measured: within(fits), not within(fails),
    fails == fits + 1 (with -1 and n standing for "not measured, taken as within / over")."""
    tried: list[tuple[int, bool]] = []

    def measure(i: int) -> bool:
        ok = bool(within(i))
        tried.append((i, ok))
        return ok

    fits, fails = -1, n  # indices known within / over
    for i in (0, n - 1):
        if fits + 1 < fails:
            fits, fails = (i, fails) if measure(i) else (fits, i)
    while fails - fits > 1:
        mid = (fits + fails) // 2
        fits, fails = (mid, fails) if measure(mid) else (fits, mid)
    return Boundary(fits, fails, tuple(tried))


# -- best of, with a margin -------------------------------------------------------------------------

class Skip(Exception):
    """Raised by a `best_of` score for a candidate that is not measured; its message says why."""


@dataclass(frozen=True)
class Trial:
    """One candidate of `best_of`: its score, or why it was skipped, and what it did to the choice."""

    index: int
    score: Optional[float] = None  # None: skipped
    skipped: Optional[str] = None
    why: str = ""  # took the lead, or did not, and why


@dataclass(frozen=True)
class Best:
    """What `best_of` chose: `index` into the candidates (None: every one skipped), each Trial, and why."""

    index: Optional[int]
    trials: tuple[Trial, ...]
    why: str

    @property
    def finite(self) -> bool:
        """Whether the chosen score is a finite number (False where none is: the first measured kept)."""
        return self.index is not None and _finite(self.trials[self.index].score)

    @property
    def scored(self) -> list[Trial]:
        return [t for t in self.trials if t.skipped is None]


def best_of(candidates: Iterable, score: Callable[[object], float], margin: float = 0.0) -> Best:
    """The lowest `score` (>= 0, an error), candidates given simplest first: a later one replaces
    the best so far only where its score < (1 - margin) * the best's, so near-equal ones keep the
    simpler. A NaN or infinite score never replaces a finite one; a finite one always replaces it;
    where no score is finite the first scored is kept (`Best.finite` False). `score` raises `Skip`
    for a candidate not measured."""
    if not (_finite(margin) and 0 <= margin < 1):
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    trials: list[Trial] = []
    best: Optional[Trial] = None
    for i, c in enumerate(candidates):
        try:
            s = float(score(c))
        except Skip as e:
            trials.append(Trial(i, skipped=str(e) or "skipped"))
            continue
        leads = best is None or (_finite(s) and (not _finite(best.score) or s < (1 - margin) * best.score))
        if best is None:
            why = "the first scored" + ("" if _finite(s) else f": {s}, not a finite number")
        elif not _finite(s):
            why = f"{s} is not a finite number: never chosen over a scored one"
        elif not _finite(best.score):
            why = f"the first finite score (the best so far, {best.score}, is not a number)"
        elif leads:
            why = f"beats the best so far ({best.score:.3g}) by more than {margin:.0%}"
        else:
            why = f"not below the best so far ({best.score:.3g}) by more than {margin:.0%}: the simpler kept"
        trials.append(Trial(i, s, why=why))
        if leads:
            best = trials[-1]
    scored = sum(t.skipped is None for t in trials)
    if best is None:
        return Best(None, tuple(trials), f"all {len(trials)} candidate(s) skipped")
    why = (f"candidate {best.index + 1}: the lowest score ({best.score:.3g}) of {scored} scored, simpler ones kept "
           f"unless beaten by over {margin:.0%}" if _finite(best.score) else
           f"candidate {best.index + 1}: no score is a finite number; the first scored kept")
    return Best(best.index, tuple(trials), why)
