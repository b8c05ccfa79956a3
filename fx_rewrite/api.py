"""The torch frontend's public API: `analyze_module` and `fold_module` (torch.export graphs).

`fold_module` exports the module with torch.export (non-strict; batch and sequence sizes dynamic
where export allows it), classifies the ATen graph into the stream view, asks passes/ for a plan
and applies it to `ExportedProgram.module()` with its own copy of every parameter: the user's
module and its state_dict are never touched.

What the returned module runs (DESIGN "Speed honesty"): in eager mode on CPU `F.rms_norm` is a
chain of separate kernels and slower than the fused `F.layer_norm` (benchmarks/RESULTS.md), and a
LayerNorm on a zero-mean stream computes exactly what RMSNorm does. So `norm="auto"` keeps `aten.layer_norm` on the now
centered stream (same speed as the original, and exact); `norm="rms_norm"` emits `aten.rms_norm`
(+ an Add for β). Under torch.compile use the `lnfold` backend, which emits RMSNorm for Inductor.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import time
from typing import Any, Callable, Optional

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..passes import FoldResult, NothingToFold, Report, VerificationError, gate, make_plan
from ..passes.defer import EAGER, add_weight_edits, compute_biases, plan_deferral
from ..passes.options import FoldOptions
from ..passes.plan import Plan, first_kept_reason

from . import defer as deferred_norm
from .apply import ATEN, Applier, AttrConstants, _unique_attr, from_numpy, rms_probe, to_numpy
from .classify import build_view
from .hf import export_error, fresh, register_caches


def _dynamic_shapes(args: tuple, kwargs: dict):
    """Dim.AUTO on every axis of every tensor argument: export keeps dynamic what it can."""
    auto = torch.export.Dim.AUTO

    def spec(x):
        return {i: auto for i in range(x.ndim)} if isinstance(x, torch.Tensor) and x.ndim else None

    return tuple(pytree.tree_map(spec, a) for a in args), {k: pytree.tree_map(spec, v) for k, v in kwargs.items()}


def export(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *, dynamic: bool = True):
    """torch.export (non-strict), with dynamic sizes when export can keep them, else static.
    transformers' cache objects are registered first (hf.py); a type export cannot flatten is a
    one-line LnfoldError."""
    kwargs = kwargs or {}
    register_caches(module)
    if dynamic:
        ds_args, ds_kwargs = _dynamic_shapes(args, kwargs)
        shapes = {**_named(module, ds_args), **ds_kwargs} if kwargs else ds_args
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False)
        except Exception:  # some models cannot be exported with dynamic sizes: fall back to static
            pass
    try:
        return torch.export.export(module, args, kwargs, strict=False)
    except Exception as e:
        short = export_error(e)
        if short is None:
            raise
        raise short from e


def _named(module: torch.nn.Module, ds_args: tuple) -> dict:
    return dict(zip(inspect.signature(module.forward).parameters, ds_args))


def _own_tensors(gm: fx.GraphModule) -> None:
    """Give `gm` its own copy of every parameter, buffer and constant (aliases stay aliases)."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            c = t.detach().clone()
            copies[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
        return copies[id(t)]

    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = copy(p)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = copy(b)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, attr = node.target.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor) and attr not in mod._parameters and attr not in mod._buffers:
                setattr(mod, attr, copy(t))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr)


def exported_view(module, args, kwargs, dynamic):
    """torch.export `module` and classify its graph: (graph module, attrs, view, info).

    `attrs` maps each get_attr node that reads a tensor to its target: `ep.module()` names its
    attributes by the fully qualified names of the graph signature, i.e. the module's own
    parameter and buffer names (one of them where parameters are tied)."""
    ep = export(module, args, kwargs, dynamic=dynamic)
    gm = ep.module()
    gm.graph.eliminate_dead_code()  # a norm whose output nothing reads is no norm (ONNX drops it too)
    attrs = {n.name: n.target for n in gm.graph.nodes
             if n.op == "get_attr" and isinstance(_attr(gm, n.target), torch.Tensor)}
    view, info = build_view(gm.graph, set(attrs))
    return gm, attrs, view, info


