"""Why a pattern did not match: every failed match returns a `NoMatch` with its reason.

As onnxscript's rewriter does (`MatchResult`), a matcher answers with what it found or with the
reason it stopped, never with a bare None. `depth` is how far it got: 0 where the start is not
the pattern's at all (a mean used for pooling), more where an op chain looked like a LayerNorm and
stopped short of one (a near miss, which the report lists with its reason).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, Union

T = TypeVar("T")


@dataclass(frozen=True)
class NoMatch:
    reason: str
    depth: int = 0  # 0: not the pattern's start; >= 1: a near miss

    def __bool__(self) -> bool:  # `if m:` reads as "it matched"
        return False

    @property
    def near(self) -> bool:
        return self.depth > 0


MatchResult = Union[T, NoMatch]


def deepest(*tries: NoMatch) -> NoMatch:
    """The failure that got furthest (the most telling of several patterns tried at one start)."""
    return max(tries, key=lambda t: t.depth)
