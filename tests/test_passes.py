"""passes/ on its own: hand-built views, no frontend (neither onnx nor torch is imported).

Each test builds a small graph in the vocabulary of passes/rules.py and checks the plan's exact
edits and the report's verdicts; the Pre-LN and LayerScale blocks also run the plan's constants
through numpy and check that the centered stream is zero-mean and the RMSNorm model computes what
the LayerNorm model did.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lnfold.passes import View, compute_constants, make_plan
from lnfold.passes.plan import AddWeightTimes, Center, ConstEdit, FoldDecompression, Identity, Ones, Project, Recenter, Scale
from lnfold.passes.rules import rule

B, T, D, V, H = 2, 5, 8, 11, 16


def _embed(v: View) -> str:
    """ids -> table lookup + a position table: the stream's first tensor `h0` [B, T, D]."""
    v.input("ids", (B, T))
    v.const("wte", (V, D))
    v.const("wpe", (T, D))
    v.add("emb", "Gather", rule("embedding", table=0, q=2), ["wte", "ids"], {"e": (B, T, D)})
    v.add("add_pos", "Add", rule("broadcast", data=[0, 1]), ["e", "wpe"], {"h0": (B, T, D)})
    return "h0"


def _ln(v: View, name: str, x: str, width: int = D) -> str:
    v.const(f"{name}.g", (width,))
    v.const(f"{name}.b", (width,))
    shape = v.values[x].shape
    v.add(name, "LayerNormalization", rule("layer_norm", axes=[-1], gamma=1, beta=2, eps=1e-5),
          [x, f"{name}.g", f"{name}.b"], {f"{name}.y": shape})
    return f"{name}.y"


def _linear(v: View, name: str, x: str, d_in: int, d_out: int, bias: bool = True) -> str:
    """x @ W.T + b with W [d_out, d_in] (torch's layout)."""
    v.const(f"{name}.W", (d_out, d_in))
    ins = [x, f"{name}.W"]
    if bias:
        v.const(f"{name}.bias", (d_out,))
        ins.append(f"{name}.bias")
    shape = v.values[x].shape[:-1] + (d_out,)
    v.add(name, "Linear", rule("linear", weight=1, w_axis=0, bias=2 if bias else None, data=0), ins,
          {f"{name}.y": shape})
    return f"{name}.y"


def _mlp_block(v: View, h: str, layer_scale: bool = False) -> str:
    """Pre-LN: h + fc2(relu(fc1(ln(h)))) [* ls]."""
    a = _linear(v, "fc1", _ln(v, "ln1", h), D, H)
    v.add("relu", "Relu", None, [a], {"r": (B, T, H)})  # not on the stream: no rule needed
    o = _linear(v, "fc2", "r", H, D)
    if layer_scale:
        v.const("ls", (D,))
        v.add("mul_ls", "Mul", rule("scale", operands=[0, 1]), [o, "ls"], {"o_scaled": (B, T, D)})
        o = "o_scaled"
    v.add("residual", "Add", rule("broadcast", data=[0, 1]), [h, o], {"h1": (B, T, D)})
    return "h1"


def pre_ln(layer_scale: bool = False) -> View:
    v = View()
    h1 = _mlp_block(v, _embed(v), layer_scale)
    v.output(_ln(v, "ln_f", h1))
    return v


def _plan_edits(plan) -> dict[str, ConstEdit]:
    return {e.value: e for e in plan.const_edits}


def _verdicts(plan) -> dict[str, tuple]:
    return {n.name: (n.verdict, n.recentered) for n in plan.report.norms}


# --- numpy: the plan's constants on a model that matches the hand-built views ------------------

