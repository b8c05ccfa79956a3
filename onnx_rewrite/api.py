"""The ONNX frontend's public API: `analyze_model` and `fold_model`."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import version_converter

from ..passes import FoldResult, LnfoldError, NothingToFold, Report, View, make_plan, pipeline
from ..passes.calibration import Rows, check_calibration
from ..passes.massive import massive_channels
from ..passes.options import APPROX_MODE, MASSIVE, FoldOptions, takes_options
from ..passes.pipeline import Progress
from ..passes.plan import Plan, first_kept_reason
from ..passes.request import PlanRequest, request_from
from ..passes import approx, geometry
from ..passes.approx import METADATA_KEY as APPROX_KEY

from . import calibration as calibration_io
from . import read, subgraphs, targets, validate, write
from . import verify as verification
from .classify import GraphInfo, build_view
from .emit import Emitter
from .already_rms import computed_gains, rms_norms
from .norms import const_values
from .sessions import in_background
from .shapes import infer_shapes
from .targets import Target
from .write import is_large

# New constants at least this big are exported without a second copy (see _export).
_HOLD_BYTES = 2**16
_PLAIN_DTYPES = {onnx.helper.tensor_dtype_to_np_dtype(t): t for t in read.PLAIN_TYPES}


@contextlib.contextmanager
def _graphsurgeon_errors_only():
    """graphsurgeon's warnings (about graphs it is handed mid-edit) are not our users' business."""
    logger = gs.logger.G_LOGGER
    before = logger.severity
    logger.severity = logger.ERROR
    try:
        yield
    finally:
        logger.severity = before


def stderr_progress(msg: str) -> None:
    print(f"lnfold: {msg}", file=sys.stderr, flush=True)


def _import(model: onnx.ModelProto) -> gs.Graph:
    graph = gs.import_onnx(model)
    # graphsurgeon keeps the model's own opset_import list and appends the domains of new nodes
    # to it on export: give it a copy, or folding would edit the caller's model
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    subgraphs.dedupe_node_names(graph, set())  # the analysis names nodes: they must be unique
    return graph


def as_model(model) -> onnx.ModelProto:
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        return read.load(model)
    if not isinstance(model, onnx.ModelProto):
        raise LnfoldError(f"expected an onnx.ModelProto or a path to one, got {type(model).__name__}")
    return model


class OnnxFrontend:
    """The ONNX frontend in the pipeline (passes/pipeline.py): a model in, a folded model out,
    verified in memory, or from the files written for `output` (the CLI; models over 2 GB)."""

    def __init__(self, model: onnx.ModelProto, opts: FoldOptions, target: Target, *, inputs=None, dims=None,
                 progress: Progress = None, output=None, source=None, layout=None, prepared=None,
                 **decided) -> None:
        self.model, self.opts, self.target = model, opts, target
        self.inputs, self.dims, self.progress = inputs, dims, progress
        self.output, self.source = output, source  # write to `output`, verify against the file `source`
        self.layout = layout  # where `output` keeps its weights (write.data_layout)
        self.work = model  # read, never written: graphsurgeon builds a new proto on export
        self.notes: list[str] = []  # what the emission adds to the plan's report
        self.decided = decided  # what a calibrated decision adds to the request (Folds.fold)
        # (model at the target's opset, opset, shapes): another frontend on the same model and target
        # may start from it (the approximate swap's tries)
        self.prepared = prepared
        self._reference: Optional[Future] = None
        self.folded: Optional[onnx.ModelProto] = None

    def view(self) -> View:
        if self.prepared is None:
            self.prepared = self._prepare()
        self.work, self.opset, shapes = self.prepared
        self.graph = _import(self.work)
        if self.opts.gamma_into_readers:
            computed_gains(self.graph)  # GemmaRMSNorm's Add(1, weight): a constant γ
        self.info = GraphInfo(self.graph, shapes)
        view, self.matches = build_view(self.info, self.opset, rms=self.opts.reads_rms_norms)
        # If branches: one view with the main graph
        self.scopes = subgraphs.inline_branches(self.work, self.graph, view, self.opset,
                                                rms=self.opts.reads_rms_norms)
        self.built_view = view  # (where "nothing to fold" finds the RMSNorms it names)
        return view

    def _prepare(self) -> tuple:
        need = self.target.opset
        if need and validate.check_opset(self.work) < need:
            pipeline.stage(self.progress, f"converting to opset {need} for {self.target.norm_op}")
            try:
                self.work = version_converter.convert_version(self.work, need)
            except Exception as e:  # the converter raises bare RuntimeErrors
                raise LnfoldError(f"--target {self.target.name} needs opset {need}; converting failed: "
                                  f"{str(e).splitlines()[0]}") from None
        model = self.work
        opset = validate.check_opset(model)
        validate.check_graph(model)
        validate.check_tensors(model)
        return model, opset, infer_shapes(model)

    def request(self) -> PlanRequest:
        return request_from(self.opts, self.target.capabilities(), zero=lambda name: _all_zero(self.info, name),
                            **self.decided)

    def check(self, plan: Plan) -> None:
        if not plan.report.norms and plan.empty:
            raise NothingToFold(validate.no_norm_message(self.work, rms_norms(self.info, self.built_view))
                                + plan.report.near_miss_hint()
                                + _unrotated(plan))
        if plan.empty:
            raise NothingToFold(f"no LayerNorm can be folded; first kept: {first_kept_reason(plan.report)}")

    def apply(self, plan: Plan) -> onnx.ModelProto:
        self._reference = self._start_reference(plan)
        emitters = [Emitter(self.graph, self.info, self.opset, self.target)]
        if self.scopes:
            def branch_emitter(g, i) -> Emitter:
                emitters.append(Emitter(g, i, self.opset, self.target))
                return emitters[-1]

            subgraphs.apply(plan, emitters[0], self.matches, self.scopes, branch_emitter)
        else:
            emitters[0].apply(plan, self.matches)
        self.notes = [n for e in emitters for n in e.notes]
        out = _export(self.graph, self.work)
        if plan.approx:  # whoever loads the file can tell it is not the original's function
            out.metadata_props.append(onnx.StringStringEntryProto(key=APPROX_KEY, value=(
                f"NOT exactly equivalent: {len(plan.approx)} LayerNorm(s) that cannot be folded were swapped to "
                f"RMSNorm under a measured error budget (lnfold --mode rms-approx): {', '.join(plan.approx)}")))
        return out

    def emit(self, folded: onnx.ModelProto):
        self.folded = folded  # (as written: verification reads its graph from here, not from the file)
        if self.output is None:
            return pipeline.in_memory(folded)
        pipeline.stage(self.progress, f"saving {self.output}")
        return write.staged(folded, self.output, layout=self.layout)

    def _start_reference(self, plan: Plan) -> Optional[Future]:
        """The original's side of verification (verify.reference), run in a thread while the plan is
        applied and the output written: it does not depend on the fold, and onnxruntime and numpy
        release the GIL. None where `verify` will not run."""
        if not self.opts.verify or plan.approx or (self.output is None and is_large(self.model)):
            return None
        original = verification.Source(self.source, parsed=self.model) if self.output is not None else self.model
        return in_background("reference", verification.reference, original, inputs=self.inputs, dims=self.dims)

    def verify(self, plan: Plan, artifact):
        reference = self._reference
        if reference is None or (self.output is None and is_large(artifact)):
            return None  # over protobuf's 2 GB in memory: onnxruntime needs files
        pipeline.stage(self.progress, "verifying in onnxruntime" if self.output is not None else "verifying")
        folded = verification.Source(artifact, parsed=self.folded) if self.output is not None else artifact
        verdict = verification.check_against(reference.result(), folded)
        if not verdict.ok:
            raise verdict.error()
        return verdict

    def result(self, plan: Plan, folded: onnx.ModelProto) -> FoldResult:
        return FoldResult(report=plan.report.with_notes(self.notes), model=folded)

    def capture(self, artifact: Optional[onnx.ModelProto], values: list[str], batches: list[dict]) -> dict:
        return calibration_io.capture(self.model if artifact is None else artifact, values, batches)

    def run(self, artifact: Optional[onnx.ModelProto], batches: list[dict]) -> list:
        return calibration_io.run(self.model if artifact is None else artifact, batches)


def _unrotated(plan: Plan) -> str:
    """For "nothing to fold" with γ into the readers asked: why the RMSNorms as given changed nothing."""
    said = [f"stream {k + 1} {s.rotation}" for k, s in enumerate(plan.report.streams) if s.rms and s.rotation]
    said += [f"`{r.name}`: γ {r.gamma}" for r in plan.report.rms_norms if r.gamma][:1]
    return "".join(f"; {t}" for t in said[:2])


def stamp(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set the model's metadata entry `key`, replacing any it had."""
    for p in [p for p in model.metadata_props if p.key == key]:
        model.metadata_props.remove(p)
    model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))


