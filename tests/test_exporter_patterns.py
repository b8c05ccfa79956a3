"""Issue 10, part 3: patterns other exporters emit, each rule with a test that fails without it.

Graphs are built with onnx.helper to reproduce each producer's exact node pattern (the corpus
test, tests/test_corpus.py, runs the real producers' files).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lnfold import onnx_rewrite
from lnfold.onnx_rewrite import fold_model

from .onnx_graphs import FLOAT, INT64, VOCAB, D, T, Builder

RTOL = 1e-5


def _ops(model):
    return [n.op_type for n in model.graph.node]


# --- Hugging Face's fp16 overflow clamp ---------------------------------------------------------

def _clamped_encoder(dtype, lo: float, hi: float, t5_where: bool = False) -> onnx.ModelProto:
    """Whisper's encoder layer: h = h + fc2(relu(fc1(LN(h)))); h = Clip(h, -c, c) after every layer
    (modeling_whisper.py: `clamp_value = finfo(fp16).max - 1000`); T5's variant picks the bound with
    Where(IsInf(h).any(), max - 1000, max)."""
    b = Builder(21, dtype)
    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids)
    for _ in range(2):
        h = b.block(h)
        if t5_where:
            any_inf = b.op("Cast", [b.op("ReduceMax", [b.op("Cast", [b.op("IsInf", [h])], to=TensorProto.INT32)],
                                         keepdims=0)], to=TensorProto.BOOL)
            hi_t = b.op("Where", [any_inf, b.const("c1", np.array(hi, dtype)), b.const("c2", np.array(np.finfo(dtype).max, dtype))])
            lo_t = b.op("Neg", [hi_t])
        else:
            lo_t, hi_t = b.const("lo", np.array(lo, dtype)), b.const("hi", np.array(hi, dtype))
        h = b.op("Clip", [h, lo_t, hi_t])
    b.output(b.layernorm(h), shape=[2, T, D])
    return b.model(20 if t5_where else 17)  # IsInf takes fp16 from opset 20


@pytest.mark.parametrize("dtype,t5", [(np.float16, False), (np.float32, False), (np.float16, True)])
def test_hf_overflow_clamp_is_transparent(dtype, t5):
    top = float(np.finfo(dtype).max) - 1000
    model = _clamped_encoder(dtype, -top, top, t5_where=t5)
    res = fold_model(model)  # verifies in onnxruntime (fp16: against its fp16 tolerance)
    assert (res.report.folded, res.report.kept) == (3, 0)
    assert _ops(res.model).count("Clip") == 2  # the guard stays, on the centered stream
    if dtype == np.float32:
        assert res.max_rel_err < RTOL


@pytest.mark.parametrize("bound", [6.0, 60000.0])
def test_clip_that_can_act_blocks(bound):
    """ReLU6-style clamps and bounds below finfo.max - 1000 compute something: not transparent."""
    report = onnx_rewrite.analyze_model(_clamped_encoder(np.float16, -bound, bound))
    assert report.folded == 0
    assert any("Clip" in n.reason for n in report.norms)


# --- a Reshape whose shape is computed at run time (Optimum's CLIP vision embeddings) -------------

def _conv_stem(scramble: bool = False) -> onnx.ModelProto:
    """pixels [batch, 3, height, width] -> Conv (patches) -> Reshape(x, Concat(Slice(Shape(x), 0, 2), [-1]))
    -> Transpose -> + bias -> 2 Pre-LN blocks -> LN -> head: TorchScript's `flatten(2)` on symbolic
    sizes, as in Optimum's CLIP export. `scramble` computes [B, -1, C] instead, which mixes the
    channels into the token axis (not a feature-preserving reshape)."""
    b = Builder(22)
    px = b.input("pixel_values", FLOAT, ["batch", 3, "height", "width"])
    w = b.weight("patch_w", (D, 3, 2, 2), mean=0.0)
    conv = b.op("Conv", [px, w, b.weight("patch_b", (D,), mean=3.0)], kernel_shape=[2, 2], strides=[2, 2])
    shape = b.op("Shape", [conv])
    starts, ends = b.const("s", np.array([0], np.int64)), b.const("e", np.array([2 if not scramble else 1], np.int64))
    head = b.op("Slice", [shape, starts, ends])
    if scramble:
        chan = b.op("Slice", [shape, b.const("s1", np.array([1], np.int64)), b.const("e1", np.array([2], np.int64))])
        target = b.op("Concat", [head, b.const("m1", np.array([-1], np.int64)), chan], axis=0)
        h = b.op("Reshape", [conv, target])
    else:
        target = b.op("Concat", [head, b.const("m1", np.array([-1], np.int64))], axis=0)
        h = b.op("Transpose", [b.op("Reshape", [conv, target])], perm=[0, 2, 1])
    h = b.op("Add", [h, b.weight("cls_like", (D,), mean=2.0)])
    for _ in range(2):
        h = b.block(h)
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 4))]))
    return b.model(17)


def test_reshape_with_computed_shape_keeps_the_feature_axis():
    res = fold_model(_conv_stem())
    assert (res.report.folded, res.report.kept, res.report.recentered) == (3, 0, 0)
    assert res.max_rel_err < RTOL


def test_reshape_with_computed_shape_that_moves_channels_is_opaque():
    """[B, C, h, w] -> [B, -1, C] scrambles channels into tokens: no constant edit centers its
    output, so the stream gets a recenter instead (3 swaps pay for it)."""
    res = fold_model(_conv_stem(scramble=True))
    assert (res.report.folded, res.report.recentered) == (3, 1)
    assert res.max_rel_err < RTOL


# --- decomposed LayerNorms of tf2onnx (Keras) and jax2onnx (flax) ---------------------------------

def _keras_ln(b: Builder, x: str, gap: bool, affine: bool) -> str:
    """tf2onnx's Keras LayerNormalization, node for node (keras 3 `moments` + `rsqrt`)."""
    def mean(t):
        return b.op("GlobalAveragePool", [t]) if gap else b.op("ReduceMean", [t], axes=[-1], keepdims=1)

    mu = mean(x)
    neg = b.op("Neg", [mu])
    d = b.op("Sub", [x, mu])
    var = mean(b.op("Mul", [d, d]))
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])])])
    g, be = b.affine()
    if affine:
        inv = b.op("Mul", [inv, b.const("g3", onnx.numpy_helper.to_array(b.inits[-2]).reshape(1, 1, D))])
    shift = b.op("Mul", [neg, inv])
    if affine:
        shift = b.op("Add", [shift, b.const("b3", onnx.numpy_helper.to_array(b.inits[-2]).reshape(1, 1, D))])
    return b.op("Add", [b.op("Mul", [x, inv]), shift])


