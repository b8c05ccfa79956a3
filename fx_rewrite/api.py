"""`analyze_module` and `fold_module`: the module exported with torch.export (non-strict, sizes dynamic
where export allows it), its ATen graph classified, the plan applied to `ExportedProgram.module()` with
its own copy of every parameter (the user's module is never touched). `norm="auto"` keeps
`aten.layer_norm` on the centered stream, where it is exact and, in eager mode on CPU, faster than
`F.rms_norm` (DESIGN "Speed honesty").
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Callable, Optional

import torch
from torch import fx

from ..passes import FoldResult, NothingToFold, Report, View, approx, gate, geometry, make_plan, pipeline
from ..passes.defer import EAGER, compute_biases
from ..passes.calibration import check_calibration
from ..passes.massive import massive_channels
from ..passes.options import APPROX_MODE, MASSIVE, FoldOptions, check_choice, takes_options
from ..passes.request import Capabilities, PlanRequest, request_from
from ..passes.plan import Plan, first_kept_reason

from . import calibration as calibration_io
from . import deferred_norm
from .apply import ATEN, NORMS, Applier, AttrConstants, rms_probe
from .edits import attr_of, from_numpy, new_attr, tensor_attrs, to_numpy
from .ops import canonical
from .classify import build_view
from .hf import export_error, pytree, register_caches
from .inline import inline_no_grad_regions
from .verify import Verifier, judge_outputs, ref64  # noqa: F401  (judge_outputs, ref64: the torch frontends' gate)


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
        named = dict(zip(inspect.signature(module.forward).parameters, ds_args))
        shapes = {**named, **ds_kwargs} if kwargs else ds_args
        # torch.export warns that Dim.AUTO was specialized for every size-1 dimension of the example
        # inputs (a batch of 1): an export detail lnfold asked for, not the user's problem
        logger = logging.getLogger("torch._export.non_strict_utils")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False)
        except Exception:  # some models cannot be exported with dynamic sizes: fall back to static
            pass
        finally:
            logger.setLevel(level)
    try:
        return torch.export.export(module, args, kwargs, strict=False)
    except Exception as e:
        short = export_error(e)
        if short is None:
            raise
        raise short from e


def own_tensors(gm: fx.GraphModule) -> None:
    """Give `gm` its own copy of every parameter, buffer and constant (aliases stay aliases)."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            c = t.detach().clone()
            copies[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
        return copies[id(t)]

    for mod in gm.modules():
        for tensors in (mod._parameters, mod._buffers):
            for name, t in list(tensors.items()):
                if t is not None:
                    tensors[name] = copy(t)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, attr = node.target.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor) and attr not in mod._parameters and attr not in mod._buffers:
                setattr(mod, attr, copy(t))


def exported_view(module, args, kwargs, dynamic, rms: bool = False):
    """torch.export `module` and classify its graph: (graph module, attrs, view, info). `attrs`: the
    get_attr nodes' targets, i.e. the module's own parameter and buffer names (`ep.module()` names
    its attributes so; one of them where parameters are tied). `rms`: RMSNorms as given are norms
    of the view (classify.build_view)."""
    return program_view(export(module, args, kwargs, dynamic=dynamic), rms)


def program_view(ep, rms: bool = False) -> tuple:
    """`exported_view` of an ExportedProgram: each call a new graph module (sharing the program's
    tensors, which `ExportFrontend.apply` copies before it edits them), so one export serves many folds."""
    gm = ep.module()
    inline_no_grad_regions(gm)
    if rms:
        computed_gains(gm)
    gm.graph.eliminate_dead_code()  # a norm whose output nothing reads is no norm (ONNX drops it too)
    attrs = tensor_attrs(gm)
    view, info = build_view(gm.graph, set(attrs), rms=rms)
    return gm, attrs, view, info


