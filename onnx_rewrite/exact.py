"""The float64 copy of an ONNX model (DESIGN §4; the twin of fx_rewrite/float64.py): every float
tensor of the computation double, run in onnxruntime, segment by segment where a few ops lack a
double kernel there (those in onnx's reference evaluator), or in the reference evaluator whole."""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import random_ops
from .sessions import QUIET, ModelLike, first_line, proto_of, reference, session, skeleton_of

# A float64 copy is made only of models with at most this many float weights (1 GiB in float64).
EXACT_MAX_ELEMS = 2**27
FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def float64_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The same graph computing in float64 (value_info dropped: onnxruntime re-infers it), and its
    float weights in float64: inputs of the copy, fed with its inputs, so that onnxruntime takes
    them from numpy unserialized (a GPT-2's 1 GB took longer to serialize and parse than to run)."""
    g = model.graph
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in g.initializer if t.data_type in FLOATS}
    declared = {i.name for i in g.input}
    inputs = list(g.input) + [helper.make_tensor_value_info(name, onnx.TensorProto.DOUBLE, w.shape)
                              for name, w in weights.items() if name not in declared]
    graph = helper.make_graph(g.node, g.name, inputs, g.output,
                              [t for t in g.initializer if t.name not in weights], sparse_initializer=g.sparse_initializer)
    out = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                            functions=model.functions)
    _graph_to_f64(out.graph)
    for f in out.functions:  # model-local functions' nodes make float tensors alike
        for n in f.node:
            _node_to_f64(n)
    if any(map(random_ops.runs_in_own_dtype, g.node)):  # random draws, DequantizeLinear's float scales
        random_ops.in_own_dtype(out.graph, random_ops.own_types(model))
    return out, weights


def _tensor_to_f64(t: onnx.TensorProto) -> None:
    if t.data_type in FLOATS:
        raw = np.ascontiguousarray(numpy_helper.to_array(t), dtype="<f8").tobytes()
        for field in ("float_data", "int32_data", "raw_data"):
            t.ClearField(field)
        t.data_type, t.raw_data = onnx.TensorProto.DOUBLE, raw


def _graph_to_f64(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        _tensor_to_f64(t)
    for vi in list(g.input) + list(g.output):
        tt = vi.type.tensor_type
        if tt.elem_type in FLOATS:
            tt.elem_type = onnx.TensorProto.DOUBLE
    del g.value_info[:]
    for n in g.node:
        _node_to_f64(n)


def _node_to_f64(n: onnx.NodeProto) -> None:
    """The float tensors `n` makes from its attributes made double: tensor values (sparse ones too),
    subgraphs, Cast's and EyeLike's target type, Constant's value_float(s), and ConstantOfShape's
    default float32 zero."""
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            _tensor_to_f64(a.t)
        elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
            _tensor_to_f64(a.sparse_tensor.values)
        elif a.type == onnx.AttributeProto.GRAPH:
            _graph_to_f64(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sub in a.graphs:
                _graph_to_f64(sub)
        if n.op_type == "Cast" and a.name == "to" and a.i in FLOATS:
            a.i = onnx.TensorProto.DOUBLE
        if a.name == "dtype" and a.type == onnx.AttributeProto.INT and a.i in FLOATS and not random_ops.is_random(n):
            a.i = onnx.TensorProto.DOUBLE  # EyeLike's: the type it makes (random nodes: random_ops.py)
    if n.op_type == "ConstantOfShape" and n.domain in ("", "ai.onnx") and not any(a.name == "value" for a in n.attribute):
        # without `value` it makes float32 zeros (the op's default): double zeros in the copy, or
        # the ops they meet (ScatterElements' data, an Add) see float32 beside double
        n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float64))))
    if n.op_type == "Constant":  # value_float(s) make float tensors: make them double tensors
        for a in list(n.attribute):
            if a.name in ("value_float", "value_floats"):
                arr = np.array(a.f if a.name == "value_float" else list(a.floats), dtype=np.float64)
                n.attribute.remove(a)
                n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(arr)))


def float_elems(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer if t.data_type in FLOATS)


class Float64Run:
    """A float64 copy of a model, run in onnxruntime (in _Segments where it lacks a double kernel
    for some ops), else wholly in onnx's reference evaluator."""

    def __init__(self, model: ModelLike) -> None:
        self.model, self.weights = float64_copy(proto_of(model))
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
            self.sess, self.segments, self.why = None, None, first_line(e)

    def run(self, feeds: dict, weights: Optional[dict] = None) -> tuple[list[np.ndarray], str]:
        """(outputs, what ran them) on `feeds` with floats upcast, with the model's float weights or
        `weights` in their place; raises RuntimeError saying why neither could run it."""
        f64 = {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in feeds.items()}
        f64.update(self.weights if weights is None else weights)
        why = self.why
        if self.sess is not None:
            try:
                return self.sess.run(None, f64, QUIET), "onnxruntime"
            except Exception as e:
                why = first_line(e)
        if self.segments is not None:
            try:
                return self.segments.run(f64), self.segments.how
            except Exception as e:
                why = first_line(e)
        try:
            if self.ref is None:
                self.ref = reference(self.model)
            return [np.asarray(x) for x in self.ref.run(None, f64)], "onnx reference evaluator"
        except Exception as e:
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            raise RuntimeError(f"onnxruntime: {why}; reference evaluator: {type(e).__name__}: {msg}") from None


