"""Numerical verification (DESIGN §4): run the original, the folded model and a float64 copy of
the original on the same inputs, and let passes/gate.py judge the fold.

The inputs are the user's (`inputs`) or made up from the graph (inputs.py), trying a few size
assignments until the original runs. The float64 run is a float64 copy of the original in
onnxruntime, or, where onnxruntime has no double kernel for one of its ops, onnx's reference
evaluator. A model onnxruntime refuses to load (a type error its checker finds; onnx's does not)
is run with the reference evaluator throughout. Where the reference evaluator cannot run it in its
own dtype either (onnxconverter-common's fp16 files type a Cast's output against what its readers
expect), float64 copies of both models are compared (gate.judge_float64_copies), and the folded
model must be refused by onnxruntime for the same reason as the input, not a new one.

Cost (issue 24): each model is read once and each session built once; a model given as a path
is loaded by onnxruntime from the file, without a serialized copy. The folded model's norm
inputs (needed only by the gate's fallback) are added as outputs only when no float64 run was
possible. A float64 copy runs in onnxruntime even where a few of its ops have no double kernel
(Conv, Erf on CPU): those run in onnx's reference evaluator, the rest in onnxruntime, segment by
segment, instead of the whole model in the reference evaluator.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional, Union

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from ..passes import LnfoldError, VerificationError
from ..passes import gate
from ..passes.weights import max_rel_err
from . import inputs as synth
from . import random_ops

ModelLike = Union[onnx.ModelProto, str, os.PathLike]

# A float64 copy is made only of models with at most this many float weights (1 GiB in float64).
EXACT_MAX_ELEMS = 2**27
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_RMS_OPS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"}
_HINT = "give real inputs with --inputs FILE.npz or sizes with --dim NAME=SIZE (API: inputs=, dims=)"

_QUIET = ort.RunOptions()
_QUIET.log_severity_level = 4


class _Source:
    """A model as given, a ModelProto or a path, read at most once: its graph without external
    weights (`skeleton`) first, the weights (`proto`) only if something needs them; onnxruntime
    loads a path itself."""

    def __init__(self, model: ModelLike) -> None:
        self.path = None if isinstance(model, onnx.ModelProto) else str(model)
        self._proto = model if isinstance(model, onnx.ModelProto) else None
        self._skeleton: Optional[onnx.ModelProto] = None

    @staticmethod
    def of(model: Union[ModelLike, "_Source"]) -> "_Source":
        return model if isinstance(model, _Source) else _Source(model)

    @property
    def skeleton(self) -> onnx.ModelProto:
        if self._proto is not None:
            return self._proto
        if self._skeleton is None:
            self._skeleton = onnx.load(self.path, load_external_data=False)
        return self._skeleton

    @property
    def proto(self) -> onnx.ModelProto:
        if self._proto is None:  # the skeleton, its external weights read in
            load_external_data_for_model(self.skeleton, os.path.dirname(os.path.abspath(self.path)))
            self._proto = self.skeleton
        return self._proto


def session(model: Union[ModelLike, _Source]) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4  # failures raise; ERROR logs would only repeat them on stderr
    if isinstance(model, _Source):
        model = model.path if model.path is not None else model.proto
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _proto(model: Union[ModelLike, _Source]) -> onnx.ModelProto:
    return _Source.of(model).proto


def _skeleton(model: Union[ModelLike, _Source]) -> onnx.ModelProto:
    return _Source.of(model).skeleton


# --- runners -------------------------------------------------------------------------------------

class _Runner:
    """Runs one model: in onnxruntime, or with onnx's reference evaluator where onnxruntime
    refuses to load it."""

    def __init__(self, model: ModelLike, *, allow_reference: bool = False) -> None:
        self.model, self.load_error, self.refusal = model, None, None
        try:
            self.sess = session(model)
            self.names = [o.name for o in self.sess.get_outputs()]
        except Exception as e:
            if not allow_reference:
                raise
            self.sess, self.load_error, self.refusal = None, _first_line(e), _refusal(e)
            self.ref = _reference(_proto(model))
            self.names = list(self.ref.output_names)

    def run(self, feeds: dict) -> list[np.ndarray]:
        if self.sess is not None:
            return self.sess.run(None, feeds, _QUIET)
        return [np.asarray(x) for x in self.ref.run(None, feeds)]


def _reference(model: onnx.ModelProto):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=_contrib_ops())


def _contrib_ops() -> list:
    """Ops onnx's reference evaluator lacks: onnxruntime's RMSNorm ops (what `--target ort`
    emits), and Erfc. Erfc is for the reference evaluator only: onnxruntime has no schema for it."""
    from onnx.reference.op_run import OpRun

    def rms(x, gamma, axis, eps):
        axis = axis % x.ndim
        axes = tuple(range(axis, x.ndim))
        ms = np.mean(np.square(x.astype(np.float64)), axis=axes, keepdims=True)
        return (x / np.sqrt(ms + eps) * gamma).astype(x.dtype)

    class SimplifiedLayerNormalization(OpRun):
        op_domain = ""

        def _run(self, x, gamma, axis=-1, epsilon=1e-5, stash_type=1):
            return (rms(x, gamma, axis, epsilon),)

    class SkipSimplifiedLayerNormalization(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, skip, gamma, bias=None, epsilon=1e-5):
            s = x + skip + (bias if bias is not None else 0)
            return (rms(s, gamma, -1, epsilon), None, None, s)

    class Erfc(OpRun):
        """tf2onnx writes Erfc, which is not an ONNX op (its GELU: 0.5 x erfc(-x/√2)): 1 - erf(x),
        computed as math.erfc (exact where 1 - erf(x) would cancel, for large x)."""
        op_domain = ""

        def _run(self, x):
            return (_ERFC(x).astype(x.dtype),)

    return [SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, Erfc]


_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


def float64_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The same graph computing in float64 (float constants, casts, inputs and outputs become
    double; value_info is dropped: onnxruntime re-infers it), and its float weights in float64.
    The weights become inputs of the copy, fed with its inputs: onnxruntime takes them from numpy
    without a serialized copy (a GPT-2's 1 GB in float64 took longer to serialize and parse than
    to run)."""
    g = model.graph
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in g.initializer if t.data_type in _FLOATS}
    declared = {i.name for i in g.input}
    inputs = list(g.input) + [helper.make_tensor_value_info(name, onnx.TensorProto.DOUBLE, w.shape)
                              for name, w in weights.items() if name not in declared]
    graph = helper.make_graph(g.node, g.name, inputs, g.output,
                              [t for t in g.initializer if t.name not in weights], sparse_initializer=g.sparse_initializer)
    out = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                            functions=model.functions)
    _graph_to_f64(out.graph)
    if any(map(random_ops.runs_in_own_dtype, g.node)):  # random draws, DequantizeLinear's float scales
        random_ops.in_own_dtype(out.graph, random_ops.own_types(model))
    return out, weights