def _arrays(view: View, seed: int = 0) -> dict[str, np.ndarray]:
    """Random constants with a large mean (a fold that skips centering is far off), γ/β random."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(3.0, 1.0, v.shape) for name, v in view.values.items() if v.is_const}


def _layer_norm(x, g, b, center=True):
    if center:
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g + b


def _forward(c: dict, ids: np.ndarray, center: bool, layer_scale: bool, ln1_beta: bool = True):
    """pre_ln() in numpy: (the residual stream h0, h1, the output); `center` False: RMSNorms;
    `ln1_beta` False: ln1's β went into fc1's bias."""
    h0 = c["wte"][ids] + c["wpe"]
    b1 = c["ln1.b"] if ln1_beta else 0.0
    r = np.maximum(_layer_norm(h0, c["ln1.g"], b1, center) @ c["fc1.W"].T + c["fc1.bias"], 0)
    o = r @ c["fc2.W"].T + c["fc2.bias"]
    h1 = h0 + (o * c["ls"] if layer_scale else o)
    return h0, h1, _layer_norm(h1, c["ln_f.g"], c["ln_f.b"], center)


def _check_numerics(view: View, plan, layer_scale: bool) -> None:
    consts = _arrays(view)
    folded = dict(consts)
    for edit, arr in compute_constants(plan.const_edits, consts.__getitem__):
        folded[edit.value] = arr
    ids = np.random.default_rng(1).integers(0, V, (B, T))
    h0, h1, want = _forward(consts, ids, True, layer_scale)
    assert abs(h0.mean(-1)).max() > 1  # the test can fail: the stream starts far from zero-mean
    f0, f1, got = _forward(folded, ids, False, layer_scale, plan.emissions["ln1"].beta_add)
    assert abs(f0.mean(-1)).max() < 1e-9 and abs(f1.mean(-1)).max() < 1e-9
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


# --- views as data -------------------------------------------------------------------------------

def test_view_prints_compares_and_diffs_as_data():
    a, b = pre_ln(), pre_ln()
    assert a == b and str(a) == str(b)
    text = a.dump()
    assert "ids[2, 5] input" in text.splitlines()
    assert "emb = Gather[embedding table=0 q=2](wte[11, 8], ids) -> e[2, 5, 8]" in text
    assert "ln_f = LayerNormalization[layer_norm axes=[-1] gamma=1 beta=2 eps=1e-05]" in text
    assert "ln_f.y[2, 5, 8] output" in text
    assert "relu = Relu(fc1.y) -> r[2, 5, 16]" in text
    assert "<function" not in repr(a.nodes["fc1"]) and "<function" not in text
    b.values["wpe"].shape = (1, T, D)
    b.changed()
    assert a != b
    assert a.diff(b) and any(line.startswith("+wpe[1, 5, 8] const") for line in a.diff(b))


def test_answers_come_from_the_rule_without_a_frontend():
    v = pre_ln()
    emb, lin, ln = v.nodes["emb"], v.nodes["fc1"], v.nodes["ln_f"]
    (ref,) = emb.centering(0, 2)
    assert (ref.value, ref.axis, ref.user, ref.user_input) == ("wte", 1, "emb", 0)
    assert lin.linear(0, 2).weight.axis == 1 and lin.linear(0, 2).bias.value == "fc1.bias"
    assert v.nodes["add_pos"].transfer(0, 2) == [(0, 2)]
    assert ln.norm.axis == 2 and ln.norm.gamma == "ln_f.g" and ln.norm.epsilon == 1e-5
    assert v.nodes["relu"].transfer(0, 2) is None and v.nodes["relu"].norm is None


# --- folds ---------------------------------------------------------------------------------------

def test_pre_ln_block_folds_with_its_sources_centered():
    v = pre_ln()
    plan = make_plan(v)
    assert _verdicts(plan) == {"ln1": ("fold", False), "ln_f": ("fold", False)}
    assert plan.swaps == ["ln1", "ln_f"] and plan.recenters == []
    assert sorted(plan.const_edits, key=lambda e: e.value) == [
        ConstEdit("fc1.bias", (AddWeightTimes("fc1.W", 1, "ln1.b"),), [("fc1", 2)], False),  # β into fc1
        ConstEdit("fc2.W", (Center(0),), [("fc2", 1)], False),
        ConstEdit("fc2.bias", (Center(0),), [("fc2", 2)], False),
        ConstEdit("wpe", (Center(1),), [("add_pos", 1)], False),
        ConstEdit("wte", (Center(1),), [("emb", 0)], False),
    ]
    _check_numerics(v, plan, layer_scale=False)


def test_post_ln_block_is_kept_naming_the_linear_reader():
    v = View()
    h0 = _embed(v)
    o = _linear(v, "fc", h0, D, D)  # reads the stream itself, not a norm of it
    v.add("residual", "Add", rule("broadcast", data=[0, 1]), [h0, o], {"h1": (B, T, D)})
    v.output(_ln(v, "ln", "h1"))
    plan = make_plan(v)
    (n,) = plan.report.norms
    assert n.verdict == "keep" and "`h0`" in n.reason and "Linear `fc`" in n.reason
    assert plan.const_edits == [] and plan.swaps == []


def test_layer_scale_is_folded_into_its_sources():
    v = pre_ln(layer_scale=True)
    plan = make_plan(v)
    assert _verdicts(plan) == {"ln1": ("fold", False), "ln_f": ("fold", False)}
    edits = _plan_edits(plan)
    assert edits["fc2.W"] == ConstEdit("fc2.W", (Scale("ls", 0, 0), Center(0)), [("fc2", 1)], False)
    assert edits["fc2.bias"] == ConstEdit("fc2.bias", (Scale("ls", 0, 0), Center(0)), [("fc2", 2)], False)
    assert edits["ls"] == ConstEdit("ls", (Ones(),), [("mul_ls", 1)], False)
    assert plan.report.streams[0].scaled == ["`ls` (Mul `mul_ls`)"]
    _check_numerics(v, plan, layer_scale=True)


def test_tied_embedding_and_head_clone_the_table():
    v = pre_ln()
    v.values["ln_f.y"].is_graph_output = False  # read by the head instead
    v.add("head", "Linear", rule("linear", weight=1, w_axis=0, data=0), ["ln_f.y", "wte"], {"logits": (B, T, V)})
    v.output("logits")
    plan = make_plan(v)
    assert _verdicts(plan) == {"ln1": ("fold", False), "ln_f": ("fold", False)}
    edits = _plan_edits(plan)
    assert edits["wte"] == ConstEdit("wte", (Center(1),), [("emb", 0)], True)  # the head keeps the original
    assert not edits["wpe"].clone and not edits["fc2.W"].clone
    assert plan.report.streams[0].cloned == ["`wte`: also read by Linear `head`, which keeps the original"]


def test_graph_input_stream_is_recentered():
    v = View()
    v.input("x", (B, T, D))
    v.add("copy", "Identity", rule("elementwise", op="identity"), ["x"], {"h0": (B, T, D)})
    h1 = _mlp_block(v, "h0")
    v.output(_ln(v, "ln_f", h1))
    plan = make_plan(v)
    assert _verdicts(plan) == {"ln1": ("fold", True), "ln_f": ("fold", True)}
    assert plan.recenters == [Recenter("x", 2)]
    assert plan.report.streams[0].recentered == ["graph input `x`"]
    assert {e.value for e in plan.const_edits} == {"fc2.W", "fc2.bias", "fc1.bias"}  # (ln1's β into fc1.bias)


def test_a_lone_graph_input_norm_does_not_pay_a_recenter():
    v = View()
    v.input("x", (B, T, D))
    v.output(_ln(v, "ln", "x"))
    plan = make_plan(v)
    (n,) = plan.report.norms
    assert n.verdict == "keep" and "graph input `x`" in n.reason and plan.recenters == []


def test_unknown_op_blocks_with_a_reason():
    v = pre_ln()
    v.add("mystery", "FancyOp", None, ["h0"], {"m": (B, T, D)})  # an op no rule describes
    v.output("m")
    plan = make_plan(v)
    assert {n.verdict for n in plan.report.norms} == {"keep"}
    for n in plan.report.norms:
        assert "FancyOp `mystery`" in n.reason and "`h0`" in n.reason
    assert plan.const_edits == [] and plan.swaps == []


# --- per-head q/k norms ---------------------------------------------------------------------------

def test_reshape_to_heads_is_carried_by_blocks():
    """q = x Wq + bq, reshaped to (heads, head_dim), normalized over head_dim: Wq and bq are
    centered per run of head_dim output rows, the reshape mapping head_dim to blocks."""
    v = View()
    v.input("x", (B, T, D))
    q = _linear(v, "q_proj", "x", D, D)
    v.add("split_heads", "Reshape", rule("reshape", data=0), [q], {"q4": (B, T, 2, 4)})
    v.output(_ln(v, "q_norm", "q4", width=4))
    plan = make_plan(v)
    assert _verdicts(plan) == {"q_norm": ("fold", False)}
    assert sorted(plan.const_edits, key=lambda e: e.value) == [
        ConstEdit("q_proj.W", (Center(0, 4),), [("q_proj", 1)], False),
        ConstEdit("q_proj.bias", (Center(0, 4),), [("q_proj", 2)], False),
    ]
    consts = _arrays(v)
    for edit, arr in compute_constants(plan.const_edits, consts.__getitem__):
        consts[edit.value] = arr
    x = np.random.default_rng(2).normal(5.0, 1.0, (B, T, D))
    q4 = (x @ consts["q_proj.W"].T + consts["q_proj.bias"]).reshape(B, T, 2, 4)
    assert abs(q4.mean(-1)).max() < 1e-9  # every head zero-mean: its RMSNorm is its LayerNorm


def test_fused_qkv_centers_the_q_and_k_rows_per_head():
    """One q/k/v projection split in three: q's rows [0, 8) and k's [8, 16) are centered per
    head, v's rows [16, 24) are left alone."""
    v = View()
    v.input("x", (B, T, D))
    qkv = _linear(v, "qkv", "x", D, 3 * D)
    v.add("split", "Split", rule("along", data=[0], outs=[0, 1, 2], axes=[2], partition=True), [qkv],
          {"q": (B, T, D), "k": (B, T, D), "v": (B, T, D)})
    v.output("v")
    for name in ("q", "k"):
        v.add(f"{name}_heads", "Reshape", rule("reshape", data=0), [name], {f"{name}4": (B, T, 2, 4)})
        v.output(_ln(v, f"{name}_norm", f"{name}4", width=4))
    plan = make_plan(v)
    assert _verdicts(plan) == {"q_norm": ("fold", False), "k_norm": ("fold", False)}
    assert sorted(plan.const_edits, key=lambda e: e.value) == [
        ConstEdit("qkv.W", (Center(0, 4, 0, 8), Center(0, 4, 8, 16)), [("qkv", 1)], False),
        ConstEdit("qkv.bias", (Center(0, 4, 0, 8), Center(0, 4, 8, 16)), [("qkv", 2)], False),
    ]
    consts = _arrays(v)
    w0 = consts["qkv.W"].copy()
    for edit, arr in compute_constants(plan.const_edits, consts.__getitem__):
        consts[edit.value] = arr
    np.testing.assert_array_equal(consts["qkv.W"][16:], w0[16:])  # v untouched
    assert abs(consts["qkv.W"][:16].reshape(4, 4, D).mean(1)).max() < 1e-12


