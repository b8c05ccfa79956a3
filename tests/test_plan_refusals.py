"""The planner's refusals and the user's errors that no other test reached (a coverage run's list):
each test builds the smallest graph that takes the branch and asserts what it must do — the norm
kept or the stream left as it is, with the reason text, or the fold done and verified against
float64 (onnx_rewrite's verification runs a float64 copy of the original), or a one-line error.

Graphs are hand-built ONNX (tests/onnx_graphs.py) with random γ/β and sources of a large mean; the
plans are made on the ONNX frontend's View with the request each case needs (a trained constant, a
target without a readout MatMul or with a fused residual Add), as make_plan is called by any frontend.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from lnfold.onnx_rewrite import targets
from lnfold.onnx_rewrite.api import OnnxFrontend, analyze_model, fold_model, run_frontend
from lnfold.passes import LnfoldError, NothingToFold, make_plan
from lnfold.passes import gate, geometry_plot, orthogonal, slicing
from lnfold.passes.edits import Seeded
from lnfold.passes.options import FoldOptions
from lnfold.passes.request import Capabilities, PlanRequest
from tests import onnx_graphs as graphs
from tests.onnx_graphs import D, FLOAT, T, VOCAB, Builder


def _view(model):
    return OnnxFrontend(model, FoldOptions(), targets.resolve("ort", "cpu")).view()


def _skip_layernorm():
    """tests/onnx_graphs.skip_layernorm with its fused op's output shape given, as onnx cannot infer it
    (else onnxruntime's symbolic shape inference does, after an import of a second)."""
    model = graphs.skip_layernorm()
    skip = next(n for n in model.graph.node if n.op_type == "SkipLayerNormalization")
    model.graph.value_info.append(helper.make_tensor_value_info(skip.output[0], FLOAT, [2, T, D]))
    return model


def _recentered_start_read_by_linears(n_norms: int = 3):
    """x -> linear -> Relu: a stream start no edit centers (recentered), read by `n_norms` LayerNorms
    (of it, and of it times constants), each read by a linear layer only, whose products are summed."""
    b = Builder(21)
    x = b.input("x", FLOAT, [2, T, D])
    h = b.op("Relu", [b.linear(x, D, D)])
    outs = []
    for k in range(n_norms):
        src = b.op("Mul", [h, b.const("s", np.array(1.0 + k, np.float32))]) if k else h
        outs.append(b.op("MatMul", [b.layernorm(src), b.weight("W", (D, D))]))
    y = outs[0]
    for o in outs[1:]:
        y = b.op("Add", [y, o])
    b.output(y)
    return b.model(17)


def _residual_sum_read_by_two_norms():
    """ids -> embedding -> one pre-LN block, whose residual sum two LayerNorms read (parallel heads)."""
    b = Builder(22)
    h = b.block(b.embed(b.input("ids", graphs.INT64, [2, T])))
    y = b.op("Add", [b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))]),
                     b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))])])
    b.output(y, shape=[2, T, VOCAB])
    return b.model(17)


def _constant_added_in_heads():
    """x [2, T, 2, 4] (a graph input: recentered) plus a [T, 8] constant reshaped into 2 heads of 4, read
    by three LayerNorms over the heads' 4 features: the constant is centered in runs of 4 of its 8."""
    b = Builder(23)
    x = b.input("x", FLOAT, [2, T, 2, 4])
    heads = b.op("Reshape", [b.weight("C", (T, 8), mean=3.0), b.const("shape", np.array([T, 2, 4], np.int64))])
    h = b.op("Add", [x, heads])
    outs = [b.op("MatMul", [b.layernorm(h, 4), b.weight("W", (4, 4))]) for _ in range(3)]
    b.output(b.op("Add", [b.op("Add", outs[:2]), outs[2]]))
    return b.model(17)


def _scalar_added_to_the_stream():
    """ids -> embedding -> a pre-LN block -> plus a one-element constant (uniform along the features) ->
    final LayerNorm -> head."""
    b = Builder(24)
    h = b.block(b.embed(b.input("ids", graphs.INT64, [2, T])))
    h = b.op("Add", [h, b.weight("shift", (1,), mean=5.0)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))]), shape=[2, T, VOCAB])
    return b.model(17)


