"""Module-level fold for training: `fold_for_training(module, args)` edits the eager module in place.

A torch.compile backend sees one Dynamo graph at a time. Under FSDP2 (`fully_shard` per block),
per-block compile or any graph break, each graph starts its residual stream at a graph input, and
nothing can be proven zero-mean inside one fragment. So the whole model is analyzed once (the
torch.export analysis of `fold_module`), and the plan is applied to the user's `nn.Module` itself:

- each centered weight is computed in the forward from the original parameter (`W - mean(W)`,
  DESIGN §1 "Equivalence in training"): the module that holds it gets a property of the same
  name (the mechanism of `torch.nn.utils.parametrize`) that centers it while one of the plan's
  readers runs its forward (hooks count them in and out) and is the Parameter itself otherwise.
  The Parameter stays in `_parameters` under its own name: the optimizer's parameters,
  `named_parameters()` and the `state_dict` keys and values are the original ones, so a
  checkpoint of the folded model loads into the unfolded model; FSDP2, which swaps
  `_parameters` between sharded and all-gathered tensors and reads them back with `getattr`
  outside forward, sees its own tensors, and the property centers the full one in forward;
- a tied weight is centered only where the plan's readers read it (GPT-2's wte is centered
  for the embedding, not for lm_head, which holds the same Parameter);
- a LayerScale vector is folded into its sources' centered weights and reads as ones;
- each folded `nn.LayerNorm` becomes an RMSNorm (`F.rms_norm` + β), same object, same `weight`
  and `bias` Parameters (its class is swapped, as `fully_shard` does).

Fold before wrapping (DDP, `fully_shard`, activation checkpointing, `torch.compile`): the
analysis exports the plain module. `unfold_for_training(module)` (or `result.unfold()`) undoes it all.

The analysis runs in the module's current mode: a train-mode Dropout with p > 0 on the residual
stream is not shift-transparent, so its norms are kept, correctly. A component is also kept
where the module-level fold cannot apply an edit (a Python number or a tensor created in
`forward` writes into the stream, a stream that needs a recenter, a weight read through an
attribute that is also read uncentered); the report says which.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..passes import FoldResult, LnfoldError, NothingToFold, VerificationError, View, make_plan, pipeline
from ..passes.analysis import Component
from ..passes.options import FoldOptions
from ..passes.request import Capabilities, PlanRequest
from ..passes.plan import Ones, Plan, Scale

from ..passes.edits import apply_ops

from .api import check_plan, exported_view
from .classify import GraphInfo
from .edits import TENSOR
from .hf import register_caches
from .verify import Verifier

RECORD = "_lnfold_training_fold"  # attribute of the folded root module: what unfolding undoes
EDITS = "_lnfold_edits"  # attribute of a module with centered attributes: name -> _EditInForward
READING = "_lnfold_reading"  # ... and how many of their folded readers' forwards are running


class LayerNormAsRMSNorm(nn.Module):
    """A folded LayerNorm: RMSNorm of its (now zero-mean) input, γ, then β as an Add.

    Keeps the LayerNorm's attributes and Parameters (`normalized_shape`, `eps`, `weight`,
    `bias`); a module's class is set to this one in place, and set back by `unfold_for_training`."""

    normalized_shape: tuple
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps} (folded LayerNorm)"


@dataclass(frozen=True)
class _Holder:
    """Where a parameter or buffer lives: `module._parameters[name]` or `module._buffers[name]`."""

    module: nn.Module
    name: str

    def raw(self) -> torch.Tensor:
        t = self.module._parameters.get(self.name)
        return self.module._buffers[self.name] if t is None else t


@dataclass
class _EditInForward:
    """The edited tensor one attribute reads, computed in forward from the raw tensor by the one
    interpreter of edit ops (passes/edits.apply_ops) over torch tensors; `by` holds the
    LayerScale vectors its Scale ops read, raw (their own attribute reads as ones)."""

    ops: tuple
    by: dict  # constant name -> _Holder

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_ops(x, self.ops, lambda name: self.by[name].raw(), TENSOR)