def test_if_branch_ops_answer_only_what_the_branch_emitter_applies():
    """`in_branch` (onnx_rewrite/subgraphs.py's inlined If branches): the stream is followed and
    sources centered, but no linear reads (deferral, CRMS) and no per-block centering."""
    v = View()
    v.input("x", (B, T, D))
    v.const("W", (D, D))
    v.add("fc", "MatMul", rule("in_branch", op=rule("linear", weight=1, w_axis=1, data=0)), ["x", "W"],
          {"y": (B, T, D)})
    v.add("heads", "Reshape", rule("in_branch", op=rule("reshape", data=0)), ["y"], {"y4": (B, T, 2, 4)})
    fc, heads = v.nodes["fc"], v.nodes["heads"]
    assert [r.value for r in fc.centering(0, 2)] == ["W"] and fc.linear(0, 2) is None
    assert not fc.block_centering and heads.backward_block(0, 3, None) is None and not heads.layout
    assert "fc = MatMul[in_branch op=(linear weight=1 w_axis=1 data=0)](x, W[8, 8]) -> y[2, 5, 8]" in v.dump()
    plain = View()
    plain.input("x", (B, T, D))
    plain.const("W", (D, D))
    plain.add("fc", "MatMul", rule("linear", weight=1, w_axis=1, data=0), ["x", "W"], {"y": (B, T, D)})
    assert plain.nodes["fc"].linear(0, 2) is not None and plain.nodes["fc"].block_centering