def _all_zero(info: GraphInfo, name: str) -> bool:
    v = const_values(info.tensors[name]) if name in info.tensors else None
    return v is not None and not np.any(np.asarray(v))


def analyze_model(model: onnx.ModelProto, *, mode: str = "rms", calibration=None, angles: bool = False,
                  dims: Optional[dict] = None) -> Report:
    """The report alone: every LayerNorm of `model`, its verdict and the reason for each kept one.

    With `calibration` (a dict name -> array, or an .npz path) or `angles=True` (made-up inputs)
    `report.geometry` holds each norm's angle to 1 before and, for folded norms, after the fold
    (passes/geometry.py)."""
    opts = FoldOptions(mode=mode)  # (a bad mode is the first error, before the model is read)
    model = as_model(model)
    folds = OnnxFolds(model, opts, targets.resolve("ort", "cpu"))
    view, plan = folds.plan(make_plan)
    report = plan.report
    if calibration is not None or angles:
        rows, synthetic = calibration_io.rows_for(model, calibration, dims)
        measured = geometry.measure(folds, view, report.verdicts(), rows.runs(), make_plan, synthetic=synthetic)
        report = dataclasses.replace(report, geometry=measured)
    # a folded model's: listed as already RMSNorm
    return dataclasses.replace(report, rms_norms=rms_norms(folds.frontend.info, view))