def computed_gains(gm: fx.GraphModule) -> None:
    """Constants the graph computes from one parameter with Python numbers (GemmaRMSNorm's
    `1 + weight.float()`), computed once into a buffer read in their place: the view sees a constant
    γ, which can move into the readers like any (the ONNX exporters write it as an initializer, or
    onnxruntime folds the Add). Only chains of casts and arithmetic with numbers; the result floating."""
    computed: dict[fx.Node, bool] = {}  # node -> whether its chain holds arithmetic
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        call = canonical(node)
        ins = node.all_input_nodes
        v = node.meta.get("val")
        if (call is None or call.kind not in ("identity", "add", "sub", "rsub", "mul", "div", "neg") or len(ins) != 1
                or not (ins[0].op == "get_attr" or ins[0] in computed)
                or not isinstance(v, torch.Tensor) or not v.is_floating_point()):
            continue
        computed[node] = call.kind != "identity" or computed.get(ins[0], False)
    for node, arithmetic in computed.items():
        if not arithmetic or all(u in computed for u in node.users):
            continue
        values: dict[fx.Node, torch.Tensor] = {}

        def value(n: fx.Node) -> torch.Tensor:
            if n not in values:
                if n.op == "get_attr":
                    values[n] = attr_of(gm, n.target)
                else:
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), value)
                    values[n] = n.target(*args, **kwargs)
            return values[n]

        with torch.no_grad():
            t = value(node).detach().clone()
        node.replace_all_uses_with(new_attr(gm, f"lnfold_gain_{node.name}", t, node))


class ExportFrontend:
    """The torch.export frontend in the pipeline (passes/pipeline.py): the module exported, the
    plan applied to `ExportedProgram.module()` with its own copy of every parameter."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, opts: FoldOptions, *,
                 norm: str = "auto", dynamic: bool = True, program=None, **decided) -> None:
        if isinstance(module, torch.export.ExportedProgram):  # the user exported it: the program is the model
            program, module = module, module.module()
        self.module, self.args, self.kwargs, self.opts, self.dynamic = module, args, kwargs, opts, dynamic
        self.program = program  # an ExportedProgram already made (ExportFolds: one export for many folds)
        # "auto": the fused LayerNorm kernel, exact on the centered stream (see the module docstring)
        self.norm = "layer_norm" if norm == "auto" else norm
        # what a calibrated decision adds to the request (passes/calibration.Folds.fold): mode "rms-approx"'s
        # kept norms to swap (passes/approx.py), a slice's basis per stream (passes/slicer.py)
        self.decided = decided

    def view(self) -> View:
        self.gm, self.attrs, self._view, self.info = (
            exported_view(self.module, self.args, self.kwargs, self.dynamic, self.opts.reads_rms_norms)
            if self.program is None else program_view(self.program, self.opts.reads_rms_norms))
        return self._view

    def tensor(self, name: str) -> torch.Tensor:
        return attr_of(self.gm, self.attrs[name])

    def zero(self, name: str) -> bool:
        # the module is folded as it is now: a β of zeros needs neither an Add nor a fold
        return name in self.attrs and not bool(self.tensor(name).any())

    def request(self) -> PlanRequest:
        return request_from(self.opts, Capabilities(costs=EAGER, resize_refusal=self._resize_refusal), zero=self.zero,
                            **self.decided)

    def _resize_refusal(self, norm: str) -> Optional[str]:
        if norm in self.info.decomposed:  # (its mean, variance and γ ops read d features by shape)
            return f"slicing the stream of a written-out LayerNorm ({norm}) is not implemented in the torch frontend"
        return None

    def check(self, plan: Plan) -> None:
        if not plan.report.norms and plan.empty and not self.opts.gamma_into_readers:
            given = [n for n in build_view(self.gm.graph, set(self.attrs), rms=True)[0].nodes.values()
                     if n.norm is not None and n.norm.rms]
            if given:  # as onnx_rewrite/validate.no_norm_message says it
                raise NothingToFold(f"no LayerNorm found in the module: its {len(given)} norm(s) are RMSNorms "
                                    "already (gamma_into_readers or rotate takes their streams): nothing to fold")
        check_plan(plan)

    def apply(self, plan: Plan) -> fx.GraphModule:
        gm = self.gm
        own_tensors(gm)
        constants = AttrConstants(gm, self.tensor, plan, self.info)  # (the originals: edits are new attributes)
        Applier(gm, self._view, self.info, ATEN, constants, norm=self.norm).apply(plan)
        if plan.deferral.deferred:
            deferred_norm.emit_all(gm, plan.deferral, _buffer_biases(gm, plan, self.tensor))
        for node in list(gm.graph.nodes):  # free the originals the fold replaced (an uncentered embedding)
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.recompile()
        return gm

    emit = staticmethod(pipeline.in_memory)

    def verify(self, plan: Plan, gm: fx.GraphModule) -> Optional[gate.Verdict]:
        if plan.approx:  # not exact by design: its error was measured against the budget (fold_approx)
            return None
        verifier = Verifier(self.module, self.args, self.kwargs)
        verdict = verifier.check(gm)
        # A kept LayerNorm hides a missed centering: its RMSNorm twin must pass too (the norms of a
        # rotated stream are RMSNorms already); the result reports the module returned.
        probed = [n for n in plan.plain_rms if n not in plan.rotated_norms]
        if self.norm != "rms_norm" and probed:
            verifier.check(rms_probe(gm, probed, ATEN, self.info.decomposed))
        return verdict

    def result(self, plan: Plan, gm: fx.GraphModule) -> FoldResult:
        return FoldResult(report=plan.report.renamed(self.attrs), module=gm)  # weights by state_dict names

    def capture(self, artifact: Optional[fx.GraphModule], values: list[str], batches: list[tuple]) -> dict:
        return calibration_io.capture(self.gm if artifact is None else artifact, values, batches)

    def run(self, artifact: Optional[torch.nn.Module], batches: list[tuple]) -> list:
        return calibration_io.outputs(self.module if artifact is None else artifact, batches)


class ExportFolds:
    """passes/calibration.Folds over torch.export: one export (of `args`), each fold a fresh graph
    module of it (`program_view`), classified anew and edited with its own copy of every parameter."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, opts: FoldOptions, *,
                 dynamic: bool = True) -> None:
        self.opts = opts
        self.frontend = ExportFrontend(module, args, kwargs, opts, norm="auto", dynamic=dynamic)
        if self.frontend.program is None:  # (a user's ExportedProgram is the program already)
            self.frontend.program = export(module, args, kwargs, dynamic=dynamic)

    def plan(self, planner) -> tuple[View, Plan]:
        return pipeline.plan(self.frontend, planner)

    def fold(self, planner, opts: FoldOptions, *, final: bool = False, **decided) -> FoldResult:
        base = self.frontend
        frontend = ExportFrontend(base.module, base.args, base.kwargs, opts, norm="auto", dynamic=base.dynamic,
                                  program=base.program, **decided)
        return pipeline.fold(frontend, verify=opts.verify, planner=planner)

    def artifact(self, result: FoldResult) -> fx.GraphModule:
        return result.module

    def rows(self, batches: list) -> int:
        return sum(len(b[0]) for b in batches if b and hasattr(b[0], "__len__"))