def _norm_read_through_a_reshape(shape):
    b = Builder(31)
    x = b.input("x", FLOAT, [2, T, D])
    y = b.op("Reshape", [b.layernorm(b.linear(x, D, D)), b.const("shape", np.array(shape, np.int64))])
    b.output(b.op("MatMul", [y, b.weight("W", (D, D))]))
    return b.model(17)


# --- γ into the readers, where a norm must keep it, and where it goes --------------------------------

def test_a_stream_whose_norm_has_a_graph_input_gamma_is_not_rotated_and_its_fold_verifies():
    result = fold_model(graphs.gamma_input(), rotate="hadamard")  # verified against float64
    (stream,) = result.report.streams
    assert stream.rotation.startswith("not rotated: the γ of LayerNormalization")
    assert "stays in the norm (γ `gamma` is not a constant)" in stream.rotation
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and norm.gamma == "kept in the norm (γ `gamma` is not a constant)"


def test_a_norm_whose_beta_stays_keeps_its_gamma_and_its_fold_verifies():
    b = Builder(27)
    x = b.input("x", FLOAT, [2, T, D])
    beta = b.input("beta", FLOAT, [D])
    y = b.op("LayerNormalization", [b.linear(x, D, D), b.weight("gamma", (D,), mean=1.0), beta], axis=-1, epsilon=1e-5)
    b.output(b.op("MatMul", [y, b.weight("head", (D, D))]))
    result = fold_model(b.model(17), gamma_into_readers=True)  # verified against float64
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and norm.beta == "kept as an Add (β `beta` is not a constant)"
    assert norm.gamma == ("kept in the norm (β stays with the norm (β `beta` is not a constant), and a β Add "
                          "after a unit-γ norm would be scaled by γ in the readers)")


def test_crms_norms_keep_gamma_for_their_compressed_readers():
    result = fold_model(graphs.pre_ln(1), mode="crms", gamma_into_readers=True)  # verified against float64
    assert [c.verdict for c in result.report.compression] == ["compressed"]
    for norm in result.report.norms:
        assert norm.gamma == "kept in the norm (it is emitted as CRMSNorm, whose readers absorb γ already)"


def test_norms_of_unknown_feature_size_keep_gamma_and_their_stream_is_not_rotated():
    result = fold_model(graphs.dynamic_feature_no_gamma(), rotate="hadamard")  # verified against float64
    why = "its feature size is not known (a unit weight needs it)"
    assert all(n.verdict == "fold" and n.gamma == f"kept in the norm ({why})" for n in result.report.norms)
    (stream,) = result.report.streams
    assert stream.rotation.startswith("not rotated: the γ of DecomposedLayerNorm") and stream.rotation.endswith(
        f"stays in the norm ({why})")


def test_a_norm_the_target_keeps_keeps_its_gamma_out_of_its_readers():
    view = _view(graphs.pre_ln(1))
    last = [n.name for n in view.norms()][-1]  # read by the head
    refusal = lambda name, swaps: "no RMSNorm here" if name == last else None  # noqa: E731
    plan = make_plan(view, PlanRequest(gamma_into_readers=True, target=Capabilities(swap_refusal=refusal)))
    assert list(plan.kept_by_target) == [last] and last not in plan.swaps
    assert plan.gammas[last].why == "the target keeps this norm (no RMSNorm here)"
    head = [e for e in plan.const_edits if e.value.startswith("head_")]
    assert not any(op.__class__.__name__ == "Scale" for e in head for op in e.ops)  # γ is applied by the norm alone
    assert len(plan.unit_gamma) == 1  # the other norm's γ did move


def test_a_stream_of_norms_without_gamma_rotates_and_its_fold_verifies():
    b = Builder(32)
    x = b.input("x", FLOAT, [2, T, D])
    b.output(b.op("MatMul", [graphs._decomposed_no_affine(b, b.linear(x, D, D)), b.weight("W", (D, D))]))
    result = fold_model(b.model(17), rotate="hadamard")  # verified against float64
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and norm.gamma == "none (unit weight already)"
    assert result.report.streams[0].rotation.startswith("rotated (hadamard, d=8, seed 0)")


