"""Small hand-built ONNX graphs for tests: valid pre-LN streams and the hostile variants of them.

Every builder returns an `onnx.ModelProto` with IR version 10 (onnxruntime 1.31 refuses newer)
and opset 17 or 18, small enough that a test suite of dozens of them runs in seconds. Weights
follow DESIGN §5: random γ/β and a large per-row mean on every source, so that a fold that skips
one centering changes the outputs.

    from tests.onnx_graphs import pre_ln, save_model
    model = pre_ln(layers=2)
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
INT64 = TensorProto.INT64

D = 8  # feature size
T = 5  # tokens
VOCAB = 11


class Builder:
    """Accumulates nodes, initializers, inputs and outputs of one graph; names are unique."""

    def __init__(self, seed: int = 0, dtype=np.float32) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._k = 0

    @property
    def elem(self) -> int:
        return helper.np_dtype_to_tensor_dtype(self.dtype)

    def name(self, base: str) -> str:
        self._k += 1
        return f"{base}_{self._k}"

    def const(self, base: str, values) -> str:
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(values), n))
        return n

    def weight(self, base: str, shape, mean: float = 0.0, scale: float = 0.5) -> str:
        w = self.rng.standard_normal(shape) * scale + mean
        return self.const(base, w.astype(self.dtype))

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, domain: str = "", name: str = "", **attrs):
        outs = [self.name(f"{op_type.lower()}_out") for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name or self.name(op_type), domain=domain,
                                           **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, elem: int, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem: Optional[int] = None, shape=None) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, shape))
        return name

    # --- building blocks ----------------------------------------------------------------------
    def linear(self, x: str, d_in: int, d_out: int, bias_mean: float = 3.0) -> str:
        """MatMul by a constant weight with large column means, then a bias Add (a centerable source)."""
        w = self.weight("W", (d_in, d_out), mean=0.0)
        w_arr = numpy_helper.to_array(self.inits[-1]) + self.rng.standard_normal((1, d_out)).astype(self.dtype) * 2
        self.inits[-1].CopyFrom(numpy_helper.from_array(w_arr.astype(self.dtype), w))
        b = self.weight("b", (d_out,), mean=bias_mean)
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def affine(self, d: int = D) -> tuple[str, str]:
        g = self.weight("gamma", (d,), mean=1.0, scale=0.5)
        b = self.weight("beta", (d,), mean=0.0, scale=0.5)
        return g, b

    def layernorm(self, x: str, d: int = D, axis: int = -1, eps: float = 1e-5, gamma=None, beta=None) -> str:
        g, b = self.affine(d)
        return self.op("LayerNormalization", [x, gamma or g, beta or b], axis=axis, epsilon=eps)

    def embed(self, ids: str, vocab: int = VOCAB, d: int = D) -> str:
        """Gather from a table whose rows have a large mean, plus a position table (both sources)."""
        table = self.weight("emb", (vocab, d), mean=4.0)
        pos = self.weight("pos", (T, d), mean=-2.0)
        return self.op("Add", [self.op("Gather", [table, ids], axis=0), pos])

    def block(self, h: str, d: int = D) -> str:
        """Pre-LN residual block: h + W2 relu(W1 LN(h) + b1) + b2."""
        n = self.layernorm(h, d)
        return self.op("Add", [h, self.linear(self.op("Relu", [self.linear(n, d, 2 * d)]), 2 * d, d)])

    def model(self, opset: int = 17, extra_opsets: Sequence[tuple[str, int]] = (), name: str = "g") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
        return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="lnfold-tests")


# --- valid models -------------------------------------------------------------------------------

def pre_ln(layers: int = 2, d: int = D, opset: int = 17, dtype=np.float32, seed: int = 0) -> onnx.ModelProto:
    """ids [2, T] -> embedding + positions -> `layers` pre-LN blocks -> final LN -> lm head.

    Every LayerNorm (layers + 1) is foldable: the stream is started by constant tables and
    biased linears only, and read only by LayerNorms over the last axis.
    """
    b = Builder(seed, dtype)
    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids, d=d)
    for _ in range(layers):
        h = b.block(h, d)
    y = b.op("MatMul", [b.layernorm(h, d), b.weight("head", (d, VOCAB))])
    b.output(y, shape=[2, T, VOCAB])
    return b.model(opset)


def float_input_pre_ln(d: int = D, opset: int = 17, dynamic: bool = False, dtype=np.float32) -> onnx.ModelProto:
    """x [2, T, d] -> linear -> 2 pre-LN blocks -> final LN (a float graph input feeding a linear)."""
    b = Builder(1, dtype)
    x = b.input("x", b.elem, ["batch", "seq", "feat"] if dynamic else [2, T, d])
    h = b.linear(x, d, d)
    for _ in range(2):
        h = b.block(h, d)
    b.output(b.layernorm(h, d))
    return b.model(opset)


def decomposed_ln(with_eps: bool = True, opset: int = 17, layers: int = 2) -> onnx.ModelProto:
    """pre_ln with every LayerNorm written out as older exporters emit it.

    ReduceMean, Sub, Pow, ReduceMean, [Add eps], Sqrt, Div, Mul γ, Add β; `with_eps=False`
    drops the eps Add as torch's exporter does for tiny eps.
    """
    b = Builder(2)

    def reduce_mean(x):
        if opset >= 18:
            return b.op("ReduceMean", [x, b.const("axes", np.array([-1], np.int64))], keepdims=1)
        return b.op("ReduceMean", [x], axes=[-1], keepdims=1)

    def ln(x):
        mean = reduce_mean(x)
        d = b.op("Sub", [x, mean])
        var = reduce_mean(b.op("Pow", [d, b.const("two", np.array(2.0, np.float32))]))
        if with_eps:
            var = b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])
        n = b.op("Div", [d, b.op("Sqrt", [var])])
        g, be = b.affine()
        return b.op("Add", [b.op("Mul", [n, g]), be])

    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids)
    for _ in range(layers):
        h = b.op("Add", [h, b.linear(b.op("Relu", [b.linear(ln(h), D, 2 * D)]), 2 * D, D)])
    b.output(b.op("MatMul", [ln(h), b.weight("head", (D, VOCAB))]), shape=[2, T, VOCAB])
    return b.model(opset)


def no_layernorm(opset: int = 17) -> onnx.ModelProto:
    b = Builder(3)
    x = b.input("x", FLOAT, [2, D])
    b.output(b.op("Relu", [b.linear(x, D, D)]))
    return b.model(opset)


def skip_layernorm(opset: int = 17) -> onnx.ModelProto:
    """Two linears summed by onnxruntime's SkipLayerNormalization (com.microsoft) then a linear."""
    b = Builder(4)
    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids)
    r = b.linear(b.op("Relu", [b.linear(b.layernorm(h), D, D)]), D, D)
    g, be = b.affine()
    bias = b.weight("skip_bias", (D,), mean=1.5)
    out = b.op("SkipLayerNormalization", [r, h, g, be, bias], domain="com.microsoft", epsilon=1e-5)
    b.output(b.op("MatMul", [out, b.weight("head", (D, VOCAB))]), shape=[2, T, VOCAB])
    return b.model(opset, extra_opsets=[("com.microsoft", 1)])