def analyze_module(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *,
                   mode: str = "rms", dynamic: bool = True, calibration=None, angles: bool = False) -> Report:
    """The report alone: every LayerNorm of `module` (or ExportedProgram), its verdict and the reason
    for each kept one. With `calibration` (an args tuple, or a list of them) or `angles=True` (on
    `args`, which then mean little) `report.geometry` holds each norm's angle to 1 before and, for
    folded norms, after the fold (passes/geometry.py)."""
    opts = FoldOptions(mode=mode)
    folds = ExportFolds(module, tuple(args), kwargs or {}, opts, dynamic=dynamic)
    view, plan = folds.plan(make_plan)
    report = plan.report.renamed(folds.frontend.attrs)  # the weights by their state_dict names
    if calibration is None and not angles:
        return report
    batches, synthetic = calibration_io.batches_of(calibration, tuple(args))
    return dataclasses.replace(report, geometry=geometry.measure(folds, view, plan.report.verdicts(), batches,
                                                                 make_plan, synthetic=synthetic))


def fold_approx(module: torch.nn.Module, args: tuple, kwargs: Optional[dict], opts: FoldOptions, *, calibration,
                budget, heldout=None, metric=None, dynamic: bool = True) -> FoldResult:
    """`fold_module(mode="rms-approx")`: passes/approx.swap_within_budget over eager runs of folds that
    differ only in the kept norms swapped (RMSNorm, β kept; NOT exact). `calibration`: an args tuple
    or a list of them; `heldout` likewise (default: passes/calibration.split's rule)."""
    approx.check_budget(budget)
    check_calibration(calibration, approx.CALIBRATED)
    data = calibration_io.split(calibration_io.batches_of(calibration, tuple(args))[0], heldout)
    folds = ExportFolds(module, tuple(args), dict(kwargs or {}), opts, dynamic=dynamic)
    return approx.swap_within_budget(folds, data, budget, make_plan, metric=metric)


