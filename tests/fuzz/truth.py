"""The ground truth of a generated model: its stream components (union-find), each LayerNorm's
expected verdict, and the `Case` that carries model, inputs and truth together."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

RECENTER_PAYOFF = 2  # THEORY §1: recenter only if #norms >= 2 * #opaque starts


class Truth:
    """Union-find over stream components: norms, opaque starts and blockers of each."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.norms: dict[int, list[int]] = {}
        self.opaque: dict[int, list[str]] = {}
        self.blockers: dict[int, list[str]] = {}

    def new(self) -> int:
        c = len(self.parent)
        self.parent.append(c)
        self.norms[c], self.opaque[c], self.blockers[c] = [], [], []
        return c

    def find(self, c: int) -> int:
        while self.parent[c] != c:
            self.parent[c] = self.parent[self.parent[c]]
            c = self.parent[c]
        return c

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a == b:
            return a
        self.parent[b] = a
        for d in (self.norms, self.opaque, self.blockers):
            d[a] += d.pop(b)
        return a

    def block(self, c: int, why: str) -> None:
        self.blockers[self.find(c)].append(why)

    def add_opaque(self, c: int, what: str) -> None:
        self.opaque[self.find(c)].append(what)

    def add_norm(self, c: int, call: int) -> None:
        self.norms[self.find(c)].append(call)

    def verdict(self, c: Optional[int]) -> tuple[str, str]:
        if c is None:
            return "keep", "normalizes two axes, or a token axis of a stream"
        r = self.find(c)
        if self.blockers[r]:
            return "keep", f"component {r} blocked: {self.blockers[r][0]}"
        n, k = len(self.norms[r]), len(self.opaque[r])
        if n < RECENTER_PAYOFF * k:
            return "keep", f"component {r}: {k} opaque start(s) ({', '.join(self.opaque[r])}) for {n} norm(s)"
        return "fold", f"component {r}: {n} norm(s), {k} recenter(s)" + (f" ({', '.join(self.opaque[r])})" if k else "")


@dataclass
class NormCall:
    module: str
    comp: Optional[int]  # None: a LayerNorm over two axes (never folded)


@dataclass
class Case:
    """A generated model, its example inputs and its ground truth."""

    seed: Optional[int]
    draws: list[int]
    dtype: torch.dtype
    exporter: str  # "torchscript" or "dynamo"
    opset: int
    module: nn.Module
    inputs: tuple
    input_names: list[str]
    source: str
    calls: list[NormCall]
    expected: list[str]  # "fold" / "keep" per call, in forward (= graph) order
    why: list[str]
    target: str = "ort"  # onnx_rewrite.fold_model's emission target
    mode: str = "rms"  # "crms": the same ground truth (compression never changes a verdict)

    @property
    def tag(self) -> str:
        return f"seed={self.seed}" if self.seed is not None else f"draws={len(self.draws)}"

    def describe(self) -> str:
        lines = [f"# {self.tag} dtype={str(self.dtype).replace('torch.', '')} exporter={self.exporter} "
                 f"opset={self.opset} target={self.target}", self.source.rstrip(), "# ground truth:"]
        for c, v, w in zip(self.calls, self.expected, self.why):
            lines.append(f"#   {c.module:<6} {v:<4}  {w}")
        return "\n".join(lines)

    def to(self, dtype: torch.dtype) -> "Case":
        """The same model and inputs in another float dtype (ground truth unchanged)."""
        import copy

        m = copy.deepcopy(self.module).to(dtype)
        ins = tuple(a.to(dtype) if a.is_floating_point() else a for a in self.inputs)
        return Case(self.seed, self.draws, dtype, self.exporter, self.opset, m, ins, self.input_names,
                    self.source, self.calls, self.expected, self.why, self.target)