def _tensor_to_f64(t: onnx.TensorProto) -> None:
    if t.data_type in _FLOATS:
        raw = np.ascontiguousarray(numpy_helper.to_array(t), dtype="<f8").tobytes()
        for field in ("float_data", "int32_data", "raw_data"):
            t.ClearField(field)
        t.data_type, t.raw_data = onnx.TensorProto.DOUBLE, raw


def _graph_to_f64(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        _tensor_to_f64(t)
    for vi in list(g.input) + list(g.output):
        tt = vi.type.tensor_type
        if tt.elem_type in _FLOATS:
            tt.elem_type = onnx.TensorProto.DOUBLE
    del g.value_info[:]
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _tensor_to_f64(a.t)
            elif a.type == onnx.AttributeProto.GRAPH:
                _graph_to_f64(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _graph_to_f64(sub)
            if n.op_type == "Cast" and a.name == "to" and a.i in _FLOATS:
                a.i = onnx.TensorProto.DOUBLE
            if a.name == "dtype" and a.type == onnx.AttributeProto.INT and a.i in _FLOATS and not random_ops.is_random(n):
                a.i = onnx.TensorProto.DOUBLE  # EyeLike's: the type it makes (random nodes: random_ops.py)
        if n.op_type == "Constant":  # value_float(s) make float tensors: make them double tensors
            for a in list(n.attribute):
                if a.name in ("value_float", "value_floats"):
                    vals = [a.f] if a.name == "value_float" else list(a.floats)
                    arr = np.array(vals[0] if a.name == "value_float" else vals, dtype=np.float64)
                    n.attribute.remove(a)
                    n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(arr)))


def _float_elems(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer if t.data_type in _FLOATS)


