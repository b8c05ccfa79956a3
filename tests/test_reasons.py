"""Reasons a person can act on (issues 15 and 16): every kept norm says why in plain words, naming
its own input and the first reader that blocks it; every blocker is in the JSON; op chains that
almost are a LayerNorm are reported with why they are not; ops without a rule say so; the table
stays aligned with long names; a folded model's report lists its RMSNorms."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lnfold.onnx_rewrite import analyze_model, fold_model
from lnfold.passes.report import NormVerdict, Report

B, T, D = 2, 5, 8


def _lnfold(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lnfold", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _model(nodes, inits, inputs, outputs, domains=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    ops = [helper.make_opsetid("", 18)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(g, opset_imports=ops, ir_version=10)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, D])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)


# --- kept norms: the BERT case of issue 16 -------------------------------------------------------

def _norm_inputs(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.input[0] for n in model.graph.node if n.op_type == "LayerNormalization"}


def test_bert_post_ln_reason_names_the_norms_own_input_and_the_linear_reader(zoo_onnx):
    """Issue 16's BERT case: the reason named the *previous* norm's output as if it were the
    norm's, said "not shift-invariant" and nothing about Post-LN."""
    _, _, model = zoo_onnx("bert")
    inputs = _norm_inputs(model)
    report = analyze_model(model)
    kept = [n for n in report.norms if n.verdict == "keep"]
    assert len(kept) == 4
    for n in kept:
        own = inputs[n.name]
        assert n.reason.startswith(f"its input `{own}`"), n.reason
        # the blocker: the previous norm's output, read by a MatMul of a linear layer
        assert re.search(r"\(from LayerNormalization `[^`]+`\), which is also read by MatMul `[^`]+` "
                         r"\(a linear layer, which sees the mean\)", n.reason), n.reason
        assert "a Post-LN block: the stream is read by a linear layer (expected, not a defect)" in n.reason
        assert "shift-invariant" not in n.reason


def test_json_lists_every_blocker_by_its_full_name(zoo_onnx, tmp_path):
    """`report --json` and `fold --json` carry every blocking reader, not "(and 2 more)"."""
    _, _, model = zoo_onnx("bert")
    src = tmp_path / "bert.onnx"
    onnx.save(model, src)
    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    r = _lnfold("report", str(src), "--json")
    assert r.returncode == 0, r.stderr
    f = _lnfold("fold", str(src), "-o", str(tmp_path / "out.onnx"), "--json", "--no-verify")
    assert f.returncode == 0, f.stderr
    for doc in (json.loads(r.stdout), json.loads(f.stdout)["report"]):
        kept = [n for n in doc["norms"] if n["verdict"] == "keep"]
        for n in kept:
            readers = [re.search(r"read by MatMul `([^`]+)`", b)[1] for b in n["blockers"]]
            assert readers and set(readers) <= matmuls, n["blockers"]
            assert not any("more" in b for b in n["blockers"])
            more = len(n["blockers"]) - 1
            assert (f"(+{more} more, all in the JSON report)" in n["reason"]) == (more > 0), n["reason"]
        # after attention, q, k and v all read the previous norm's output: three blockers
        assert sum(len(n["blockers"]) == 3 for n in kept) == 2, [n["blockers"] for n in kept]


# --- near misses -----------------------------------------------------------------------------------

def _torch_form(kind: str) -> onnx.ModelProto:
    """mean, x - mean, (x - mean)², mean, + eps, sqrt, divide, · γ: a LayerNorm, spoiled by `kind`."""
    axes = [1, 2] if kind == "two_axes" else [-1]
    inits = [_const("axes", axes, np.int64), _const("var_axes", [1, 2] if kind == "var_axes" else axes, np.int64),
             _const("two", 2.0), _const("eps", 1e-5), _const("gamma", np.linspace(0.5, 1.5, D))]
    inputs = [X]
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["u"], name="mean", keepdims=1),
             helper.make_node("Sub", ["x", "u"], ["d"], name="center"),
             helper.make_node("Pow", ["x" if kind == "uncentered" else "d", "two"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq", "var_axes"], ["v"], name="variance", keepdims=1)]
    if kind == "eps_input":  # the eps is a model input: no constant
        inputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, [1]))
    nodes += [helper.make_node("Add", ["v", "e" if kind == "eps_input" else "eps"], ["ve"], name="plus_eps"),
              helper.make_node("Sqrt", ["ve"], ["s"], name="std"),
              helper.make_node("Div", ["d", "s"], ["n"], name="normalize"),
              helper.make_node("Mul", ["n", "gamma"], ["y"], name="scale")]
    return _model(nodes, inits, inputs, [Y])


