"""The report both frontends return: one verdict per LayerNorm, the reason for each kept one (and
every blocker, in the JSON), for each folded stream what was edited to make it zero-mean, the op
chains that almost were a LayerNorm (and why not), and the norms that are RMSNorms already."""
from __future__ import annotations

import copy
import json
import os
import re
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping, Optional

Rename = Callable[[str], str]  # a tensor's, module's or norm's name -> the name to say instead


def requoted(text: str, fn: Rename) -> str:
    """`text` with every name it quotes (`x`, the report's one way of naming something inside a
    sentence) replaced by `fn(x)`; nothing else in the sentence is read."""
    return re.sub(r"`([^`]*)`", lambda m: f"`{fn(m[1])}`", text)


def named(value, fn: Rename):
    """A name, or each of a list of them, renamed by `fn`."""
    return [fn(v) for v in value] if isinstance(value, list) else fn(value)


def applications(norms: list[str], names: Mapping[str, str]) -> dict[str, str]:
    """norm -> `name (application k of n)` for the norms `names` gives a name that n > 1 of them
    share, k counted in the order given (the graph's: the order they run)."""
    said = [names.get(n, n) for n in norms]
    total, seen, out = Counter(said), Counter(), {}
    for norm, name in zip(norms, said):
        if total[name] > 1:
            seen[name] += 1
            out[norm] = f"{name} (application {seen[name]} of {total[name]})"
    return out


class Names:
    """A record that names things in its fields `NAMES` (a name or a list of them) and `SENTENCES`
    (sentences quoting names); `renamed(fn)`: a copy that says `fn(x)` for every name x."""

    NAMES: tuple[str, ...] = ()
    SENTENCES: tuple[str, ...] = ()

    def renamed(self, fn: Rename):
        return replace(self, **{f: named(getattr(self, f), fn) for f in self.NAMES},
                       **{f: named(getattr(self, f), lambda t: requoted(t, fn)) for f in self.SENTENCES})


@dataclass
class NormVerdict(Names):
    NAMES, SENTENCES = ("name",), ("reason", "beta", "defer_reason", "blockers", "gamma")

    name: str
    verdict: str  # "fold" or "keep"
    reason: str = ""
    recentered: bool = False  # folded thanks to an explicit recenter of its stream
    stream: Optional[int] = None  # index into Report.streams for folded norms
    beta: str = ""  # where the plan puts β (e.g. "into the bias of MatMul `fc`", "kept as an Add (why)")
    deferred: bool = False  # emitted as deferred normalization (passes/defer.py)
    defer_reason: str = ""  # why a folded norm was considered for deferral and not deferred
    blockers: list[str] = field(default_factory=list)  # kept: every reason its stream cannot fold
    gamma: str = ""  # gamma_into_readers: where γ went ("into the weight of …") or why it stayed


@dataclass
class NearMiss(Names):
    """An op chain that looks like a LayerNorm (a mean, x - mean, ...) but is not one."""

    SENTENCES = ("reason",)
    name: str  # its first op (a graph node's name: not renamed)
    reason: str


@dataclass
class RmsNorm(Names):
    """A norm that is an RMSNorm already (a folded model's, or a Llama's): nothing to fold; with γ
    into the readers or a rotation asked, its stream and where its γ went."""

    NAMES, SENTENCES = ("name",), ("gamma",)
    name: str
    op: str  # "SimplifiedLayerNormalization", "RMSNormalization", "decomposed RMSNorm", ...
    stream: Optional[int] = None  # index into Report.streams: a stream whose norms are all RMSNorms as given
    gamma: str = ""  # gamma_into_readers: where γ went ("into the weight of …") or why it stayed


@dataclass
class StreamEdits(Names):
    """What made one stream component zero-mean: the edits its folded norms rely on."""

    NAMES = ("norms", "fused", "rms")
    SENTENCES = ("centered", "cloned", "scaled", "recentered", "dropped", "rotation")

    norms: list[str] = field(default_factory=list)
    rms: list[str] = field(default_factory=list)  # a stream of RMSNorms as given: nothing centered
    centered: list[str] = field(default_factory=list)  # "`wte.weight` (Gather `/wte/Gather`)"
    cloned: list[str] = field(default_factory=list)  # constants copied before centering, and why
    scaled: list[str] = field(default_factory=list)  # LayerScale vectors folded into their sources
    recentered: list[str] = field(default_factory=list)  # stream starts given an explicit x - mean(x)
    dropped: list[str] = field(default_factory=list)  # Muls by a LayerScale folded to ones, bypassed
    fused: list[str] = field(default_factory=list)  # norms emitted fused with their residual Add
    rotation: str = ""  # rotate=: "rotated by a hadamard Q (d=…)" or "not rotated: <the blocking node>"