class _Float64:
    """A float64 copy of a model, run in onnxruntime; where onnxruntime has no double kernel for
    some of its ops, those run in onnx's reference evaluator and the rest in onnxruntime
    (_Segments); where that fails too (or onnxruntime refuses the model), the whole copy runs in
    onnx's reference evaluator."""

    def __init__(self, model: ModelLike) -> None:
        self.model, self.weights = float64_copy(_proto(model))
        self.ref, self.why, self.sess, self.segments = None, "", None, None
        lacking = _without_double_kernel(self.model)
        try:
            if not lacking:
                self.sess = session(self.model)
            elif _segmentable(self.model):
                self.segments = _Segments(self.model, lacking)
            else:
                self.why = f"no double kernel in onnxruntime for {', '.join(sorted({n.op_type for n in lacking}))}"
        except Exception as e:
            self.sess, self.segments, self.why = None, None, _first_line(e)

    def run(self, feeds: dict, weights: Optional[dict] = None) -> tuple[list[np.ndarray], str]:
        """(outputs, what ran them) on `feeds` with floats upcast, with the model's float weights or
        `weights` in their place; raises RuntimeError saying why neither could run it."""
        f64 = {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in feeds.items()}
        f64.update(self.weights if weights is None else weights)
        why = self.why
        if self.sess is not None:
            try:
                return self.sess.run(None, f64, _QUIET), "onnxruntime"
            except Exception as e:
                why = _first_line(e)
        if self.segments is not None:
            try:
                return self.segments.run(f64), self.segments.describe()
            except Exception as e:
                why = _first_line(e)
        try:
            if self.ref is None:
                self.ref = _reference(self.model)
            return [np.asarray(x) for x in self.ref.run(None, f64)], "onnx reference evaluator"
        except Exception as e:
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            raise RuntimeError(f"onnxruntime: {why}; reference evaluator: {type(e).__name__}: {msg}") from None


def exact_run(model: ModelLike, feeds: dict) -> tuple[Optional[list[np.ndarray]], str]:
    """The outputs of a float64 copy of `model` on `feeds` (floats upcast), and how they were
    computed; (None, why) where no float64 run was possible."""
    if _float_elems(_skeleton(model)) > EXACT_MAX_ELEMS:
        return None, f"a float64 copy would hold more than {EXACT_MAX_ELEMS} float weights"
    try:
        return _Float64(model).run(feeds)
    except RuntimeError as e:
        return None, str(e)


def _without_double_kernel(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of a float64 copy whose op onnxruntime's CPU provider has no double kernel for
    (its kernel registry, by op, domain and opset); empty when the registry cannot be read."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_opkernel_def
        defs = get_all_opkernel_def()
    except Exception:  # an onnxruntime without the registry: try the whole copy, as before
        return []
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    floats, double = set(), set()  # ops with a kernel for some float type; for double
    for d in defs:
        lo, hi = d.version_range
        domain = d.domain or "ai.onnx"
        if d.provider != "CPUExecutionProvider" or not lo <= opsets.get(domain, 0) <= hi:
            continue
        types = {t for ts in d.type_constraints.values() for t in ts}
        if types & {"tensor(float)", "tensor(float16)", "tensor(bfloat16)"}:
            floats.add((domain, d.op_name))
        if "tensor(double)" in types:
            double.add((domain, d.op_name))
    # (an op on other types only, And or Shape, is not touched by the float64 copy)
    return [n for n in model.graph.node if (n.domain or "ai.onnx", n.op_type) in floats - double
            and not random_ops.runs_in_own_dtype(n)]


def _segmentable(model: onnx.ModelProto) -> bool:
    """Can the graph be cut into runs of nodes? Not with subgraphs (their outer-scope reads) or
    model-local functions."""
    return not model.functions and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                           for n in model.graph.node for a in n.attribute)


