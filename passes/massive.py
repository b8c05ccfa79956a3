"""`spare_channels="massive"`: each rotatable stream's massive-activation channels, found on rows.
A full rotation spreads their large reader weights into every channel's quantization blocks;
spared (the identity on them), they keep their own. Whether that pays varies with the seed more
than it gains (SmolLM2 int4, benchmarks/RESULTS.md), so `--rotate auto` measures it as a candidate.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .calibration import Folds, capture
from .slicing import norm_input

# a channel is massive where its largest |value| over the stream's norm inputs exceeds this multiple
# of the median channel's (SmolLM2: 507 at 297x, 247 at 24x, 17 at 23x; the next, 14, at 11x)
MASSIVE_RATIO = 20.0


def massive_channels(folds: Folds, batches: list, planner: Callable) -> tuple:
    """((a stream's first norm, its massive channels), ...) for every stream of `folds`' plan (its
    options: a rotation asked, so that streams of RMSNorms as given are streams too), from the norm
    inputs of the model as given on `batches` (a stream's own values: a fold moves γ and rotates,
    it does not change which channel is large)."""
    view, plan = folds.plan(planner)
    streams = [c for c in plan.components if c.norms]
    inputs = {n: norm_input(view, n) for c in streams for n in c.norms}
    captured = capture(folds, None, list(dict.fromkeys(v for v, _ in inputs.values())), batches)
    out = []
    for comp in streams:
        peaks = None
        for n in comp.norms:
            value, axis = inputs[n]
            for x in captured.get(value, ()):
                x = np.abs(np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1))
                p = x.reshape(-1, x.shape[-1]).max(axis=0)
                peaks = p if peaks is None else np.maximum(peaks, p)
        if peaks is not None and np.median(peaks) > 0:
            out.append((comp.norms[0], tuple(int(c) for c in np.flatnonzero(peaks > MASSIVE_RATIO * np.median(peaks)))))
    return tuple(out)
