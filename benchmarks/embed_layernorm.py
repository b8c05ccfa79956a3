"""onnxruntime's EmbedLayerNormalization against lnfold's emission of the folded op (its lookups on
centered tables + SimplifiedLayerNormalization + the mask count), BERT-base sizes, CPU, one thread,
interleaved runs, medians and the paired ratio. `python benchmarks/embed_layernorm.py`"""
import time, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto as TP, numpy_helper as nh
from lnfold.onnx_rewrite import fold_model
B, S, D, V = 8, 128, 768, 30522
rng = np.random.default_rng(0)
c = lambda n, a: nh.from_array(a.astype(np.float32), n)
inits = [c("W", rng.standard_normal((V, D)) + rng.standard_normal((V, 1)) * 3), c("P", rng.standard_normal((512, D)) + 2),
         c("Sg", rng.standard_normal((2, D)) + 1), c("g", 1 + 0.5 * rng.standard_normal(D)), c("b", 0.5 * rng.standard_normal(D))]
nodes = [helper.make_node("EmbedLayerNormalization", ["ids", "seg", "W", "P", "Sg", "g", "b", "mask"], ["o", "mi"], domain="com.microsoft", epsilon=1e-12)]
g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TP.INT32, [B, S]) for n in ("ids", "seg", "mask")],
                      [helper.make_tensor_value_info("o", TP.FLOAT, [B, S, D]), helper.make_tensor_value_info("mi", TP.INT32, [B])], inits)
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
folded = fold_model(m).model
feeds = {"ids": rng.integers(0, V, (B, S)).astype(np.int32), "seg": rng.integers(0, 2, (B, S)).astype(np.int32),
         "mask": np.ones((B, S), np.int32)}
so = ort.SessionOptions(); so.intra_op_num_threads = 1
sa = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
sb = ort.InferenceSession(folded.SerializeToString(), so, providers=["CPUExecutionProvider"])
ya, yb = sa.run(None, feeds)[0], sb.run(None, feeds)[0]
print("max rel diff", np.abs(ya - yb).max() / np.abs(ya).max())
ta, tb = [], []
for _ in range(200):
    for s, t in ((sa, ta), (sb, tb)):
        t0 = time.perf_counter(); s.run(None, feeds); t.append(time.perf_counter() - t0)
ta, tb = np.array(ta) * 1e3, np.array(tb) * 1e3
r = tb / ta
print(f"EmbedLayerNormalization: median {np.median(ta):.2f} ms (IQR {np.percentile(ta,25):.2f}-{np.percentile(ta,75):.2f})")
print(f"lnfold (lookups+SimplifiedLN): median {np.median(tb):.2f} ms (IQR {np.percentile(tb,25):.2f}-{np.percentile(tb,75):.2f})")
print(f"paired ratio folded/original: median {np.median(r):.3f} (IQR {np.percentile(r,25):.3f}-{np.percentile(r,75):.3f})")