def test_the_table_says_where_gamma_went_and_how_the_stream_was_rotated():
    table = fold_model(graphs.pre_ln(1), rotate="hadamard").report.table(width=200)
    assert "fold     stream 1 (4 centered), γ into the weight of MatMul `MatMul_14`, β into the bias" in table
    assert "\n  rotated (hadamard, d=8, seed 0): 4 writer constant(s), 2 reader weight(s)" in table


# --- what a rotation does with a stream it cannot carry in another basis, or with a uniform constant ---

def test_a_stream_whose_norm_output_is_the_model_output_is_not_rotated_and_says_how_to_fold_it():
    result = fold_model(graphs.ln_non_last_axis(), rotate="hadamard")  # verified against float64
    (stream,) = result.report.streams
    assert stream.rotation.endswith("is a graph output); a model's hidden states as its output: fold it with the head "
                                    "that reads them")


def test_a_stream_with_a_constant_centered_in_blocks_is_not_rotated_and_its_fold_verifies():
    result = fold_model(_constant_added_in_heads(), rotate="hadamard")  # verified against float64
    assert [n.verdict for n in result.report.norms] == ["fold"] * 3
    (stream,) = result.report.streams
    assert stream.rotation == "not rotated: `C_1` is centered in blocks"


def test_a_constant_uniform_along_the_features_is_centered_to_zero_and_not_rotated():
    result = fold_model(_scalar_added_to_the_stream(), rotate="hadamard")  # verified against float64
    (stream,) = result.report.streams
    assert stream.rotation.startswith("rotated (hadamard, d=8, seed 0): 4 writer constant(s), 2 reader weight(s)")
    assert any(c.startswith("`shift_") for c in stream.centered)


def test_a_target_without_a_constant_matmul_keeps_a_recentered_rotated_start_unrotated():
    model = _recentered_start_read_by_linears()
    view = _view(model)
    rotated = make_plan(view, PlanRequest(rotate="hadamard"))
    (basis,) = rotated.stream_bases
    assert basis.rotated and basis.starts and not basis.readouts  # the start alone needs a MatMul
    plan = make_plan(_view(model), PlanRequest(rotate="hadamard", target=Capabilities(name="T", readout_matmul=False)))
    (basis,) = plan.stream_bases
    assert basis.why.startswith("its recentered start `") and basis.why.endswith(
        "` would need a constant MatMul after the recenter, which T cannot emit")
    assert not basis.starts and not basis.writers and not basis.readers
    assert [r.project for r in plan.recenters] == [None]


def test_the_hadamard_rotation_of_a_28_feature_stream_is_orthogonal():
    assert orthogonal.hadamard_factors(28) == (1, 28)  # Paley II, q = 13: no power of two helps
    q = orthogonal.matrix("hadamard", 28, seed=3)
    assert np.allclose(q @ q.T, np.eye(28), atol=1e-12)
    assert np.allclose(np.abs(q), 28 ** -0.5)


# --- per-block bases (a calibrated slice's, here seeded and at full width: exact) -------------------

def _per_block_bases(view) -> dict:
    """One basis per norm of pre_ln(2)'s stream (each norm heads its own segment), keeping all d."""
    return {n.name: (Seeded("hadamard", D, k + 1), D) for k, n in enumerate(view.norms())}


def test_per_block_bases_at_full_width_re_express_the_shortcuts_and_fold_exactly():
    model = graphs.pre_ln(2)
    frontend = OnnxFrontend(model, FoldOptions(), targets.resolve("ort", "cpu"), bases=_per_block_bases(_view(model)))
    result = run_frontend(frontend, None)  # verified against float64
    assert result.criterion == "float64"
    assert result.report.streams[0].rotation.endswith(
        "3 per-block bases, 2 residual shortcut(s) re-expressed by a constant 8×8 MatMul; its constant MatMuls "
        "add 128 parameters")  # (two 8×8 shortcuts)


def test_a_target_without_a_constant_matmul_keeps_a_stream_with_per_block_bases_unrotated():
    view = _view(graphs.pre_ln(2))
    no_matmul = Capabilities(name="T", readout_matmul=False)
    plan = make_plan(view, PlanRequest(bases=_per_block_bases(view), target=no_matmul))
    (basis,) = plan.stream_bases
    assert basis.why == ("its residual shortcut into `Add_26` would need a constant MatMul (per-block bases), which T "
                         "cannot emit")
    assert not basis.shortcuts and not basis.norm_bases and not basis.writers and not plan.shortcuts


