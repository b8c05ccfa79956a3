"""The torch.compile backend `lnfold`: fold the LayerNorms of Dynamo's graph, then run Inductor.

    model = torch.compile(model, backend="lnfold")                      # registered entry point
    model = torch.compile(model, backend="lnfold", options={"lnfold.mode": "crms"})
    model = torch.compile(model, backend=fx_rewrite.lnfold_backend_with(mode="rms"))

Dynamo hands over a torch-level graph (`F.layer_norm`, `F.linear`, `operator.add`, `x.view`)
whose parameters are graph inputs, their real tensors among the example inputs. The backend
classifies it into the same stream view as the other frontends, applies the plan, swaps every
folded LayerNorm for `F.rms_norm` (+ β) — the faster of the two exact norms under Inductor — and
delegates to Inductor (`compile_fx`), or to any `inner` backend.

Options. torch.compile passes `mode=` (Inductor's mode: "max-autotune", ...) and `options=` to
a backend named by string as keyword arguments. Keys starting with "lnfold." are ours:
"lnfold.mode" ("rms" or "crms"), "lnfold.on_report" (a callable receiving each graph's Report),
"lnfold.verify" (run the original and the folded graph eagerly on the example inputs at compile
time — under dynamic shapes at the sizes of the tensors at hand — and raise VerificationError if
the gate of passes/gate.py refuses the fold), "lnfold.defer" ("auto", "on", "off": emit
folded norms read only by linear layers as deferred normalization, passes/defer.py; default
"off", as measured; "auto" asks the cost model; inference only); every other key is an
Inductor config patch, as with the default backend.

Inference (grad mode off, or parameters that do not require grad): each centered weight is
computed once in float64 and cached; the compiled graph reads the cached copies as extra inputs.
The user's parameters are never written. The cache notices a parameter that changed (another
tensor, or an in-place update: its version counter moved) and recomputes. Memory: one extra
copy of every edited tensor (the weights that write into the residual stream: embeddings, the
output projections of attention and MLP, their biases).

Training (grad mode on and the edited parameters require grad): the graph keeps reading the
optimizer's parameters and computes `W - mean(W)` itself, so loss and gradients are the original
model's (DESIGN §1); the cost is one mean and one subtraction per edited weight per step.
"""
from __future__ import annotations

import collections
import copy
import functools
import logging
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..passes import LnfoldError, Plan, Report, VerificationError, compute_constants, make_plan
from ..passes.options import FoldOptions
from ..passes.plan import ConstEdit

from ..passes.defer import INDUCTOR_CPU, DeferDecision, add_weight_edits, compute_biases, plan_deferral

from . import defer as deferred_norm
from .apply import TORCH, Applier, Constants, GraphConstants, from_numpy, to_numpy
from .classify import build_view

log = logging.getLogger("lnfold")
OPTION_PREFIX = "lnfold."

# The reports of the last KEPT graphs compiled in this process, newest last (for people and
# tests), and for each of the last KEPT folded graphs the seconds spent in each stage; bounded,
# so that a long-lived process that keeps compiling does not keep every report forever.
KEPT = 64
reports: collections.deque[Report] = collections.deque(maxlen=KEPT)
timings: collections.deque[dict[str, float]] = collections.deque(maxlen=KEPT)


def lnfold_backend(gm: fx.GraphModule, example_inputs: list, *, mode: Optional[str] = None,
                   options: Optional[dict] = None, **kwargs) -> Callable:
    """torch.compile backend "lnfold" (see the module docstring for `mode` and `options`)."""
    ours, patches = {}, {}
    for k, v in (options or {}).items():
        (ours if k.startswith(OPTION_PREFIX) else patches)[k.removeprefix(OPTION_PREFIX)] = v
    unknown = set(ours) - {"mode", "on_report", "verify", "defer"}
    if unknown:
        raise LnfoldError(f"unknown lnfold option(s): {', '.join(sorted(OPTION_PREFIX + k for k in unknown))}")
    inner = functools.partial(_inductor, mode=mode, config_patches=patches)
    return compile_folded(gm, example_inputs, fold_mode=ours.get("mode", "rms"), inner=inner,
                          on_report=ours.get("on_report"), verify=bool(ours.get("verify", False)),
                          defer=ours.get("defer", "off"))


