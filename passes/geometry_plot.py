"""The geometry as a picture, in the manner of seed 003's Figure 3: per norm in graph order, the
mean angle between its input and 1 with its spread (± one standard deviation), before the fold and
after it (folded norms: 90° by construction). matplotlib is an optional extra (`lnfold[plot]`)."""
from __future__ import annotations

from pathlib import Path

from .geometry import Geometry
from .plots import check_path, pyplot, save


def plot(g: Geometry, path, title: str = "") -> Path:
    """Write the picture of `g` to `path` (atomically: a temporary file renamed into place)."""
    check_path(path)
    plt = pyplot()
    xs = list(range(len(g.norms)))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(xs) + 2), 3.6))
    ax.axhline(90.0, color="0.6", lw=0.8, ls="--", zorder=0)
    before = [(x, n.before) for x, n in zip(xs, g.norms) if n.before is not None]
    folded = [x for x, n in zip(xs, g.norms) if n.verdict == "fold"]
    ax.errorbar([x for x, _ in before], [s.mean_deg for _, s in before], yerr=[s.std_deg for _, s in before],
                fmt="o", ms=4, capsize=3, color="tab:blue", label="before the fold")
    after = [(x, n.after) for x, n in zip(xs, g.norms) if n.after is not None]
    if after:
        ax.errorbar([x + 0.2 for x, _ in after], [s.mean_deg for _, s in after], yerr=[s.std_deg for _, s in after],
                    fmt="s", ms=3, capsize=2, color="tab:green", label="after (folded norms)")
    kept = [x for x in xs if x not in folded]
    if kept:
        lo, _ = ax.get_ylim()
        ax.scatter(kept, [lo] * len(kept), marker="x", color="tab:red", label="kept (not foldable)", clip_on=False)
    ax.set_xticks(xs)
    ax.set_xlabel("LayerNorm, in graph order")
    ax.set_ylabel("angle between input and 1 (°)")
    note = f" — {g.rows} rows" + (" of MADE-UP inputs" if g.synthetic else "")
    ax.set_title((title + note) if title else note.lstrip(" —"), fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return save(fig, path)