def test_bases_that_are_not_one_per_segment_keep_the_stream_unrotated():
    view = _view(graphs.pre_ln(2))
    first, _, last = _per_block_bases(view).items()  # the middle segment's basis left out
    plan = make_plan(view, PlanRequest(bases=dict([first, last])))
    (basis,) = plan.stream_bases
    assert basis.why == "per-block bases: the bases given are not one per segment"
    assert not basis.writers and not basis.readers and not plan.shortcuts


def test_per_block_bases_across_a_fused_skip_layernorm_keep_the_stream_unrotated():
    view = _view(_skip_layernorm())  # its Add of the shortcut, the branch and a bias is part of the fused op
    plan = make_plan(view, PlanRequest(bases=_per_block_bases(view)))
    (basis,) = plan.stream_bases
    assert basis.why == ("per-block bases: SkipLayerNormalization(add) `SkipLayerNormalization_29#add` joins two "
                         "segments of the stream and is no Add of two tensors")
    assert not basis.writers and not basis.readers and not plan.shortcuts


# --- trained constants: the training fold computes no γ edit and no rotation ----------------------

def test_trained_reader_weights_keep_gamma_in_the_norm():
    view = _view(graphs.pre_ln(1))
    readers = {"W_11", "head_31"}  # the first linear layer of the block, the head
    plan = make_plan(view, PlanRequest(gamma_into_readers=True, trainable=lambda value: value in readers))
    assert plan.swaps and not plan.unit_gamma
    for norm in plan.report.norms:
        assert norm.gamma == ("kept in the norm (its readers' weights are trained (the training fold computes no γ "
                              "edit))")
    assert not any(op.__class__.__name__ == "Scale" for e in plan.const_edits for op in e.ops)


def test_trained_writers_keep_the_stream_unrotated():
    view = _view(graphs.pre_ln(1))
    trained = {"emb_1", "pos_2"}  # the embedding tables: writers of the stream, none of its readers
    plan = make_plan(view, PlanRequest(rotate="hadamard", trainable=lambda value: value in trained))
    (basis,) = plan.stream_bases
    assert basis.why == "its writers are trained (the training fold computes no rotation)"
    assert plan.report.streams[0].rotation.startswith("not rotated: its writers are trained")
    assert not plan.rotated_norms and not basis.writers and not basis.readers


# --- deferred normalization: the norms it must leave alone ---------------------------------------

def test_a_norm_with_a_graph_input_gamma_is_not_deferred():
    result = fold_model(graphs.gamma_input(), defer="on")
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and not norm.deferred
    assert norm.defer_reason == "its γ `gamma` is not a constant"


def test_a_norm_over_a_feature_axis_that_is_not_last_is_not_deferred():
    result = fold_model(graphs.ln_non_last_axis(), defer="on")  # verified against float64
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and not norm.deferred
    assert norm.defer_reason.startswith("its feature axis is not the last axis of `")


def test_a_norm_read_through_a_reshape_to_rank_4_is_not_deferred_and_to_rank_2_is():
    result = fold_model(_norm_read_through_a_reshape([2, T, 1, D]), defer="on")  # verified against float64
    (norm,) = result.report.norms
    assert norm.verdict == "fold" and not norm.deferred
    assert norm.defer_reason == "a reader reads it through a reshape to another rank than 2"
    (flat,) = fold_model(_norm_read_through_a_reshape([2 * T, D]), defer="on").report.norms
    assert flat.deferred and not flat.defer_reason


def test_auto_deferral_of_norms_of_unknown_feature_size_is_refused_by_the_cost_model():
    b = Builder(28)
    x = b.input("x", FLOAT, ["batch", "seq", "feat"])
    h = b.op("Relu", [x])  # a recentered start: the feature size stays unknown
    outs = [b.op("MatMul", [b.layernorm(src), b.weight("W", (D, D))])
            for src in (h, b.op("Mul", [h, b.const("s", np.array(2.0, np.float32))]))]
    b.output(b.op("Add", outs))
    result = fold_model(b.model(17), defer="auto", dims={"batch": 2, "seq": T, "feat": D})  # verified
    assert [(n.verdict, n.deferred, n.defer_reason) for n in result.report.norms] == [
        ("fold", False, "cost model: feature sizes unknown")] * 2