def lnfold_backend_with(mode: str = "rms", *, inner: Optional[Callable] = None,
                        on_report: Optional[Callable[[Report], None]] = None, verify: bool = False,
                        defer: str = "off", **inductor_options) -> Callable:
    """A backend callable with options bound: `torch.compile(m, backend=lnfold_backend_with(...))`.

    `inner(gm, example_inputs)` compiles the folded graph (default: Inductor with
    `inductor_options` as config patches); pass e.g. `inner=lambda gm, _: gm.forward` to run it
    eagerly, or a function that records `gm` to look at what Inductor gets.
    """
    FoldOptions(mode=mode, defer=defer, verify=verify)  # a bad option fails here, not inside torch.compile
    if inner is None:
        inner = functools.partial(_inductor, mode=None, config_patches=inductor_options)

    def backend(gm, example_inputs, **kwargs):
        return compile_folded(gm, example_inputs, fold_mode=mode, inner=inner, on_report=on_report, verify=verify,
                              defer=defer)

    return backend


def _inductor(gm: fx.GraphModule, example_inputs: list, *, mode: Optional[str], config_patches: dict):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
    patches.update(config_patches)
    return compile_fx(gm, example_inputs, config_patches=patches or None)


def constant_inputs(gm: fx.GraphModule, example_inputs: list) -> dict[str, int]:
    """Placeholders that hold parameters or buffers (name -> position), as Dynamo lifted them."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, (node, t) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or _is_module_state(node)):
            out[node.name] = k
    return out


def _is_module_state(node: fx.Node) -> bool:
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    if src is None:
        return False
    name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")
    return "._parameters[" in str(name) or "._buffers[" in str(name)


def compile_folded(gm: fx.GraphModule, example_inputs: list, *, fold_mode: str = "rms",
                   inner: Callable, on_report: Optional[Callable] = None, verify: bool = False,
                   defer: str = "off") -> Callable:
    """Fold a copy of `gm` (Dynamo reads its own graph after the backend returns), compile it.

    A failure of the fold itself never costs the user their compile: it is logged and the
    unfolded graph compiled. `verify` runs both graphs eagerly on the example inputs first and
    raises VerificationError when they differ.
    """
    FoldOptions(mode=fold_mode, defer=defer, verify=verify)  # checked before the fold, whose failures are only logged
    t0 = time.perf_counter()
    placeholders = constant_inputs(gm, example_inputs)
    work = working_copy(gm)
    attrs = {n.name: n.target for n in work.graph.nodes
             if n.op == "get_attr" and isinstance(_attr(work, n.target), torch.Tensor)}
    def tensor(name: str) -> torch.Tensor:
        return example_inputs[placeholders[name]] if name in placeholders else _attr(work, attrs[name])

    try:
        specialize_scalars(work)
        view, info = build_view(work.graph, set(placeholders) | set(attrs))
        plan = make_plan(view, fold_mode)
        edited = [tensor(n) for e in plan.const_edits for n in e.sources() if n not in info.scalars]
        training = torch.is_grad_enabled() and any(t.requires_grad for t in edited)
        # under autograd the graph computes its edited weights itself: no deferral there
        plan.deferral = plan_deferral(view, plan, "off" if training else defer, INDUCTOR_CPU)
        add_weight_edits(view, plan, plan.deferral)
    except Exception as e:
        log.warning("lnfold: analysis failed, compiling unfolded: %s", e)
        return inner(gm, example_inputs)
    reports.append(plan.report)
    if on_report is not None:
        on_report(plan.report)
    log.info("lnfold: %s", plan.report.summary())
    _say_if_fragment(plan, view)
    if plan.empty:
        return inner(gm, example_inputs)
    t1 = time.perf_counter()

    try:
        constants = GraphConstants() if training else CachedInputs(placeholders, tensor)
        Applier(work, view, info, TORCH, constants, norm="rms_norm").apply(plan)
        if plan.deferral.deferred:
            emit_deferred(work, plan.deferral, constants, tensor)
        t2 = time.perf_counter()
        extra = [] if training else constants(example_inputs)  # float64 centering, once
    except Exception as e:
        log.warning("lnfold: editing the graph failed, compiling unfolded: %s", e)
        plan.report.notes.append(f"the fold failed ({e}); this graph was compiled unfolded")
        return inner(gm, example_inputs)
    t3 = time.perf_counter()
    if verify:
        _verify(gm, work, example_inputs, extra)
    compiled = inner(work, list(example_inputs) + _static_examples(extra))
    timings.append({"analysis": t1 - t0, "editing": t2 - t1, "centering": t3 - t2,
                    "inner": time.perf_counter() - t3})
    return _with_extra_inputs(compiled, constants) if extra else compiled


class FragmentWarning(UserWarning):
    """The backend kept LayerNorms because its graph is a fragment of the model."""


_fragment_warned = False


def _say_if_fragment(plan: Plan, view) -> None:
    """Say, once per process, that norms were kept because the graph starts mid-stream.

    Under a graph break, per-block torch.compile or FSDP2 (`fully_shard` per block), Dynamo
    hands over one piece of the model at a time: its residual stream starts at a graph input,
    which no constant edit can center, so nothing inside the fragment can be proven zero-mean.
    The module-level fold sees the whole model (a module folded with it has RMSNorms here
    already, and this graph has no LayerNorm left to keep)."""
    global _fragment_warned
    starts = [o for comp in plan.components if not comp.foldable for o in comp.opaque
              if view.values[o.value].producer is None and not view.values[o.value].is_const]
    if not starts:
        return
    kept = sum(n.verdict == "keep" for n in plan.report.norms)
    msg = (f"lnfold: {kept} of {len(plan.report.norms)} LayerNorm(s) of this graph kept: it is a fragment "
           f"(graph break, per-block torch.compile or FSDP2): the stream starts at {starts[0].what}, so "
           "nothing in it can be proven zero-mean; fold the whole model before wrapping and compiling: "
           "lnfold.fold_for_training(model, args)")
    if _fragment_warned:
        log.info(msg)
        return
    _fragment_warned = True
    warnings.warn(msg, FragmentWarning, stacklevel=2)


def specialize_scalars(gm: fx.GraphModule) -> None:
    """Put the value in place of every scalar node that Dynamo has specialized.

    Under dynamic shapes (`dynamic=True`, or the recompile after a second shape) Dynamo passes a
    module's float attributes (a LayerNorm's eps) as 0-d tensor inputs read through `.item()`;
    where an op needs a plain number it specializes that SymFloat to its value and guards on it
    (`ln.eps == 1e-05`). The graph still reads the `.item()` node, whose value is that constant:
    using the number itself is what the guard guarantees, and lets the analysis see a constant
    eps (otherwise every norm is kept: "its eps is not a constant")."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            continue
        value = _constant_scalar(node.meta.get("example_value", node.meta.get("val")))
        if value is None:
            continue
        for user in list(node.users):
            swap = lambda n, node=node, value=value: value if n is node else n  # noqa: E731
            user.args, user.kwargs = fx.node.map_arg(user.args, swap), fx.node.map_arg(user.kwargs, swap)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