# --- hostile variants -----------------------------------------------------------------------------

def ln_over_axis(axis: int) -> onnx.ModelProto:
    """x [2, D, T] (features on axis 1) -> LayerNormalization(axis=`axis`).

    axis=1 normalizes axes 1 and 2 together (multiple axes); over a non-last axis alone
    see `ln_non_last_axis`.
    """
    b = Builder(5)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.linear(x, D, D)
    if axis == 1:  # LN over [T, D] jointly: γ, β of shape [T, D]
        g = b.weight("gamma", (T, D), mean=1.0)
        be = b.weight("beta", (T, D))
        y = b.op("LayerNormalization", [h, g, be], axis=1, epsilon=1e-5)
    else:
        y = b.layernorm(h, axis=axis)
    b.output(y)
    return b.model(17)


def ln_non_last_axis() -> onnx.ModelProto:
    """Channels-first stream [2, D, T], normalized by a decomposed LN over axis 1 only."""
    b = Builder(6)
    x = b.input("x", FLOAT, [2, D, T])
    w = b.weight("W", (D, D), mean=1.0)
    h = b.op("Add", [b.op("MatMul", [w, x]), b.weight("b", (D, 1), mean=3.0)])  # W @ x: rows are features
    mean = b.op("ReduceMean", [h], axes=[1], keepdims=1)
    d = b.op("Sub", [h, mean])
    var = b.op("ReduceMean", [b.op("Pow", [d, b.const("two", np.array(2.0, np.float32))])], axes=[1], keepdims=1)
    n = b.op("Div", [d, b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])])])
    g = b.weight("gamma", (D, 1), mean=1.0)
    be = b.weight("beta", (D, 1))
    b.output(b.op("Add", [b.op("Mul", [n, g]), be]))
    return b.model(17)