class _Segments:
    """A float64 copy run as consecutive runs of nodes (the graph's topological order): each run
    of nodes onnxruntime has double kernels for in one session, each other run in onnx's reference
    evaluator. The sessions are built on the first call, from the dtypes of the values then."""

    def __init__(self, model: onnx.ModelProto, lacking: list[onnx.NodeProto]) -> None:
        self.model, self.ref_ops = model, sorted({n.op_type for n in lacking})
        ids = {id(n) for n in lacking}
        self.runs: list[tuple[bool, list[onnx.NodeProto]]] = []  # (in the reference evaluator, nodes)
        for n in model.graph.node:
            ref = id(n) in ids
            if self.runs and self.runs[-1][0] == ref:
                self.runs[-1][1].append(n)
            else:
                self.runs.append((ref, [n]))
        self.runners: list = [None] * len(self.runs)

    def describe(self) -> str:
        return (f"onnxruntime, with {', '.join(self.ref_ops)} in onnx's reference evaluator "
                "(onnxruntime has no double kernel for them)")

    def run(self, feeds: dict) -> list[np.ndarray]:
        g = self.model.graph
        inits = {t.name: t for t in g.initializer}
        outputs = [o.name for o in g.output]
        later: list[set] = [set(outputs)] * (len(self.runs) + 1)  # values read by runs k.. or output
        for k in range(len(self.runs) - 1, -1, -1):
            later[k] = later[k + 1] | {i for n in self.runs[k][1] for i in n.input if i}
        values = dict(feeds)
        for k, (ref, nodes) in enumerate(self.runs):
            made = {o for n in nodes for o in n.output if o}
            wanted = [o for o in dict.fromkeys(o for n in nodes for o in n.output if o) if o in later[k + 1]]
            if not wanted:
                continue  # nothing reads what this run computes
            if self.runners[k] is None:
                self.runners[k] = self._build(k, values, inits, made, wanted)
            runner, reads = self.runners[k]
            got = runner.run(None, {i: values[i] for i in reads}, *(() if ref else (_QUIET,)))
            values.update(zip(wanted, (np.asarray(x) for x in got)))
            for name in [v for v in values if v not in later[k + 1] and v not in feeds]:
                del values[name]  # nothing after this run reads it
        return [values[o] for o in outputs]

    def _build(self, k: int, values: dict, inits: dict, made: set, wanted: list) -> tuple:
        """(runner, the names it is fed) for run k: what it reads from earlier runs or the
        inputs becomes its inputs (typed by their values now), the weights it reads its own."""
        ref, nodes = self.runs[k]
        reads = [i for i in dict.fromkeys(i for n in nodes for i in n.input if i) if i not in made]
        fed = [i for i in reads if i in values]
        graph = helper.make_graph(nodes, f"segment{k}", [_value_info(i, values[i]) for i in fed],
                                  [onnx.ValueInfoProto(name=o) for o in wanted],
                                  [inits[i] for i in reads if i not in values and i in inits])
        sub = helper.make_model(graph, opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        return (_reference(sub) if ref else session(sub)), fed


def _value_info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype), None)


# --- running the original on inputs it accepts ----------------------------------------------------

class _RefusedAndUnrunnable(LnfoldError):
    """onnxruntime refuses to load the original and onnx's reference evaluator cannot run it in
    its own dtype: check() then compares float64 copies."""

    def __init__(self, message: str, runner: _Runner) -> None:
        super().__init__(message)
        self.runner = runner


def original_run(original: ModelLike, *, inputs: Optional[dict] = None, dims: Optional[dict] = None,
                 seed: int = 0) -> tuple[_Runner, dict, list[np.ndarray]]:
    """Run the original on the user's inputs, or on made-up ones that it accepts.

    Raises LnfoldError naming the input(s) and the op that failed when no attempt runs.
    """
    original = _Source.of(original)
    skel = original.skeleton
    try:
        runner = _Runner(original, allow_reference=True)
    except Exception as e:  # neither onnxruntime nor the reference evaluator can load it
        raise LnfoldError(f"cannot verify: onnxruntime cannot load the input model ({_first_line(e)}); "
                          "use --no-verify (API: verify=False) to skip it") from None
    if inputs is not None:
        feeds = synth.check_feeds(inputs, skel)
        try:
            return runner, feeds, runner.run(feeds)
        except Exception as e:
            error = LnfoldError if runner.sess is not None else lambda m: _RefusedAndUnrunnable(m, runner)
            raise error(f"cannot verify: {_where(runner, skel, e)} on the given inputs: "
                        f"{_first_line(e)}") from None
    if dims:
        synth.check_dims(dims, skel)
    first: Optional[Exception] = None
    for _, feeds in synth.candidates(skel, dims, seed):
        try:
            return runner, feeds, runner.run(feeds)
        except Exception as e:
            first = first or e
    assert first is not None
    if runner.sess is None:
        raise _RefusedAndUnrunnable(f"cannot verify: onnxruntime refuses to load the input model ({runner.load_error}), and "
                          f"onnx's reference evaluator cannot run it either ({_where(runner, skel, first)}: "
                          f"{_first_line(first)}); use --no-verify (API: verify=False) to skip it",
                                     runner) from None
    raise LnfoldError(f"cannot verify: onnxruntime cannot run the input model on made-up inputs: "
                      f"{_where(runner, skel, first)}: {_first_line(first)}; {_HINT}; or skip it with --no-verify "
                      "(API: verify=False)") from None