def _edited_attribute(name: str) -> property:
    def get(self):
        raw = _Holder(self, name).raw()
        return self._lnfold_edits[name](raw) if self._lnfold_reading else raw

    return property(get, doc=f"`{name}` centered while a folded reader's forward runs, else the Parameter")


_classes: dict[tuple, type] = {}


def _with_edited_attributes(cls: type, names: frozenset) -> type:
    """A subclass of `cls` whose attributes `names` are properties (one class per kind of edit)."""
    key = (cls, names)
    if key not in _classes:
        attrs = {n: _edited_attribute(n) for n in sorted(names)}
        _classes[key] = type(f"Folded{cls.__name__}", (cls,), attrs)
    return _classes[key]


def _start_reading(holders: list[nn.Module], module, args) -> None:
    for h in holders:
        h._lnfold_reading += 1


def _stop_reading(holders: list[nn.Module], module, args, output) -> None:
    for h in holders:
        h._lnfold_reading -= 1


@dataclass
class _Fold:
    """What `unfold_for_training` undoes: swapped classes (with the original) and hooks."""

    classes: list[tuple[nn.Module, type]] = field(default_factory=list)
    hooks: list = field(default_factory=list)


class TrainingFold(FoldResult):
    """FoldResult of `fold_for_training`: `.module` is the user's module, folded in place."""

    def unfold(self) -> nn.Module:
        return unfold_for_training(self.module)


def fold_for_training(module: nn.Module, args: tuple, kwargs: Optional[dict] = None, *, mode: str = "rms",
                      verify: bool = True, dynamic: bool = True) -> TrainingFold:
    """Fold `module` in place for training: centered weights computed in forward, RMSNorms.

    Call it on the plain module, before DDP / fully_shard / checkpointing / torch.compile.
    Parameters, their names and the state_dict are unchanged. Returns a TrainingFold whose
    report is `fold_module`'s (less the components this fold cannot edit, kept with a reason).
    Raises NothingToFold when no LayerNorm can be folded, and VerificationError (the module
    restored) when the folded module's outputs on `args` differ from the original's.
    """
    opts = FoldOptions(mode=mode, verify=verify)
    if RECORD in module.__dict__:
        raise LnfoldError("the module is already folded for training (unfold it first)")
    frontend = _TrainingFrontend(module, tuple(args), dict(kwargs or {}), opts, dynamic)
    return pipeline.fold(frontend, verify=opts.verify, planner=frontend.plan)