@takes_options
def fold_model(
    model: onnx.ModelProto,
    *,
    options: FoldOptions,
    target: str = "ort",
    device: str = "cpu",
    inputs=None,
    dims: Optional[dict] = None,
    progress: Progress = None,
    verify_outputs: Optional[bool] = None,
    calibration=None,
    budget: Optional[float] = None,
    heldout=None,
    metric: Optional[Callable] = None,
) -> FoldResult:
    """Fold every foldable LayerNorm of `model` into an RMSNorm; the input is not modified.

    `target` picks the emission ("ort", "onnx", "portable": targets.py); `device` picks onnxruntime's
    fastest exact emission for "ort": on "cpu" an Add and SimplifiedLayerNormalization, on "cuda" the
    fused SkipSimplifiedLayerNormalization. The options are listed at the end.

    Verification runs the original, the folded model and a float64 copy of the original (passes/gate.py
    judges) on `inputs` (a dict name -> array, or an .npz path), else on inputs made up from the graph
    with `dims` (symbolic dim name -> size) fixing sizes. `report.norms[i].gamma` says where γ went,
    `report.streams[k].rotation` which streams were rotated and why not.

    `mode="rms-approx"` (NOT exact; passes/approx.py): after the exact fold, norms that cannot be
    folded are swapped for RMSNorm (β kept) while the outputs' relative error (or `metric(reference
    outputs, outputs)`) on `calibration` (a dict or an .npz path) stays <= `budget`, greedily by
    measured effect; the error on `heldout` (default: the calibration batch's second half, which
    then does not decide) is in `report.approx`. Every other option is exact and verified.

    Raises NothingToFold when no LayerNorm can be folded and VerificationError when the folded
    model is less exact than the original allows. Models over 2 GB are verified only by `fold_file`,
    from the files it writes. `verify_outputs` is the old name of `verify`.
    """
    if verify_outputs is not None:
        warnings.warn("fold_onnx(verify_outputs=...) is now verify=...", DeprecationWarning, stacklevel=2)
        options = dataclasses.replace(options, verify=verify_outputs)
    if options.mode == APPROX_MODE:
        return fold_approx(as_model(model), options, calibration=calibration, budget=budget, heldout=heldout,
                           metric=metric, target=target, device=device, progress=progress)
    return fold_file(None, model, None, options, target=target, device=device, inputs=inputs, dims=dims,
                     progress=progress)


