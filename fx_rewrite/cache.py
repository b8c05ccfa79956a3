"""The backend's extra inputs under inference: edited constants computed in float64 from the
parameters Dynamo passes, cached, and recomputed only when a parameter changes."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..passes import compute_constants
from ..passes.defer import DeferDecision, Deferral, compute_biases
from ..passes.edits import ConstEdit

from .apply import Constants
from .edits import from_numpy, to_numpy
from .deferred_norm import BiasNode


class CachedInputs(Constants):
    """Inference: edited copies of constants as extra graph inputs (new attributes are no option:
    AOTAutograd would lift them as parameters Dynamo does not know), computed in float64 and again
    only when a source parameter changes (tensor object, storage or version); an attribute's, once."""

    def __init__(self, placeholders: dict[str, int], tensor: Callable) -> None:
        self.placeholders = placeholders
        self.tensor = tensor
        self.extra: list[Any] = []  # per extra input: a ConstEdit (recomputed) or a fixed tensor
        self._key: Any = None
        self._tensors: list[torch.Tensor] = []

    def node_for(self, applier, edit, k):
        g = applier.graph
        name = f"lnfold_{edit.value}"
        if any(n.op == "placeholder" and n.target == name for n in g.nodes):
            name = f"{name}_{k}"  # one constant, two edits (CRMS: a tied table and its lm_head)
        fixed = not all(n in self.placeholders for n in edit.sources())  # (an attribute's: centered once)
        return self._input(g, name, self._compute([edit], self.tensor)[0] if fixed else edit)

    def derived_input(self, g: fx.Graph, name: str, sources: list[str], compute: Callable) -> fx.Node:
        fixed = not all(n in self.placeholders for n in sources)
        return self._input(g, name, compute(self.tensor) if fixed else Derived(sources, compute))

    def _input(self, g: fx.Graph, name: str, entry: Any) -> fx.Node:
        """A new last input of `g`, fed `entry` (see `extra`)."""
        with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
            node = g.placeholder(name)
        node._dynamo_source = None  # AOTAutograd asks every Dynamo input where it came from
        self.extra.append(entry)
        return node

    def _compute(self, edits: list[ConstEdit], tensor: Callable) -> list[torch.Tensor]:
        return [from_numpy(arr, tensor(e.value)) for e, arr in compute_constants(edits, lambda n: to_numpy(tensor(n)))]

    def __call__(self, args) -> list[torch.Tensor]:
        edits = [e for e in self.extra if isinstance(e, ConstEdit)]
        derived = [e for e in self.extra if isinstance(e, Derived)]
        key = tuple(_identity(args[self.placeholders[n]]) for e in edits for n in e.sources())
        key += tuple(_identity(args[self.placeholders[n]]) for e in derived for n in e.sources)
        if key != self._key:
            get = lambda n: args[self.placeholders[n]]  # noqa: E731
            fresh = iter(self._compute(edits, get))
            self._tensors = [next(fresh) if isinstance(e, ConstEdit) else e.compute(get) if isinstance(e, Derived)
                             else e for e in self.extra]
            self._key = key
        return self._tensors


def _identity(t: torch.Tensor):
    """Which tensor, and which contents: a changed parameter must not reuse a stale copy."""
    try:
        return (id(t), t.data_ptr(), t._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: assume unchanged
        return (id(t), t.data_ptr(), -1)


@dataclass
class Derived:
    """An extra input computed from constants (a deferred norm's bias), and what it reads."""

    sources: list[str]
    compute: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]


def with_extra_inputs(compiled: Callable, extra: CachedInputs) -> Callable:
    # Dynamo calls what a backend returns as fn(*args), whatever `_boxed_call` says (AOTAutograd
    # copies that flag onto a wrapper that is not boxed).
    def run(*args):
        return compiled(*args, *extra(args))

    return run


def derived_biases(gm: fx.GraphModule, constants: CachedInputs) -> BiasNode:
    """Each deferred reader's new bias `W β + b` as an extra input of the graph, recomputed
    (float64) when a parameter it derives from changes."""
    def bias_node(d: Deferral, rd) -> Optional[fx.Node]:
        if d.beta is None:
            return None
        one = DeferDecision(deferred=[replace(d, readers=[rd])])
        like = rd.bias.value if rd.bias is not None else rd.weight.value
        sources = [d.beta, rd.weight.value] + ([rd.bias.value] if rd.bias is not None else [])

        def compute(get: Callable[[str], torch.Tensor]) -> torch.Tensor:
            arr = compute_biases(one, lambda n: to_numpy(get(n)))[(d.norm, rd.node)]
            if arr is not None:
                return from_numpy(arr, get(like))
            if rd.bias is not None:  # β is all zeros now: the reader's own bias
                return get(rd.bias.value)
            w = get(rd.weight.value)  # nor has it one: a zero bias (β may change later)
            return torch.zeros_like(w.select(rd.weight.axis, 0))

        return constants.derived_input(gm.graph, f"lnfold_bias_{rd.node}", sources, compute)

    return bias_node
