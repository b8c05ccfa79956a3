"""The report both frontends return: one verdict per LayerNorm, with the reason for each kept one."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class NormVerdict:
    name: str
    verdict: str  # "fold" or "keep"
    reason: str = ""
    recentered: bool = False  # folded thanks to an explicit recenter of its stream


@dataclass
class Report:
    norms: list[NormVerdict] = field(default_factory=list)
    recentered: int = 0  # Recenter ops inserted
    mode: str = "rms"
    notes: list[str] = field(default_factory=list)  # e.g. why CRMSNorm fell back to RMSNorm

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
            "notes": list(self.notes),
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def summary(self) -> str:
        return (
            f"{len(self.norms)} LayerNorm(s): {self.folded} folded, {self.kept} kept, "
            f"{self.recentered} recenter(s) inserted"
        )

    def table(self) -> str:
        """A fixed-width table for people: name, verdict, reason."""
        if not self.norms:
            return "no LayerNorm found"
        w = min(max(len(n.name) for n in self.norms), 60)
        lines = [f"{'norm':<{w}}  verdict  reason", f"{'-' * w}  -------  ------"]
        for n in self.norms:
            reason = n.reason or ("folded with a recenter of its stream" if n.recentered else "")
            lines.append(f"{n.name:<{w}}  {n.verdict:<7}  {reason}")
        lines.append(self.summary())
        lines.extend(f"note: {t}" for t in self.notes)
        return "\n".join(lines)
