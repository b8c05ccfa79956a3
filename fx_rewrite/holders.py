"""From an exported graph back to the eager module it came from: which module ran a node, through
which attribute a node reads a parameter or buffer, and which folded norms are `nn.LayerNorm`
modules. The module-level folds (fx_rewrite/train.py for training, fx_rewrite/handoff.py for the
RMSNorm hand-off) apply a plan to the user's module through these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx, nn

from ..passes import LnfoldError, View
from ..passes.analysis import Component
from ..passes.plan import Plan
from ..passes.request import PlanRequest

from .classify import GraphInfo


@dataclass(frozen=True)
class Holder:
    """Where a parameter or buffer lives: `module._parameters[name]` or `module._buffers[name]`."""

    module: nn.Module
    name: str

    def raw(self) -> torch.Tensor:
        t = self.module._parameters.get(self.name)
        return self.module._buffers[self.name] if t is None else t


# --- from the exported graph back to the module ---------------------------------------------------

class ModuleMap:
    """Maps the plan's constants (graph values) to where the module holds them, per reader: the
    attribute of the module the reader runs in (`nn_module_stack`) or of the one module below it
    that holds the tensor (a tied tensor: one per module, GPT-2's `wte.weight`, `lm_head.weight`)."""

    def __init__(self, module: nn.Module, gm: fx.GraphModule, attrs: dict[str, str], info: GraphInfo,
                 who: str = "the module-level training fold") -> None:
        self.module = module
        self.who = who  # the fold, in the reasons it gives
        self.attrs = attrs
        self.info = info
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def tensor(self, value: str) -> Optional[torch.Tensor]:
        target = self.attrs.get(value)
        if target is None:
            return None
        owner, _, name = target.rpartition(".")
        try:
            mod = self.module.get_submodule(owner)
        except AttributeError:
            return None
        t = mod._parameters.get(name)
        return mod._buffers.get(name) if t is None else t

    def holder(self, value: str, reader: str) -> Optional[Holder]:
        t = self.tensor(value)
        scope = scope_of(self.module, self.nodes.get(reader))
        if t is None or scope is None:
            return None
        own = [n for n, x in (*scope._parameters.items(), *scope._buffers.items()) if x is t]
        if len(own) == 1:
            return Holder(scope, own[0])
        below = {(id(m), n): Holder(m, n) for _, m in scope.named_modules(remove_duplicate=False)
                 for n, x in (*m._parameters.items(), *m._buffers.items()) if x is t}
        return next(iter(below.values())) if len(below) == 1 else None

    def readers(self, value: str) -> list[str]:
        node = self.nodes.get(value)
        return [u.name for u in node.users] if node is not None else []

    def refusal(self, comp: Component, conflicts: set[str]) -> Optional[str]:
        """Why the module-level fold cannot edit this component, or None."""
        if comp.opaque:
            return (f"needs a recenter of {comp.opaque[0].what}, which {self.who} "
                    "does not insert (fold_module or the lnfold backend do)")
        for src in comp.sources:
            for ref in (*src.refs, *src.scales):
                if ref.value in self.info.scalars:
                    node, _ = self.info.scalars[ref.value]
                    return (f"a Python number in forward (`{node.name}`) writes into the stream; "
                            f"{self.who} edits only parameters and buffers")
                if self.tensor(ref.value) is None:
                    return (f"`{ref.value}` writes into the stream but is not a parameter or buffer of the "
                            f"module (a tensor made in forward?); {self.who} cannot edit it")
                if self.holder(ref.value, ref.user) is None:
                    return f"cannot tell through which attribute `{ref.user}` reads `{self.attrs[ref.value]}`"
                if ref.value in conflicts:
                    return (f"`{self.attrs[ref.value]}` is read centered and uncentered through one module "
                            "attribute (or through one that cannot be told)")
        return None

    def conflict(self, value: str, users: list[tuple[str, int]]) -> bool:
        """Some reader's attribute is unknown, or a centered and an uncentered reader share one."""
        users_ = {u for u, _ in users}
        centered = {self.holder(value, u) for u in users_}
        uncentered = {self.holder(value, r) for r in self.readers(value) if r not in users_}
        return None in centered | uncentered or bool(centered & uncentered)

    def plan(self, view: View, request_for: Callable[[frozenset], PlanRequest], planner: Callable) -> Plan:
        """`planner`'s plan, asked again with more refusals (`request_for(conflicts)`) while a tied
        tensor is read centered and uncentered through one attribute."""
        conflicts: frozenset = frozenset()
        while True:
            plan = planner(view, request_for(conflicts))
            found = {e.value for e in plan.const_edits if self.conflict(e.value, e.users)}
            if not found:
                return plan
            if found <= conflicts:  # the refusals stop stream sources only: this is a reader's weight or bias
                name = self.attrs.get(min(found), min(found))
                raise LnfoldError(f"`{name}` would need different values for its readers (one module attribute "
                                  f"read after different norms, or edited and not); {self.who} cannot edit it "
                                  "(fold_module can)")
            conflicts |= found


def scope_of(root: nn.Module, node: Optional[fx.Node]) -> Optional[nn.Module]:
    """The innermost module whose forward ran `node` (the root where export recorded none)."""
    if node is None:
        return None
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return root
    path = list(stack.values())[-1][0]
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def layernorm_module_refusal(root: nn.Module, info: GraphInfo, name: str, swaps: frozenset) -> Optional[str]:
    """Why folded norm `name` has no nn.LayerNorm module to swap (None: it has one).

    A LayerNorm module swaps only when every call of it in the graph folds; an F.layer_norm in
    some module's forward has no module to swap (its stream is still centered: it stays exact)."""
    m = scope_of(root, info.nodes[name])
    if m is None or not isinstance(m, nn.LayerNorm) or type(m).forward is not nn.LayerNorm.forward:
        where = "" if m is None else f" in `{type(m).__name__}.forward`"
        what = "a LayerNorm written as several ops" if name in info.decomposed else "a functional layer_norm"
        return f"no nn.LayerNorm module to swap ({what}{where}); its stream is centered"
    calls = [n for n, node in info.nodes.items()
             if node.op == "call_function" and "layer_norm" in str(node.target) and scope_of(root, node) is m]
    if not set(calls) <= swaps:
        return "its nn.LayerNorm module is also called where the stream cannot be folded"
    return None
