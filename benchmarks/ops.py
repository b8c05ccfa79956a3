"""Single-op graphs: which RMSNorm / LayerNorm emission does onnxruntime run fastest on this CPU?

Every graph reads x and (for the residual variants) a skip tensor of the same shape and writes the
normalized tensor; the residual variants also write the residual sum x + skip, as a Pre-LN block
needs it for its next residual. Sessions run with all of onnxruntime's graph optimizations on
(what a user gets), and the ops it actually ran after its own fusions are listed next to the
time. Times: the median of interleaved samples through IOBinding (no output allocation), and
the per-call kernel time from onnxruntime's profiler.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper


from .common import bound_runner, log, ort_session, timed

D = 768
EPS = 1e-5
OPSET = 23
MS = "com.microsoft"

# name -> (nodes builder, uses skip input, description)
VARIANTS = {
    "LayerNormalization": "LayerNormalization(x, γ, β)",
    "SimplifiedLayerNormalization": "SimplifiedLayerNormalization(x, γ) (ORT, onnx domain)",
    "SimplifiedLayerNormalization+Add(β)": "SimplifiedLayerNormalization(x, γ) then Add β",
    "RMSNormalization": "RMSNormalization(x, γ) (opset 23)",
    "Add+LayerNormalization": "Add(x, skip) -> LayerNormalization; sum also output",
    "Add+SimplifiedLayerNormalization": "Add(x, skip) -> SimplifiedLayerNormalization; sum also output",
    "Add+RMSNormalization": "Add(x, skip) -> RMSNormalization; sum also output",
    "SkipLayerNormalization": "com.microsoft SkipLayerNormalization(x, skip, γ, β); sum output",
    "SkipSimplifiedLayerNormalization": "com.microsoft SkipSimplifiedLayerNormalization(x, skip, γ); sum output",
}


def _graph(variant: str, shape: list[int]) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    g = helper.make_tensor("gamma", f, [D], (1 + 0.1 * rng.standard_normal(D)).astype(np.float32).tobytes(), raw=True)
    b = helper.make_tensor("beta", f, [D], (0.1 * rng.standard_normal(D)).astype(np.float32).tobytes(), raw=True)
    inputs = [helper.make_tensor_value_info("x", f, shape)]
    outputs = [helper.make_tensor_value_info("y", f, shape)]
    residual = variant.startswith(("Add+", "Skip"))
    if residual:
        inputs.append(helper.make_tensor_value_info("skip", f, shape))
        outputs.append(helper.make_tensor_value_info("sum", f, shape))
    n = []
    base = variant.split("+", 1)[1] if variant.startswith("Add+") else variant
    src = "x"
    if variant.startswith("Add+"):
        n.append(helper.make_node("Add", ["x", "skip"], ["sum"]))
        src = "sum"
    if base == "LayerNormalization":
        n.append(helper.make_node("LayerNormalization", [src, "gamma", "beta"], ["y"], axis=-1, epsilon=EPS))
    elif base == "SimplifiedLayerNormalization":
        n.append(helper.make_node("SimplifiedLayerNormalization", [src, "gamma"], ["y"], axis=-1, epsilon=EPS,
                                  stash_type=1))
    elif base == "SimplifiedLayerNormalization+Add(β)":
        n.append(helper.make_node("SimplifiedLayerNormalization", [src, "gamma"], ["n"], axis=-1, epsilon=EPS,
                                  stash_type=1))
        n.append(helper.make_node("Add", ["n", "beta"], ["y"]))
    elif base == "RMSNormalization":
        n.append(helper.make_node("RMSNormalization", [src, "gamma"], ["y"], axis=-1, epsilon=EPS, stash_type=1))
    elif base == "SkipLayerNormalization":
        n.append(helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y", "", "", "sum"],
                                  domain=MS, epsilon=EPS))
    elif base == "SkipSimplifiedLayerNormalization":
        n.append(helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"],
                                  domain=MS, epsilon=EPS))
    else:
        raise ValueError(variant)
    graph = helper.make_graph(n, variant, inputs, outputs, initializer=[g, b])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    m.ir_version = 10
    return m


def kernel_ops(model: onnx.ModelProto) -> list[str]:
    """The ops onnxruntime runs after its own graph optimizations."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "opt.onnx")
        ort_session(model, optimized_path=p)
        return [n.op_type for n in onnx.load(p).graph.node]


def profile_kernel_time(sess_factory, feeds, runs: int) -> dict[str, float]:
    """Mean kernel time per run (seconds) by op type, from onnxruntime's profiler."""
    with tempfile.TemporaryDirectory() as d:
        sess = sess_factory(os.path.join(d, "prof"))
        for _ in range(3):
            sess.run(None, feeds)
        for _ in range(runs):
            sess.run(None, feeds)
        path = sess.end_profiling()
        events = json.load(open(path))
    return kernel_times(events, runs + 3)


def kernel_times(events, runs: int) -> dict[str, float]:
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + e["dur"] * 1e-6 / runs
    return by_op


def run(batches=(1, 8), seq: int = 128, rounds: int = 30) -> list[dict]:
    rows = []
    for batch in batches:
        shape = [batch, seq, D]
        rng = np.random.default_rng(batch)
        x = rng.standard_normal(shape).astype(np.float32) + 3.0
        skip = rng.standard_normal(shape).astype(np.float32)
        inner = max(1, 40 // batch)
        fns, meta = {}, {}
        for v in VARIANTS:
            m = _graph(v, shape)
            feeds = {"x": x, "skip": skip} if v.startswith(("Add+", "Skip")) else {"x": x}
            try:
                sess = ort_session(m)
            except Exception as e:
                meta[v] = {"error": str(e).splitlines()[0][:200]}
                continue
            r = bound_runner(sess, feeds)

            def many(r=r):
                for _ in range(inner):
                    r()

            fns[v] = many
            prof = profile_kernel_time(lambda prefix, m=m: ort_session(m, profile=prefix), feeds, runs=60)
            meta[v] = {"ops_run": kernel_ops(m), "kernel_s": sum(prof.values()), "kernel_by_op": prof}
        log(f"ops: timing {len(fns)} single-op graphs at {shape}")
        stats = timed(fns, rounds=rounds, warmup=3)
        for v in VARIANTS:
            row = {"variant": v, "shape": shape, "desc": VARIANTS[v], **meta.get(v, {})}
            if v in stats:
                s = stats[v]
                row.update(median_s=s["median"] / inner, q1_s=s["q1"] / inner, q3_s=s["q3"] / inner, n=s["n"],
                           inner=inner, cpu_median_s=s["cpu_median"] / inner)
            rows.append(row)
    return rows


if __name__ == "__main__":
    import sys

    for r in run(rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        print(f"{str(r['shape']):16} {r['variant']:38} {r.get('median_s', float('nan')) * 1e6:8.1f} us  "
              f"kernel {r.get('kernel_s', float('nan')) * 1e6:8.1f} us  ran {r.get('ops_run', r.get('error'))}")
