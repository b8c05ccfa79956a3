"""Apply a fold plan to an onnx-graphsurgeon graph and emit the RMSNorms for one target
(targets.py, DESIGN §3): its norm op where it has one, SkipSimplifiedLayerNormalization where the
plan fuses the residual Add, else primitive ops any runtime runs. The emitter only executes the
plan: where β goes, which Muls by ones go and which norms fuse are the plan's decisions.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes import Plan, compute_constants
from ..passes.plan import CRMS, DEFERRED, NormEmission
from ..passes.defer import compute_biases

from . import fused
from . import deferred_norm
from . import crms
from .classify import GraphInfo
from .norm_patterns import SKIP_BIAS
from .norms import NormMatch, const_values, dtype_of, float_dtype, given, is_constant, np_dtype, replace_input
from .subgraphs import SEP as SCOPE_SEP
from .targets import Target

# The name (a prefix: `unique` numbers repeats) of every constant MatMul the emitter inserts to take
# a stream into or out of a rotated basis (a recentered start's projection, a readout's un-rotation,
# a shortcut between per-block bases): no layer of the model, quantizers keep them float.
BASIS_CHANGE = "lnfold/basis_change"


class Emitter:
    def __init__(self, graph: gs.Graph, info: GraphInfo, opset: int, target: Target) -> None:
        self.graph, self.info, self.opset, self.target = graph, info, opset, target
        self.nodes = {n.name: n for n in graph.nodes}
        self._names = {t for t in graph.tensors()} | set(self.nodes)
        self._next: dict[str, int] = {}  # base -> the suffix `unique` tries first (those below are taken)
        self.dtypes: dict = {}  # norms.float_dtype's walks, shared by every norm of this emission
        self.retyped: dict[str, tuple] = {}  # norm -> (its input's dtype, its γ/β's other dtype)
        self.notes: list[str] = []  # what the emission adds to the report

    def unique(self, base: str) -> str:
        """`base`, else `base_1`, `base_2`, …: the first not taken. Names are only ever added, so
        the search resumes where the base's last one stopped (thousands of `lnfold/Mul`s)."""
        k = self._next.get(base, 0)
        name = base if k == 0 else f"{base}_{k}"
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._next[base] = k
        self._names.add(name)
        return name

    def const(self, base: str, values: np.ndarray) -> gs.Constant:
        # (np.ascontiguousarray makes a scalar 1-d: onnxruntime's optimizer wants a scalar ε)
        values = np.ascontiguousarray(values) if np.ndim(values) else np.asarray(values)
        return gs.Constant(self.unique(base), values)

    def node(self, op: str, inputs: list, outputs: list, domain: str = "", **attrs) -> gs.Node:
        n = gs.Node(op, name=self.unique(f"lnfold/{op}"), attrs=attrs, inputs=inputs, outputs=outputs, domain=domain)
        self.graph.nodes.append(n)
        if op in _ORT_ONLY_NORMS:
            _type_outputs(n)
        return n

    def basis_change(self, inputs: list, out) -> gs.Node:
        """The MatMul of a stream by a constant basis change, named BASIS_CHANGE."""
        n = self.node("MatMul", inputs, [out])
        n.name = self.unique(BASIS_CHANGE)
        return n

    def square(self, x, out) -> gs.Node:
        """x² as Pow(x, 2): onnxruntime's transformer optimizer fuses Pow -> ReduceMean -> ... into
        its RMS op, while the same chain squared by Mul(x, x) crashes it (fusion_simplified_layernorm
        indexes the Mul node itself: "'NodeProto' object is not subscriptable", onnxruntime 1.32)."""
        dt = out.dtype if out.dtype is not None else np.float32
        return self.node("Pow", [x, self.const("lnfold/two", np.array(2.0, np_dtype(dt)))], [out])

    def var(self, base: str, dtype=None) -> gs.Variable:
        return gs.Variable(self.unique(base), dtype=dtype)

    def reduce(self, op: str, x, axes: list[int], out, keepdims: int = 1) -> gs.Node:
        """A Reduce* node; its axes are an input from opset 13 (ReduceSum) or 18 (the others)."""
        if self.opset >= (13 if op == "ReduceSum" else 18):
            return self.node(op, [x, self.const("lnfold/axes", np.array(axes, np.int64))], [out], keepdims=keepdims)
        return self.node(op, [x], [out], axes=axes, keepdims=keepdims)

    def to_fp32(self, x, name: str) -> gs.Variable:
        """x cast to fp32: an fp16/bf16 norm's statistics are computed in fp32, as
        LayerNormalization's stash_type=1 computes them (in fp16, x*x overflows past 256 and an eps
        under 6e-8 rounds to 0: a zero row gives NaN)."""
        x32 = self.var(f"{name}/lnfold_x32", np.float32)
        self.node("Cast", [x], [x32], to=int(onnx.TensorProto.FLOAT))
        return x32

    def cast(self, x, out, dtype) -> gs.Node:
        return self.node("Cast", [x], [out], to=int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))))

    # --- the plan ----------------------------------------------------------------------------
    def apply(self, plan: Plan, matches: dict[str, NormMatch]) -> None:
        """Execute `plan`: every decision is in it."""
        # γ into the readers' weights is among the plan's edits; W β + b from the original weights
        biases = compute_biases(plan.deferral, lambda n: const_values(self.info.tensors[n])) \
            if plan.deferral is not None and plan.deferral.deferred else {}
        self.write_constants(plan, plan.const_edits, self.info.tensors.__getitem__, self.nodes.__getitem__)
        for rc in plan.recenters:
            self._recenter(rc.value, rc.axis, rc.matrix())
        for sc in plan.shortcuts:  # before the swaps: a norm fused with this Add reads the MatMul's output
            self._shortcut(self.nodes[sc.node], sc.input, sc.matrix())
        online = {}  # one constant H per basis and dtype, read by every layer of its width
        for o in plan.online:
            self._online(self.nodes[plan.origin(o.node)], o, online)
        for name in plan.drop_muls:
            self.bypass_mul(self.nodes[plan.origin(name)])
        for e in plan.emissions.values():  # (an RMSNorm as given or an approximate swap: the target's RMSNorm)
            if e.how == DEFERRED:
                deferred_norm.emit(self, matches[e.norm], e.deferred, biases)
            elif e.how == CRMS:
                crms.swap(self, matches[e.norm], e.crms)
            else:
                self._swap(matches[e.norm], e)
        if self.retyped:
            (first, (stream, given)), more = sorted(self.retyped.items())[0], len(self.retyped) - 1
            self.notes.append(
                f"the input model is ill-typed: LayerNorm `{first}`{f' and {more} more' if more else ''} take(s) a "
                f"{stream} input with {given} scale/bias, which onnxruntime refuses to load; repaired in the "
                f"folded norms, whose γ and β are stored in {stream}, the stream's dtype")
        crms.resize_dims(self, plan)
        crms.add_new_biases(plan, self.info.tensors.__getitem__, lambda name: (self, self.nodes[name]))
        crms.forget_shapes(self, plan)
        self.graph.cleanup(remove_unused_graph_inputs=False).toposort()

    def write_constants(self, plan: Plan, edits, tensor, node_of) -> None:
        """Each edited constant as a new tensor, read by the edit's users. `tensor(name)`: the
        original constant; `node_of(view name)`: the graph node (and emitter) a user is."""
        for edit, arr in compute_constants(edits, lambda name: const_values(tensor(name))):
            new = self.const(f"{edit.value.split(SCOPE_SEP)[-1]}/lnfold_{'ones' if edit.sets_ones else 'centered'}",
                             arr)
            for user, idx in edit.users:
                node_of(plan.origin(user)).inputs[idx] = new

    def detach(self, m: NormMatch) -> tuple:
        """Take the matched norm out of the graph; the tensors it read, from its slots as the plan's
        edits and recenters left them: (x, skip, bias), x an EmbedLayerNormalization's lookups' sum
        (written out here), skip and bias a SkipLayerNormalization's (else None)."""
        ins = list(m.nodes[0].inputs)
        x = ins[0] if m.kind != "EmbedLayerNormalization" else fused.embed_sum(self, m)
        skip, bias = (ins[1], given(ins, SKIP_BIAS[m.kind])) if m.kind in SKIP_BIAS else (None, None)
        for n in m.nodes:  # its output tensors get new producers
            n.outputs.clear()
            n.inputs.clear()
        return x, skip, bias

    def residual_sum(self, x, skip, bias, summed, name: str) -> gs.Tensor:
        """The residual Add a SkipLayerNormalization fused (x + skip (+ bias)), as plain Adds into
        `summed` (its sum output) or a new tensor: the stream an unfused norm reads."""
        s = summed if summed is not None else self.var(f"{name}/lnfold_sum", x.dtype)
        xs = s if bias is None else self.var(f"{name}/lnfold_xs", x.dtype)
        self.node("Add", [x, skip], [xs])
        if bias is not None:
            self.node("Add", [xs, bias], [s])
        return s

    def bypass_mul(self, mul: gs.Node) -> None:
        """A Mul by all-ones (a LayerScale folded into its sources; the plan checked that it
        changes no shape) reads through: its readers read its data input."""
        data = next(t for t in mul.inputs if not is_constant(t))
        out = mul.outputs[0]
        for reader in list(out.outputs):
            replace_input(reader, out, data)
        mul.outputs.clear()

    def _recenter(self, value: str, axis: int, project=None) -> None:
        """x - mean(x) along the feature axis, for a stream start no constant edit can center;
        `project` (d × k, float64): then times it along that axis (a rotated stream: `c·M` on the
        last axis, `Mᵀ·c` on the second-to-last).

        Two passes (c = x - mean(x), then c - mean(c)): one leaves the rounding of mean(x), up to an
        ulp of |mean(x)|, along 1 in every row, which every RMSNorm downstream keeps and which is far
        above the row's own spread where a nonlinearity saturates (DESIGN §4). The second pass leaves
        an ulp of that residual."""
        x = self.info.tensors[value]
        readers = list(x.outputs)
        mean, rough = self.var(f"{value}/lnfold_mean", x.dtype), self.var(f"{value}/lnfold_rough", x.dtype)
        residual = self.var(f"{value}/lnfold_residual_mean", x.dtype)
        centered = self.var(f"{value}/lnfold_recentered", x.dtype)
        self.reduce("ReduceMean", x, [axis], mean)
        self.node("Sub", [x, mean], [rough])
        self.reduce("ReduceMean", rough, [axis], residual)
        self.node("Sub", [rough, residual], [centered])
        if project is not None:
            m = project.astype(np_dtype(float_dtype(x)))  # (x.dtype: None where the exporter wrote no type)
            last = axis == self.info.rank(x) - 1
            rotated = self.var(f"{value}/lnfold_projected", x.dtype)
            matrix = self.const(f"{value}/lnfold_projection", m if last else np.ascontiguousarray(m.T))
            self.basis_change([centered, matrix] if last else [matrix, centered], rotated)
            centered = rotated
        for r in readers:
            replace_input(r, x, centered)

    def _shortcut(self, add: gs.Node, i: int, matrix: np.ndarray) -> None:
        """Per-block bases: the residual Add's input `i` times the constant (k × k) change of basis
        between its segment and the next (its features are on the last axis: the plan checked)."""
        x = add.inputs[i]
        m = self.const(f"{x.name}/lnfold_shortcut", matrix.astype(np_dtype(float_dtype(x))))
        out = self.var(f"{x.name}/lnfold_reexpressed", x.dtype)
        self.basis_change([x, m], out)
        add.inputs[i] = out

    def _online(self, layer: gs.Node, o, shared: dict) -> None:
        """online_hadamard (passes/online.py): the layer's activation input `o.value` times H before
        it (its weight took Hᵀ among the constant edits): a constant MatMul, or where H = A ⊗ B,
        `Aᵀ · reshape(u, [-1, p, m]) · B` reshaped back (n·(p+m) multiply-adds instead of n²)."""
        (j, x), = [(j, t) for j, t in enumerate(layer.inputs) if t.name == o.value]
        dtype = np_dtype(float_dtype(x))
        key = (o.basis, np.dtype(dtype).str)
        if key not in shared:
            name = f"lnfold_online_{o.basis.kind}{o.basis.dim}"
            factors = o.factors()
            shared[key] = ((self.const(name, o.basis.matrix().astype(dtype)),) if factors is None else
                           (self.const(f"{name}_a", np.ascontiguousarray(factors[0].T).astype(dtype)),
                            self.const(f"{name}_b", factors[1].astype(dtype)),
                            self.const(f"{name}_pm", np.array([-1, len(factors[0]), len(factors[1])], np.int64))))
        out = self.var(f"{x.name}/lnfold_online", x.dtype)
        if len(shared[key]) == 1:
            self.basis_change([x, shared[key][0]], out)
        else:
            a_t, b, pm = shared[key]
            grouped, right, left = (self.var(f"{x.name}/lnfold_online_{s}", x.dtype) for s in ("pm", "b", "a"))
            self.node("Reshape", [x, pm], [grouped])
            self.basis_change([grouped, b], right)
            self.basis_change([a_t, right], left)
            shape = self.var(f"{x.name}/lnfold_online_shape")
            self.node("Shape", [x], [shape])
            self.node("Reshape", [left, shape], [out])
        layer.inputs[j] = out

    # --- norms -------------------------------------------------------------------------------
    def _swap(self, m: NormMatch, how: NormEmission) -> None:
        """Replace one LayerNorm by an RMSNorm as `how` (passes/plan.NormEmission) says, then its β
        Add where the plan kept one. Shapes are those of the tensors as matched (edits keep them);
        a `readout` takes the output back from a rotated basis by a constant MatMul before its β."""
        unit_gamma, readout = how.unit_gamma, how.readout
        rank = self.info.rank(m.x)
        width = self.info.shape(m.x)[m.axis] if how.width is None else how.width  # a sliced stream: k of d
        dtype = dtype_of(m.x, m.gamma, m.nodes, self.dtypes)
        if unit_gamma and not isinstance(width, int):
            raise ValueError(f"{m.name}: γ moved into the readers but the feature size is unknown")
        if how.scale != 1.0 and not unit_gamma:
            raise ValueError(f"{m.name}: a sliced stream's norm keeps no γ of its own")
        gamma = (self.const(f"{m.name}/lnfold_unit_gamma", np.full([width], how.scale, dtype)) if unit_gamma
                 else self._in_stream_dtype(self._gamma(m, width, dtype), dtype, m.name, "gamma"))
        eps = m.epsilon * how.eps_scale
        unrotate = None
        if readout is not None:
            g = const_values(m.gamma) if m.gamma is not None else None
            what = "lnfold_float_gamma" if readout.rotated else "lnfold_unrotate"
            unrotate = self.const(f"{m.name}/{what}", readout.matrix(g).astype(dtype))
        x, skip, bias = self.detach(m)
        beta = m.beta if how.beta_add else None
        normed = m.output if beta is None else self.var(f"{m.name}/lnfold_rms", m.output.dtype)
        if unrotate is not None:
            final, normed = normed, self.var(f"{m.name}/lnfold_rotated", m.output.dtype)
        if skip is not None:
            summed = m.sum_output
            if summed is None and m.kind == "SkipSimplifiedLayerNormalization" and how.fuse_residual:
                # an RMSNorm as given whose sum the model does not name: named as the view names it
                # (classify._add_norm), so that a slice can capture its stream (passes/slicer.py)
                summed = self.var(f"{m.name}/input_skip_bias_sum", x.dtype)
            self._skip_rms(x, skip, gamma, bias, summed, normed, eps, m.name, rank, how.fuse_residual)
        elif gamma is not None and how.fuse_residual:
            self._fuse_residual(x, gamma, normed, eps)
        elif gamma is not None and self.target.norm_op and m.axis == rank - 1:
            self._norm_op(x, gamma, normed, eps)
        else:
            self._portable_rms(x, gamma, normed, m.axis, eps, m.name, rank)
        if unrotate is not None:
            self.basis_change([normed, unrotate], final)
            normed = final
        if beta is not None:
            self.node("Add", [normed, self._in_stream_dtype(beta, dtype, m.name, "beta")], [m.output])

    def _in_stream_dtype(self, t, dtype, name: str, what: str):
        """γ or β as the emitted norm and its β Add take them: in the stream's dtype. TorchScript's
        fp16 exports of models that keep their LayerNorms in fp32 give LayerNormalization an fp16
        input with fp32 γ/β, a model onnxruntime refuses ("bound to different types"); the folded
        norm repairs it (the rounding of γ, β to fp16 is within the fp16 output's own)."""
        vals = const_values(t) if t is not None else None
        if vals is None or np.asarray(vals).dtype == dtype or np.asarray(vals).dtype.kind != "f":
            return t
        self.retyped[name] = (np.dtype(dtype).name, np.asarray(vals).dtype.name)
        return self.const(f"{name}/lnfold_{what}", np.asarray(vals).astype(dtype))

    def _gamma(self, m: NormMatch, width, dtype) -> gs.Tensor:
        if m.gamma is None:
            if not isinstance(width, int):
                return None  # feature size unknown: an RMSNorm without γ (portable ops only)
            return self.const(f"{m.name}/lnfold_gamma", np.ones([width], dtype))
        vals = const_values(m.gamma)
        if vals is not None and np.ndim(vals) != 1:
            return self.const(f"{m.name}/lnfold_gamma", np.asarray(vals).reshape(-1))
        return m.gamma

    def _portable_rms(self, x, gamma, out, axis: int, eps: float, name: str, rank: int) -> None:
        dt = x.dtype
        # x.dtype is None where the exporter wrote no value_info; γ has it
        x_dt = np.dtype(np_dtype(dt) if dt is not None else dtype_of(x, gamma, memo=self.dtypes))
        low = x_dt.itemsize < 4
        xs = self.to_fp32(x, name) if low else x
        sd = np.float32 if low else dt
        sq, ms, ms_eps, rms, inv = (self.var(f"{name}/lnfold_{k}", sd) for k in ("sq", "ms", "mse", "rms", "inv"))
        n = out if gamma is None else self.var(f"{name}/lnfold_n", dt)
        self.square(xs, sq)
        self.reduce("ReduceMean", sq, [axis], ms)
        self.node("Add", [ms, self.const(f"{name}/lnfold_eps", np.array(eps, np.float32 if low else x_dt))], [ms_eps])
        self.node("Sqrt", [ms_eps], [rms])
        self.node("Reciprocal", [rms], [inv])
        if low:
            n32 = self.var(f"{name}/lnfold_n32", np.float32)
            self.node("Mul", [xs, inv], [n32])
            self.cast(n32, n, x_dt)
        else:
            self.node("Mul", [x, inv], [n])
        if gamma is None:
            return
        g = gamma
        if axis != rank - 1:  # γ broadcasts along the last axis; put it on the feature axis
            gv = const_values(gamma)
            shape = [1] * rank
            shape[axis] = -1
            g = self.const(f"{name}/lnfold_gamma_b", np.asarray(gv).reshape(shape))
        self.node("Mul", [n, g], [out])

    def _skip_rms(self, x, skip, gamma, bias, summed, out, eps, name, rank: int, fuse: bool) -> None:
        ins = [x, skip, gamma] + ([bias] if bias is not None else [])
        outs = [out, gs.Variable.empty(), gs.Variable.empty()] + ([summed] if summed is not None else [])
        if fuse:
            self.node("SkipSimplifiedLayerNormalization", ins, outs, domain="com.microsoft", epsilon=float(eps))
            return
        s = self.residual_sum(x, skip, bias, summed, name)
        if self.target.norm_op:
            self._norm_op(s, gamma, out, eps)
        else:
            self._portable_rms(s, gamma, out, rank - 1, eps, name, rank)

    def _norm_op(self, x, gamma, out, eps: float) -> None:
        self.node(self.target.norm_op, [x, gamma], [out], axis=-1, epsilon=float(eps), stash_type=1)

    def _fuse_residual(self, x: gs.Tensor, gamma, out, eps: float) -> None:
        """Add(a, b) -> norm becomes SkipSimplifiedLayerNormalization(a, b), its sum output kept
        where the sum is read (the plan chose the norms: passes/plan.py `_fusable`)."""
        add = x.inputs[0]
        a, b = add.inputs
        keep_sum = x in self.graph.outputs or any(r for r in x.outputs)
        add.outputs.clear()
        add.inputs.clear()
        outs = [out, gs.Variable.empty(), gs.Variable.empty()] + ([x] if keep_sum else [])
        self.node("SkipSimplifiedLayerNormalization", [a, b, gamma], outs, domain="com.microsoft", epsilon=float(eps))


# onnxruntime's RMS ops, whose outputs (and every tensor after them) onnx's shape inference leaves
# untyped, which stops onnxruntime's quantizer ("Unable to find data type for weight_name=...").
_ORT_ONLY_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def _type_outputs(n: gs.Node) -> None:
    """Give `n`'s outputs their element type where it is known and the exporter wrote none: the
    plain RMS op's Y is typed as its scale γ (V), the fused op's outputs as the stream (T)."""
    x = n.inputs[0]
    gamma = n.inputs[1] if n.op == "SimplifiedLayerNormalization" else None
    gamma_dtype = np.asarray(const_values(gamma)).dtype if gamma is not None and is_constant(gamma) else None
    for i, out in enumerate(n.outputs):
        if not out.name or out.dtype is not None or i in (1, 2):  # 1, 2: mean and inv std (training)
            continue
        out.dtype = gamma_dtype if gamma_dtype is not None else x.dtype