def _flax_ln(b: Builder, x: str, gap: bool, affine: bool) -> str:
    """jax2onnx's flax LayerNorm: variance as E[x²] − E[x]², clipped at 0."""
    mu = b.op("ReduceMean", [x], axes=[2], keepdims=1)
    centered = b.op("Sub", [x, mu])
    m2 = b.op("ReduceMean", [b.op("Mul", [x, x])], axes=[2], keepdims=1)
    var = b.op("Max", [b.op("Sub", [m2, b.op("Mul", [mu, mu])]), b.const("zero", np.array(0.0, np.float32))])
    n = b.op("Div", [centered, b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-6, np.float32))])])])
    if not affine:
        return n
    g, be = b.affine()
    return b.op("Add", [b.op("Mul", [n, g]), be])


def _pre_ln_with(ln, gap: bool = False, affine: bool = True) -> onnx.ModelProto:
    b = Builder(23)
    ids = b.input("ids", INT64, [2, T])
    h = b.embed(ids)
    for _ in range(2):
        h = b.op("Add", [h, b.linear(b.op("Relu", [b.linear(ln(b, h, gap, affine), D, 2 * D)]), 2 * D, D)])
    b.output(b.op("MatMul", [ln(b, h, gap, affine), b.weight("head", (D, 4))]))
    return b.model(17)


