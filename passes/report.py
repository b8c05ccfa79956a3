"""The report both frontends return: one verdict per LayerNorm, the reason for each kept one, and
for each folded stream what was edited to make it zero-mean."""
from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class NormVerdict:
    name: str
    verdict: str  # "fold" or "keep"
    reason: str = ""
    recentered: bool = False  # folded thanks to an explicit recenter of its stream
    stream: Optional[int] = None  # index into Report.streams for folded norms
    beta: str = ""  # where β went, once a frontend emitted the fold (e.g. "into the bias of MatMul `fc`")
    deferred: bool = False  # emitted as deferred normalization (passes/defer.py)
    defer_reason: str = ""  # why a folded norm was considered for deferral and not deferred


@dataclass
class StreamEdits:
    """What made one stream component zero-mean: the edits its folded norms rely on."""

    norms: list[str] = field(default_factory=list)
    centered: list[str] = field(default_factory=list)  # "`wte.weight` (Gather `/wte/Gather`)"
    cloned: list[str] = field(default_factory=list)  # constants copied before centering, and why
    scaled: list[str] = field(default_factory=list)  # LayerScale vectors folded into their sources
    recentered: list[str] = field(default_factory=list)  # stream starts given an explicit x - mean(x)


@dataclass
class CompressionVerdict:
    """mode="crms": one stream component, compressed to d-1 features or left as RMSNorm, and why."""

    norms: list[str]
    verdict: str  # "compressed" or "rms"
    reason: str = ""
    width: object = None  # d
    decompressions: int = 0  # norms whose d-vector output is still produced for a reader


@dataclass
class Report:
    norms: list[NormVerdict] = field(default_factory=list)
    recentered: int = 0  # Recenter ops inserted
    mode: str = "rms"
    notes: list[str] = field(default_factory=list)
    streams: list[StreamEdits] = field(default_factory=list)
    compression: list[CompressionVerdict] = field(default_factory=list)  # mode="crms", per component

    @property
    def compressed(self) -> int:
        """Norms emitted as CRMSNorm (mode="crms")."""
        return sum(len(c.norms) for c in self.compression if c.verdict == "compressed")

    @property
    def folded(self) -> int:
        return sum(n.verdict == "fold" for n in self.norms)

    @property
    def kept(self) -> int:
        return sum(n.verdict == "keep" for n in self.norms)

    def verdicts(self) -> dict[str, str]:
        return {n.name: n.verdict for n in self.norms}

    def to_dict(self) -> dict:
        return {
            "folded": self.folded,
            "kept": self.kept,
            "recentered": self.recentered,
            "mode": self.mode,
            "norms": [asdict(n) for n in self.norms],
            "streams": [asdict(s) for s in self.streams],
            "notes": list(self.notes),
            "compression": [asdict(c) for c in self.compression],
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def summary(self) -> str:
        return (
            f"{len(self.norms)} LayerNorm(s): {self.folded} folded, {self.kept} kept, "
            f"{self.recentered} recenter(s) inserted"
        )

    def table(self, width: int = 100) -> str:
        """For people: one row per norm (verdict, and why it was kept or how it was folded), then
        one block per folded stream listing the edited sources."""
        if not self.norms:
            return "no LayerNorm found"
        w = min(max(len("norm"), *(len(n.name) for n in self.norms)), 48)
        lines = [f"{'norm':<{w}}  verdict  reason / how", f"{'-' * w}  -------  {'-' * 12}"]
        for n in self.norms:
            lines.append(f"{_clip(n.name, w):<{w}}  {n.verdict:<7}  {_clip(_how(n), width)}")
        lines.append("")
        lines.append(self.summary())
        for k, s in enumerate(self.streams):
            lines.append(f"stream {k + 1}: {len(s.norms)} norm(s) folded")
            for label, items in (("centered", s.centered), ("cloned", s.cloned), ("LayerScale folded", s.scaled),
                                 ("recentered", s.recentered)):
                if items:
                    lines.extend(textwrap.wrap(f"{label} ({len(items)}): " + "; ".join(items), width,
                                               initial_indent="  ", subsequent_indent="      "))
        for c in self.compression:
            what = (f"compressed to {c.width - 1} features, {c.decompressions} decompression(s)"
                    if c.verdict == "compressed" else f"RMSNorm: {c.reason}")
            lines.append(f"crms: {len(c.norms)} norm(s) from {c.norms[0]}: {what}")
        lines.extend(f"note: {t}" for t in self.notes)
        return "\n".join(lines)


def _how(n: NormVerdict) -> str:
    if n.verdict == "keep":
        return n.reason
    parts = [f"stream {n.stream + 1}" if n.stream is not None else "folded"]
    if n.recentered:
        parts.append("with a recenter")
    if n.beta:
        parts.append(f"β {n.beta}")
    return ", ".join(parts)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