def fold_file(src, model: onnx.ModelProto, dst, opts: FoldOptions, *, target: str = "ort", device: str = "cpu",
              inputs=None, dims: Optional[dict] = None, progress: Progress = None, layout=None) -> FoldResult:
    """`fold_model` of `model` (loaded from the file `src`), written to `dst` (its weights as `layout`
    says: write.data_layout) and published only when the written files pass verification against
    `src` (any size: onnxruntime reads them). With `dst` None: fold_model, in memory."""
    tgt = targets.resolve(target, device)
    model = as_model(model)
    if opts.verify:  # bad inputs or dims are the user's error: say so before any work
        inputs, dims = check_verify_args(model, inputs, dims)
    opts = with_massive_channels(model, opts, tgt, inputs, dims)
    frontend = OnnxFrontend(model, opts, tgt, inputs=inputs, dims=dims, progress=progress, output=dst, source=src,
                            layout=layout)
    return run_frontend(frontend, progress)


def with_massive_channels(model: onnx.ModelProto, opts: FoldOptions, target: Target, rows=None,
                          dims: Optional[dict] = None) -> FoldOptions:
    """`opts` with spare_channels=MASSIVE found on `rows` (the user's inputs, an .npz path, Rows, or
    None: made-up ones) for each stream (passes/massive.py); other options as they are."""
    if opts.spare_channels != MASSIVE:
        return opts
    if not isinstance(rows, Rows):
        rows = calibration_io.rows_for(model, rows, dims)[0]
    folds = OnnxFolds(model, dataclasses.replace(opts, spare_channels=None, verify=False), target)
    return dataclasses.replace(opts, spare_channels=massive_channels(folds, rows.runs(), make_plan))


def fold_approx(model: onnx.ModelProto, opts: FoldOptions, *, calibration, budget, heldout=None, metric=None,
                target: str = "ort", device: str = "cpu", progress: Progress = None,
                output=None, source=None, layout=None) -> FoldResult:
    """Mode "rms-approx" (see fold_model): passes/approx.swap_within_budget over onnxruntime runs of
    folds that differ only in the kept norms swapped. Written to `output` when given."""
    approx.check_budget(budget)
    check_calibration(calibration, approx.CALIBRATED)
    data = calibration_io.calibration_data(model, calibration, heldout)
    folds = OnnxFolds(model, opts, targets.resolve(target, device),
                      inputs=data.deciding[0], progress=progress, written=dict(output=output, source=source,
                                                                                layout=layout))
    return approx.swap_within_budget(folds, data, budget, make_plan, metric=metric, progress=progress)


class OnnxFolds:
    """passes/calibration.Folds over ONNX: the model validated and its shapes inferred once, each fold
    a fresh import of it, verified on `inputs`; the final fold written to `written["output"]` where
    given, and measured as read back from there, as a user would load it."""

    def __init__(self, model: onnx.ModelProto, opts: FoldOptions, target: Target, *, inputs: Optional[dict] = None,
                 progress: Progress = None, written: Optional[dict] = None) -> None:
        self.model, self.opts, self.target, self.inputs, self.progress = model, opts, target, inputs, progress
        self.written = written or {}
        self.frontend = OnnxFrontend(model, opts, target)
        self.loaded: dict = {}  # the final result -> its model read back from `output`

    def plan(self, planner) -> tuple[View, Plan]:
        with _graphsurgeon_errors_only():
            return pipeline.plan(self.frontend, planner)

    def fold(self, planner, opts: FoldOptions, *, final: bool = False, **decided) -> FoldResult:
        progress = self.progress if final or opts.verify else None
        frontend = OnnxFrontend(self.model, opts, self.target, inputs=self.inputs, progress=progress,
                                prepared=self.frontend.prepared, **decided,
                                **(self.written if final else {}))
        result = run_frontend(frontend, progress, planner)
        self.frontend.prepared = frontend.prepared  # (the first fold may be the first to prepare)
        if final and self.written.get("output") is not None:
            self.loaded = {id(result): read.load(self.written["output"])}
        return result

    def artifact(self, result: FoldResult) -> onnx.ModelProto:
        return self.loaded.get(id(result), result.model)

    def rows(self, batches: list) -> int:
        return sum(len(next(iter(b.values()))) for b in batches if b)