@pytest.mark.parametrize("ln,gap,affine", [(_keras_ln, True, True), (_keras_ln, False, False),
                                           (_flax_ln, False, True), (_flax_ln, False, False)])
def test_tf2onnx_and_jax2onnx_layernorms_fold(ln, gap, affine):
    res = fold_model(_pre_ln_with(ln, gap, affine))
    assert (res.report.folded, res.report.kept) == (3, 0)
    assert res.max_rel_err < RTOL
    assert "Neg" not in _ops(res.model) and "Max" not in _ops(res.model)  # the whole pattern is gone


def test_keras_layernorm_whose_mean_is_read_elsewhere_is_not_matched():
    """An inner tensor read outside the pattern: removing the pattern would orphan that reader."""
    m = _pre_ln_with(_keras_ln)
    mean = next(n for n in m.graph.node if n.op_type == "ReduceMean" or n.op_type == "GlobalAveragePool")
    m.graph.output.append(helper.make_tensor_value_info(mean.output[0], FLOAT, None))
    report = onnx_rewrite.analyze_model(m)
    assert len(report.norms) == 2  # the first norm is not a match any more


# --- onnxruntime's fused ops: EmbedLayerNormalization, Attention, MultiHeadAttention -------------

MS = "com.microsoft"
INT32 = TensorProto.INT32


def _embed_model(reader: str = "Attention", segments: bool = True, mask: bool = True,
                 position_ids: bool = False) -> onnx.ModelProto:
    """BERT's embeddings as onnxruntime's optimizer fuses them: EmbedLayerNormalization over word,
    position and segment tables (each with a large per-row mean), read by `reader`:
    - "Attention": Attention(normed, W_qkv, b_qkv, mask_index) and a SkipLayerNormalization of
      its projection with the normed tensor (BERT's Post-LN block: only the embedding norm folds);
    - "AttentionOnly": Attention alone (β folds into its bias);
    - "MultiHeadAttention": MHA(normed, normed, normed) (takes projected Q/K/V: not linear)."""
    b = Builder(24)
    ids = b.input("input_ids", INT32, [2, T])
    word = b.weight("word", (13, D), mean=4.0)
    pos = b.weight("pos", (T + 3, D), mean=-2.0)
    ins = [ids, b.input("segment_ids", INT32, [2, T]) if segments else "", word, pos,
           b.weight("seg", (2, D), mean=3.0) if segments else ""]
    g, be = b.affine()
    ins += [g, be, b.input("mask", INT32, [2, T]) if mask else ""]
    if position_ids:
        ins.append(b.input("position_ids", INT32, [1, T]))
    normed, mask_index = b.op("EmbedLayerNormalization", ins, n_out=2, domain=MS, epsilon=1e-12)
    if reader == "MultiHeadAttention":
        y = b.op("MultiHeadAttention", [normed, normed, normed], domain=MS, num_heads=2)
    else:
        w = b.weight("qkv_w", (D, 3 * D), mean=0.5)
        y = b.op("Attention", [normed, w, b.weight("qkv_b", (3 * D,), mean=1.0), mask_index], domain=MS, num_heads=2)
    if reader == "Attention":
        proj = b.op("MatMul", [y, b.weight("o", (D, D))])
        g2, be2 = b.affine()
        y = b.op("SkipLayerNormalization", [proj, normed, g2, be2, b.weight("o_b", (D,), mean=2.0)], domain=MS,
                 epsilon=1e-5)
        y = b.op("MatMul", [y, b.weight("next", (D, D))])
    b.output(y, shape=[2, T, D])
    return b.model(17, extra_opsets=[(MS, 1)])


