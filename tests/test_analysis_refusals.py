"""Branches of the analysis (passes/analysis.py, rules.py, patterns.py, axes.py, guards.py) that no
other test reached: each small graph reaches one branch that keeps a norm or is no norm, and
checks what is kept and the reason said; where the branch lets a fold through, the fold is checked
against float64 (random γ/β, sources with a large mean, tests/onnx_graphs.py). Then two pieces of
the plan's bookkeeping (passes/shards.py, frozen.py). Every graph is hand-built: milliseconds each
(the first fold of a process imports onnxruntime's symbolic shape inference, about 0.8 s)."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from lnfold.onnx_rewrite import analyze_model, fold_model
from lnfold.passes import gate
from lnfold.passes.edits import Center
from lnfold.passes.frozen import FrozenList
from lnfold.passes.shards import untie

from tests import onnx_graphs as G


def _kept_because(model) -> str:
    """The reason of the graph's one norm, which must be kept."""
    (norm,) = analyze_model(model).norms
    assert norm.verdict == "keep", norm
    return norm.reason


def _folds_exactly(model) -> None:
    """Every norm folds, and the folded model is as close to float64 as the original."""
    res = fold_model(model)
    assert {n.verdict for n in res.report.norms} == {"fold"}, res.report.norms
    assert res.criterion == "float64"
    assert res.exact_err <= 2 * res.original_exact_err + gate.FLOOR["float32"], res.exact_err


def _stream(b: G.Builder, shape=(2, G.T, G.D)) -> str:
    """A biased linear of a graph input: a stream that constant edits can center."""
    return b.linear(b.input("x", G.FLOAT, list(shape)), shape[-1], G.D)


def _c(b: G.Builder, name: str, values) -> str:
    """An int64 constant (shapes, indices, slice bounds)."""
    return b.const(name, np.array(values, np.int64))


# --- norms that are no LayerNorm over one axis -----------------------------------------------------

def test_a_layernorm_whose_mean_output_is_read_is_kept():
    """ONNX LayerNormalization's Mean output is the stream's mean: folding would change it."""
    b = G.Builder(11)
    g, beta = b.affine()
    y, mean, _ = b.op("LayerNormalization", [_stream(b), g, beta], n_out=3, axis=-1, epsilon=1e-5)
    b.output(y)
    b.output(mean)
    assert _kept_because(b.model(17)) == "its mean/variance outputs are used"


# --- a stream reached two ways ----------------------------------------------------------------------

def test_a_stream_added_to_its_own_transpose_is_kept():
    """h + hᵀ: centering h along its features does not center hᵀ along them (a square [D, D])."""
    b = G.Builder(12)
    h = _stream(b, (2, G.D, G.D))
    b.output(b.layernorm(b.op("Add", [h, b.op("Transpose", [h], perm=[0, 2, 1])])))
    assert "is reached with feature axis 2 and 1 (a reshape or transpose mixes the feature axis)" in _kept_because(
        b.model(17))


def test_a_stream_clipped_by_bounds_known_only_at_run_time_is_kept():
    """A Clip is transparent only as an overflow guard: bounds that are graph inputs may clip anything.
    (The Clip reads the graph input itself, whose dtype is known: passes/guards.py judges the bounds.)"""
    b = G.Builder(13)
    lo, hi = b.input("lo", G.FLOAT, []), b.input("hi", G.FLOAT, [])
    x = b.input("x", G.FLOAT, [2, G.T, G.D])
    b.output(b.layernorm(x))
    b.output(b.op("Clip", [x, lo, hi]))
    assert _kept_because(b.model(17)) == "its input `x` is also read by Clip `Clip_6`, whose result depends on the mean"


def test_a_stream_plus_a_number_computed_at_run_time_is_kept():
    """h + mean(x), a scalar: a shift of every row that no constant edit removes (a constant one
    would be centered away), so the sum is a start only a recenter centers, which 1 norm does not pay."""
    b = G.Builder(21)
    x = b.input("x", G.FLOAT, [2, G.T, G.D])
    shift = b.op("ReduceMean", [x], keepdims=0)
    total = b.op("Add", [b.linear(x, G.D, G.D), shift])
    b.output(b.layernorm(total))
    assert _kept_because(b.model(17)) == ("its stream is started by Add `Add_10`, which no weight edit can make "
                                          "zero-mean; 1 recenter(s) would buy only 1 fold(s)")

@pytest.mark.parametrize("reader", ["Mul", "Div"])
def test_a_stream_squared_or_divided_into_is_kept(reader):
    """h · h and 1 / h: a product of the stream with itself, a quotient by it, see its mean."""
    b = G.Builder(22)
    h = _stream(b)
    b.output(b.layernorm(h))
    b.output(b.op(reader, [h, h] if reader == "Mul" else [b.const("one", np.array(1.0, np.float32)), h]))
    reason = _kept_because(b.model(17))
    assert f"is also read by {reader} `" in reason and reason.endswith(", whose result depends on the mean"), reason