def run_frontend(frontend: OnnxFrontend, progress: Progress, planner=None) -> FoldResult:
    """The pipeline over one ONNX frontend (`planner`: make_plan, looked up at each call, or one that
    also keeps what it planned)."""
    with _graphsurgeon_errors_only():
        return pipeline.fold(frontend, verify=frontend.opts.verify, planner=planner or make_plan, progress=progress)


def check_verify_args(model: onnx.ModelProto, inputs, dims) -> tuple[Optional[dict], Optional[dict]]:
    """The user's verification inputs (a dict or an .npz path) and dims, checked against `model`."""
    from . import inputs as synth

    if inputs is not None:
        inputs = synth.load_npz(inputs, model) if isinstance(inputs, (str, os.PathLike)) \
            else synth.check_feeds(dict(inputs), model)
    if dims:
        dims = synth.check_dims(dict(dims), model)
    if inputs is None:  # the inputs verification would make up: refused here if too big to make
        synth.check_size(model, dims)
    return inputs, dims


def check_equivalent(original, folded, *, inputs=None, dims=None):
    """The gate's verdict (passes/gate.py); raises VerificationError when the fold fails it."""
    verdict = verification.check(original, folded, inputs=inputs, dims=dims)
    if not verdict.ok:
        raise verdict.error()
    return verdict


def _export(graph: gs.Graph, like: onnx.ModelProto) -> onnx.ModelProto:
    uses_ms = any(n.domain == "com.microsoft" for n in graph.nodes)
    # Export copies every big constant twice (new arrays into a TensorProto, then the graph's; untouched
    # ones into the graph's list, then the model): they are exported as empty placeholders and filled
    # in once after, so a big model's weights are held once.
    lazy = gs.ir.tensor.LazyValues
    held: dict[str, np.ndarray] = {}
    kept: dict[str, gs.ir.tensor.LazyValues] = {}  # name -> its values (the original TensorProto)
    arr = None
    for t in graph.tensors().values():
        if not isinstance(t, gs.Constant) or t._export_dtype is not None:
            continue
        if isinstance(t._values, np.ndarray):
            arr = t._values
            dtype = _PLAIN_DTYPES.get(arr.dtype)
            if arr.nbytes >= _HOLD_BYTES and dtype is not None:
                held[t.name] = arr
                t._values = lazy(onnx.TensorProto(name=t.name, data_type=dtype, dims=arr.shape))
        elif type(t._values) is lazy and t._values.tensor.HasField("raw_data") and \
                validate.raw_bytes(t._values.tensor) >= _HOLD_BYTES:
            kept[t.name], src = t._values, t._values.tensor
            t._values = lazy(onnx.TensorProto(name=t.name, data_type=src.data_type, dims=src.dims))
    del arr
    shared = subgraphs.hoistable(graph)
    try:
        out = gs.export_onnx(graph, do_type_check=False)
    finally:
        for t in graph.tensors().values():  # the graph keeps its constants (another export may follow)
            if t.name in kept:
                t._values = kept[t.name]
    if held or kept:
        copied: set[str] = set()
        for tp in read.all_tensors(out):
            arr = held.pop(tp.name, None)
            if arr is not None and not tp.HasField("raw_data"):
                tp.raw_data = np.ascontiguousarray(arr).tobytes()  # (name, type and dims: the placeholder's)
                del arr
            elif tp.name in kept and not tp.HasField("raw_data"):
                name = tp.name
                tp.CopyFrom(kept[name].tensor)
                tp.name = name  # (graphsurgeon's name for it, as its export would write)
                copied.add(name)
        lost = sorted(held) + sorted(set(kept) - copied)
        if lost:  # pragma: no cover - every held constant is an initializer of the graph
            raise RuntimeError(f"lost constants on export: {lost[:3]}")
    if shared:
        subgraphs.hoist_initializers(out, shared)
    out.ir_version = like.ir_version
    del out.opset_import[:]
    out.opset_import.extend(like.opset_import)
    if uses_ms and not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, field, getattr(like, field))
    del out.metadata_props[:]
    out.metadata_props.extend(like.metadata_props)
    out.metadata_props.append(onnx.StringStringEntryProto(key="lnfold", value="folded LayerNorms into RMSNorms"))
    del out.functions[:]
    out.functions.extend(like.functions)
    return out