class _TrainingFrontend:
    """The module-level training fold in the pipeline (passes/pipeline.py): the plan of the
    exported graph applied to the user's module itself."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, opts: FoldOptions, dynamic: bool) -> None:
        self.module, self.args, self.kwargs, self.opts, self.dynamic = module, args, kwargs, opts, dynamic
        register_caches(module)  # before the original's run: its cache outputs flatten as the folded module's will
        # runs (and copies) the module before it is edited
        self.verifier = Verifier(module, args, kwargs) if opts.verify else None

    def view(self) -> View:
        gm, self.attrs, view, self.info = exported_view(self.module, self.args, self.kwargs, self.dynamic)
        self.mapper = _Mapper(self.module, gm, self.attrs, self.info)
        return view

    def request(self, conflicts: frozenset = frozenset()) -> PlanRequest:
        # The LayerNorm modules stay (their class swapped) and keep their own β; compression would
        # rewrite the readers' weights and shapes: not done on an eager module.
        target = Capabilities(name="the module-level training fold", folds_beta=False, compresses=False,
                              swap_refusal=functools.partial(_swap_refusal, self.module, self.info))
        return PlanRequest(self.opts.mode, target=target,
                           refuse=functools.partial(self.mapper.refusal, conflicts=conflicts))

    def plan(self, view: View, request: PlanRequest) -> Plan:
        """make_plan, asked again with more refusals while a tied tensor is read centered and
        uncentered through one attribute."""
        conflicts: frozenset = frozenset()
        while True:
            plan = make_plan(view, request)
            found = {e.value for e in plan.const_edits if self.mapper.conflict(e.value, e.users)}
            if not found:
                return plan
            conflicts |= found
            request = self.request(conflicts)

    def check(self, plan: Plan) -> None:
        if plan.empty and plan.unswapped:
            raise NothingToFold(f"no nn.LayerNorm module can be swapped; first: {plan.report.norms[0].reason}")
        try:
            check_plan(plan)
        except NothingToFold as e:
            raise NothingToFold(f"{e}{_dropout_advice(self.module, plan, self.mapper.nodes)}") from None

    def apply(self, plan: Plan) -> nn.Module:
        module = self.module
        norms = list({id(m): m for m in (_scope(module, self.info.nodes[n]) for n in plan.swaps)}.values())
        record = _Fold()
        module.__dict__[RECORD] = record
        _apply_edits(module, plan, self.mapper, record)
        for ln in norms:
            record.classes.append((ln, type(ln)))
            ln.__class__ = LayerNormAsRMSNorm
        return module

    emit = staticmethod(pipeline.in_memory)

    def verify(self, plan: Plan, module: nn.Module):
        try:
            return self.verifier.check(module)
        except VerificationError:
            unfold_for_training(module)
            raise

    def result(self, plan: Plan, module: nn.Module) -> "TrainingFold":
        return TrainingFold(report=plan.report.renamed(self.attrs), module=module)  # weights by state_dict names


def unfold_for_training(module: nn.Module) -> nn.Module:
    """Undo `fold_for_training` on `module` (its root): original classes, no edited attributes."""
    record = module.__dict__.pop(RECORD, None)
    if record is None:
        raise LnfoldError("the module was not folded by fold_for_training")
    for hook in record.hooks:
        hook.remove()
    for mod, cls in reversed(record.classes):
        mod.__dict__.pop(EDITS, None)
        mod.__dict__.pop(READING, None)
        mod.__class__ = cls
    return module


# --- from the exported graph back to the module ---------------------------------------------------

class _Mapper:
    """Maps the plan's constants (graph values) to where the module holds them, per reader.

    A reader (a graph node) reads a tensor through the attribute of the module it runs in
    (`nn_module_stack`), or of the one module below it that holds the tensor; a tied tensor has
    one holder per module that holds it (GPT-2: `wte.weight` and `lm_head.weight`)."""

    def __init__(self, module: nn.Module, gm: fx.GraphModule, attrs: dict[str, str], info: GraphInfo) -> None:
        self.module = module
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

    def holder(self, value: str, reader: str) -> Optional[_Holder]:
        t = self.tensor(value)
        scope = _scope(self.module, self.nodes.get(reader))
        if t is None or scope is None:
            return None
        own = [n for n, x in (*scope._parameters.items(), *scope._buffers.items()) if x is t]
        if len(own) == 1:
            return _Holder(scope, own[0])
        below = {(id(m), n): _Holder(m, n) for _, m in scope.named_modules(remove_duplicate=False)
                 for n, x in (*m._parameters.items(), *m._buffers.items()) if x is t}
        return next(iter(below.values())) if len(below) == 1 else None

    def readers(self, value: str) -> list[str]:
        node = self.nodes.get(value)
        return [u.name for u in node.users] if node is not None else []

    def refusal(self, comp: Component, conflicts: set[str]) -> Optional[str]:
        """Why the module-level fold cannot edit this component, or None."""
        if comp.opaque:
            return (f"needs a recenter of {comp.opaque[0].what}, which the module-level training fold "
                    "does not insert (fold_module or the lnfold backend do)")
        for src in comp.sources:
            for ref in (*src.refs, *src.scales):
                if ref.value in self.info.scalars:
                    node, _ = self.info.scalars[ref.value]
                    return (f"a Python number in forward (`{node.name}`) writes into the stream; the "
                            "module-level training fold edits only parameters and buffers")
                if self.tensor(ref.value) is None:
                    return (f"`{ref.value}` writes into the stream but is not a parameter or buffer of the "
                            "module (a tensor made in forward?); the module-level training fold cannot edit it")
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


def _scope(root: nn.Module, node: Optional[fx.Node]) -> Optional[nn.Module]:
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


def _apply_edits(root: nn.Module, plan: Plan, mapper: _Mapper, record: _Fold) -> None:
    """Give each holder of an edited tensor a property that centers it while one of the plan's
    readers runs: hooks on the reader's module count it in and out. Outside those forwards
    (an uncentered reader of a tied weight, FSDP2's `getattr`, user code) it reads the Parameter."""
    recipes: dict[int, tuple[nn.Module, dict[str, _EditInForward]]] = {}
    readers: dict[int, tuple[nn.Module, dict[int, nn.Module]]] = {}
    ones_holders = {e.value: mapper.holder(e.value, e.users[0][0]) for e in plan.const_edits if e.ops == (Ones(),)}
    for edit in plan.const_edits:
        by = {op.by: ones_holders.get(op.by) or mapper.holder(op.by, mapper.readers(op.by)[0])
              for op in edit.ops if isinstance(op, Scale)}
        for user, _ in edit.users:
            h = mapper.holder(edit.value, user)
            mod, table = recipes.setdefault(id(h.module), (h.module, {}))
            table[h.name] = _EditInForward(edit.ops, by)
            scope = _scope(root, mapper.nodes[user])
            readers.setdefault(id(scope), (scope, {}))[1][id(h.module)] = h.module
    for mod, table in recipes.values():
        record.classes.append((mod, type(mod)))
        mod.__dict__[EDITS] = table
        mod.__dict__[READING] = 0
        mod.__class__ = _with_edited_attributes(type(mod), frozenset(table))
    for scope, holders in readers.values():
        hs = list(holders.values())
        record.hooks.append(scope.register_forward_pre_hook(functools.partial(_start_reading, hs)))
        record.hooks.append(scope.register_forward_hook(functools.partial(_stop_reading, hs), always_call=True))


def _swap_refusal(root: nn.Module, info: GraphInfo, name: str, swaps: frozenset) -> Optional[str]:
    """Why folded norm `name` has no nn.LayerNorm module to swap (None: it has one).

    A LayerNorm module swaps only when every call of it in the graph folds; an F.layer_norm in
    some module's forward has no module to swap (its stream is still centered: it stays exact)."""
    m = _scope(root, info.nodes[name])
    if m is None or not isinstance(m, nn.LayerNorm) or type(m).forward is not nn.LayerNorm.forward:
        where = "" if m is None else f" in `{type(m).__name__}.forward`"
        what = "a LayerNorm written as several ops" if name in info.decomposed else "a functional layer_norm"
        return f"no nn.LayerNorm module to swap ({what}{where}); its stream is centered"
    calls = [n for n, node in info.nodes.items()
             if node.op == "call_function" and "layer_norm" in str(node.target) and _scope(root, node) is m]
    if not set(calls) <= swaps:
        return "its nn.LayerNorm module is also called where the stream cannot be folded"
    return None


def _dropout_advice(root: nn.Module, plan: Plan, nodes: dict) -> str:
    """What to set when train-mode Dropout starts the residual stream (it drops entries, so the
    stream's mean is not zero and nothing folds: correctly); '' where none does."""
    names = {id(m): n for n, m in root.named_modules()}
    drops = {names[id(m)]: None for comp in plan.components for o in comp.opaque
             for m in [_scope(root, nodes.get(o.value))]
             if isinstance(m, nn.Dropout) and m.training and m.p > 0 and id(m) in names}
    if not drops:
        return ""
    shown = ", ".join(f"`{n}`" for n in list(drops)[:3]) + (f" and {len(drops) - 3} more" if len(drops) > 3 else "")
    config = getattr(root, "config", None)
    fields = {k: v for k, v in (config.to_dict() if hasattr(config, "to_dict") else {}).items()
              if "drop" in k and isinstance(v, float) and v > 0}
    now = "; this config's: " + ", ".join(f"{k}={v}" for k, v in fields.items()) if fields else ""
    return (f". Train-mode Dropout writes into the residual stream ({shown}) and breaks its zero mean: set "
            "their p to 0 to train the folded model (a transformers config's residual and embedding dropout, "
            f"e.g. GPT-2's resid_pdrop=0, embd_pdrop=0{now}; attention dropout may stay), or, for inference, "
            "fold_module(model.eval(), ...)")


def is_folded(module: nn.Module) -> bool:
    return RECORD in module.__dict__


__all__ = ["LayerNormAsRMSNorm", "TrainingFold", "fold_for_training", "is_folded", "unfold_for_training"]
