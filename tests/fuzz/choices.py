"""The generator's random decisions: drawn from a seed, replayed from a list (shrinking), or drawn
by hypothesis."""
from __future__ import annotations

import random


class Chooser:
    """Every random decision of the generator; `trace` records the draws (offsets from `lo`)."""

    def __init__(self) -> None:
        self.trace: list[int] = []

    def _offset(self, n: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def int(self, lo: int, hi: int) -> int:
        v = self._offset(hi - lo)
        self.trace.append(v)
        return lo + v

    def bool(self, p: float) -> bool:
        """True with probability `p`; a draw of 0 (what shrinking tends to) is False."""
        return self.int(0, 99) >= 100 - round(100 * p)

    def pick(self, seq):
        """An element of `seq`; list the simplest first (shrinking tends to index 0)."""
        return seq[self.int(0, len(seq) - 1)]


class SeededChooser(Chooser):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def _offset(self, n: int) -> int:
        return self.rng.randint(0, n)


class ReplayChooser(Chooser):
    """Replays recorded draws (clamped to range); past the end every draw is 0."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__()
        self.draws = list(draws)

    def _offset(self, n: int) -> int:
        i = len(self.trace)
        return min(self.draws[i], n) if i < len(self.draws) else 0


class HypothesisChooser(Chooser):
    def __init__(self, data) -> None:
        super().__init__()
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def _offset(self, n: int) -> int:
        return self.data.draw(self.st.integers(0, n))
