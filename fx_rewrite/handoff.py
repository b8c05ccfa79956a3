"""The eager RMSNorm hand-off: the user's own module, folded, for the tools that expect RMSNorm.

Rotation-based quantizers and their exporters (QuaRot, SpinQuant, ModelOpt, llm-compressor,
Brevitas) find norms by class name ("RMSNorm") and read `config.rms_norm_eps`; they take no graph.
So fold_module's plan is applied to the module itself, in place (no second copy of a big model):
each edited constant is computed once in float64 and baked into the attribute its reader reads
(holders.py), a bias-free reader Linear gets `W β` as a new bias, and each folded `nn.LayerNorm`
becomes a `torch.nn.RMSNorm`, exact on its now zero-mean input (THEORY §1); one whose β cannot move
(its output is a graph output, a reader is not linear) stays an `nn.LayerNorm`, reported kept. A tie
whose holders the fold makes differ (GPT-2's centered wte, uncentered lm_head) is broken and
`config.tie_word_embeddings` set False, or `from_pretrained` would tie them again; `config.lnfold`
records the swaps and new biases for `restore_rmsnorm`.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..passes import FoldResult, LnfoldError, NothingToFold, VerificationError, View, make_plan, pipeline
from ..passes.edits import compute_constants, compute_new_bias
from ..passes.errors import first_line
from ..passes.options import FoldOptions
from ..passes.outputs import inside
from ..passes.plan import Plan
from ..passes.defer import EAGER
from ..passes.request import Capabilities, PlanRequest, request_from
from .api import ExportFrontend, check_plan
from .checkpoint import INDEX, SINGLE
from .edits import from_numpy, to_numpy
from .hf import register_caches
from .holders import Holder, ModuleMap, layernorm_module_refusal, scope_of
from .verify import Verifier

HANDOFF = "the eager RMSNorm hand-off"
CONFIG_KEY = "lnfold"  # config.lnfold: what restore_rmsnorm needs after from_pretrained


@dataclass
class Handoff:
    """What the hand-off did to the module, by the module's own names."""

    rmsnorm: list[str] = field(default_factory=list)  # modules now torch.nn.RMSNorm
    eps: dict[str, float] = field(default_factory=dict)  # their ε
    kept: dict[str, str] = field(default_factory=dict)  # LayerNorm modules left as they are: why
    parameters: list[str] = field(default_factory=list)  # state_dict names whose values changed
    new_biases: list[str] = field(default_factory=list)  # Linear modules given a bias (W β)
    untied: list[str] = field(default_factory=list)  # ties the fold broke, and why
    config: list[str] = field(default_factory=list)  # config fields set, per transformers model

    def table(self) -> str:
        lines = [f"{len(self.rmsnorm)} torch.nn.RMSNorm modules, {len(self.parameters)} parameters baked, "
                 f"{len(self.new_biases)} new biases"]
        lines += [f"  rmsnorm  {n} (eps={self.eps[n]:g})" for n in self.rmsnorm]
        lines += [f"  kept     {n}: {why}" for n, why in self.kept.items()]
        lines += [f"  bias     {n} (new: β moved in)" for n in self.new_biases]
        lines += [f"  untied   {t}" for t in self.untied]
        lines += [f"  config   {c}" for c in self.config]
        return "\n".join(lines)


@dataclass
class HandoffResult(FoldResult):
    """FoldResult of `fold_to_rmsnorm`: `.module` is the user's module, edited in place."""

    handoff: Handoff = field(default_factory=Handoff)


def fold_to_rmsnorm(module: nn.Module, args: tuple, kwargs: Optional[dict] = None, *, rotate: Optional[str] = None,
                    seed: int = 0, gamma_into_readers: bool = True, verify: bool = True,
                    dynamic: bool = True) -> HandoffResult:
    """Fold `module` in place into an RMSNorm model its class still runs (see the module docstring).

    `gamma_into_readers` (default): each norm's γ moves into the weights of the layers that read
    it, leaving a unit-weight RMSNorm (False: the RMSNorm keeps γ). `rotate` ("hadamard" or
    "orthogonal", with `seed`): each folded stream is rotated as `fold_module(rotate=...)` does,
    exactly (the "-keep-ln" rotations are for models that keep their LayerNorms: fold_module).
    Returns a HandoffResult (`.module`: `module`; `.handoff`: what changed, by name; `.report`:
    the fold's report). Raises NothingToFold when no LayerNorm module can become an RMSNorm, and
    VerificationError (the module restored) when the edited module's outputs on `args` differ
    from the original's beyond what float64 allows.
    """
    if rotate is not None and rotate.endswith("-keep-ln"):
        raise LnfoldError(f"rotate={rotate!r} keeps the LayerNorms; the hand-off makes them RMSNorms: use "
                          "fold_module(..., rotate=...) for it, or rotate='hadamard' / 'orthogonal' here")
    opts = FoldOptions(mode="rms", defer="off", verify=verify, gamma_into_readers=gamma_into_readers or bool(rotate),
                       rotate=rotate, seed=seed)
    frontend = HandoffFrontend(module, tuple(args), dict(kwargs or {}), opts, dynamic=dynamic)
    return pipeline.fold(frontend, verify=opts.verify, planner=frontend.plan)