@pytest.mark.parametrize("opts", [{"defer": "on"}, {"mode": "crms"}])
def test_embed_layernorm_deferred_or_crms_reads_the_lookups_sum(opts):
    """EmbedLayerNormalization read by a MatMul: deferred, or as CRMSNorm, the norm reads the
    sum of its lookups (both emissions read the op's first input, the ids, before)."""
    b = Builder(27)
    ids = b.input("input_ids", INT32, [2, T])
    ins = [ids, "", b.weight("word", (13, D), mean=4.0), b.weight("pos", (T + 3, D), mean=-2.0), ""]
    ins += list(b.affine())
    normed, _ = b.op("EmbedLayerNormalization", ins, n_out=2, domain=MS, epsilon=1e-12)
    b.output(b.op("MatMul", [normed, b.weight("head", (D, 7))]), shape=[2, T, 7])
    res = fold_model(b.model(17, extra_opsets=[(MS, 1)]), **opts)  # verified against float64
    if "defer" in opts:
        assert [n.deferred for n in res.report.norms] == [True]
    else:
        assert [c.verdict for c in res.report.compression] == ["compressed"]
    assert res.max_rel_err < RTOL and "EmbedLayerNormalization" not in _ops(res.model)


def test_embed_layernorm_is_not_fused_as_a_residual_add_on_cuda():
    """The CUDA emission fuses residual Adds with their norms; EmbedLayerNormalization's sum of
    lookups is no residual Add (fusing it crashed where its embedding_sum output is read)."""
    b = Builder(28)
    ids = b.input("input_ids", INT32, [2, T])
    ins = [ids, "", b.weight("word", (13, D), mean=4.0), b.weight("pos", (T + 3, D), mean=-2.0), ""]
    ins += list(b.affine())
    normed, _, summed = b.op("EmbedLayerNormalization", ins, n_out=3, domain=MS, epsilon=1e-12)
    h = b.op("Add", [summed, b.op("MatMul", [normed, b.weight("w", (D, D))])])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, 7))]), shape=[2, T, 7])
    res = fold_model(b.model(17, extra_opsets=[(MS, 1)]), device="cuda")  # verified against float64
    embed, ln_f = res.report.norms
    assert (embed.verdict, ln_f.verdict) == ("fold", "fold")
    assert [n for s in res.report.streams for n in s.fused] == [ln_f.name]  # the residual Add only
    assert _ops(res.model).count("SkipSimplifiedLayerNormalization") == 1 and res.max_rel_err < RTOL


@pytest.mark.parametrize("segments,mask,position_ids", [(True, True, False), (False, False, True)])
def test_embed_layernorm_folds_into_lookups_and_rmsnorm(segments, mask, position_ids):
    res = fold_model(_embed_model("Attention", segments, mask, position_ids))
    verdicts = {n.name.split("_")[0]: n.verdict for n in res.report.norms}
    assert verdicts == {"EmbedLayerNormalization": "fold", "SkipLayerNormalization": "keep"}
    assert res.max_rel_err < RTOL
    ops = _ops(res.model)
    assert "EmbedLayerNormalization" not in ops and "SimplifiedLayerNormalization" in ops
    tables = {t.name for t in res.model.graph.initializer}
    lookups = [n for n in res.model.graph.node if n.op_type == "Gather" and n.input[0] in tables]
    assert len(lookups) == 1 + segments + position_ids  # word (+ segment) (+ position ids; else a Slice)