def test_gamma_into_the_readers_turns_deferral_off_and_says_so():
    result = fold_model(graphs.pre_ln(1), defer="on", gamma_into_readers=True)
    assert "deferred normalization is off: γ goes into the readers (gamma_into_readers)" in result.report.notes
    assert not any(n.deferred or n.defer_reason for n in result.report.norms)  # not asked, not refused
    assert all(n.gamma.startswith("into the weight of MatMul") for n in result.report.norms)


# --- CRMS where the stream cannot be compressed ------------------------------------------------

def test_crms_on_a_two_feature_stream_folds_to_rms_norms_with_the_reason():
    result = fold_model(graphs.pre_ln(1, d=2), mode="crms")  # verified against float64
    (verdict,) = result.report.compression
    assert verdict.verdict == "rms" and verdict.reason == "a 2-feature stream has nothing to compress"
    assert [n.verdict for n in result.report.norms] == ["fold", "fold"]


def test_crms_on_a_stream_centered_per_head_folds_to_rms_norms_with_the_reason():
    b = Builder(25)
    x = b.input("x", FLOAT, [2, T, 8])
    heads = b.op("Reshape", [b.linear(x, 8, 8), b.const("shape", np.array([2, T, 2, 4], np.int64))])
    b.output(b.op("MatMul", [b.layernorm(heads, 4), b.weight("W", (4, 4))]))
    result = fold_model(b.model(17), mode="crms")  # verified against float64
    (verdict,) = result.report.compression
    assert verdict.verdict == "rms"
    assert verdict.reason == ("the stream is centered per head (a per-head norm reads it); compressing it is not "
                              "implemented")
    assert [n.verdict for n in result.report.norms] == ["fold"]


def _final_norm_read_through_a_layout_op(kind: str):
    """pre-LN stream whose final LayerNorm is read through a Reshape that is also a graph output
    ("output"), or through a Concat with a Relu of itself ("concat"): no linear reader absorbs it."""
    b = Builder(33)
    n = b.layernorm(b.block(b.embed(b.input("ids", graphs.INT64, [2, T]))))
    if kind == "output":
        flat = b.op("Reshape", [n, b.const("shape", np.array([2 * T, D], np.int64))])
        b.output(flat, shape=[2 * T, D])
        b.output(b.op("MatMul", [flat, b.weight("head", (D, VOCAB))]), shape=[2 * T, VOCAB])
    else:
        both = b.op("Concat", [n, b.op("Relu", [n])], axis=-1)
        b.output(b.op("MatMul", [both, b.weight("head", (2 * D, VOCAB))]), shape=[2, T, VOCAB])
    return b.model(17)


@pytest.mark.parametrize("kind", ["output", "concat"])
def test_a_crms_norm_read_through_a_layout_op_no_linear_absorbs_is_decompressed(kind):
    result = fold_model(_final_norm_read_through_a_layout_op(kind), mode="crms")  # verified against float64
    (verdict,) = result.report.compression
    assert verdict.verdict == "compressed" and verdict.decompressions == 1
    assert [n.beta for n in result.report.norms] == ["into the biases of 1 reader(s) (CRMS)",
                                                     "added after the decompression"]


# --- a target that fuses the residual Add with the norm after it: what it must not fuse -------------

def test_a_residual_sum_read_by_two_norms_is_fused_with_one_only_and_folds_exactly():
    result = fold_model(_residual_sum_read_by_two_norms(), target="ort", device="cuda")  # verified against float64
    assert [n.verdict for n in result.report.norms] == ["fold"] * 3
    (stream,) = result.report.streams
    assert len(stream.fused) == 1
    assert [n.op_type for n in result.model.graph.node].count("SkipSimplifiedLayerNormalization") == 1


def test_a_deferred_norm_is_not_fused_with_the_residual_add_before_it():
    result = fold_model(_residual_sum_read_by_two_norms(), target="ort", device="cuda", defer="on")  # verified
    assert all(n.verdict == "fold" and n.deferred for n in result.report.norms)
    assert not any(s.fused for s in result.report.streams)
    assert "SkipSimplifiedLayerNormalization" not in {n.op_type for n in result.model.graph.node}