def _analyze(module, args, kwargs, mode, dynamic):
    gm, attrs, view, info = exported_view(module, args, kwargs, dynamic)
    # the module is folded as it is now: a β of zeros needs neither an Add nor a fold
    zero = lambda name: name in attrs and not bool(_attr(gm, attrs[name]).any())  # noqa: E731
    plan = make_plan(view, mode, zero=zero)
    plan.report.rename(attrs)  # the weights by their state_dict names
    return gm, attrs, view, info, plan


def analyze_module(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *,
                   mode: str = "rms", dynamic: bool = True) -> Report:
    """The report alone: every LayerNorm of `module`, its verdict and the reason for each kept one."""
    opts = FoldOptions(mode=mode)
    return _analyze(module, tuple(args), kwargs or {}, opts.mode, dynamic)[-1].report


def fold_module(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *, mode: str = "rms",
                defer: str = "off", verify: bool = True, norm: str = "auto", dynamic: bool = True) -> FoldResult:
    """Fold every foldable LayerNorm of `module`; the module and its parameters are not modified.

    Returns a FoldResult whose `.module` takes the same inputs and returns the same outputs.
    `mode`, `defer` and `verify` mean what they mean for `fold_onnx` (passes/options.py checks
    all options; `defer="on"` emits the folded norms read only by linear layers as deferred
    normalization, "auto" asks the cost model, which defers nothing in eager mode). `norm`:
    "auto" (eager: keep the fused LayerNorm kernel on the centered stream), "rms_norm" or
    "layer_norm". Raises NothingToFold when no LayerNorm can be folded and
    VerificationError when the folded module's outputs on `args` differ from the original's.
    """
    opts = FoldOptions(mode=mode, defer=defer, verify=verify, norm=norm)
    args, kwargs = tuple(args), dict(kwargs or {})
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    gm, attrs, view, info, plan = _analyze(module, args, kwargs, opts.mode, dynamic)
    _check_plan(plan)
    plan.deferral = plan_deferral(view, plan, opts.defer, EAGER)
    add_weight_edits(view, plan, plan.deferral)
    timings["analysis"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    _own_tensors(gm)
    tensor_of = lambda name: _attr(gm, attrs[name])  # noqa: E731  (the originals: edits are new attributes)
    constants = AttrConstants(gm, tensor_of)
    constants.prepare(plan, info)
    # "auto": the fused LayerNorm kernel, exact on the centered stream (see the module docstring)
    chosen = "layer_norm" if opts.norm == "auto" else opts.norm
    Applier(gm, view, info, ATEN, constants, norm=chosen).apply(plan)
    if plan.deferral.deferred:
        _emit_deferred(gm, plan, tensor_of)
    _drop_unused_attrs(gm)
    timings["editing"] = time.perf_counter() - t1

    result = FoldResult(report=plan.report, module=gm, timings=timings)
    if opts.verify:
        t2 = time.perf_counter()
        # A kept LayerNorm hides a missed centering: check the RMSNorm twin as well.
        verifier = Verifier(module, args, kwargs)
        verdict = verifier.check(gm)
        if chosen != "rms_norm":  # must pass too; the result reports the module returned
            crms_norms = {n for cc in plan.compressions if cc.compressed for n in cc.norms}
            deferred = {d.norm for d in plan.deferral.deferred}
            rms = [n for n in plan.swaps if n not in crms_norms and n not in deferred]  # CRMSNorms need no
            # twin (exact only if centered); deferred norms are no norms any more
            if rms:
                verifier.check(rms_probe(gm, rms, ATEN, info.decomposed))
        result.max_rel_err, result.criterion = verdict.diff, verdict.criterion
        result.exact_err, result.original_exact_err = verdict.folded_err, verdict.original_err
        timings["verification"] = time.perf_counter() - t2
    return result


def _emit_deferred(gm: fx.GraphModule, plan: Plan, tensor_of: Callable[[str], torch.Tensor]) -> None:
    """The deferred norms, after the plan's other edits (γ is in the readers' weights already);
    each reader's new bias `W β + b` is computed once in float64 and stored as a buffer."""
    biases = compute_biases(plan.deferral, lambda n: to_numpy(tensor_of(n)))
    nodes = {n.name: n for n in gm.graph.nodes}
    for d in plan.deferral.deferred:
        def bias_node(reader: str, d=d) -> Optional[fx.Node]:
            arr = biases[(d.norm, reader)]
            if arr is None:  # no β: the reader keeps its own bias
                return None
            rd = next(r for r in d.readers if r.node == reader)
            t = from_numpy(arr, tensor_of(rd.bias.value if rd.bias is not None else rd.weight.value))
            name = _unique_attr(gm, f"lnfold_bias_{reader}")
            gm.register_buffer(name, t)
            with gm.graph.inserting_before(nodes[reader]):
                node = gm.graph.get_attr(name)
            node.meta["val"] = t
            return node

        deferred_norm.emit(gm.graph, nodes, d, bias_node)
    gm.graph.lint()


def _check_plan(plan: Plan) -> None:
    if not plan.report.norms:
        raise NothingToFold("no LayerNorm found in the module: nothing to fold")
    if plan.empty:
        raise NothingToFold(f"no LayerNorm can be folded; first kept: {first_kept_reason(plan.report)}")


def _drop_unused_attrs(gm: fx.GraphModule) -> None:
    """Free the originals the fold replaced (e.g. an uncentered embedding no node reads now)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def check_equivalent(original: torch.nn.Module, folded: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """Worst relative output difference on `args`; raises VerificationError when the gate fails."""
    return Verifier(original, args, kwargs).check(folded).diff


class Verifier:
    """Runs the original (and a float64 copy of it) once and judges folded modules with the gate
    of passes/gate.py (DESIGN §4): each output's error against float64 may not exceed the
    original's own error times a small factor, plus a floor. Where the float64 copy cannot be
    made or run, the gate's fallback (a fixed tolerance against the original) is used."""

    def __init__(self, original: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.original, self.args, self.kwargs = original, args, kwargs
        with torch.no_grad():
            self.ref = pytree.tree_leaves(_seeded(original, args, kwargs))
        self.exact = ref64(original, args, kwargs, self.ref)

    def verdict(self, folded: torch.nn.Module) -> gate.Verdict:
        with torch.no_grad():
            got = pytree.tree_leaves(_seeded(folded, self.args, self.kwargs))
        return judge_outputs(self.ref, got, self.exact)

    def check(self, folded: torch.nn.Module) -> gate.Verdict:
        v = self.verdict(folded)
        if not v.ok:
            raise VerificationError(v.message())
        return v


def ref64(original: Callable, args, kwargs: dict, ref: list) -> Optional[list]:
    """The leaves of a float64 run of a copy of `original` (floats upcast), or None where it
    cannot be made (a module that does not copy or does not run in float64)."""
    cast = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    try:
        m64 = copy.deepcopy(original).double()
        # a graph that makes float32 tensors of its own fails here, and torch.fx prints the
        # traceback before raising: an expected, handled failure, not the user's to read
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            out = pytree.tree_leaves(_seeded(m64, pytree.tree_map(cast, tuple(args)), pytree.tree_map(cast, kwargs)))
    except Exception:
        return None
    return out if len(out) == len(ref) else None


def judge_outputs(ref: list, got: list, exact: Optional[list]) -> gate.Verdict:
    """The gate's verdict on output leaves (non-tensor leaves must be equal)."""
    if len(ref) != len(got):
        return gate.Verdict(False, "outputs", float("inf"), failure=f"{len(got)} outputs instead of {len(ref)}")
    outs = []
    for k, (r, g) in enumerate(zip(ref, got)):
        if not isinstance(r, torch.Tensor):
            if r != g:
                return gate.Verdict(False, "outputs", float("inf"), failure=f"output {r!r} became {g!r}")
            continue
        e = exact[k] if exact is not None and isinstance(exact[k], torch.Tensor) else None
        outs.append(gate.Output(f"#{k}", str(r.dtype).removeprefix("torch."), _np(r), _np(g),
                                None if e is None else _np(e)))
    return gate.judge(outs)


def _seeded(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Run with a fixed seed, so that random ops (train-mode dropout) draw the same numbers, on
    fresh copies of the inputs (hf.fresh: a key/value cache grows in place at every run)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return module(*fresh(args), **fresh(kwargs))


def _np(t: torch.Tensor):
    t = t.detach().to("cpu")
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