# --- CRMSNorm -------------------------------------------------------------------------------------

def _crms_view(width) -> View:
    """Pre-LN block with a linear head: every norm is read by linear layers only."""
    v = View()
    v.input("ids", (B, T))
    v.const("wte", (V, width))
    v.add("emb", "Gather", rule("embedding", table=0, q=2), ["wte", "ids"], {"h0": (B, T, width)})
    v.const("ln1.g", (width,))
    v.const("ln1.b", (width,))
    v.add("ln1", "LayerNormalization", rule("layer_norm", axes=[-1], gamma=1, beta=2, eps=1e-5),
          ["h0", "ln1.g", "ln1.b"], {"n1": (B, T, width)})
    v.const("fc.W", (width, width))
    v.const("fc.bias", (width,))
    v.add("fc", "Linear", rule("linear", weight=1, w_axis=0, bias=2, data=0), ["n1", "fc.W", "fc.bias"],
          {"o": (B, T, width)})
    v.add("residual", "Add", rule("broadcast", data=[0, 1]), ["h0", "o"], {"h1": (B, T, width)})
    v.const("ln_f.g", (width,))
    v.add("ln_f", "LayerNormalization", rule("layer_norm", axes=[-1], gamma=1, eps=1e-5), ["h1", "ln_f.g"],
          {"n2": (B, T, width)})
    v.const("head.W", (V, width))
    v.add("head", "Linear", rule("linear", weight=1, w_axis=0, data=0), ["n2", "head.W"], {"logits": (B, T, V)})
    v.output("logits")
    return v