def _where(runner: _Runner, model: onnx.ModelProto, e: Exception) -> str:
    """'Gather `/x` (reached from position_ids)': the failing node and the inputs it depends on."""
    m = re.search(r"running (\w+) node\. Name:'([^']*)'", str(e))
    if not m:
        return "the model"
    op, name = m.group(1), m.group(2)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next((n for n in model.graph.node if n.name == name), None)
    inputs = {i.name for i in model.graph.input}
    found, stack, seen = [], list(node.input) if node is not None else [], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in inputs and t not in found:
            found.append(t)
        elif t in producer:
            stack.extend(producer[t].input)
    order = [i.name for i in model.graph.input if i.name in found]
    reach = f" (reached from input{'s' if len(order) > 1 else ''} {', '.join(order)})" if order else ""
    return f"{op} `{name}`{reach}"


# --- the verdict ---------------------------------------------------------------------------------

def check(original: ModelLike, folded: ModelLike, *, inputs: Optional[dict] = None,
          dims: Optional[dict] = None, seed: int = 0) -> gate.Verdict:
    """The gate's verdict on `folded` (passes/gate.py). Raises LnfoldError when the original cannot
    be run (nothing to compare with) and VerificationError when only the folded model fails."""
    original, folded = _pinned(original), _pinned(folded)
    seeds = random_ops.describe(original.skeleton)
    try:
        runner, feeds, ra = original_run(original, inputs=inputs, dims=dims, seed=seed)
    except _RefusedAndUnrunnable as e:
        verdict = _check_float64_copies(original, folded, e, inputs=inputs, dims=dims, seed=seed)
        verdict.criterion += f"; {seeds}" if seeds else ""
        return verdict
    exact, how = exact_run(original, feeds)
    # the folded norms' inputs are read only by the gate's fallback without float64
    norm_names = _new_rms_inputs(original.skeleton, folded.skeleton) if exact is None else []
    try:
        fr = _Runner(_with_outputs(folded.proto, norm_names) if norm_names else folded,
                     allow_reference=runner.sess is None)
        rb_all = fr.run(feeds)
    except Exception as e:
        raise VerificationError(f"verification failed: {'onnxruntime' if runner.sess is not None else 'the reference evaluator'} "
                                f"cannot run the folded model ({_first_line(e)})") from None
    rb, extra = rb_all[:len(ra)], rb_all[len(ra):]
    if len(rb_all) != len(ra) + len(norm_names):
        raise VerificationError(f"verification failed: the folded model has {len(rb_all) - len(norm_names)} outputs, "
                                f"the original {len(ra)}")
    compute = _compute_dtype(original.skeleton)
    outs = [gate.Output(name, _narrower(_dtype_name(a), compute), a, b, None if exact is None else exact[k])
            for k, (name, a, b) in enumerate(zip(runner.names, ra, rb))]
    norm_inputs = {}
    for (name, axis, _), val in zip(norm_names, extra):
        norm_inputs[name] = np.moveaxis(np.asarray(val), axis, -1)
    verdict = gate.judge(outs, norm_inputs, norm_dtype=_narrowest(outs), original_is_faithful=runner.sess is not None,
                         no_float64=how if exact is None else "")
    if runner.sess is None:
        erfc = "; tf2onnx writes Erfc, which is not an ONNX op: computed as math.erfc" \
            if any(n.op_type == "Erfc" and n.domain in ("", "ai.onnx") for n in original.skeleton.graph.node) else ""
        verdict.criterion += (f" (onnxruntime refuses to load the model: {runner.load_error}; run with onnx's "
                              f"reference evaluator{erfc})")
    verdict.criterion += f"; {seeds}" if seeds else ""
    return verdict


def _pinned(model: ModelLike) -> _Source:
    """The model as verification runs it: a copy with seeds pinned on its random nodes, if any
    (random_ops.py); else as given."""
    src = _Source.of(model)
    return _Source(random_ops.pinned(src.proto)) if random_ops.random_nodes(src.skeleton) else src