@takes_options
def fold_module(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *, options: FoldOptions,
                norm: str = "auto", dynamic: bool = True, calibration=None, budget: Optional[float] = None,
                heldout=None, metric: Optional[Callable] = None) -> FoldResult:
    """Fold every foldable LayerNorm of `module` (or of an ExportedProgram already made, read as it
    is: `dynamic` then means nothing); the module and its parameters are not modified. Returns a
    FoldResult whose `.module` takes the same inputs and returns the same outputs.

    The options (listed at the end) mean what they mean for `fold_onnx` (`defer="auto"` defers
    nothing in eager mode). `norm`: "auto" (the fused LayerNorm kernel on the centered stream),
    "rms_norm" or "layer_norm"; the norms of a stream rotated by a Q with Q·1 ≠ 1 are `aten.rms_norm`
    whatever it says (a LayerNorm is exact only on a zero-mean input), "-keep-ln" rotations keep its
    choice. Raises NothingToFold when no LayerNorm can be folded, VerificationError when the folded
    module's outputs on `args` differ.
    """
    if options.mode == APPROX_MODE:  # NOT exact: see fold_approx
        return fold_approx(module, args, kwargs, options, calibration=calibration, budget=budget, heldout=heldout,
                           metric=metric, dynamic=dynamic)
    check_choice("norm", norm, ("auto",) + NORMS)
    options = with_massive_channels(module, tuple(args), dict(kwargs or {}), options, dynamic=dynamic)
    frontend = ExportFrontend(module, tuple(args), dict(kwargs or {}), options, norm=norm, dynamic=dynamic)
    return pipeline.fold(frontend, verify=options.verify, planner=make_plan)


def with_massive_channels(module, args: tuple, kwargs: dict, options: FoldOptions, batches=None,
                          dynamic: bool = True) -> FoldOptions:
    """`options` with spare_channels=MASSIVE found on `batches` (args tuples; None: the example
    `args`) for each stream (passes/massive.py); other options as they are."""
    if options.spare_channels != MASSIVE:
        return options
    folds = ExportFolds(module, args, kwargs, dataclasses.replace(options, spare_channels=None, verify=False),
                        dynamic=dynamic)
    found = massive_channels(folds, batches or [args], make_plan)
    return dataclasses.replace(options, spare_channels=found)


def _buffer_biases(gm: fx.GraphModule, plan: Plan, tensor_of: Callable[[str], torch.Tensor]) -> deferred_norm.BiasNode:
    """Each deferred reader's new bias `W β + b`, computed once in float64 and stored as a buffer."""
    biases = compute_biases(plan.deferral, lambda n: to_numpy(tensor_of(n)))
    nodes = {n.name: n for n in gm.graph.nodes}

    def bias_node(d, rd) -> Optional[fx.Node]:
        arr = biases[(d.norm, rd.node)]
        if arr is None:  # no β: the reader keeps its own bias
            return None
        t = from_numpy(arr, tensor_of(rd.bias.value if rd.bias is not None else rd.weight.value))
        return new_attr(gm, f"lnfold_bias_{rd.node}", t, nodes[rd.node])

    return bias_node


def check_plan(plan: Plan) -> None:
    """Raise NothingToFold when the module has no LayerNorm, or none the plan folds (a stream of
    RMSNorms as given whose γ moves or which rotates is a fold: `plan.rms_swaps`)."""
    if not plan.report.norms and plan.empty:
        raise NothingToFold("no LayerNorm found in the module: nothing to fold")
    if plan.empty:
        raise NothingToFold(f"no LayerNorm can be folded; first kept: {first_kept_reason(plan.report)}")


def check_equivalent(original: torch.nn.Module, folded: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """Worst relative output difference on `args`; raises VerificationError when the gate fails."""
    return Verifier(original, args, kwargs).check(folded).diff