_SYMBOLIC = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}  # -> the Python type of its value


def _constant_scalar(v) -> Optional[Any]:
    """The Python number a specialized SymInt/SymFloat/SymBool stands for, else None."""
    if type(v) not in _SYMBOLIC or not v.node.expr.is_number:
        return None
    return _SYMBOLIC[type(v)](v.node.expr)


def concrete_inputs(gm: fx.GraphModule, example_inputs: list) -> Optional[list]:
    """The example inputs with each symbolic size replaced by the size it stands for in the
    example tensors (the ones Dynamo is compiling for), else by its hint; None where a symbol
    has neither (an unbacked size no input tensor carries)."""
    sizes: dict = {}  # sympy symbol -> the example tensors' size
    for node, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        fake = node.meta.get("example_value")
        if isinstance(x, torch.Tensor) and isinstance(fake, torch.Tensor) and fake.ndim == x.ndim:
            for d, n in zip(fake.shape, x.shape):
                if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                    sizes[d.node.expr] = n
    out = []
    for x in example_inputs:
        if type(x) in _SYMBOLIC:
            if x.node.expr in sizes:
                x = sizes[x.node.expr]
            elif x.node.has_hint():
                x = _SYMBOLIC[type(x)](x.node.hint)
            else:
                return None
        out.append(x)
    return out


def _verify(original: fx.GraphModule, folded: fx.GraphModule, example_inputs: list, extra: list) -> None:
    """Judge the folded graph with the gate of passes/gate.py (against a float64 run of a copy of
    the original graph where one can be made). Under dynamic shapes the graphs take symbolic
    sizes among their inputs: they run here with the sizes of the tensors at hand."""
    from torch.utils import _pytree as pytree

    from .api import judge_outputs, ref64

    concrete = concrete_inputs(original, example_inputs)
    if concrete is None:
        raise VerificationError("lnfold: cannot verify: a symbolic size of this graph has no example value "
                                "(an unbacked size no input carries); compile without lnfold.verify, or verify "
                                "with lnfold.fold_module")
    example_inputs = concrete
    with torch.no_grad():
        ref = pytree.tree_leaves(original(*example_inputs))
        got = pytree.tree_leaves(folded(*example_inputs, *extra))
    verdict = judge_outputs(ref, got, ref64(original, example_inputs, {}, ref))
    if not verdict.ok:
        raise verdict.error("lnfold: ")


