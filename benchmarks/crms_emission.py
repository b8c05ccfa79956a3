"""CRMSNorm emission choices for `--target ort`, one op in onnxruntime (issue 12).

    python -m benchmarks.crms_emission [--rounds 200]

Given the compressed stream z ∈ R^{d-1} ([8, 128, 767] fp32, d = 768), three ways to produce the
normalized vector a linear reader consumes:
- primitives: what lnfold emits, z · 1/sqrt((ΣZ² + (Σz)²)/d + eps) (ReduceSumSquare, ReduceSum, ...);
- function: the same ops inside an ONNX local function (onnxruntime inlines it at load);
- decompress + SimplifiedLayerNormalization: concat(z, −Σz) then the fused RMS kernel over d,
  which then needs the uncompressed reader weights (it gives up the d-1 saving downstream).
Plus the plain RMS op over d (what `--mode rms` runs) as the reference. Interleaved, medians, CPU
time beside wall time (onnx_rewrite/timing.py).
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper

from lnfold.onnx_rewrite.timing import describe_ratio, interleaved, ratio

D, EPS, SHAPE = 768, 1e-5, (8, 128)


def _c(name, arr):
    return helper.make_tensor(name, TensorProto.FLOAT if arr.dtype == np.float32 else TensorProto.INT64,
                              arr.shape, arr.flatten().tolist())


def _crms_nodes(z, y, prefix=""):
    p = prefix
    return [
        helper.make_node("ReduceSumSquare", [z, p + "axes"], [p + "ss"], keepdims=1),
        helper.make_node("ReduceSum", [z, p + "axes"], [p + "s"], keepdims=1),
        helper.make_node("Mul", [p + "s", p + "s"], [p + "s2"]),
        helper.make_node("Add", [p + "ss", p + "s2"], [p + "t"]),
        helper.make_node("Div", [p + "t", p + "d"], [p + "m"]),
        helper.make_node("Add", [p + "m", p + "eps"], [p + "me"]),
        helper.make_node("Sqrt", [p + "me"], [p + "r"]),
        helper.make_node("Reciprocal", [p + "r"], [p + "ir"]),
        helper.make_node("Mul", [z, p + "ir"], [y]),
    ]


def _consts(prefix=""):
    return [_c(prefix + "axes", np.array([-1], np.int64)), _c(prefix + "d", np.array([float(D)], np.float32)),
            _c(prefix + "eps", np.array([EPS], np.float32))]


def _model(nodes, inits, width, functions=(), domains=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("z", TensorProto.FLOAT, [*SHAPE, width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    ops = [helper.make_opsetid("", 18)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(g, opset_imports=ops, functions=list(functions))


def models() -> dict[str, tuple[onnx.ModelProto, int]]:
    prim = _model(_crms_nodes("z", "y"), _consts(), D - 1)
    # the function takes its constants from Constant nodes inside it
    body = [helper.make_node("Constant", [], [n.name], value=n) for n in _consts()] + _crms_nodes("z", "y")
    fn = helper.make_function("lnfold", "CRMSNorm", ["z"], ["y"], body, [helper.make_opsetid("", 18)])
    func = _model([helper.make_node("CRMSNorm", ["z"], ["y"], domain="lnfold")], [], D - 1, [fn], ["lnfold"])
    gamma = _c("gamma", np.ones([D], np.float32))
    deco = _model([helper.make_node("ReduceSum", ["z", "axes"], ["s"], keepdims=1),
                   helper.make_node("Neg", ["s"], ["ns"]),
                   helper.make_node("Concat", ["z", "ns"], ["x"], axis=-1),
                   helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], axis=-1, epsilon=EPS)],
                  [_c("axes", np.array([-1], np.int64)), gamma], D - 1)
    rms = _model([helper.make_node("SimplifiedLayerNormalization", ["z", "gamma"], ["y"], axis=-1, epsilon=EPS)],
                 [gamma], D)
    return {"crms primitives": (prim, D - 1), "crms function": (func, D - 1),
            "decompress + SimplifiedLN": (deco, D - 1), "rms op over d (reference)": (rms, D)}


def main(argv=None) -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((*SHAPE, D - 1)).astype(np.float32)
    z -= 0  # compressed stream: any values
    fns, outs = {}, {}
    for name, (m, width) in models().items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feed = {"z": z if width == D - 1 else np.concatenate([z, -z.sum(-1, keepdims=True)], -1)}
        outs[name] = sess.run(None, feed)[0]
        fns[name] = (lambda s, f: lambda: s.run(None, f))(sess, feed)
    # the three CRMS forms compute the same first d-1 entries as the RMS op over the d-vector
    ref = outs["rms op over d (reference)"][..., : D - 1]
    for name in list(fns)[:3]:
        got = outs[name][..., : D - 1]
        assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max(), name
    stats = interleaved(fns, rounds=args.rounds, warmup=10)
    base = "crms primitives"
    print(f"onnxruntime {ort.__version__}, CPU, 1 thread, [8,128,{D - 1}] fp32, {args.rounds} interleaved rounds")
    for name, s in stats.items():
        line = (f"  {name:<28} wall {s['median'] * 1e6:8.1f} µs [IQR {(s['q3'] - s['q1']) * 1e6:.1f}]  "
                f"CPU {s['cpu_median'] * 1e6:8.1f} µs")
        if name != base:
            line += f"   vs primitives: {describe_ratio(ratio(stats, name, base))}"
        print(line)


if __name__ == "__main__":
    main()