def test_attention_reader_takes_beta_into_its_bias():
    res = fold_model(_embed_model("AttentionOnly"))
    assert res.report.folded == 1 and res.max_rel_err < RTOL
    norm = next(n for n in res.model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    readers = [n.op_type for n in res.model.graph.node if norm.output[0] in n.input]
    assert readers == ["Attention"]  # no β Add between the norm and the Attention


def test_multihead_attention_is_a_plain_reader():
    res = fold_model(_embed_model("MultiHeadAttention", mask=False))
    assert res.report.folded == 1 and res.max_rel_err < RTOL
    norm = next(n for n in res.model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    readers = [n.op_type for n in res.model.graph.node if norm.output[0] in n.input]
    assert readers == ["Add"]  # β stays an Add: MHA's inputs are already projected


# --- Optimum's merged decoders: the model in both branches of an If -----------------------------

def _merged_decoder(else_observes_stream: bool = False) -> onnx.ModelProto:
    """`If(use_cache_branch)` with the same Pre-LN decoder in both branches, reading shared outer
    initializers, with the same node and tensor names in both (as Optimum's merge writes them).
    `else_observes_stream`: the else branch also outputs the residual stream, so only the then
    branch may fold, and the shared weights must be cloned for it."""
    b = Builder(25)
    ids = b.input("ids", INT64, [2, T])
    cond = b.input("use_cache_branch", TensorProto.BOOL, [])
    base = len(b.nodes)
    h = b.embed(ids)
    h = b.block(h)
    normed = b.layernorm(h)
    y = b.op("MatMul", [normed, b.weight("head", (D, VOCAB))])
    nodes, b.nodes[:] = b.nodes[base:], b.nodes[:base]

    def branch(name: str, side: str) -> onnx.GraphProto:
        extra = helper.make_node("Identity", [side], ["side_out"], name="side")
        return helper.make_graph(nodes + [extra], name, [], [helper.make_tensor_value_info(y, FLOAT, None),
                                                            helper.make_tensor_value_info("side_out", FLOAT, None)])

    then_g = branch("with_past", normed)
    else_g = branch("no_past", h if else_observes_stream else normed)
    logits, side = b.op("If", [cond], n_out=2, then_branch=then_g, else_branch=else_g)
    b.output(logits, shape=[2, T, VOCAB])
    b.output(side, shape=[2, T, D])
    return b.model(17)


def _run_both_branches(model: onnx.ModelProto) -> list:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 11, (2, T)).astype(np.int64)
    return [sess.run(None, {"ids": ids, "use_cache_branch": np.array(c)}) for c in (True, False)]


def _rel(a, b) -> float:
    return float(np.abs(np.float64(a) - np.float64(b)).max() / np.abs(np.float64(a)).max())


@pytest.mark.parametrize("else_observes_stream", [False, True])
def test_merged_decoder_folds_both_branches_consistently(else_observes_stream):
    model = _merged_decoder(else_observes_stream)
    res = fold_model(model, verify=False)  # checked below, in both branches
    by_branch = {}
    for n in res.report.norms:
        by_branch.setdefault(n.name.split("::")[0], []).append(n.verdict)
    if_name = next(n.name for n in model.graph.node if n.op_type == "If")
    assert by_branch == {f"{if_name}/then_branch": ["fold", "fold"],
                         f"{if_name}/else_branch": ["keep", "keep"] if else_observes_stream else ["fold", "fold"]}
    for got, want in zip(_run_both_branches(res.model), _run_both_branches(model)):
        assert max(_rel(w, g) for w, g in zip(want, got)) < RTOL
    # shared weights stay in the main graph, once (not copied into each branch)
    branches = [a.g for n in res.model.graph.node if n.op_type == "If" for a in n.attribute]
    assert all(len(g.initializer) == 0 for g in branches)
    outer = [t.name for t in res.model.graph.initializer]
    assert len(outer) == len(set(outer))
    centered = [t for t in outer if "/lnfold_centered" in t]
    originals_kept = {t.name for t in model.graph.initializer} <= set(outer)
    assert originals_kept == else_observes_stream  # cloned for one branch, edited in place for both
    assert centered


@pytest.mark.parametrize("opts", [{"defer": "on"}, {"mode": "crms"}])
def test_main_graph_deferred_and_crms_norms_next_to_an_if(opts):
    """An If off the stream sends the emission through the per-scope path: the main graph's
    deferred and CRMS norms must be emitted as such (the γ-scaled weights and the d-1 wide
    sources are already written), not as plain RMSNorms."""
    from .onnx_graphs import pre_ln

    model = pre_ln(layers=2)
    g = model.graph
    then_g = helper.make_graph([helper.make_node("Identity", ["z"], ["ty"], name="tid")], "t", [],
                               [helper.make_tensor_value_info("ty", FLOAT, [3])])
    else_g = helper.make_graph([helper.make_node("Neg", ["z"], ["ey"], name="eneg")], "e", [],
                               [helper.make_tensor_value_info("ey", FLOAT, [3])])
    g.input.extend([helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("z", FLOAT, [3])])
    g.node.append(helper.make_node("If", ["cond"], ["side"], then_branch=then_g, else_branch=else_g, name="side_if"))
    g.output.append(helper.make_tensor_value_info("side", FLOAT, [3]))
    res = fold_model(model, verify=False, **opts)  # judged below
    if "defer" in opts:
        assert all(n.deferred for n in res.report.norms)
    else:
        assert any(c.verdict == "compressed" for c in res.report.compression)

    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, VOCAB, (2, T)).astype(np.int64)
    feed = {"ids": ids, "cond": np.array(True), "z": np.ones(3, np.float32)}
    want, got = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
                 for m in (model, res.model))
    assert _rel(want[0], got[0]) < RTOL


