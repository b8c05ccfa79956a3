"""The torch.compile backend `lnfold`: fold the LayerNorms of Dynamo's graph, then run Inductor.

    model = torch.compile(model, backend="lnfold", options={"lnfold.mode": "crms"})
    model = torch.compile(model, backend=fx_rewrite.lnfold_backend_with(mode="rms"))

torch.compile passes `mode=` (Inductor's) and `options=` to a backend named by string. Keys starting
with "lnfold." are ours: "lnfold.mode" ("rms" or "crms"), "lnfold.on_report" (a callable receiving each
graph's Report), "lnfold.verify" (run both graphs eagerly on the example inputs at compile time, at the
sizes of the tensors at hand, and raise VerificationError if passes/gate.py refuses the fold),
"lnfold.defer" ("auto", "on", "off": folded norms read only by linear layers as deferred
normalization, passes/defer.py; default "off", as measured; inference only); every other key is an
Inductor config patch.

Every folded LayerNorm becomes `F.rms_norm` (+ β), the faster exact norm under Inductor. Edited
weights are computed in the graph from the parameters Dynamo passes, at every call, so no copy can go
stale (apply.GraphConstants): in float64 at inference, rounded once; in the parameter's dtype in
training, so loss and gradients are the original model's (THEORY §1).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
import warnings
from typing import Callable, Optional

import torch
from torch import fx

from ..passes import FoldResult, LnfoldError, Plan, Report, View, make_plan, pipeline
from ..passes.defer import INDUCTOR_CPU
from ..passes.options import FoldOptions
from ..passes.request import Capabilities, PlanRequest, request_from

from . import deferred_norm
from .apply import TORCH, Applier, GraphConstants
from .classify import build_view
from .dynamo import constant_inputs, specialize_scalars, working_copy
from .edits import LOW_PRECISION, attr_of, tensor_attrs
from .verify import verify_graph

log = logging.getLogger("lnfold")
OPTION_PREFIX = "lnfold."
# The reports of the last KEPT graphs compiled in this process and the seconds each of the last KEPT
# folded graphs spent in each stage, newest last (bounded: a long-lived process keeps compiling).
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


class _Unfolded(Exception):
    """The graph is compiled as Dynamo handed it over (nothing to fold, or the fold failed)."""


class DynamoFrontend:
    """The backend in the pipeline (passes/pipeline.py): a copy of Dynamo's graph folded. A failure
    of the fold never costs the user their compile: `view`, `plan` and `apply` turn it into
    `_Unfolded` (logged), and the unfolded graph is compiled; a failed verification is raised."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, opts: FoldOptions,
                 on_report: Optional[Callable]) -> None:
        self.gm, self.example_inputs, self.opts, self.on_report = gm, example_inputs, opts, on_report
        self.placeholders = constant_inputs(gm, example_inputs)
        self.work = working_copy(gm)
        self.attrs = tensor_attrs(self.work)

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.placeholders:
            return self.example_inputs[self.placeholders[name]]
        return attr_of(self.work, self.attrs[name])

    def view(self) -> View:
        with self._unfolded_on_failure("analysis failed"):
            specialize_scalars(self.work)
            self._view, self.info = build_view(self.work.graph, set(self.placeholders) | set(self.attrs))
        return self._view

    def request(self) -> PlanRequest:
        grad = torch.is_grad_enabled()
        trainable = lambda n: grad and n not in self.info.scalars and self.tensor(n).requires_grad  # noqa: E731
        return request_from(self.opts, Capabilities(costs=INDUCTOR_CPU), trainable=trainable)

    def plan(self, view: View, request: PlanRequest) -> Plan:
        with self._unfolded_on_failure("analysis failed"):
            return make_plan(view, request)

    def check(self, plan: Plan) -> None:
        _say_if_fragment(plan, self._view)
        if plan.empty:
            self._tell(plan.report)
            raise _Unfolded()
        if not plan.training:
            # (the tensors among the edited values: a Python number the graph adds, `h#other`, has no dtype)
            _say_if_low_precision({self.tensor(e.value).dtype for e in plan.const_edits
                                   if e.value in self.placeholders or e.value in self.attrs})

    def _tell(self, report: Report) -> None:
        """Every graph's report is told once (the log, `on_report`, `reports`), folded or not."""
        reports.append(report)
        if self.on_report is not None:
            self.on_report(report)
        log.info("lnfold: %s", report.summary())

    def apply(self, plan: Plan) -> fx.GraphModule:
        with self._unfolded_on_failure("editing the graph failed", plan):
            constants = GraphConstants(exact=not plan.training)
            Applier(self.work, self._view, self.info, TORCH, constants, norm="rms_norm").apply(plan)
            if plan.deferral.deferred:
                deferred_norm.emit_all(self.work, plan.deferral, deferred_norm.graph_biases(self.work))
                self.work.recompile()
        self._tell(plan.report)
        return self.work

    emit = staticmethod(pipeline.in_memory)

    def verify(self, plan: Plan, work: fx.GraphModule) -> None:
        verify_graph(self.gm, work, self.example_inputs)  # raises VerificationError

    def result(self, plan: Plan, work: fx.GraphModule) -> FoldResult:
        return FoldResult(report=plan.report, module=work)

    @contextlib.contextmanager
    def _unfolded_on_failure(self, what: str, plan: Optional[Plan] = None):
        try:
            yield
        except Exception as e:
            log.warning("lnfold: %s, compiling unfolded: %s", what, e)
            if plan is not None:  # (a copy: the plan's own report stays as planned)
                self._tell(plan.report.with_notes([f"the fold failed ({e}); this graph was compiled unfolded"]))
            raise _Unfolded() from e


