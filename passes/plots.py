"""Pictures a command offers with `--plot FILE.svg|png|pdf` (matplotlib: the optional extra
`lnfold[plot]`): where a user compares candidates, the figure that tells it at a glance — the
geometry of each norm (passes/geometry_plot.py), a slice's `--budget` search (`budget_curve`) and
`quantize --rotate auto`'s candidates (`candidates_chart`). Written atomically (a temporary file
renamed into place); the path is checked before any work."""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import LnfoldError

_FORMATS = (".svg", ".png", ".pdf")


def check_path(path) -> Path:
    """The picture's path, with a format matplotlib writes; else a one-line error."""
    p = Path(path)
    if p.suffix.lower() not in _FORMATS:
        raise LnfoldError(f"{p}: --plot writes {', '.join(_FORMATS)} files (say which by the suffix)")
    if not p.parent.is_dir() and str(p.parent):
        raise LnfoldError(f"{p.parent}: output directory does not exist")
    return p


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LnfoldError("--plot needs matplotlib: pip install 'lnfold[plot]'") from None
    return plt


def save(fig, path) -> Path:
    """`fig` written to `path` (checked) through a temporary file renamed into place; closed."""
    p = check_path(path)
    plt = pyplot()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp{p.suffix}")
    try:
        fig.savefig(tmp, metadata={"Date": None} if p.suffix.lower() == ".svg" else None)
        os.replace(tmp, p)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return p


def budget_curve(report, path, title: str = "") -> Path:
    """A slice's `--budget` search (passes/slicer: `SliceReport.tries`): the error against the exact
    fold at each fraction tried, the budget, the fraction chosen, and the parameters kept."""
    plt = pyplot()
    tries = sorted(report.tries)
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.plot([f for f, _, _ in tries], [max(e, 1e-18) for _, e, _ in tries], "o-", color="tab:blue",
            label="error against the exact fold")
    ax.axhline(report.budget, color="tab:red", ls="--", lw=1, label=f"budget {report.budget:g}")
    ax.scatter([report.fraction], [max(report.error, 1e-18)], s=120, facecolors="none", edgecolors="tab:green",
               lw=2, zorder=3, label=f"chosen F={report.fraction:g}")
    ax.set_yscale("log")
    ax.set_xlabel("fraction of each stream's width deleted (F)")
    ax.set_ylabel("relative error (" + ("in-sample" if report.in_sample else "held out") + ")")
    twin = ax.twinx()
    twin.plot([f for f, _, _ in tries], [p / report.params_before for _, _, p in tries], "s:", color="0.5", ms=3)
    twin.set_ylabel("parameters kept (×)", color="0.4")
    ax.set_title(title or "lnfold slice --budget: NOT exact", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return save(fig, path)


def candidates_chart(report, path, title: str = "") -> Path:
    """`quantize --rotate auto`'s candidates (`QuantizeReport.candidates`): each one's error (a bar;
    skipped ones named with why, short), its file's size against the input's, the one chosen, and
    plain onnxruntime for reference."""
    plt = pyplot()
    rows = list(report.candidates)
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.4))
    ys = list(range(len(rows)))[::-1]
    scored = [r.get("score") for r in rows if r.get("score") is not None and math.isfinite(r["score"])]
    floor = min(scored, default=1.0) / 10 or 1e-12
    for y, r in zip(ys, rows):
        name = r["candidate"][:48]
        if r.get("score") is None:
            ax.text(floor, y - 0.12, f"  skipped: {str(r.get('skipped', ''))[:70]}", va="center", fontsize=7, color="0.4")
        else:
            color = "tab:green" if r.get("chosen") else "0.55" if r.get("plain") else "tab:blue"
            ax.barh(y - 0.12, r["score"], height=0.5, color=color, left=0)
            size = f", {r['bytes'] / max(report.bytes_before, 1):.2f}x the size" if r.get("bytes") else ""
            ax.text(r["score"], y - 0.12, f" {r['score']:.3g}{size}", va="center", fontsize=7)
        ax.text(floor, y + 0.17, name + (" (chosen)" if r.get("chosen") else ""), fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_xlim(left=floor)
    ax.set_yticks([])
    ax.set_xlabel("what --rotate auto minimizes: the worst output's KL of logits, else relative RMS error (NOT exact)")
    ax.set_title(title or f"lnfold quantize --rotate auto: {report.scheme}", fontsize=9)
    fig.tight_layout()
    return save(fig, path)