def _check_float64_copies(original: ModelLike, folded: ModelLike, refused: _RefusedAndUnrunnable, *,
                          inputs: Optional[dict], dims: Optional[dict], seed: int) -> gate.Verdict:
    """The verdict on a fold of a model that neither onnxruntime nor onnx's reference evaluator
    runs in its own dtype (onnxconverter-common's fp16 files): float64 copies of both, where the
    fold is exact algebra but for the rounding of the weights it edits (gate.judge_float64_copies).
    The folded model must be refused by onnxruntime for the input's reason, not a new one."""
    skel, why = original.skeleton, str(refused)
    if _float_elems(skel) > EXACT_MAX_ELEMS:
        raise LnfoldError(f"{why}; a float64 copy of it is too big (more than {EXACT_MAX_ELEMS} float weights)")
    load_error, refusal = refused.runner.load_error, refused.runner.refusal
    try:
        session(folded)
        same = "onnxruntime loads the folded model"
    except Exception as e:
        if _refusal(e) != refusal:
            raise VerificationError(f"verification failed: onnxruntime refuses to load the folded model for a reason "
                                    f"the input does not have ({_first_line(e)}; the input's: {load_error})") from None
        same = "it refuses the folded model for the same reason"
    orig64, fold64 = _Float64(original), _Float64(folded)
    tries = [synth.check_feeds(inputs, skel)] if inputs is not None else \
        [feeds for _, feeds in synth.candidates(skel, dims, seed)]
    ra, first = None, None
    for feeds in tries:
        try:
            ra, how = orig64.run(feeds)
            break
        except RuntimeError as e:
            first = first or e
    if ra is None:
        raise LnfoldError(f"{why}; nor a float64 copy of it ({first})") from None
    try:
        rb, _ = fold64.run(feeds)
    except RuntimeError as e:
        raise VerificationError(f"verification failed: cannot run a float64 copy of the folded model ({e})") from None
    if len(rb) != len(ra):
        raise VerificationError(f"verification failed: the folded model has {len(rb)} outputs, the original {len(ra)}")
    names = [o.name for o in skel.graph.output]
    storage = _storage_dtype(skel)
    verdict = gate.judge_float64_copies([gate.Output(n, "float64", a, b) for n, a, b in zip(names, ra, rb)],
                                        storage, _rounding_sensitivity(((orig64, original), (fold64, folded)),
                                                                       storage, feeds, ra, rb))
    verdict.criterion += (f"; onnxruntime refuses to load the input ({load_error}), {same}, and onnx's reference "
                          f"evaluator cannot run it in its own dtype; both run as float64 in {how}")
    return verdict


def _rounding_sensitivity(copies, storage: str, feeds: dict, ra: list, rb: list) -> Optional[float]:
    """How far one rounding to `storage` of its stored weights moves a model's outputs, for the
    folded model (its edited weights are what the fold rounded) and the original (the same weights
    before centering: a fold that missed one cannot widen its own bound), the smaller of the two
    (gate.rounding_bound). `copies`: ((original's _Float64, original), (folded's, folded)), run
    again with their weights moved; `ra`, `rb`: their outputs as they are. None where one cannot run."""
    elem = {v: k for k, v in _FLOAT_NAMES.items()}[storage]
    worst = []
    for (m, model), exact in zip(copies, (ra, rb)):
        rng = np.random.default_rng(0)
        moved_weights = dict(m.weights)  # (float64_copy: the float weights are inputs of the copy)
        for t in _skeleton(model).graph.initializer:
            if t.data_type == elem and t.name in moved_weights:  # each one unit roundoff away, in a random direction
                a = moved_weights[t.name]
                moved_weights[t.name] = a * (1 + gate.UNIT_ROUNDOFF[storage] * rng.choice([-1.0, 1.0], size=a.shape))
        try:
            moved, _ = m.run(feeds, moved_weights)
        except RuntimeError:
            return None
        worst.append(max((max_rel_err(a, b) for a, b in zip(exact, moved)), default=0.0))
    return min(worst)


def _refusal(e: BaseException) -> str:
    """The kind of onnxruntime's reason for refusing to load a model: without the file it was loaded
    from and without the names of the node and tensor it stopped at (the first in its order: a
    fold that moves nodes makes it stop at another Cast with the same wrong declared type)."""
    text = re.sub(r"^(\[ONNXRuntimeError\] : \d+ : \w+ : )?Load model (from .*? )?failed:\s*", "",
                  " ".join(str(e).split()))
    return re.sub(r"\b(arg|node|Node) \([^()]*\)", r"\1 (…)", text)