def test_skip_layernorm_chain_with_sum_output_and_bias():
    """onnxruntime's optimizer chains SkipLayerNormalizations: each takes the MLP's bias as its
    input 4 and hands the residual sum (output 3) to the next one as its skip input."""
    b = Builder(26)
    h = b.embed(b.input("ids", INT64, [2, T]))
    r = b.linear(b.op("Relu", [b.linear(b.layernorm(h), D, D)]), D, D)
    g, be = b.affine()
    normed, _, _, summed = b.op("SkipLayerNormalization", [r, h, g, be, b.weight("bias", (D,), mean=1.5)], n_out=4,
                                domain=MS, epsilon=1e-5)
    r2 = b.op("MatMul", [b.op("Relu", [b.linear(normed, D, D)]), b.weight("W2", (D, D), mean=1.0)])
    g2, be2 = b.affine()
    out = b.op("SkipLayerNormalization", [r2, summed, g2, be2, b.weight("bias2", (D,), mean=-2.0)], domain=MS,
               epsilon=1e-5)
    b.output(b.op("MatMul", [out, b.weight("head", (D, VOCAB))]), shape=[2, T, VOCAB])
    res = fold_model(b.model(17, extra_opsets=[(MS, 1)]))
    assert (res.report.folded, res.report.kept) == (3, 0)
    assert res.max_rel_err < RTOL
    assert "SkipLayerNormalization" not in _ops(res.model)


def test_computed_shape_suffix_and_copy_rules():
    """The suffix rule (the last dims kept: [B, T, D] -> [B*T, D] as Concat([-1], Shape(x)[2:])) and
    Reshape's 0 (copy the input's dim) place the feature axis; -1 or another tensor's dims do not."""
    import onnx_graphsurgeon as gs

    from lnfold.onnx_rewrite.computed_shapes import computed_axis_map

    x, y = gs.Variable("x", np.float32, (2, "T", 8)), gs.Variable("y", np.float32, (2, "T", "F"))

    def shape_of(t, start, end):
        out = gs.Variable(f"shape_{t.name}_{start}", np.int64)
        gs.Node("Shape", inputs=[t], outputs=[out], attrs={"start": start, "end": end})
        return out

    def reshape(*parts, allowzero=0):
        target = gs.Variable("target", np.int64)
        gs.Node("Concat", inputs=list(parts), outputs=[target], attrs={"axis": 0})
        node = gs.Node("Reshape", inputs=[x, target], outputs=[gs.Variable("out")], attrs={"allowzero": allowzero})
        return computed_axis_map(node, x.shape, lambda t: t.shape)

    minus1 = gs.Constant("m1", np.array([-1], np.int64))
    assert reshape(minus1, shape_of(x, 2, 3)) == {2: 1}                     # suffix: features last
    assert reshape(gs.Constant("z", np.array([0, 0], np.int64)), minus1) == {0: 0, 1: 1}  # copies
    assert reshape(gs.Constant("z", np.array([0, 0], np.int64)), minus1, allowzero=1) == {}
    assert reshape(minus1, shape_of(y, 2, 3)) == {}                         # another tensor's dim