def exact_run(model: ModelLike, feeds: dict, prepared: Optional["Float64Run"] = None
              ) -> tuple[Optional[list[np.ndarray]], str]:
    """(the outputs of a float64 copy of `model` on `feeds`, how they were computed); (None, why)
    where no float64 run was possible. `prepared`: its Float64Run, made beforehand (`prepare`)."""
    if float_elems(skeleton_of(model)) > EXACT_MAX_ELEMS:
        return None, f"a float64 copy would hold more than {EXACT_MAX_ELEMS} float weights"
    try:
        return (prepared or Float64Run(model)).run(feeds)
    except RuntimeError as e:
        return None, str(e)


def prepare(model: ModelLike) -> Optional["Float64Run"]:
    """The Float64Run `exact_run` would make, or None where it would make none (too big)."""
    return Float64Run(model) if float_elems(skeleton_of(model)) <= EXACT_MAX_ELEMS else None


def _without_double_kernel(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of a float64 copy whose op onnxruntime's CPU provider has no double kernel for
    (its kernel registry, by op, domain and opset); empty when the registry cannot be read."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_opkernel_def
        defs = get_all_opkernel_def()
    except Exception:  # an onnxruntime without the registry: try the whole copy
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
    """A float64 copy run as consecutive runs of nodes in graph order: in one onnxruntime session
    each, or in onnx's reference evaluator where onnxruntime has no double kernel. Built on the first
    call, from the dtypes of the values then."""

    def __init__(self, model: onnx.ModelProto, lacking: list[onnx.NodeProto]) -> None:
        self.model = model
        self.how = (f"onnxruntime, with {', '.join(sorted({n.op_type for n in lacking}))} in onnx's reference "
                    "evaluator (onnxruntime has no double kernel for them)")
        ids = {id(n) for n in lacking}
        self.runs: list[tuple[bool, list[onnx.NodeProto]]] = [  # (in the reference evaluator, nodes)
            (ref, list(nodes)) for ref, nodes in itertools.groupby(model.graph.node, key=lambda n: id(n) in ids)]
        self.runners: list = [None] * len(self.runs)

    def run(self, feeds: dict) -> list[np.ndarray]:
        g = self.model.graph
        inits = {t.name: t for t in g.initializer}
        outputs = [o.name for o in g.output]
        later: list[set] = [set(outputs)] * (len(self.runs) + 1)  # values read by runs k.. or output
        for k in range(len(self.runs) - 1, -1, -1):
            later[k] = later[k + 1] | {i for n in self.runs[k][1] for i in n.input if i}
        values = dict(feeds)
        for k, (ref, nodes) in enumerate(self.runs):
            wanted = [o for o in dict.fromkeys(o for n in nodes for o in n.output if o) if o in later[k + 1]]
            if not wanted:
                continue  # nothing reads what this run computes
            if self.runners[k] is None:
                self.runners[k] = self._build(k, values, inits, wanted)
            runner, reads = self.runners[k]
            got = runner.run(None, {i: values[i] for i in reads}, *(() if ref else (QUIET,)))
            values.update(zip(wanted, (np.asarray(x) for x in got)))
            for name in [v for v in values if v not in later[k + 1] and v not in feeds]:
                del values[name]  # nothing after this run reads it
        return [values[o] for o in outputs]

    def _build(self, k: int, values: dict, inits: dict, wanted: list) -> tuple:
        """(runner, the names it is fed) for run k: what it reads from earlier runs or the
        inputs becomes its inputs (typed by their values now), the weights it reads its own."""
        ref, nodes = self.runs[k]
        made = {o for n in nodes for o in n.output if o}
        reads = [i for i in dict.fromkeys(i for n in nodes for i in n.input if i) if i not in made]
        fed = [i for i in reads if i in values]
        typed = [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(np.asarray(values[i]).dtype), None)
                 for i in fed]
        graph = helper.make_graph(nodes, f"segment{k}", typed,
                                  [onnx.ValueInfoProto(name=o) for o in wanted],
                                  [inits[i] for i in reads if i not in values and i in inits])
        sub = helper.make_model(graph, opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        return (reference(sub) if ref else session(sub)), fed