def gamma_input() -> onnx.ModelProto:
    """A LayerNorm whose γ and β are graph inputs (not constants)."""
    b = Builder(7)
    x = b.input("x", FLOAT, [2, T, D])
    g = b.input("gamma", FLOAT, [D])
    be = b.input("beta", FLOAT, [D])
    h = b.linear(x, D, D)
    y = b.op("LayerNormalization", [h, g, be], axis=-1, epsilon=1e-5)
    b.output(b.op("MatMul", [y, b.weight("head", (D, D))]))
    return b.model(17)


def ln_in_subgraph(kind: str = "If") -> onnx.ModelProto:
    """A foldable-looking stream whose LayerNorm sits inside an If (or Loop) body."""
    b = Builder(8)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.linear(x, D, D)
    g, be = b.affine()
    y_name = "sub_y"
    if kind == "If":
        then_ln = helper.make_node("LayerNormalization", [h, g, be], [y_name], name="then_ln", axis=-1, epsilon=1e-5)
        then_g = helper.make_graph([then_ln], "then", [], [helper.make_tensor_value_info(y_name, FLOAT, [2, T, D])])
        else_id = helper.make_node("Identity", [h], ["else_y"], name="else_id")
        else_g = helper.make_graph([else_id], "else", [], [helper.make_tensor_value_info("else_y", FLOAT, [2, T, D])])
        cond = b.input("cond", TensorProto.BOOL, [])
        out = b.op("If", [cond], then_branch=then_g, else_branch=else_g)
    else:  # Loop: 2 iterations, carried h -> LN(h) + h
        ln = helper.make_node("LayerNormalization", ["carry_in", g, be], ["normed"], name="loop_ln", axis=-1, epsilon=1e-5)
        add = helper.make_node("Add", ["carry_in", "normed"], ["carry_out"], name="loop_add")
        ident = helper.make_node("Identity", ["cond_in"], ["cond_out"], name="loop_cond")
        body = helper.make_graph(
            [ln, add, ident], "body",
            [helper.make_tensor_value_info("iter", INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
             helper.make_tensor_value_info("carry_in", FLOAT, [2, T, D])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("carry_out", FLOAT, [2, T, D])],
        )
        trip = b.const("trip", np.array(2, np.int64))
        cond = b.const("cond", np.array(True))
        out = b.op("Loop", [trip, cond, h], body=body)
    b.output(b.op("MatMul", [out, b.weight("head", (D, D))]))
    return b.model(17)


def qdq_stream() -> onnx.ModelProto:
    """int8 QDQ: a MatMul on dequantized int8 weights writes to the stream read by LayerNorms."""
    b = Builder(10)
    x = b.input("x", FLOAT, [2, T, D])
    scale = b.const("scale", np.array(0.05, np.float32))
    zp = b.const("zp", np.array(0, np.int8))
    xq = b.op("DequantizeLinear", [b.op("QuantizeLinear", [x, scale, zp]), scale, zp])
    wq = b.const("Wq", b.rng.integers(-60, 100, (D, D)).astype(np.int8))
    w = b.op("DequantizeLinear", [wq, scale, zp])
    h = b.op("Add", [b.op("MatMul", [xq, w]), b.weight("b", (D,), mean=3.0)])
    for _ in range(2):
        h = b.block(h)
    b.output(b.layernorm(h))
    return b.model(17)


def nonfinite_weights(value: float = float("nan")) -> onnx.ModelProto:
    """pre_ln with one NaN (or Inf) in the embedding table."""
    m = pre_ln()
    for t in m.graph.initializer:
        if t.name.startswith("emb"):
            a = numpy_helper.to_array(t).copy()
            a[1, 2] = value
            t.CopyFrom(numpy_helper.from_array(a, t.name))
    return m


def with_cycle() -> onnx.ModelProto:
    """Two Adds reading each other's output: not a DAG."""
    b = Builder(11)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.linear(x, D, D)
    b.nodes.append(helper.make_node("Add", [h, "loop_b"], ["loop_a"], name="cyc_a"))
    b.nodes.append(helper.make_node("Add", ["loop_a", h], ["loop_b"], name="cyc_b"))
    b.output(b.layernorm("loop_b"))
    return b.model(17)


def dangling_input() -> onnx.ModelProto:
    """A node reads a tensor that no node, input or initializer produces."""
    b = Builder(12)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.op("Add", [b.linear(x, D, D), "nobody_makes_this"])
    for _ in range(2):
        h = b.block(h)
    b.output(b.layernorm(h))
    return b.model(17)


def unknown_domain_op() -> onnx.ModelProto:
    """A custom-domain op (com.example.Frob) sits on the stream between two LayerNorms."""
    b = Builder(13)
    ids = b.input("ids", INT64, [2, T])
    h = b.block(b.embed(ids))
    h = b.op("Frob", [h], domain="com.example")
    h = b.block(h)
    b.output(b.layernorm(h))
    return b.model(17, extra_opsets=[("com.example", 1)])


def opaque_start(n_norms: int = 3) -> onnx.ModelProto:
    """A Relu output read directly by `n_norms` LayerNorms: folded only with a recenter, and the
    norms must then read the recentered tensor (not the Relu's)."""
    b = Builder(14)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.op("Relu", [b.linear(x, D, D)])
    outs = [b.layernorm(b.op("Mul", [h, b.const("s", np.array(1.0 + k, np.float32))]) if k else h)
            for k in range(n_norms)]
    y = outs[0]
    for o in outs[1:]:
        y = b.op("Add", [y, o])
    b.output(y)
    return b.model(17)


def _decomposed_no_affine(b: Builder, x: str) -> str:
    mean = b.op("ReduceMean", [x], axes=[-1], keepdims=1)
    d = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Pow", [d, b.const("two", np.array(2.0, np.float32))])], axes=[-1], keepdims=1)
    return b.op("Div", [d, b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])])])