def _static_examples(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The extra inputs as fake tensors of static shape: AOTAutograd would otherwise give the
    dims of these source-less inputs fresh symbols, and Dynamo cannot guard on those."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode()
    return [mode.from_tensor(t, static_shapes=True) for t in tensors] if mode is not None else tensors


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module to edit, with what AOTAutograd reads from the original."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    for attr in ("_param_name_to_source", "shape_env"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    old_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    new_ph = [n for n in new.graph.nodes if n.op == "placeholder"]
    for a, b in zip(old_ph, new_ph):
        if hasattr(a, "_dynamo_source"):
            b._dynamo_source = a._dynamo_source
    return new


def _attr(gm: torch.nn.Module, target: str) -> Any:
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr, None)


class CachedInputs(Constants):
    """Inference: centered copies of constants, fed to the graph as extra inputs.

    Computed in float64 when first needed and again only when a source parameter changes
    (another tensor object, storage or version counter). A constant that is a graph attribute
    rather than an input is centered once. (New attributes are no option: AOTAutograd would
    lift them as parameters Dynamo does not know.)
    """

    def __init__(self, placeholders: dict[str, int], tensor: Callable) -> None:
        self.placeholders = placeholders
        self.tensor = tensor
        self.extra: list[Any] = []  # per extra input: a ConstEdit (recomputed) or a fixed tensor
        self._key: Any = None
        self._tensors: list[torch.Tensor] = []

    def node_for(self, applier, edit, k):
        g = applier.graph
        last = [n for n in g.nodes if n.op == "placeholder"][-1]
        name = f"lnfold_{edit.value}"
        if any(n.op == "placeholder" and n.target == name for n in g.nodes):
            name = f"{name}_{k}"  # one constant, two edits (CRMS: a tied table and its lm_head)
        with g.inserting_after(last):
            node = g.placeholder(name)
        node._dynamo_source = None  # AOTAutograd asks every Dynamo input where it came from
        if all(n in self.placeholders for n in edit.sources()):
            self.extra.append(edit)
        else:
            self.extra.append(self._compute([edit], self.tensor)[0])
        return node

    def derived_input(self, g: fx.Graph, name: str, sources: list[str], compute: Callable) -> fx.Node:
        last = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(last):
            node = g.placeholder(name)
        node._dynamo_source = None
        entry = Derived(sources, compute)
        self.extra.append(entry if all(n in self.placeholders for n in sources) else compute(self.tensor))
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


def emit_deferred(gm: fx.GraphModule, decision: DeferDecision, constants: "CachedInputs", tensor: Callable) -> None:
    """The deferred norms, after the plan's other edits; each new bias `W β + b` is an extra
    input of the graph, recomputed (float64) when a parameter it derives from changes."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for d in decision.deferred:
        def bias_node(reader: str, d=d) -> Optional[fx.Node]:
            rd = next(r for r in d.readers if r.node == reader)
            if d.beta is None:
                return None
            one = DeferDecision(deferred=[type(d)(d.norm, d.x, d.output, d.axis, d.gamma, d.beta, d.epsilon, [rd])])
            like = rd.bias.value if rd.bias is not None else rd.weight.value
            sources = [d.beta, rd.weight.value] + ([rd.bias.value] if rd.bias is not None else [])

            def compute(get: Callable[[str], torch.Tensor]) -> torch.Tensor:
                arr = compute_biases(one, lambda n: to_numpy(get(n)))[(d.norm, reader)]
                if arr is not None:
                    return from_numpy(arr, get(like))
                if rd.bias is not None:  # β is all zeros now: the reader's own bias
                    return get(rd.bias.value)
                w = get(rd.weight.value)  # nor has it one: a zero bias (β may change later)
                return torch.zeros_like(w.select(rd.weight.axis, 0))

            return constants.derived_input(gm.graph, f"lnfold_bias_{reader}", sources, compute)

        deferred_norm.emit(gm.graph, nodes, d, bias_node)
    gm.graph.lint()
    gm.recompile()


class Derived:
    """An extra input computed from constants (a deferred norm's bias), and what it reads."""

    def __init__(self, sources: list[str], compute: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]) -> None:
        self.sources = sources
        self.compute = compute


def _with_extra_inputs(compiled: Callable, extra: CachedInputs) -> Callable:
    # Dynamo calls what a backend returns as fn(*args), whatever `_boxed_call` says (AOTAutograd
    # copies that flag onto a wrapper that is not boxed).
    def run(*args):
        return compiled(*args, *extra(args))

    return run


def register() -> None:
    """Make backend="lnfold" resolve to this module, unless torch already knows the name.

    An installed lnfold registers through the `torch_dynamo_backends` entry point, which torch
    loads itself; registering again here would make that load fail as a duplicate.
    """
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "lnfold" not in list_backends(exclude_tags=()):
        register_backend(lnfold_backend, name="lnfold")
