"""Module-level fold for training: `fold_for_training(module, args)` edits the eager module in place.

A compile backend sees one Dynamo graph at a time: under FSDP2, per-block compile or a graph break
each starts its stream at a graph input, where nothing can be proven zero-mean. So the whole model
is analyzed once (fold_module's torch.export analysis) and the plan applied to the module itself:

- a centered weight is computed in the forward from the original Parameter (THEORY §1): its holder
  gets a property of the same name (parametrize's mechanism) that centers it while one of the plan's
  readers runs (hooks count them in and out) and is the Parameter otherwise. The Parameter stays in
  `_parameters`: the optimizer and the state_dict see the originals, and FSDP2, which swaps
  `_parameters` and reads them back with `getattr` outside forward, sees its own tensors;
- a tied weight is centered only where the plan's readers read it (GPT-2's wte, not lm_head);
- a LayerScale vector is folded into its sources' centered weights and reads as ones;
- each folded `nn.LayerNorm` becomes an RMSNorm, same object and Parameters (its class swapped).

A component is kept where train-mode Dropout (p > 0) writes into the stream, or where this fold
cannot apply an edit (a Python number or a tensor created in `forward` writes into the stream, a
stream that needs a recenter, a weight read through an attribute also read uncentered).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..passes import FoldResult, LnfoldError, NothingToFold, VerificationError, View, make_plan, pipeline
from ..passes.options import FoldOptions
from ..passes.edits import apply_ops
from ..passes.plan import Plan
from ..passes.request import Capabilities, PlanRequest, request_from

from .api import check_plan, exported_view
from .edits import TENSOR
from .hf import register_caches
from .holders import Holder, ModuleMap, layernorm_module_refusal, scope_of
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


@dataclass
class _EditInForward:
    """The edited tensor one attribute reads, computed in forward from the raw tensor by the one
    interpreter of edit ops (passes/edits.apply_ops) over torch tensors; `by` holds the
    LayerScale vectors its Scale ops read, raw (their own attribute reads as ones)."""

    ops: tuple
    by: dict  # constant name -> Holder

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_ops(x, self.ops, lambda name: self.by[name].raw(), TENSOR)


def _edited_attribute(name: str) -> property:
    def get(self):
        raw = Holder(self, name).raw()
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


def _count_reading(holders: list[nn.Module], step: int, module, *hook_args) -> None:
    """A reader's forward hooks: pre (step 1) and post (step -1) count it in and out of its holders."""
    for h in holders:
        h._lnfold_reading += step


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

    Call it on the plain module, before DDP / fully_shard / checkpointing / torch.compile (the
    analysis exports the plain module); `unfold_for_training(module)` (or `result.unfold()`) undoes
    it. Parameters, their names and the state_dict are unchanged. Returns a TrainingFold whose
    report is `fold_module`'s (less the components this fold cannot edit, kept with a reason).
    Raises NothingToFold when no LayerNorm can be folded, and VerificationError (the module
    restored) when the folded module's outputs on `args` differ from the original's.
    """
    opts = FoldOptions(mode=mode, verify=verify)
    if is_folded(module):
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
        self.mapper = ModuleMap(self.module, gm, self.attrs, self.info)
        return view

    def request(self, conflicts: frozenset = frozenset()) -> PlanRequest:
        # The LayerNorm modules stay (their class swapped) and keep their own β; compression would
        # rewrite the readers' weights and shapes: not done on an eager module.
        target = Capabilities(name="the module-level training fold", folds_beta=False, compresses=False,
                              swap_refusal=functools.partial(layernorm_module_refusal, self.module, self.info))
        return request_from(self.opts, target, refuse=functools.partial(self.mapper.refusal, conflicts=conflicts))

    def plan(self, view: View, request: PlanRequest) -> Plan:
        """make_plan, asked again with more refusals while a tied tensor is read centered and
        uncentered through one attribute."""
        return self.mapper.plan(view, lambda conflicts: self.request(conflicts) if conflicts else request,
                                planner=make_plan)  # (looked up here: a test plants a bug in it)

    def check(self, plan: Plan) -> None:
        if plan.empty and plan.kept_by_target:
            raise NothingToFold(f"no nn.LayerNorm module can be swapped; first: {plan.report.norms[0].reason}")
        try:
            check_plan(plan)
        except NothingToFold as e:
            raise NothingToFold(f"{e}{_dropout_advice(self.module, plan, self.mapper.nodes)}") from None

    def apply(self, plan: Plan) -> nn.Module:
        module = self.module
        norms = list({id(m): m for m in (scope_of(module, self.info.nodes[n]) for n in plan.swaps)}.values())
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


def _apply_edits(root: nn.Module, plan: Plan, mapper: ModuleMap, record: _Fold) -> None:
    """Each holder of an edited tensor gets its property, each of the plan's readers the hooks that
    count its forward in and out (the module docstring)."""
    recipes: dict[int, tuple[nn.Module, dict[str, _EditInForward]]] = {}
    readers: dict[int, tuple[nn.Module, dict[int, nn.Module]]] = {}
    ones_holders = {e.value: mapper.holder(e.value, e.users[0][0]) for e in plan.const_edits if e.sets_ones}
    for edit in plan.const_edits:
        by = {c: ones_holders.get(c) or mapper.holder(c, mapper.readers(c)[0])
              for op in edit.ops for c in op.constants()}
        for user, _ in edit.users:
            h = mapper.holder(edit.value, user)
            mod, table = recipes.setdefault(id(h.module), (h.module, {}))
            table[h.name] = _EditInForward(edit.ops, by)
            scope = scope_of(root, mapper.nodes[user])
            readers.setdefault(id(scope), (scope, {}))[1][id(h.module)] = h.module
    for mod, table in recipes.values():
        record.classes.append((mod, type(mod)))
        mod.__dict__[EDITS] = table
        mod.__dict__[READING] = 0
        mod.__class__ = _with_edited_attributes(type(mod), frozenset(table))
    for scope, holders in readers.values():
        hs = list(holders.values())
        record.hooks.append(scope.register_forward_pre_hook(functools.partial(_count_reading, hs, 1)))
        record.hooks.append(scope.register_forward_hook(functools.partial(_count_reading, hs, -1), always_call=True))


def _dropout_advice(root: nn.Module, plan: Plan, nodes: dict) -> str:
    """What to set when train-mode Dropout starts the residual stream (it drops entries, so the
    stream's mean is not zero and nothing folds: correctly); '' where none does."""
    names = {id(m): n for n, m in root.named_modules()}
    drops = {names[id(m)]: None for comp in plan.components for o in comp.opaque
             for m in [scope_of(root, nodes.get(o.value))]
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