def _keras_form(gamma_shape: tuple) -> onnx.ModelProto:
    """tf2onnx's Keras LayerNorm (norm_variants.py), its γ of `gamma_shape`."""
    rng = np.random.default_rng(0)
    inits = [_const("axes", [-1], np.int64), _const("eps", 1e-3), _const("gamma", 1 + rng.random(gamma_shape)),
             _const("beta", rng.random(D))]
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mu"], name="mean", keepdims=1),
             helper.make_node("Neg", ["mu"], ["negmu"], name="neg"),
             helper.make_node("Sub", ["x", "mu"], ["d"], name="center"),
             helper.make_node("Mul", ["d", "d"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["var"], name="variance", keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="plus_eps"),
             helper.make_node("Sqrt", ["ve"], ["s"], name="std"),
             helper.make_node("Reciprocal", ["s"], ["inv"], name="inv"),
             helper.make_node("Mul", ["inv", "gamma"], ["ig"], name="gamma_mul"),
             helper.make_node("Mul", ["x", "ig"], ["a"], name="x_scaled"),
             helper.make_node("Mul", ["negmu", "ig"], ["b"], name="shift"),
             helper.make_node("Add", ["b", "beta"], ["bb"], name="beta_add"),
             helper.make_node("Add", ["a", "bb"], ["y"], name="out")]
    return _model(nodes, inits, [X], [Y])


@pytest.mark.parametrize("model,reason", [
    (_torch_form("uncentered"),
     "the variance is not of the centered input: it averages the square of `x`, not of x - mean"),
    (_torch_form("var_axes"), "the variance is a mean over axes (1, 2) but the mean over axis 2"),
    (_torch_form("eps_input"), "Add `plus_eps` adds `e` to the variance: not a constant scalar eps"),
    (_keras_form((1, T, D)), f"looks like a LayerNorm, but its γ `gamma` (shape (1, {T}, {D})) varies along "
                             "axis 1 too, not only along the feature axis 2"),
], ids=["variance-of-uncentered-input", "variance-over-other-axes", "eps-not-a-constant", "keras-gamma-two-axes"])
def test_near_miss_is_reported_with_its_reason(model, reason, tmp_path):
    """Each chain stopped the matcher with a silent `return None` before: nothing was reported."""
    report = analyze_model(model)
    assert report.norms == []
    assert [(m.name, m.reason) for m in report.near_misses] == [("mean", reason)]
    # `lnfold report` shows it (exit 0: there is something to report), `fold` says it in its error
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    r = _lnfold("report", str(src), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["near_misses"] == [{"name": "mean", "reason": reason}]
    r = _lnfold("report", str(src))
    assert r.returncode == 0 and "near miss" in r.stdout and "mean: " in r.stdout, r.stdout + r.stderr
    f = _lnfold("fold", str(src), "-o", str(tmp_path / "out.onnx"), "--no-verify")
    assert f.returncode == 2 and "nothing to fold" in f.stderr and reason.split("`")[0] in f.stderr, f.stderr


def test_mean_over_two_axes_is_a_kept_norm_with_its_axes():
    """Matched, but over two axes: a kept norm whose reason gives the axes (not a near miss)."""
    report = analyze_model(_torch_form("two_axes"))
    assert [(n.name, n.verdict) for n in report.norms] == [("mean", "keep")]
    assert "normalizes over axes [1, 2] of a rank-3 tensor, not one feature axis" in report.norms[0].reason
    assert report.to_dict()["near_misses"] == []


def test_a_recognized_norm_and_a_plain_centering_are_no_near_misses():
    """The Keras form with a γ along the feature axis is a norm; x - mean(x) alone (what a
    recenter computes) is not a LayerNorm gone wrong."""
    report = analyze_model(_keras_form((D,)))
    assert [n.name for n in report.norms] == ["mean"] and report.near_misses == []
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["u"], name="mean", keepdims=1),
             helper.make_node("Sub", ["x", "u"], ["y"], name="center")]
    report = analyze_model(_model(nodes, [_const("axes", [-1], np.int64)], [X], [Y]))
    assert report.norms == [] and report.near_misses == []