@dataclass
class CompressionVerdict(Names):
    """mode="crms": one stream component, compressed to d-1 features or left as RMSNorm, and why."""

    NAMES, SENTENCES = ("norms",), ("reason",)

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
    near_misses: list[NearMiss] = field(default_factory=list)
    rms_norms: list[RmsNorm] = field(default_factory=list)  # already RMSNorm (the ONNX frontend's analyze_model)
    geometry: Optional[object] = None  # passes/geometry.Geometry: each norm's angle to 1 (report --calibrate)
    approx: Optional[object] = None  # passes/approx.Selection: the norms swapped without being exact

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

    @property
    def approximated(self) -> int:
        """Norms swapped to RMSNorm without an exact fold (mode "rms-approx", passes/approx.py)."""
        return sum(n.verdict == "approx" for n in self.norms)

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
            "near_misses": [asdict(m) for m in self.near_misses],
            "rms_norms": [asdict(r) for r in self.rms_norms],
            **({"geometry": self.geometry.to_dict()} if self.geometry is not None else {}),
            **({"approximate": self.approx.to_dict()} if self.approx is not None else {}),
        }

    def with_notes(self, notes) -> "Report":
        """This report with `notes` added (a copy where there are any: a plan's report stays as planned)."""
        return replace(self, notes=self.notes + list(notes)) if notes else self

    def renamed(self, names: Mapping[str, str]) -> "Report":
        """A copy that says `names[x]` wherever this report names `x` (a norm, or a name quoted in a
        sentence): the user's names for the torch graph's. A copy: the plan's own report stays as
        planned. Norms that `names` gives one name (a shared module applied many times: ALBERT's one
        layer, 12 times) are numbered in the report's order, `name (application k of n)`."""
        names = {**names, **applications([n.name for n in self.norms] + [r.name for r in self.rms_norms], names)}
        fn = lambda x: names.get(x, x)  # noqa: E731
        r = copy.deepcopy(self)
        r.norms, r.streams = [n.renamed(fn) for n in r.norms], [s.renamed(fn) for s in r.streams]
        r.compression, r.near_misses = [c.renamed(fn) for c in r.compression], [m.renamed(fn) for m in r.near_misses]
        r.rms_norms, r.notes = [x.renamed(fn) for x in r.rms_norms], [requoted(t, fn) for t in r.notes]
        return r

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def summary(self) -> str:
        rms = f"; {len(self.rms_norms)} already RMSNorm" if self.rms_norms else ""
        approx = f" exactly, {self.approximated} swapped approximately (NOT exact)" if self.approximated else ""
        return (
            f"{len(self.norms)} LayerNorm(s): {self.folded} folded{approx}, {self.kept} kept, "
            f"{self.recentered} recenter(s) inserted{rms}"
        )

    def table(self, width: int = 100) -> str:
        """For people: one row per norm (verdict, and why it was kept or what the fold edited),
        then one block per folded stream listing the edited sources, then the near misses. Long
        names are cut in the middle here (`--json` has them whole)."""
        if not self.norms and not self.rms_norms:
            return "no LayerNorm found" + ("" if not self.near_misses else "\n" + self._near_miss_lines(width))
        rows = [(n.name, n.verdict, self._how(n)) for n in self.norms]
        rows += [(r.name, "rms", _as_given(r)) for r in self.rms_norms]
        w = min(max(len("norm"), *(len(name) for name, _, _ in rows)), NAME_WIDTH)
        lines = [f"{'norm':<{w}}  verdict  reason / how", f"{'-' * w}  -------  {'-' * 12}"]
        shown = clip_apart([name for name, _, _ in rows], w)
        for (name, verdict, how), short in zip(rows, shown):  # a long reason wraps under its column
            how = requoted(how, lambda name: clip_middle(name, NAME_WIDTH))
            how_lines = textwrap.wrap(how, max(width - w - 11, 60), break_on_hyphens=False) or [""]
            lines.append(f"{short:<{w}}  {verdict:<7}  {how_lines[0]}")
            lines.extend(" " * (w + 11) + more for more in how_lines[1:])
        lines += ["", self.summary()]
        for k, s in enumerate(self.streams):
            lines.append(f"stream {k + 1}: {len(s.rms)} RMSNorm(s) as given, nothing to center" if s.rms and not s.norms
                         else f"stream {k + 1}: {len(s.norms)} norm(s) folded")
            for label, items in (("centered", s.centered), ("cloned", s.cloned), ("LayerScale folded", s.scaled),
                                 ("recentered", s.recentered), ("Mul by ones dropped", s.dropped),
                                 ("fused with the residual Add", s.fused)):
                if items:
                    lines.extend(_indented(f"{label} ({len(items)}): " + "; ".join(items), width))
            if s.rotation:
                lines.extend(_indented(s.rotation, width))
        for c in self.compression:
            what = (f"compressed to {c.width - 1} features, {c.decompressions} decompression(s)"
                    if c.verdict == "compressed" else f"RMSNorm: {c.reason}")
            lines.append(f"crms: {len(c.norms)} norm(s) from {c.norms[0]}: {what}")
        if self.near_misses:
            lines.append(self._near_miss_lines(width))
        lines.extend(f"note: {t}" for t in self.notes)
        if self.approx is not None:
            lines.append(self.approx.table())
        if self.geometry is not None:
            lines.append(self.geometry.table(lambda s: clip_middle(s, NAME_WIDTH).ljust(min(w, NAME_WIDTH))))
        return "\n".join(lines)

    def near_miss_hint(self) -> str:
        """For "nothing to fold": the first op chain that almost was a LayerNorm, and why not."""
        if not self.near_misses:
            return ""
        m = self.near_misses[0]
        more = f" (+{len(self.near_misses) - 1} more)" if len(self.near_misses) > 1 else ""
        return f"; near miss at `{m.name}`{more}: {m.reason}"

    def _near_miss_lines(self, width: int) -> str:
        lines = [f"{len(self.near_misses)} near miss(es): op chains that look like a LayerNorm but are not one"]
        for m in self.near_misses:
            lines.extend(_indented(f"{clip_middle(m.name, NAME_WIDTH)}: {m.reason}", width))
        return "\n".join(lines)

    def _how(self, n: NormVerdict) -> str:
        """A kept norm's reason; for a folded one, what the fold edited."""
        if n.verdict in ("keep", "approx"):  # approx: swapped, not exact (its reason says so)
            return n.reason
        s = self.streams[n.stream] if n.stream is not None and n.stream < len(self.streams) else None
        parts = [f"stream {n.stream + 1}" if n.stream is not None else "folded"]
        if s is not None:
            counts = ((s.centered, "centered"), (s.cloned, "cloned"), (s.scaled, "LayerScale(s) folded"),
                      (s.recentered, "recenter(s)"))
            edits = [f"{len(items)} {what}" for items, what in counts if items]
            if edits:  # counts of the weights edited; the stream's block below names them
                parts[0] += f" ({', '.join(edits)})"
        elif n.recentered:
            parts.append("with a recenter")
        if n.gamma:
            parts.append(f"γ {n.gamma}")
        if n.beta:
            parts.append(f"β {n.beta}")
        if n.deferred:
            parts.append("deferred")
        return ", ".join(parts)


