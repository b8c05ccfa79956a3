"""Why a pattern did not match: as onnxscript's rewriter does (`MatchResult`), a matcher answers
with what it found or a `NoMatch` saying where it stopped, never a bare None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, Union

T = TypeVar("T")


@dataclass(frozen=True)
class NoMatch:
    reason: str
    depth: int = 0  # how far it got: 0, not the pattern's start (a mean for pooling); >= 1, a near miss

    def __bool__(self) -> bool:  # `if m:` reads as "it matched"
        return False

    @property
    def near(self) -> bool:
        return self.depth > 0


MatchResult = Union[T, NoMatch]


def deepest(*tries: NoMatch) -> NoMatch:
    """The failure that got furthest (the most telling of several patterns tried at one start)."""
    return max(tries, key=lambda t: t.depth)