# --- ops without a rule -----------------------------------------------------------------------------

def test_custom_domain_op_says_no_rule_for_op():
    """A stream read by an op the classifier has no rule for: "no rule for op", with its domain."""
    rng = np.random.default_rng(1)
    inits = [_const("E", rng.standard_normal((11, D)) + 3.0), _const("g", 1 + rng.random(D)),
             _const("b", rng.random(D))]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], name="ln", axis=-1),
             helper.make_node("Frob", ["h"], ["z"], name="frob", domain="com.example")]
    model = _model(nodes, inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, [B, T])],
                   [Y, helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], domains=["com.example"])
    (n,) = analyze_model(model).norms
    assert n.verdict == "keep"
    assert n.reason == ("its input `h` is read by com.example.Frob `frob`: no rule for op `com.example.Frob`, "
                        "so lnfold cannot tell whether it sees the mean"), n.reason


# --- the table -------------------------------------------------------------------------------------

def test_long_names_are_cut_in_the_middle_and_the_table_stays_aligned():
    long = "/model/encoder/layers.11/self_attention/output/LayerNorm/LayerNormalization"
    reason = "its input `h` is also read by MatMul `fc` (a linear layer, which sees the mean) " * 3
    report = Report(norms=[NormVerdict("ln_f", "fold", stream=None), NormVerdict(long, "keep", reason.strip())])
    lines = report.table().splitlines()
    rows = [ln for ln in lines if " fold " in ln or " keep " in ln]
    assert len(rows) == 2 and len({ln.index(" fold ") if " fold " in ln else ln.index(" keep ") for ln in rows}) == 1
    cut = rows[1].split()[0]
    assert "…" in cut and cut.startswith("/model/encoder") and cut.endswith("LayerNormalization"), cut
    assert len(cut) == len(lines[1].split()[0])  # exactly the column's width
    # the reason is not cut: it wraps under its column
    table = " ".join(ln.strip() for ln in lines)
    assert reason.strip() in table
    assert long in report.to_json()


def test_fold_rows_say_what_was_edited(zoo_onnx):
    """A fold row's "how" lists the stream's edits and where β went (it was "stream 1" alone)."""
    _, _, model = zoo_onnx("gpt2")
    res = fold_model(model, verify=False)
    (stream,) = res.report.streams
    rows = [ln for ln in res.report.table(width=200).splitlines() if " fold " in ln]
    assert len(rows) == res.report.folded == 5
    for row, n in zip(rows, res.report.norms):
        assert f"stream 1 ({len(stream.centered)} centered), β {n.beta}" in row, row
    assert sum("β into the bias of Gemm `" in row for row in rows) == 4, rows  # ln_f has no bias to take it


# --- a folded model --------------------------------------------------------------------------------