class HandoffFrontend(ExportFrontend):
    """fold_module's frontend (export, view, request), its plan applied to the eager module."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, opts: FoldOptions, *,
                 dynamic: bool = True) -> None:
        super().__init__(module, args, kwargs, opts, norm="rms_norm", dynamic=dynamic)
        register_caches(module)  # before the original's run: its cache outputs flatten as the edited module's
        # runs (and copies, for float64) the module before it is edited
        self.verifier = Verifier(module, args, kwargs) if opts.verify else None
        self.rotation = None if opts.rotate is None else {"kind": opts.rotate, "seed": opts.seed}
        self.undo: list[Callable[[], None]] = []

    def view(self) -> View:
        view = super().view()
        self.mapper = ModuleMap(self.module, self.gm, self.attrs, self.info, who=HANDOFF)
        return view

    def request(self, conflicts: frozenset = frozenset()) -> PlanRequest:
        target = Capabilities(name=HANDOFF, costs=EAGER, compresses=False, new_biases=True, norm_beta=False,
                              readout_matmul=False,
                              swap_refusal=functools.partial(layernorm_module_refusal, self.module, self.info))
        return request_from(self.opts, target, zero=self.zero,
                            refuse=functools.partial(self.mapper.refusal, conflicts=conflicts))

    def plan(self, view: View, request: PlanRequest) -> Plan:
        return self.mapper.plan(view, lambda conflicts: self.request(conflicts) if conflicts else request,
                                planner=make_plan)  # (looked up here: a test plants a bug in it)

    def check(self, plan: Plan) -> None:
        if plan.empty and plan.kept_by_target:
            first = next(v for v in plan.report.norms if v.name == plan.kept_by_target[0])
            raise NothingToFold(f"no nn.LayerNorm module can become an RMSNorm; first: {first.reason}")
        check_plan(plan)

    def apply(self, plan: Plan) -> nn.Module:
        self.done = Handoff()
        self.names = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}  # (as the user has it)
        try:
            self._bake(plan)
            self._new_biases(plan)
            self._swap(plan)
            self._configure(plan)
        except Exception:
            self.restore()
            raise
        return self.module

    emit = staticmethod(pipeline.in_memory)

    def verify(self, plan: Plan, module: nn.Module):
        try:
            return self.verifier.check(module)
        except VerificationError:
            self.restore()
            raise

    def result(self, plan: Plan, module: nn.Module) -> HandoffResult:
        report = plan.report.renamed(self.attrs)
        for name, why in self.done.kept.items():
            report.notes.append(f"`{name}` stays an nn.LayerNorm: {why}")
        return HandoffResult(report=report, module=module, handoff=self.done)

    def restore(self) -> None:
        """Undo every edit made so far, last first."""
        while self.undo:
            self.undo.pop()()

    # --- the edits, each recorded for `restore` -------------------------------------------------
    def _set(self, h: Holder, t: torch.Tensor) -> None:
        table = h.module._parameters if h.name in h.module._parameters else h.module._buffers
        old = table[h.name]
        table[h.name] = t
        self.undo.append(lambda: table.__setitem__(h.name, old))

    def _qualified(self, h: Holder) -> str:
        owner = self.names[id(h.module)]
        return f"{owner}.{h.name}" if owner else h.name

    def _bake(self, plan: Plan) -> None:
        """Every edited constant, computed once in float64 from the originals, into the attribute
        each of its readers reads. Equal edits of one tensor stay one (tied) Parameter."""
        edited = {id(t): t for t in (self.mapper.tensor(e.value) for e in plan.const_edits) if t is not None}
        tied = {k: hs for k, hs in _holders_of(self.module, edited).items() if len(hs) > 1}
        made: dict[tuple, torch.Tensor] = {}
        assigned: dict[Holder, tuple] = {}
        for edit, arr in compute_constants(list(plan.const_edits), lambda n: to_numpy(self.tensor(n))):
            old = self.mapper.tensor(edit.value)
            for user, _ in edit.users:
                h = self.mapper.holder(edit.value, user)
                key = (id(old), edit.ops)
                if assigned.setdefault(h, key) != key:
                    raise LnfoldError(f"`{self._qualified(h)}` would need two different edits (read by `{user}` "
                                      f"and another reader); {HANDOFF} cannot bake both")
                if key not in made:
                    t = from_numpy(arr, old)
                    made[key] = nn.Parameter(t, requires_grad=old.requires_grad) \
                        if isinstance(old, nn.Parameter) else t
                self._set(h, made[key])
        self.done.parameters = sorted({self._qualified(h) for h in assigned})
        for hs in tied.values():  # one tensor, several attributes, now different values: the tie is broken
            if len({id(h.raw()) for h in hs}) > 1:
                self.done.untied.append(" / ".join(self._qualified(h) for h in hs)
                                        + ": the fold makes them differ (each holds its own tensor now)")

    def _new_biases(self, plan: Plan) -> None:
        """A reader Linear without a bias gets `W β` as its bias (float64, the weight's dtype)."""
        for nb in plan.new_biases:
            h = self.mapper.holder(nb.op.weight, nb.node)
            m = h.module if h is not None else None
            if m is None or h.name != "weight" or "bias" not in m._parameters or m._parameters["bias"] is not None:
                raise LnfoldError(f"`{nb.node}` reads a folded norm through a layer that cannot take a new bias; "
                                  f"{HANDOFF} needs a bias there for β")
            w = self.tensor(nb.op.weight)
            b = from_numpy(compute_new_bias(nb, lambda n: to_numpy(self.tensor(n))), w)
            m._parameters["bias"] = nn.Parameter(b, requires_grad=w.requires_grad)
            self.undo.append(lambda m=m: m._parameters.__setitem__("bias", None))
            self.done.new_biases.append(self.names[id(m)])

    def _swap(self, plan: Plan) -> None:
        """Each folded LayerNorm module becomes a torch.nn.RMSNorm with its ε and its (baked) γ."""
        norms = {id(m): m for m in (scope_of(self.module, self.info.nodes[n]) for n in plan.swaps)}
        unit = {id(scope_of(self.module, self.info.nodes[n])) for n in plan.unit_gamma}
        for ln in norms.values():
            # γ moved into the readers: a unit weight (the module's own γ Parameter is left alone)
            rms = rmsnorm_like(ln, torch.ones_like(ln.weight) if id(ln) in unit and ln.weight is not None else None)
            for parent in list(self.module.modules()):
                for attr, child in list(parent._modules.items()):
                    if child is ln:
                        parent._modules[attr] = rms
                        self.undo.append(lambda p=parent, a=attr, old=ln: p._modules.__setitem__(a, old))
            self.done.rmsnorm.append(self.names[id(ln)])
            self.done.eps[self.names[id(ln)]] = float(ln.eps)
        order = {n: k for k, n in enumerate(self.names.values())}
        self.done.rmsnorm.sort(key=order.__getitem__)  # in the module's order
        for name in plan.kept_by_target:
            m = scope_of(self.module, self.info.nodes[name])
            why = next(v.reason for v in plan.report.norms if v.name == name)
            self.done.kept[self.names.get(id(m), name)] = why

    def _configure(self, plan: Plan) -> None:
        """transformers models: rms_norm_eps where one ε serves every swapped norm, the hand-off's
        record for restore_rmsnorm, and no re-tying of a tie the fold broke."""
        for prefix, model in _hf_models(self.module):
            mine = lambda n: n == prefix[:-1] or n.startswith(prefix)  # noqa: E731
            rel = lambda n: n[len(prefix):]  # noqa: E731
            norms = [n for n in self.done.rmsnorm if mine(n)]
            if not norms:
                continue
            cfg = model.config
            record = {"rmsnorm": [rel(n) for n in norms], "eps": {rel(n): self.done.eps[n] for n in norms},
                      "new_biases": [rel(n) for n in self.done.new_biases if mine(n)],
                      "rotation": self.rotation}
            self._config(cfg, CONFIG_KEY, record)
            self.done.config.append(f"{self.names[id(model)] or type(model).__name__}.config.{CONFIG_KEY}")
            epss = {self.done.eps[n] for n in norms}
            if len(epss) == 1:
                self._config(cfg, "rms_norm_eps", epss.pop())
                self.done.config.append(f"rms_norm_eps={cfg.rms_norm_eps:g}")
            else:
                self.done.config.append(f"rms_norm_eps not set: the norms have {len(epss)} different ε")
            if self.done.untied and getattr(cfg, "tie_word_embeddings", False):
                self._config(cfg, "tie_word_embeddings", False)
                self.done.config.append("tie_word_embeddings=False (the fold broke the tie)")

    def _config(self, cfg, key: str, value) -> None:
        had = key in cfg.__dict__
        old = cfg.__dict__.get(key)
        setattr(cfg, key, value)
        self.undo.append(lambda: setattr(cfg, key, old) if had else cfg.__dict__.pop(key, None))


def rmsnorm_like(ln: nn.LayerNorm, weight: Optional[torch.Tensor] = None) -> nn.RMSNorm:
    """A torch.nn.RMSNorm with `ln`'s shape, ε, device and dtype, weight `weight` (default: `ln`'s
    γ, ones where it has none)."""
    w = ln.weight if weight is None else weight
    like = w if w is not None else (ln.bias if ln.bias is not None else torch.empty(0))
    rms = nn.RMSNorm(ln.normalized_shape, eps=ln.eps, elementwise_affine=True, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        if w is not None:
            rms.weight.copy_(w)
    rms.train(ln.training)
    return rms


def _holders_of(root: nn.Module, tensors: dict[int, torch.Tensor]) -> dict[int, list[Holder]]:
    """Every attribute (module, name) that holds one of `tensors` (by identity)."""
    out: dict[int, list[Holder]] = {}
    for m in root.modules():
        for n, t in (*m._parameters.items(), *m._buffers.items()):
            if t is not None and id(t) in tensors:
                out.setdefault(id(t), []).append(Holder(m, n))
    return out


def _hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models in `root` (name prefix with its dot, model)."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        hf = hasattr(getattr(m, "config", None), "to_dict") and hasattr(m, "save_pretrained")
        if hf and not any(name.startswith(p) for p, _ in out):  # (the root's prefix "" starts every name)
            out.append((f"{name}." if name else "", m))
    return out


# --- after from_pretrained -------------------------------------------------------------------------

def restore_rmsnorm(model: nn.Module, folder: Optional[str] = None) -> nn.Module:
    """Make a transformers model loaded from a hand-off's folder the hand-off again, in place.

    `from_pretrained` builds the model's own class, with LayerNorm modules and bias-free Linears
    where the hand-off has `torch.nn.RMSNorm`s and new biases. This swaps the norms that
    `config.lnfold` lists for RMSNorms (their weights are the loaded ones), gives the listed
    Linears their bias, and reads those biases (which `from_pretrained` skipped as unexpected)
    from `folder` (default: the folder the model was loaded from). Without a folder (a model
    built from its config) the biases are zeros: load the hand-off's state_dict after this.

        model = AutoModelForCausalLM.from_pretrained(path)
        lnfold.fx_rewrite.restore_rmsnorm(model)
    """
    records = [(hf, record) for _, hf in _hf_models(model) if (record := getattr(hf.config, CONFIG_KEY, None))]
    if not records:
        raise LnfoldError(f"the model has no config.{CONFIG_KEY}: it was not saved from fold_to_rmsnorm's result")
    biases = []  # every check and read before the first change: an error leaves the model as it was
    for hf, record in records:
        for name in record["rmsnorm"]:
            ln = hf.get_submodule(name)
            if not isinstance(ln, (nn.RMSNorm, nn.LayerNorm)):
                raise LnfoldError(f"`{name}` is a {type(ln).__name__}, not the LayerNorm config.{CONFIG_KEY} names")
        path = folder if folder is not None else getattr(hf.config, "_name_or_path", None)
        wanted = record["new_biases"] and path and os.path.isdir(path)
        biases.append(_read_tensors(path, [f"{n}.bias" for n in record["new_biases"]]) if wanted else {})
    for (hf, record), loaded in zip(records, biases):
        for name in record["rmsnorm"]:
            ln = hf.get_submodule(name)
            if isinstance(ln, nn.LayerNorm):
                parent, _, attr = name.rpartition(".")
                hf.get_submodule(parent)._modules[attr] = rmsnorm_like(ln)
        for name in record["new_biases"]:
            lin = hf.get_submodule(name)
            if lin._parameters.get("bias") is None:
                w = lin.weight
                lin.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                                        requires_grad=w.requires_grad)
        params = dict(hf.named_parameters())
        with torch.no_grad():
            for key, t in loaded.items():
                params[key].copy_(t)
    return model


def _read_tensors(folder: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors `keys` of a save_pretrained folder (safetensors, sharded or not)."""
    from safetensors import safe_open

    where = {}
    if os.path.exists(os.path.join(folder, INDEX)):
        try:
            with open(inside(folder, INDEX, folder)) as f:
                where = dict(json.load(f)["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise LnfoldError(f"{os.path.join(folder, INDEX)}: not a shard index ({first_line(e)})") from None
    # every file the index names for `keys`, checked before any is opened (a `../x` would be read)
    files = {key: inside(folder, where.get(key, SINGLE), os.path.join(folder, INDEX) if where else folder)
             for key in keys}
    out = {}
    for key in keys:
        with safe_open(str(files[key]), framework="pt") as f:
            if key not in f.keys():
                raise LnfoldError(f"`{key}` is not in {folder}: not a folder saved from fold_to_rmsnorm's result")
            out[key] = f.get_tensor(key)
    return out