def test_a_norm_over_features_gathered_from_the_stream_is_kept():
    """LN(h[..., [0, 2, 5, 7]]): centering h over all its features does not center four of them."""
    b = G.Builder(24)
    h = _stream(b)
    b.output(b.layernorm(b.op("Gather", [h, _c(b, "some", [0, 2, 5, 7])], axis=2), d=4))
    assert _kept_because(b.model(17)).startswith("its stream is started by Gather `Gather_9`, which no weight edit ")

# --- a stream centered per head (the input of per-head q/k norms) ---------------------------------------

def _per_head_norm(reader: str):
    """q = linear(x), its 2 heads of D/2 normalized each; `reader` also reads q, flat."""
    b = G.Builder(14)
    q = _stream(b)
    heads = b.op("Reshape", [q, b.const("shape", np.array([2, G.T, 2, G.D // 2], np.int64))])
    b.output(b.layernorm(heads, d=G.D // 2))
    if reader == "output":
        b.output(q)
    elif reader == "Shape":
        b.output(b.op("Shape", [q]), elem=G.INT64)
    elif reader == "MatMul":
        b.output(b.op("MatMul", [q, b.weight("head", (G.D, G.D))]))
    else:
        b.output(b.op(reader, [q]))
    return b.model(17)


@pytest.mark.parametrize("reader,why", [
    ("Relu", "no rule for op `Relu`"),
    ("MatMul", "it would see the per-block means"),
])
def test_a_per_head_stream_read_whole_is_kept(reader, why):
    reason = _kept_because(_per_head_norm(reader))
    assert "which is centered per block of 4 along axis 2, and" in reason, reason
    assert f"reads it otherwise than per block ({why})" in reason, reason


def test_a_per_head_stream_that_is_a_graph_output_is_kept():
    reason = _kept_because(_per_head_norm("output"))
    assert reason.endswith("which is a graph output (the model's output would see the mean)"), reason


def test_a_per_head_stream_read_only_for_its_shape_folds_exactly():
    """Shape reads no values: it blocks nothing (and the fold is exact)."""
    _folds_exactly(_per_head_norm("Shape"))


# --- LayerScale: a per-channel factor folded into the sources behind it, where it can be -------------

def _layer_scaled(source: str, op: str = "Mul"):
    """ids -> embedding h -> h + y(LN(h)) · ls (or / ls) -> LN -> head, y one of the sources below."""
    b = G.Builder(17)
    h = b.embed(b.input("ids", G.INT64, [2, G.T]))
    n = b.layernorm(h)
    if source == "linear":
        y = b.linear(n, G.D, G.D)
    elif source == "half of a Split":  # the writer has two outputs: scaling its weights scales both
        y = b.op("Split", [b.linear(n, G.D, 2 * G.D)], n_out=2, axis=-1)[0]
    elif source == "a bias per row":  # [T, 1]: one number per token, no channel to scale
        y = b.op("Add", [b.op("MatMul", [n, b.weight("W", (G.D, G.D))]), b.weight("row_bias", (G.T, 1), mean=5.0)])
    s = b.op(op, [y, b.weight("ls", (G.D,), mean=0.5)])
    b.output(b.op("MatMul", [b.layernorm(b.op("Add", [h, s])), b.weight("head", (G.D, G.VOCAB))]))
    return b.model(17)


@pytest.mark.parametrize("source,op,scaled", [
    ("linear", "Mul", True),
    ("linear", "Div", False),  # y / ls: not the product that LayerScale's fold scales the weights by
    ("half of a Split", "Mul", False),
    ("a bias per row", "Mul", False),
])
def test_a_layer_scale_folds_into_its_sources_only_where_they_can_hold_it(source, op, scaled):
    """Where the factor cannot go into the sources, the stream is recentered instead: exact either way.
    Regression: a [T, 1] bias behind the factor crashed the fold (weights.scale: "cannot fold a
    per-channel scale into a tensor constant along channels"), in both frontends."""
    model = _layer_scaled(source, op)
    report = analyze_model(model)
    assert [bool(s.scaled) for s in report.streams] == [scaled] and report.recentered == (0 if scaled else 1)
    _folds_exactly(model)


# --- per-head runs in part of a fused projection ----------------------------------------------------

def test_per_head_runs_on_a_fused_projection_whose_width_is_no_multiple_of_them_are_kept():
    """q = qkv[..., :8] of a 19-wide projection, in heads of 4: the edit centers runs of 4 along
    the whole projection axis, which 19 entries do not tile."""
    b = G.Builder(18)
    qkv = b.linear(b.input("x", G.FLOAT, [2, G.T, G.D]), G.D, 19)
    q = b.op("Slice", [qkv, _c(b, "starts", [0]), _c(b, "ends", [8]), _c(b, "axes", [2])])
    b.output(b.layernorm(b.op("Reshape", [q, _c(b, "shape", [2, G.T, 2, 4])]), d=4))
    b.output(b.op("Relu", [b.op("Slice", [qkv, _c(b, "s", [8]), _c(b, "e", [19]), _c(b, "a", [2])])]))
    reason = _kept_because(b.model(17))
    assert reason.endswith("which would be centered per block of 4 along axis 2, whose size 19 is not a multiple of it")



# --- a LayerNorm written out op by op: chains that almost are one are no norm (a swap would change them) ----

def _decomposed(variant: str = ""):
    """x = linear(input); d = x - mean(x); y = d / sqrt(mean(d²) + eps) · γ + β, every value named
    after what it is; `variant` changes one op or adds one reader (a near miss, or another form)."""
    b = G.Builder(20)
    x = b.linear(b.input("input", G.FLOAT, [2, G.T, G.D]), G.D, G.D)
    ops = {  # name: (op, inputs, attributes)
        "mean": ("ReduceMean", [x], dict(axes=[-1], keepdims=1)),
        "d": ("Sub", [x, "mean"], {}),
        "square": ("Mul", ["d", "d"], {}),
        "var": ("ReduceMean", ["square"], dict(axes=[-1], keepdims=1)),
        "var_eps": ("Add", ["var", b.const("eps", np.array(1e-5, np.float32))], {}),
        "std": ("Sqrt", ["var_eps"], {}),
        "normed": ("Div", ["d", "std"], {}),
    }
    if variant == "times a reciprocal":
        ops["inv_std"] = ("Reciprocal", ["std"], {})
        ops["normed"] = ("Mul", ["d", "inv_std"], {})
    elif variant == "times the std":
        ops["normed"] = ("Mul", ["d", "std"], {})
    elif variant == "not divided":
        ops["normed"] = ("Add", ["d", "std"], {})
    for name, (op, inputs, attrs) in ops.items():
        b.nodes.append(G.helper.make_node(op, inputs, [name], name=name, **attrs))
    g, beta = b.affine()
    b.output(b.op("Add", [b.op("Mul", ["normed", g]), beta]))
    if variant.startswith("output "):  # "output d": one more graph output
        b.output(variant.split()[1])
    elif variant.startswith("Relu "):  # "Relu d": one more reader
        b.output(b.op("Relu", [variant.split()[1]]))
    return b.model(17)


@pytest.mark.parametrize("variant,why", [
    ("output d", "the centered value `d` is a model output"),
    ("Relu d", "the centered value `d` is read by Mul `square`, Div `normed`, Relu `Relu_15`: expected only its square "
               "and the division by the standard deviation"),
    ("not divided", "the centered value is read by Add `normed` where a division by the standard deviation is "
                    "expected"),
    ("Relu square", "the square `square` is read by ReduceMean `var`, Relu `Relu_15`, not by one mean (the variance)"),
    ("Relu var_eps", "the variance `var_eps` is read by Sqrt `std`, Relu `Relu_15`, not by one square root"),
    ("times the std", "Mul `normed` multiplies the centered value, and the standard deviation `std` is read by "
                      "Mul `normed`, not by one reciprocal"),
    ("output std", "the standard deviation `std` is also read by Div `normed`, the model's output"),
])
def test_a_chain_that_almost_is_a_layernorm_is_no_norm_and_says_why(variant, why):
    report = analyze_model(_decomposed(variant))
    assert report.norms == [] and [(m.name, m.reason) for m in report.near_misses] == [("mean", why)]


def test_a_layernorm_written_with_a_reciprocal_of_the_std_folds_exactly():
    """d * (1 / sqrt(v)): the same norm as d / sqrt(v)."""
    model = _decomposed("times a reciprocal")
    assert [(n.name, n.verdict) for n in analyze_model(model).norms] == [("mean", "fold")]
    _folds_exactly(model)


# --- a checkpoint's tied tensors, and a final plan's lists ---------------------------------------------

def test_tied_tensors_that_all_take_the_same_edit_stay_one_tensor():
    """A tied embedding and lm_head both centered along axis 1: the stored tensor is edited once,
    in place; no member is untied, no tensor is added to the checkpoint."""
    center = (Center(1),)
    in_place, new, untied = untie([["embed", "head"]], {"embed": "embed", "head": "embed"},
                                  {"embed": center, "head": center})
    assert (in_place, new, untied) == ({"embed": center}, [], [])


def test_a_final_plans_list_copies_pickles_and_hashes_whole_and_stays_final():
    edits = FrozenList([Center(0), Center(1)])
    for copied in (copy.deepcopy(edits), pickle.loads(pickle.dumps(edits))):
        assert type(copied) is FrozenList and copied == edits and hash(copied) == hash(edits)
        with pytest.raises(TypeError, match="a plan is final"):
            copied.append(Center(2))