@pytest.mark.parametrize("target,op", [("ort", "SimplifiedLayerNormalization"), ("portable", "decomposed RMSNorm")])
def test_report_on_a_folded_model_lists_its_rmsnorms(zoo_onnx, tmp_path, target, op):
    """`lnfold report` on `lnfold fold`'s output: exit 0, its RMSNorms listed as already RMSNorm;
    `lnfold fold` on it: exit 2, saying so."""
    _, _, model = zoo_onnx("gpt2")
    res = fold_model(model, target=target, verify=False)
    src = tmp_path / "folded.onnx"
    onnx.save(res.model, src)
    r = _lnfold("report", str(src), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["norms"] == [] and len(doc["rms_norms"]) == res.report.folded
    assert {m["op"] for m in doc["rms_norms"]} == {op}
    r = _lnfold("report", str(src))
    assert r.returncode == 0 and r.stdout.count("already RMSNorm (") == res.report.folded, r.stdout + r.stderr
    f = _lnfold("fold", str(src), "-o", str(tmp_path / "again.onnx"), "--no-verify")
    assert f.returncode == 2 and "RMSNorms already" in f.stderr and "nothing to fold" in f.stderr, f.stderr


# --- the torch frontend gives the same reasons ---------------------------------------------------

def test_fx_analyze_module_gives_the_same_kind_of_reasons():
    torch = pytest.importorskip("torch")
    from lnfold.fx_rewrite import analyze_module

    class PostLN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln0, self.fc = torch.nn.Embedding(11, D), torch.nn.LayerNorm(D), torch.nn.Linear(D, D)
            self.ln1, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, 3)

        def forward(self, ids, x):
            h = self.ln0(self.emb(ids))
            out = self.head(self.ln1(h + self.fc(h)))
            # a hand-written norm whose variance is of x, not of x - mean: a near miss
            u = x.mean(-1, keepdim=True)
            v = (x * x).mean(-1, keepdim=True)
            return out, (x - u) / torch.sqrt(v + 1e-5)

    ids = torch.randint(0, 11, (B, T))
    report = analyze_module(PostLN().eval(), (ids, torch.randn(B, T, D)))
    kept = [n for n in report.norms if n.verdict == "keep"]
    assert len(kept) == 1
    assert kept[0].reason.startswith("its input `add`"), kept[0].reason
    assert "which is also read by aten.linear.default" in kept[0].reason and "a Post-LN block" in kept[0].reason
    assert "shift-invariant" not in kept[0].reason
    assert [m.reason.split(":")[0] for m in report.near_misses] == ["the variance is not of the centered input"]


def test_clone_of_an_all_zero_tensor_an_exporter_shared_says_so():
    """torch.onnx de-duplicates equal initializers: a zero bias writing into the stream and a zero
    β become one tensor. The bias is centered, the LayerNorm keeps the original: the clone's note
    says why a β is "also" a reader of a bias."""
    from tests.onnx_graphs import Builder, INT64, T as TOKENS, VOCAB

    b = Builder(seed=3)
    zeros = b.const("zeros", np.zeros(D, np.float32))
    h = b.embed(b.input("ids", INT64, [2, TOKENS]))
    n = b.layernorm(h, beta=zeros)
    first = b.nodes[-1].name
    mlp = b.op("MatMul", [b.op("Relu", [b.linear(n, D, 2 * D)]), b.weight("W2", (2 * D, D), mean=2.0)])
    h = b.op("Add", [h, b.op("Add", [mlp, zeros])])
    b.output(b.op("MatMul", [b.layernorm(h), b.weight("head", (D, VOCAB))]), shape=[2, TOKENS, VOCAB])
    model = b.model(17)
    cloned = [c for s in analyze_model(model).streams for c in s.cloned]
    assert cloned == [f"`{zeros}`: also read by LayerNormalization `{first}` (one all-zero tensor "
                      "the exporter shared between them), which keeps the original"], cloned
    fold_model(model)  # and the fold is exact (verified)


def test_table_cuts_long_names_where_they_differ():
    """Optimum's Whisper decoder names its norms `/model/decoder/layers.0/self_attn_layer_norm/
    LayerNormalization`, `.../encoder_attn_layer_norm/...`, `.../final_layer_norm/...`: cut in the
    middle, the three of a block read alike; the table keeps each row's distinguishing part."""
    from pathlib import Path

    from lnfold.passes.report import NAME_WIDTH, clip_middle

    model = onnx.load(str(Path(__file__).parent / "corpus" / "optimum_whisper_decoder_model.onnx"))
    report = analyze_model(model)
    names = [n.name for n in report.norms]
    assert len({clip_middle(n, NAME_WIDTH) for n in names}) < len(names)  # the cut this replaces
    rows = [r for r in report.table().splitlines()[2:] if r and not r.startswith(" ")][:len(names)]
    shown = [r.split("  ")[0] for r in rows]
    assert len(set(shown)) == len(names) and all(len(s) <= NAME_WIDTH for s in shown), shown
    assert any(s.startswith("/model/decoder/layers.0/") and "…" in s for s in shown), shown