def compile_folded(gm: fx.GraphModule, example_inputs: list, *, fold_mode: str = "rms",
                   inner: Callable, on_report: Optional[Callable] = None, verify: bool = False,
                   defer: str = "off") -> Callable:
    """Fold a copy of `gm` (Dynamo reads its own graph after the backend returns), compile it; the
    unfolded graph where the fold fails (DynamoFrontend). `verify`: run both graphs eagerly on the
    example inputs first, VerificationError when they differ."""
    opts = FoldOptions(mode=fold_mode, defer=defer, verify=verify)  # checked before the fold, whose failures are only logged
    frontend = DynamoFrontend(gm, example_inputs, opts, on_report)
    try:
        result = pipeline.fold(frontend, verify=opts.verify, planner=frontend.plan)
    except _Unfolded:
        return inner(gm, example_inputs)
    t = time.perf_counter()
    compiled = inner(result.module, example_inputs)
    timings.append({"analysis": result.timings["analysis"], "editing": result.timings["editing"],
                    "inner": time.perf_counter() - t})
    return compiled


class FragmentWarning(UserWarning):
    """The backend kept LayerNorms because its graph is a fragment of the model."""


_fragment_warned = False


def _say_if_fragment(plan: Plan, view) -> None:
    """Say, once per process, that norms were kept because the graph starts mid-stream: under a graph
    break, per-block torch.compile or FSDP2, Dynamo hands over one piece of the model at a time, whose
    stream starts at a graph input no constant edit can center. The module-level fold sees the whole
    model (a module folded with it has no LayerNorm left here)."""
    starts = [o for comp in plan.components if not comp.foldable for o in comp.opaque
              if view.values[o.value].producer is None and not view.values[o.value].is_const]
    if not starts:
        return
    kept = sum(n.verdict == "keep" for n in plan.report.norms)
    _warn_once("_fragment_warned", FragmentWarning,
               f"lnfold: {kept} of {len(plan.report.norms)} LayerNorm(s) of this graph kept: it is a fragment "
               f"(graph break, per-block torch.compile or FSDP2): the stream starts at {starts[0].what}, so "
               "nothing in it can be proven zero-mean; fold the whole model before wrapping and compiling: "
               "lnfold.fold_for_training(model, args)")


class LowPrecisionWarning(UserWarning):
    """The backend folded a bf16/fp16 model: each edited weight is rounded a second time."""


_low_precision_warned = False


def _say_if_low_precision(edited_dtypes: set[torch.dtype]) -> None:
    """Say, once per process, that folding a bf16/fp16 model rounds each edited weight twice (once at
    the cast, once after the float64 centering; the fp32 weights are not in Dynamo's graph): up to 4x
    the original's logits error (benchmarks/lowprecision.py). Inference only: training centers the
    optimizer's own parameters each step, and there is no fp32 copy to fold."""
    low = sorted(str(t).removeprefix("torch.") for t in edited_dtypes & set(LOW_PRECISION))
    if not low:
        return
    _warn_once("_low_precision_warned", LowPrecisionWarning,
               f"lnfold: folding a {'/'.join(low)} model: each weight the fold edits is rounded to {low[0]} a "
               "second time (its fp32 values are not in the graph), so the folded model can be less exact than "
               "the original; for one rounding, fold the fp32 checkpoint, then cast: "
               f"lnfold.fold_to_rmsnorm(model_fp32, args); model_fp32.to(torch.{low[0]}); then torch.compile it")


def _warn_once(flag: str, category: type, msg: str) -> None:
    """A warning the first time per process (`flag`: this module's global that remembers it), a log
    line after."""
    if globals()[flag]:
        log.info(msg)
        return
    globals()[flag] = True
    warnings.warn(msg, category, stacklevel=3)


def register() -> None:
    """Make backend="lnfold" resolve to this module, unless torch already knows the name (an
    installed lnfold's entry point, which a second registration would make fail as a duplicate)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "lnfold" not in list_backends(exclude_tags=()):
        register_backend(lnfold_backend, name="lnfold")