_FLOAT_NAMES = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
                onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}


def _storage_dtype(model: onnx.ModelProto) -> str:
    """The narrowest float type of the model's weights: the fold stores the weights it edits
    back in it."""
    names = _FLOAT_NAMES
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    found = {names[t.data_type] for t in tensors if t.data_type in names}
    return max(found, key=lambda d: gate.FLOOR[d]) if found else "float32"


def _compute_dtype(model: onnx.ModelProto) -> Optional[str]:
    """The narrowest float type of the model's weights: an fp16 model with fp32 inputs and
    outputs (onnxruntime's optimizer, converters' keep_io_types) computes, and rounds, in fp16."""
    names = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}
    found = {names[t.data_type] for t in model.graph.initializer if t.data_type in names}
    return max(found, key=lambda d: gate.FLOOR[d]) if found else None


def _narrower(dtype: str, compute: Optional[str]) -> str:
    if compute is None or dtype not in gate.FLOOR:
        return dtype
    return max((dtype, compute), key=lambda d: gate.FLOOR[d])


def _narrowest(outs: list) -> str:
    floats = [o.dtype for o in outs if o.dtype in gate.FLOOR]
    return max(floats, key=lambda d: gate.FLOOR[d], default="float32")


def _dtype_name(a: np.ndarray) -> str:
    return "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name


def _new_rms_inputs(original: onnx.ModelProto, folded: onnx.ModelProto) -> list[tuple[str, int, list]]:
    """(input tensor, axis, nodes) of every RMSNorm the fold emitted (not one the original had).
    A Skip variant normalizes input + skip, which its optional 4th output holds."""
    before = {n.name for n in original.graph.node if n.op_type in _RMS_OPS}
    out = []
    for n in folded.graph.node:
        if n.op_type not in _RMS_OPS or n.name in before:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        if n.op_type == "SkipSimplifiedLayerNormalization":
            if len(n.output) < 4 or not n.output[3]:
                continue  # the sum is not exposed; this norm is judged by the outputs alone
            out.append((n.output[3], -1, [n.name]))
        else:
            out.append((n.input[0], axis, [n.name]))
    return out


def _with_outputs(model: onnx.ModelProto, extra: list) -> onnx.ModelProto:
    if not extra:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name, _, _ in extra:
        if name not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=name))
    return m


def compare(original: ModelLike, folded: ModelLike, *, seed: int = 0, inputs: Optional[dict] = None,
            dims: Optional[dict] = None) -> tuple[float, float]:
    """(worst relative difference between the two models' outputs, the fallback tolerance for
    their dtypes) on the same inputs: a measure for tests and tools, not the gate."""
    runner, feeds, ra = original_run(_pinned(original), inputs=inputs, dims=dims, seed=seed)
    try:
        rb = _Runner(_pinned(folded), allow_reference=runner.sess is None).run(feeds)
    except Exception as e:
        raise VerificationError(f"verification failed: cannot run the folded model ({_first_line(e)})") from None
    fp32 = gate.TOLERANCE["float32"]  # outputs of other types are held to float32's
    tol = min((gate.TOLERANCE.get(_dtype_name(a), fp32) for a in ra), default=fp32)
    if len(ra) != len(rb):
        return float("inf"), tol
    return max((max_rel_err(x, y) for x, y in zip(ra, rb)), default=0.0), tol


def _first_line(e: BaseException) -> str:
    """onnxruntime's message on one line, without its source locations and C++ signatures."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    m = re.search(r"/?onnxruntime_src/\S+:\d+ ", text)
    if m:  # "/onnxruntime_src/x.h:46 void ns::f(args...) message": drop the location and signature
        rest, depth, cut = text[m.end():], 0, 0
        for k, ch in enumerate(rest):
            depth += ch == "("
            if ch == ")":
                depth -= 1
                if depth == 0:
                    cut = k + 1
                    break
        text = text[:m.start()] + " " + rest[cut:].strip()
    if len(text) > 240:
        sentences = [x for x in re.split(r"(?<=\.) ", text) if x]
        first, last = sentences[0], sentences[-1]
        text = f"{first} ... {last}" if len(sentences) > 1 and len(first) + len(last) < 300 else text[:240] + "..."
    return text