def test_a_norm_reading_a_residual_sub_is_not_fused_as_an_add():
    b = Builder(26)
    h = b.embed(b.input("ids", graphs.INT64, [2, T]))
    h = b.op("Sub", [h, b.linear(b.op("Relu", [b.linear(b.layernorm(h), D, 2 * D)]), 2 * D, D)])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))]), shape=[2, T, VOCAB])
    result = fold_model(b.model(17), target="ort", device="cuda")  # verified against float64
    assert [n.verdict for n in result.report.norms] == ["fold", "fold"]
    assert not any(s.fused for s in result.report.streams)


def test_a_norm_over_a_feature_axis_that_is_not_last_is_not_fused():
    """Channels first: h = W1 @ x + W2 @ x [2, D, T], a sum of two equal-shaped tensors (a fused kernel's
    shape), normalized over axis 1 by a decomposed LayerNorm; the fused op would normalize axis 2."""
    b = Builder(29)
    x = b.input("x", FLOAT, [2, D, T])
    h = b.op("Add", [b.op("MatMul", [b.weight("W", (D, D), mean=1.0), x]) for _ in range(2)])
    centered = b.op("Sub", [h, b.op("ReduceMean", [h], axes=[1], keepdims=1)])
    var = b.op("ReduceMean", [b.op("Mul", [centered, centered])], axes=[1], keepdims=1)
    normed = b.op("Div", [centered, b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])])])
    y = b.op("Add", [b.op("Mul", [normed, b.weight("gamma", (D, 1), mean=1.0)]), b.weight("beta", (D, 1))])
    b.output(b.op("MatMul", [b.weight("head", (D, D)), y]))
    result = fold_model(b.model(17), target="ort", device="cuda")  # verified against float64
    assert [n.verdict for n in result.report.norms] == ["fold"]
    assert not any(s.fused for s in result.report.streams)


# --- the verification gate without a float64 run --------------------------------------------------

def _outputs(rel_err: float) -> list:
    y = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    return [gate.Output("y", "float32", y, y + np.float32(rel_err))]


def test_without_float64_or_norm_inputs_an_output_beyond_tolerance_fails():
    v = gate.judge(_outputs(1e-3), no_float64="no float64 kernels")
    assert not v.ok and v.criterion == "tolerance"
    assert v.failure.startswith("output y differs from the original's by 0.001 (relative), above 0.0001")
    assert v.failure.endswith("no float64 run of the model was possible (no float64 kernels)")


def test_without_float64_centered_norm_inputs_do_not_excuse_an_error_beyond_loose_tolerance():
    centered = {"ln": np.array([[1.0, -1.0, 2.0, -2.0]]), "empty": np.zeros((0, 4))}
    assert gate.judge(_outputs(5e-4), centered).ok  # within LOOSE x TOLERANCE: the zero-mean criterion
    v = gate.judge(_outputs(5e-3), centered)
    assert not v.ok and v.criterion == "zero-mean norm inputs"
    assert v.failure.endswith(", even 10x that")


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["broadcastable", "not-broadcastable"])
def test_an_output_whose_shape_the_fold_changed_fails_verification(shape):
    y = np.linspace(-1.0, 1.0, 8, dtype=np.float32)
    v = gate.judge([gate.Output("y", "float32", y, y.reshape(shape))])  # the same values, another shape
    assert not v.ok and v.diff == float("inf")


def test_an_empty_norm_input_is_no_evidence_of_an_uncentered_norm():
    assert gate.off_center({"empty": np.zeros((0, 4)), "ln": np.array([[1.0, -1.0]])}, "float32") is None
    assert gate.off_center({"empty": np.zeros((0, 4)), "ln": np.array([[1.0, 3.0]])}, "float32") == ("ln", 2 / 5 ** 0.5)


# --- the approximate swap where nothing folds exactly ---------------------------------------------