def dynamic_feature_no_gamma() -> onnx.ModelProto:
    """x [batch, seq, feat] (feature size unknown) -> Relu -> two decomposed LNs without γ/β."""
    b = Builder(15)
    x = b.input("x", FLOAT, ["batch", "seq", "feat"])
    h = b.op("Relu", [x])
    y = b.op("Add", [_decomposed_no_affine(b, h),
                     b.op("Tanh", [_decomposed_no_affine(b, b.op("Mul", [h, b.const("s", np.array(2.0, np.float32))]))])])
    b.output(y)
    return b.model(17)


def unknown_domain_off_stream() -> onnx.ModelProto:
    """pre_ln whose logits go through a custom-domain op no runtime knows (off the stream)."""
    b = Builder(16)
    ids = b.input("ids", INT64, [2, T])
    h = b.block(b.embed(ids))
    logits = b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))])
    b.output(b.op("Frob", [logits], domain="com.example"), shape=[2, T, VOCAB])
    return b.model(17, extra_opsets=[("com.example", 1)])


def subgraph_reads_stream() -> onnx.ModelProto:
    """A foldable pre-LN stream that an If's branch reads implicitly (outer-scope capture)."""
    b = Builder(17)
    ids = b.input("ids", INT64, [2, T])
    h = b.block(b.embed(ids))
    then_g = helper.make_graph([helper.make_node("Identity", [h], ["then_y"], name="then_id")], "then", [],
                               [helper.make_tensor_value_info("then_y", FLOAT, [2, T, D])])
    else_g = helper.make_graph([helper.make_node("Neg", [h], ["else_y"], name="else_neg")], "else", [],
                               [helper.make_tensor_value_info("else_y", FLOAT, [2, T, D])])
    cond = b.input("cond", TensorProto.BOOL, [])
    side = b.op("If", [cond], then_branch=then_g, else_branch=else_g)
    b.output(b.op("Add", [b.layernorm(h), b.op("ReduceSum", [side], axes=[-1], keepdims=1)]))
    return b.model(17)


def duplicate_producer() -> onnx.ModelProto:
    """Two nodes write the same tensor name (not single-assignment)."""
    m = pre_ln(layers=1)
    n = m.graph.node[1]
    m.graph.node.append(helper.make_node("Identity", [n.input[0]], [n.output[0]], name="second_writer"))
    return m


def short_initializer() -> onnx.ModelProto:
    """pre_ln whose embedding table holds fewer bytes than its dims say."""
    m = pre_ln(layers=1)
    for t in m.graph.initializer:
        if t.name.startswith("emb"):
            t.raw_data = t.raw_data[: len(t.raw_data) // 2]
    return m


def save_model(model: onnx.ModelProto, path, external: bool = False) -> Path:
    """Write `model` to `path` (weights to `<name>.data` beside it when `external`)."""
    p = Path(path)
    if external:
        onnx.save_model(model, str(p), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=p.name + ".data", size_threshold=0)
    else:
        onnx.save_model(model, str(p))
    return p
