"""What the backend tells about each graph it compiles: the reports and stage timings of the
last graphs (bounded, for people and tests)."""
from __future__ import annotations

import collections

from ..passes import Report

# The reports of the last KEPT graphs compiled in this process, newest last (for people and
# tests), and for each of the last KEPT folded graphs the seconds spent in each stage; bounded,
# so that a long-lived process that keeps compiling does not keep every report forever.
KEPT = 64
reports: collections.deque[Report] = collections.deque(maxlen=KEPT)
timings: collections.deque[dict[str, float]] = collections.deque(maxlen=KEPT)