def test_crms_compresses_a_static_width_to_d_minus_1():
    plan = make_plan(_crms_view(D), mode="crms")
    (c,) = plan.report.compression
    assert (c.verdict, c.width, c.decompressions) == ("compressed", D, 0)
    edits = _plan_edits(plan)
    drop = lambda axis: Project(axis, Identity(D), D - 1)  # noqa: E731  (keep the first d-1 features)
    assert edits["wte"].ops == (Center(1), drop(1))
    assert edits["fc.W"].ops == (Scale("ln1.g", 0, 1), FoldDecompression(1), Center(0), drop(0))
    assert edits["fc.bias"].ops == (AddWeightTimes("fc.W", 1, "ln1.b"), Center(0), drop(0))
    assert edits["head.W"].ops == (Scale("ln_f.g", 0, 1), FoldDecompression(1))  # no β, no bias
    assert plan.new_biases == []


def test_crms_falls_back_to_rms_on_a_symbolic_width():
    plan = make_plan(_crms_view("d_model"), mode="crms")
    (c,) = plan.report.compression
    assert c.verdict == "rms" and "LayerNormalization `ln1`" in c.reason and "not static" in c.reason
    assert _verdicts(plan) == {"ln1": ("fold", False), "ln_f": ("fold", False)}
    assert {e.value: e.ops for e in plan.const_edits} == {"wte": (Center(1),), "fc.W": (Center(0),),
                                                          "fc.bias": (Center(0),)}



def test_crms_norms_are_not_deferred_and_say_why():
    """A compressed norm's readers already absorb γ, β and the decompression: deferral gives
    that as its reason (it said their weights were edited because they write into a stream)."""
    from lnfold.passes.defer import plan_deferral

    v = _crms_view(D)
    plan = make_plan(v, mode="crms")
    decision = plan_deferral(v, plan, "on")
    assert decision.deferred == []
    assert decision.reasons == {n: "it is emitted as CRMSNorm (mode crms)" for n in ("ln1", "ln_f")}
    rms = make_plan(_crms_view(D))  # the same view in mode rms: ln_f's head is deferrable
    assert [d.norm for d in plan_deferral(v, rms, "on").deferred] == ["ln_f"]

# --- no frontend ----------------------------------------------------------------------------------

def test_runs_without_onnx_or_torch():
    """Every other test of this module, in a fresh interpreter: neither onnx nor torch is loaded."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_passes as t\n"
        "tests = [f for n, f in vars(t).items() if n.startswith('test_') and n != 'test_runs_without_onnx_or_torch']\n"
        "for f in tests:\n"
        "    f()\n"
        "loaded = [m for m in ('onnx', 'torch', 'onnx_graphsurgeon', 'onnxruntime') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print(len(tests))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 12


def _fake_slices(error, deletes=True):
    """A slicer attempt over no frontend: fraction -> (a stand-in fold, a report with `error(F)`)."""
    from types import SimpleNamespace

    from lnfold.passes.slicing import SliceReport

    def attempt(f):
        streams = [SimpleNamespace(sliced=True, keep=8 - int(deletes), dim=8)]
        return f"fold at {f}", SliceReport(f, streams, 100, 90, error=error(f))
    return attempt


def test_budget_search_takes_the_largest_fraction_within_by_bisection():
    from lnfold.passes import slicer

    fold, report = slicer._largest_within(_fake_slices(lambda f: f / 10), 0.0301, "2 rows")
    assert fold == "fold at 0.3" and report.fraction == 0.3
    (note,) = report.notes
    assert "F=0.3 is the largest fraction" in note and note.count("F=") <= 1 + 8  # ceil(log2 39) + 2 tried


def test_budget_search_that_deletes_nothing_is_a_one_line_error():
    """Every fraction within the budget, none deleting a feature: the error names the largest (it
    raised KeyError: the fraction past the grid was never tried)."""
    from lnfold.passes import LnfoldError, slicer

    with pytest.raises(LnfoldError, match=r"no slicing that deletes a feature .* \(F=0.975 gives 0.000e\+00"):
        slicer._largest_within(_fake_slices(lambda f: 0.0, deletes=False), 0.1, "2 rows")
    with pytest.raises(LnfoldError, match=r"F=0.025 gives 1.000e\+00"):
        slicer._largest_within(_fake_slices(lambda f: 1.0), 0.1, "2 rows")