def _one_norm_on_a_relu(rows: int = 8):
    """x -> Relu -> LayerNorm -> linear: one norm on a recentered start, which a recenter does not
    pay for (kept), and calibration rows of a large mean."""
    b = Builder(30)
    x = b.input("x", FLOAT, ["batch", T, D])
    b.output(b.op("MatMul", [b.layernorm(b.op("Relu", [x])), b.weight("W", (D, D))]))
    calibration = {"x": np.random.default_rng(0).standard_normal((rows, T, D)).astype(np.float32) + 2}
    return b.model(17), calibration


@pytest.mark.parametrize("verify", [True, False])
def test_the_approximate_swap_of_a_model_with_no_exact_fold_swaps_within_the_budget(verify):
    model, calibration = _one_norm_on_a_relu()
    result = fold_model(model, mode="rms-approx", calibration=calibration, budget=10.0, verify=verify)
    (norm,) = result.report.norms
    assert norm.verdict == "approx" and norm.reason.startswith("swapped to RMSNorm although its input keeps its mean")
    assert result.criterion.startswith("approximate: not verified")
    assert [s.name for s in result.report.approx.swapped] == [norm.name]


@pytest.mark.parametrize("verify", [True, False])
def test_the_approximate_swap_with_no_exact_fold_and_nothing_within_budget_is_a_one_line_error(verify):
    model, calibration = _one_norm_on_a_relu()
    with pytest.raises(NothingToFold, match="^no LayerNorm can be folded, and none swapped within budget 1e-12$"):
        fold_model(model, mode="rms-approx", calibration=calibration, budget=1e-12, verify=verify)


# --- what the user sees: the stages of a fold, and errors in one line, nothing folded --------------

def test_a_fold_reports_its_stages_to_the_progress_callback():
    stages = []
    fold_model(graphs.pre_ln(1), progress=stages.append)
    assert stages == ["analyzing", "editing (2 norms, 5 constants)", "verifying"]


def test_the_angle_of_a_fused_norms_input_is_reported_as_not_measured():
    geometry = analyze_model(_skip_layernorm(), angles=True).geometry
    first, fused = geometry.norms
    assert first.before is not None and first.after is not None and not first.note
    assert fused.before is None and fused.after is None
    assert fused.note == ("its input `SkipLayerNormalization_29/input_skip_bias_sum` is not a tensor the model "
                          "computes by itself (a fused op's part)")
    assert "SkipLayerNormalization_29  fold   before not measured (its input" in geometry.table()


def test_a_seeded_rotation_and_a_given_basis_together_are_refused():
    both = "^a stream is rotated by a seeded Q or projected on a given basis, not both$"
    with pytest.raises(LnfoldError, match=both):
        PlanRequest(rotate="hadamard", bases={})


@pytest.mark.parametrize("fraction", ["a third", None, [0.5]])
def test_a_slice_fraction_that_is_not_a_number_is_a_one_line_error(fraction):
    with pytest.raises(LnfoldError, match=r"^fraction must be a number in \(0, 1\), got "):
        slicing.check_fraction(fraction)


@pytest.mark.parametrize("options", [dict(rotate="hadamard"), dict(gamma_into_readers=True)])
def test_the_approximate_swap_is_not_combined_with_gamma_into_readers_or_a_rotation(options):
    with pytest.raises(LnfoldError, match="^--mode rms-approx is not combined with --gamma-into-readers or --rotate"):
        fold_model(graphs.pre_ln(1), mode="rms-approx", budget=0.1, **options)


def test_an_approximate_swap_of_a_name_that_is_no_layernorm_is_refused():
    view = _view(graphs.pre_ln(1))
    with pytest.raises(LnfoldError, match="^approximate swap: `MatMul_14` is not a LayerNorm of the model$"):
        make_plan(view, PlanRequest(), approx=frozenset({"MatMul_14"}))


def test_a_plot_into_a_directory_that_does_not_exist_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no such dir"
    with pytest.raises(LnfoldError, match=f"^{missing}: output directory does not exist$"):
        geometry_plot.check_path(missing / "angles.svg")
    assert not missing.exists()


def test_slicing_on_calibration_rows_that_are_all_zero_is_a_one_line_error():
    with pytest.raises(LnfoldError, match=r"^no calibration row reached the stream \(all rows zero\)$"):
        slicing.second_moment([np.zeros((2, T, D)), np.zeros((0, T, D))], axis=-1)
