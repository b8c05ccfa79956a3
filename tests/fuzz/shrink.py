"""Shrinking a failing model's draws."""
from __future__ import annotations

from typing import Callable


def shrink(draws: list[int], fails: Callable[[list[int]], bool], budget: int = 400, **kw) -> list[int]:
    """Smallest draws (by length, then values) for which `fails` still holds: truncate, zero,
    halve. Draws past the end replay as 0, so a shorter list is a simpler model."""
    best = list(draws)
    tries = 0

    def attempt(c: list[int]) -> bool:
        nonlocal best, tries
        if tries >= budget or c == best:
            return False
        tries += 1
        if fails(c):
            best = c
            return True
        return False

    changed = True
    while changed and tries < budget:
        changed = False
        n = len(best)
        k = n // 2
        while k >= 1 and tries < budget:  # drop the tail
            if attempt(best[: len(best) - k]):
                changed = True
            else:
                k //= 2
        for i in range(len(best) - 1, -1, -1):
            if i < len(best) and best[i] != 0 and attempt(best[:i] + [0] + best[i + 1:]):
                changed = True
            elif i < len(best) and best[i] > 1 and attempt(best[:i] + [best[i] // 2] + best[i + 1:]):
                changed = True
    return best
