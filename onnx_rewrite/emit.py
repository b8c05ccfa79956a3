"""Apply a fold plan to an onnx-graphsurgeon graph and emit the RMSNorms for one target.

Targets (DESIGN §3):
- ``ort``: onnxruntime's `SimplifiedLayerNormalization`, and `SkipSimplifiedLayerNormalization`
  where a residual Add feeds the norm (the fused forms its kernels run fastest);
- ``onnx``: the standard `RMSNormalization` (opset 23);
- ``portable``: primitive ops any runtime runs.
β stays an Add after the norm unless every reader is a linear layer with a constant weight and
a bias, where it is folded into that bias (`W(γ⊙n + β) + b = W(γ⊙n) + (Wβ + b)`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..passes import Plan, compute_constants
from ..passes import weights
from ..passes.axes import reshape_axis
from ..passes.defer import compute_biases
from ..passes.options import TARGETS, check_choice
from ..passes.plan import Ones

from . import fused
from . import defer as deferred_norm
from . import crms
from .classify import GraphInfo
from .norms import NormMatch, const_values, is_constant

_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


class Emitter:
    def __init__(self, graph: gs.Graph, info: GraphInfo, opset: int, target: str, device: str = "cpu") -> None:
        check_choice("target", target, TARGETS)
        self.graph = graph
        self.info = info
        self.opset = opset
        self.target = target
        # onnxruntime's fused residual+norm kernel (SkipSimplifiedLayerNormalization) is slower
        # on CPU than Add + SimplifiedLayerNormalization (benchmarks/RESULTS.md, op table);
        # on CUDA one memory-bound kernel is the usual win. Fuse only for CUDA.
        self.fuse_skip = target == "ort" and device == "cuda"
        self.nodes = {n.name: n for n in graph.nodes}
        self._names = {t for t in graph.tensors()} | set(self.nodes)
        self.beta_folds = 0
        self.skip_fusions = 0

    def unique(self, base: str) -> str:
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def const(self, base: str, values: np.ndarray) -> gs.Constant:
        return gs.Constant(self.unique(base), np.ascontiguousarray(values))

    def node(self, op: str, inputs: list, outputs: list, domain: str = "", **attrs) -> gs.Node:
        n = gs.Node(op, name=self.unique(f"lnfold/{op}"), attrs=attrs, inputs=inputs, outputs=outputs, domain=domain)
        self.graph.nodes.append(n)
        return n

    def var(self, base: str, dtype=None) -> gs.Variable:
        return gs.Variable(self.unique(base), dtype=dtype)

    # --- the plan ----------------------------------------------------------------------------
    def apply(self, plan: Plan, matches: dict[str, NormMatch]) -> None:
        deferred = {d.norm: d for d in plan.deferral.deferred} if plan.deferral is not None else {}
        # γ into the readers' weights is among the plan's edits; W β + b from the original weights
        biases = compute_biases(plan.deferral, lambda n: const_values(self.info_tensor(n))) if deferred else {}
        self._const_edits(plan)
        for rc in plan.recenters:
            self._recenter(rc.value, rc.axis)
        verdicts = {v.name: v for v in plan.report.norms}
        crms_norms = {c.name: c for cc in plan.compressions if cc.compressed for c in cc.crms}
        for name in plan.swaps:
            if name in deferred:
                d = deferred[name]
                deferred_norm.emit(self, matches[name], d, biases)
                readers = ", ".join(f"`{r.node}`" for r in d.readers)
                verdicts[name].beta = f"into the bias of {readers} (deferred)" if d.beta else ""
            elif name in crms_norms:
                verdicts[name].beta = crms.swap(self, matches[name], crms_norms[name])
            else:
                verdicts[name].beta = self._swap(matches[name])
        crms.patch_dims(self, plan)
        crms.add_new_biases(self, plan)
        crms.forget_shapes(self, plan)
        self.graph.cleanup(remove_unused_graph_inputs=False).toposort()

    def _const_edits(self, plan: Plan) -> None:
        def original(name: str) -> np.ndarray:
            return const_values(self.info_tensor(name))

        for edit, arr in compute_constants(plan, original):
            ones = edit.ops[0] == Ones()
            new = self.const(f"{edit.value}/lnfold_{'ones' if ones else 'centered'}", arr)
            for user, idx in edit.users:
                self.nodes[user.split("#")[0]].inputs[idx] = new
            if ones:
                for user, _ in edit.users:
                    self._bypass_mul(self.nodes[user.split("#")[0]])

    def residual_sum(self, x, skip, bias, summed, name: str) -> gs.Tensor:
        """The residual Add a SkipLayerNormalization fused (x + skip (+ bias)), as plain Adds into
        `summed` (its sum output) or a new tensor: the stream an unfused norm reads."""
        s = summed if summed is not None else self.var(f"{name}/lnfold_sum", x.dtype)
        if bias is not None:
            xs = self.var(f"{name}/lnfold_xs", x.dtype)
            self.node("Add", [x, skip], [xs])
            self.node("Add", [xs, bias], [s])
        else:
            self.node("Add", [x, skip], [s])
        self.info.shapes.setdefault(s.name, self.info.shape(x))  # a new tensor: later emission asks its rank
        return s

    def info_tensor(self, name: str):
        return self.info.tensors[name]

    def _bypass_mul(self, mul: gs.Node) -> None:
        """Drop a Mul by all-ones (a LayerScale folded into its sources) when it changes no shape."""
        if mul.op != "Mul":
            return
        data = next((t for t in mul.inputs if not is_constant(t)), None)
        out = mul.outputs[0]
        if data is None or out in self.graph.outputs or self.info.shape(data) != self.info.shape(out):
            return
        for reader in list(out.outputs):
            _replace_input(reader, out, data)
        mul.outputs.clear()

    def _reduce_mean(self, x, axes: list[int], out) -> gs.Node:
        if self.opset >= 18:
            return self.node("ReduceMean", [x, self.const("lnfold/axes", np.array(axes, np.int64))], [out], keepdims=1)
        return self.node("ReduceMean", [x], [out], axes=axes, keepdims=1)

    def _recenter(self, value: str, axis: int) -> None:
        """x - mean(x) along the feature axis, for a stream start no constant edit can center."""
        x = self.info_tensor(value)
        readers = list(x.outputs)
        mean = self.var(f"{value}/lnfold_mean", x.dtype)
        centered = self.var(f"{value}/lnfold_recentered", x.dtype)
        self._reduce_mean(x, [axis], mean)
        self.node("Sub", [x, mean], [centered])
        self.info.shapes[centered.name] = self.info.shape(x)
        for r in readers:
            _replace_input(r, x, centered)

    # --- norms -------------------------------------------------------------------------------
    def _swap(self, m: NormMatch) -> str:
        """Replace one LayerNorm by an RMSNorm; says where its β went (for the report)."""
        rank = self.info.rank(m.x)
        width = self.info.shape(m.x)[m.axis]
        dtype = _dtype_of(m.x, m.gamma, m.nodes)
        gamma = self._gamma(m, width, dtype)
        # Recenters and constant edits rewired the norm's own inputs: read them live, not as matched.
        live = list(m.nodes[0].inputs) + [None] * 5
        m.x = live[0] if m.kind != "EmbedLayerNormalization" else fused.embed_sum(self, m)
        if m.kind == "SkipLayerNormalization":
            m.skip = live[1]
            m.bias = live[4] if live[4] is not None and live[4].name else None
        for n in m.nodes:  # detach the LayerNorm; its output tensor gets a new producer
            n.outputs.clear()
            n.inputs.clear()

        beta, where = m.beta, ""
        bvals = const_values(beta) if beta is not None else None
        if bvals is not None and not np.any(np.asarray(bvals)):
            beta, where = None, "is zero"
        elif bvals is not None and (into := self._fold_beta(m.output, np.asarray(bvals).reshape(-1))):
            self.beta_folds += 1
            beta, where = None, "into the bias of " + ", ".join(into)
        elif beta is not None:
            where = "kept as an Add (not every reader is a linear layer with a bias to absorb it)"
        normed = m.output if beta is None else self.var(f"{m.name}/lnfold_rms", m.output.dtype)

        last = m.axis == rank - 1
        if m.kind == "SkipLayerNormalization":
            self._skip_rms(m.x, m.skip, gamma, m.bias, m.sum_output, normed, m.epsilon, m.name)
        elif gamma is None:
            self._portable_rms(m.x, gamma, normed, m.axis, m.epsilon, m.name)
        elif self.fuse_skip and last and self._fuse_residual(m, gamma, normed):
            pass
        elif self.target == "ort" and last:
            self.node("SimplifiedLayerNormalization", [m.x, gamma], [normed], axis=-1,
                      epsilon=float(m.epsilon), stash_type=1)
        elif self.target == "onnx" and last:
            self.node("RMSNormalization", [m.x, gamma], [normed], axis=-1, epsilon=float(m.epsilon), stash_type=1)
        else:
            self._portable_rms(m.x, gamma, normed, m.axis, m.epsilon, m.name)
        if beta is not None:
            if bvals is not None and m.x.dtype is not None and np.asarray(bvals).dtype != _np(m.x.dtype):
                # TorchScript's fp16 exports give LayerNormalization fp32 γ/β (a model onnxruntime
                # refuses): the separate β Add must take the stream's dtype to be a valid op
                beta = self.const(f"{m.name}/lnfold_beta", np.asarray(bvals).astype(_np(m.x.dtype)))
            self.node("Add", [normed, beta], [m.output])
        return where

    def _gamma(self, m: NormMatch, width, dtype) -> gs.Tensor:
        if m.gamma is None:
            if not isinstance(width, int):
                return None  # feature size unknown: an RMSNorm without γ (portable ops only)
            return self.const(f"{m.name}/lnfold_gamma", np.ones([width], dtype))
        vals = const_values(m.gamma)
        if vals is not None and np.ndim(vals) != 1:
            return self.const(f"{m.name}/lnfold_gamma", np.asarray(vals).reshape(-1))
        return m.gamma

    def _portable_rms(self, x, gamma, out, axis: int, eps: float, name: str) -> None:
        dt = x.dtype
        # x.dtype is None where the exporter wrote no value_info; γ has it
        x_dt = np.dtype(_np(dt) if dt is not None else _dtype_of(x, gamma))
        # fp16/bf16: statistics in fp32, as LayerNormalization's stash_type=1 computes them (in
        # fp16, x*x overflows past 256 and an eps under 6e-8 rounds to 0: a zero row gives NaN)
        low = x_dt.itemsize < 4
        xs = x
        if low:
            xs = self.var(f"{name}/lnfold_x32", np.float32)
            self.node("Cast", [x], [xs], to=int(onnx.TensorProto.FLOAT))
        sd = np.float32 if low else dt
        sq, ms, ms_eps, rms, inv = (self.var(f"{name}/lnfold_{k}", sd) for k in ("sq", "ms", "mse", "rms", "inv"))
        n = out if gamma is None else self.var(f"{name}/lnfold_n", dt)
        self.node("Mul", [xs, xs], [sq])
        self._reduce_mean(sq, [axis], ms)
        self.node("Add", [ms, self.const(f"{name}/lnfold_eps", np.array(eps, np.float32 if low else x_dt))], [ms_eps])
        self.node("Sqrt", [ms_eps], [rms])
        self.node("Reciprocal", [rms], [inv])
        if low:
            n32 = self.var(f"{name}/lnfold_n32", np.float32)
            self.node("Mul", [xs, inv], [n32])
            self.node("Cast", [n32], [n], to=int(onnx.helper.np_dtype_to_tensor_dtype(x_dt)))
        else:
            self.node("Mul", [x, inv], [n])
        if gamma is None:
            return
        rank = self.info.rank(x)
        g = gamma
        if axis != rank - 1:  # γ broadcasts along the last axis; put it on the feature axis
            gv = const_values(gamma)
            shape = [1] * rank
            shape[axis] = -1
            g = self.const(f"{name}/lnfold_gamma_b", np.asarray(gv).reshape(shape))
        self.node("Mul", [n, g], [out])

    def _skip_rms(self, x, skip, gamma, bias, summed, out, eps, name) -> None:
        ins = [x, skip, gamma] + ([bias] if bias is not None else [])
        outs = [out, gs.Variable.empty(), gs.Variable.empty()] + ([summed] if summed is not None else [])
        if self.fuse_skip:
            self.node("SkipSimplifiedLayerNormalization", ins, outs, domain="com.microsoft", epsilon=float(eps))
            return
        s = self.residual_sum(x, skip, bias, summed, name)
        axis = (self.info.rank(x) or 1) - 1
        if self.target == "onnx":
            self.node("RMSNormalization", [s, gamma], [out], axis=-1, epsilon=float(eps), stash_type=1)
        elif self.target == "ort":
            self.node("SimplifiedLayerNormalization", [s, gamma], [out], axis=-1, epsilon=float(eps), stash_type=1)
        else:
            self._portable_rms(s, gamma, out, axis, eps, name)

    def _fuse_residual(self, m: NormMatch, gamma, out) -> bool:
        """Add(a, b) -> norm becomes SkipSimplifiedLayerNormalization(a, b) (its sum kept if read)."""
        x = m.x
        if len(x.inputs) != 1 or x.inputs[0].op != "Add":
            return False
        add = x.inputs[0]
        a, b = add.inputs
        sa, sb = self.info.shape(a), self.info.shape(b)
        if is_constant(a) or is_constant(b) or sa is None or sb is None:
            return False
        if len(sa) != 3 or sa != sb or any(d is None for d in sa):
            return False
        keep_sum = x in self.graph.outputs or any(r for r in x.outputs)
        add.outputs.clear()
        add.inputs.clear()
        outs = [out, gs.Variable.empty(), gs.Variable.empty()] + ([x] if keep_sum else [])
        self.node("SkipSimplifiedLayerNormalization", [a, b, gamma], outs, domain="com.microsoft",
                  epsilon=float(m.epsilon))
        self.skip_fusions += 1
        return True

    # --- β into the readers' biases ------------------------------------------------------------
    def _fold_beta(self, y: gs.Tensor, beta: np.ndarray) -> list[str]:
        """Fold β into the biases of every reader of `y`, if all are linear layers with biases;
        the readers folded into ([] when β must stay an Add)."""
        if y in self.graph.outputs:
            return []
        readers = self._linear_readers(y, self.info.rank(y))
        if readers is None or not readers:
            return []
        new_biases = []
        for node, w, in_axis, bias_slot in readers:
            b = const_values(bias_slot[0].inputs[bias_slot[1]]) if bias_slot[1] is not None else None
            dtype = np.asarray(b).dtype if b is not None else np.asarray(w).dtype
            nb = weights.beta_into_bias(w, beta, b, in_axis, dtype)
            if b is not None:
                nb = nb.reshape(np.shape(b))
            new_biases.append((bias_slot, node, nb))
        for (bias_node, slot), node, nb in new_biases:
            c = self.const(f"{node.name}/lnfold_bias", nb)
            if slot is None:
                bias_node.inputs.append(c)
            else:
                bias_node.inputs[slot] = c
        return [f"{node.op} `{node.name}`" for node, *_ in readers]

    def _linear_readers(self, t: gs.Tensor, rank: Optional[int]):
        """[(node, weight array, weight's input-feature axis, (bias node, bias slot))] or None."""
        out = []
        for r in t.outputs:
            if r.op in _RESHAPES:
                o = r.outputs[0]
                ro = self.info.rank(o)
                if (rank is None or ro is None or o in self.graph.outputs
                        or reshape_axis(self.info.shape(t), self.info.shape(o), rank - 1) != ro - 1):
                    return None
                sub = self._linear_readers(o, ro)
                if sub is None:
                    return None
                out += sub
            elif r.op == "Gemm" and r.inputs[0] is t:
                got = self._gemm_reader(r)
                if got is None:
                    return None
                out.append(got)
            elif r.op == "Attention":  # onnxruntime's: linear in its input (fused.py)
                got = fused.attention_reader(r, t)
                if got is None:
                    return None
                out.append(got)
            elif r.op == "MatMul" and r.inputs[0] is t:
                got = self._matmul_reader(r)
                if got is None:
                    return None
                out.append(got)
            else:
                return None
        return out

    def _gemm_reader(self, r: gs.Node):
        if int(r.attrs.get("transA", 0)) or float(r.attrs.get("alpha", 1.0)) != 1.0 or float(r.attrs.get("beta", 1.0)) != 1.0:
            return None
        w = const_values(r.inputs[1])
        if w is None:
            return None
        in_axis = 1 if int(r.attrs.get("transB", 0)) else 0
        if len(r.inputs) > 2 and r.inputs[2] is not None and r.inputs[2].name:
            c = const_values(r.inputs[2])
            if c is None or np.ndim(c) > 1 and np.shape(c)[0] != 1:
                return None
            return (r, w, in_axis, (r, 2))
        return (r, w, in_axis, (r, None))

    def _matmul_reader(self, r: gs.Node):
        w = _weight_2d(r.inputs[1])
        out = r.outputs[0]
        if w is None or len(out.outputs) != 1 or out in self.graph.outputs or out.outputs[0].op != "Add":
            return None
        add = out.outputs[0]
        slot = 1 if add.inputs[0] is out else 0
        b = const_values(add.inputs[slot])
        if b is None or np.size(b) != np.shape(w)[1]:
            return None
        return (r, w, 0, (add, slot))


def _weight_2d(t: gs.Tensor) -> Optional[np.ndarray]:
    """A constant [in, out] matrix, possibly behind a Transpose (a tied lm_head)."""
    if is_constant(t):
        w = const_values(t)
        return w if np.ndim(w) == 2 else None
    p = t.inputs[0] if len(t.inputs) == 1 else None
    if p is not None and p.op == "Transpose" and is_constant(p.inputs[0]):
        w = const_values(p.inputs[0])
        if np.ndim(w) == 2 and list(p.attrs.get("perm", [1, 0])) == [1, 0]:
            return np.asarray(w).T
    return None


def _replace_input(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    # graphsurgeon's input lists keep tensor.outputs in sync only through item assignment
    for i, t in enumerate(node.inputs):
        if t is old:
            node.inputs[i] = new


def _np(dtype):
    return np.dtype(dtype) if dtype is not None else np.float32


def _dtype_of(x, gamma, nodes=()):
    if x.dtype is not None:
        return _np(x.dtype)
    v = const_values(gamma) if gamma is not None else None
    if v is not None:
        return np.asarray(v).dtype
    if nodes and nodes[-1].op == "Cast":  # a decomposed fp16 norm casts its fp32 result back
        return onnx.helper.tensor_dtype_to_np_dtype(int(nodes[-1].attrs["to"]))
    return np.float32
