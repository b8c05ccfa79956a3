"""What the backend tells about the graphs it compiles, for people and tests: the reports of the last
KEPT graphs compiled in this process and the seconds each of the last KEPT folded graphs spent in each
stage, newest last (bounded: a long-lived process that keeps compiling does not keep them all)."""
from __future__ import annotations

import collections

from ..passes import Report

KEPT = 64
reports: collections.deque[Report] = collections.deque(maxlen=KEPT)
timings: collections.deque[dict[str, float]] = collections.deque(maxlen=KEPT)