def _as_given(r: RmsNorm) -> str:
    """An RMSNorm's row: already one, and with γ into the readers, its stream and where γ went."""
    parts = [f"already RMSNorm ({r.op})"] + ([f"stream {r.stream + 1}"] if r.stream is not None else [])
    return ", ".join(parts + ([f"γ {r.gamma}"] if r.gamma else []))


# Longest norm name the table shows whole; longer ones are cut in the middle.
NAME_WIDTH = 48


def _indented(text: str, width: int) -> list[str]:
    """`text` wrapped to `width` as an item of the table: indented, its next lines further."""
    return textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")


def clip_middle(text: str, width: int) -> str:
    """`text` cut to `width` characters in the middle (`abc…xyz`): both ends of a node name say
    the most (its block and its op)."""
    if len(text) <= width:
        return text
    if width < 3:
        return text[:width]
    head = width // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def clip_apart(names: list[str], width: int) -> list[str]:
    """Each name cut to `width` as clip_middle does, but where it cuts: so that the part where a
    name differs from the others stays visible (two norms of one block, `…/layers.0/self_attn_layer_norm/
    LayerNormalization` and `…/layers.0/final_layer_norm/…`, must not read alike), at a separator
    where possible, else nearest the middle."""
    others = sorted(set(names))
    return [_clip_apart(n, others, width) for n in names]


def _clip_apart(name: str, others: list[str], width: int) -> str:
    if len(name) <= width or width < 3:
        return clip_middle(name, width)
    # each other name: the lengths of the prefix and the suffix it shares with `name`; the cut
    # `head…tail` tells them apart when the head or the tail reaches past the shared part
    shared = [(len(os.path.commonprefix([name, o])), len(os.path.commonprefix([name[::-1], o[::-1]])))
              for o in others if o != name]
    middle = width // 2

    def score(h: int) -> tuple:
        t = width - 1 - h
        apart = sum(h > p or t > q for p, q in shared)
        at_separators = (name[h - 1] in _SEPARATORS) + (name[len(name) - t - 1] in _SEPARATORS)
        return apart, at_separators, -abs(h - middle)

    h = max(range(1, width - 1), key=score)
    return name[:h] + "…" + name[len(name) - (width - 1 - h):]


_SEPARATORS = "/._:"
