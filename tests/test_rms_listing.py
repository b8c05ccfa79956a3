"""The RMSNorms a model already has, as `lnfold report` (analyze_model) lists them and "nothing to
fold" names them, are the ones the fold itself recognizes (onnx_rewrite/already_rms.rms_norms: the
view with RMSNorms as given, issue 44): each single op by its node's name, each one written out by
its mean's (ReduceMean) name as "decomposed RMSNorm", once each, in graph order.
"""
from __future__ import annotations

import numpy as np
import pytest

import lnfold
from lnfold.onnx_rewrite import analyze_model
from lnfold.passes import NothingToFold
from tests.onnx_graphs import decomposed_ln
from onnx import TensorProto, helper

from tests.test_rms_onnx_view_rule import FORMS as WRITTEN_OUT, _rms, one_block
from tests.test_rms_streams import B, D, F, FORMS, T, V, _Graph, llama_like, llama_skip

SINGLE = ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization")


def _listed(model) -> list[tuple]:
    return [(r.name, r.op) for r in analyze_model(model).rms_norms]


def _in_the_graph(model) -> list[tuple]:
    """Each norm as the hand-built graph holds it: a single op, or the mean of one written out."""
    return [(n.name, n.op_type if n.op_type in SINGLE else "decomposed RMSNorm") for n in model.graph.node
            if n.op_type in SINGLE + ("ReduceMean",)]


@pytest.mark.parametrize("model", [llama_like(f) for f in FORMS + ("gemma", "t5")] + [llama_skip()]
                         + [one_block(f) for f in WRITTEN_OUT],
                         ids=[*FORMS, "gemma", "t5", "skip_simplified", *WRITTEN_OUT])
def test_each_form_is_listed_under_its_name(model):
    want = _in_the_graph(model)
    assert len(want) in (2, 3) and _listed(model) == want


@pytest.mark.parametrize("form,first", [("decomposed", "simplified"), ("simplified", "decomposed")])
def test_single_ops_and_written_out_norms_are_listed_in_graph_order_and_named_when_nothing_folds(form, first):
    m = llama_like(form, first=first)
    want = _in_the_graph(m)
    assert sorted({k for _, k in want}) == ["SimplifiedLayerNormalization", "decomposed RMSNorm"] and len(want) == 3
    assert _listed(m) == want
    with pytest.raises(NothingToFold, match=r"the model's 3 norm\(s\) are RMSNorms already "
                                            r"\(SimplifiedLayerNormalization, decomposed RMSNorm; "):
        lnfold.fold_onnx(m)


def test_a_written_out_layernorm_is_not_listed_as_an_rmsnorm():
    """The mean square of x - mean(x) is a LayerNorm's variance: its norms are LayerNorms, none RMSNorm."""
    r = analyze_model(decomposed_ln())
    assert len(r.norms) == 3 and r.rms_norms == []


def _unit_gain_block():
    """Embedding -> RMSNorm -> MatMul -> residual Add -> RMSNorm -> lm head, both norms without γ."""
    g = _Graph(0)
    h = g.op("Gather", [g.weight("embed", (V, D), mean=3.0), "input_ids"], axis=0)
    up = g.op("MatMul", [_rms(g, h, "no_gamma_no_eps"), g.weight("up", (D, F))])
    h = g.op("Add", [h, g.op("MatMul", [up, g.weight("down", (F, D))])])
    logits = g.op("MatMul", [_rms(g, h, "no_gamma_no_eps"), g.weight("lm_head", (D, V))])
    graph = helper.make_graph(g.nodes, "unit_gain", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [B, T, V])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("options", [{}, {"gamma_into_readers": True}])
def test_nothing_to_fold_names_the_rmsnorms_whether_the_folds_view_has_them_or_not(options):
    """With γ into the readers the fold's view has its RMSNorms already (found there, not again); a
    model of γ-less RMSNorms then has nothing to fold all the same."""
    m = _unit_gain_block()
    assert _listed(m) == _in_the_graph(m) and len(_listed(m)) == 2
    with pytest.raises(NothingToFold, match=r"the model's 2 norm\(s\) are RMSNorms already \(decomposed RMSNorm; "):
        lnfold.fold_onnx(m, **options)


def test_a_stream_of_gamma_less_rmsnorms_rotates():
    """No norm to swap, but a rotation edits the writers and readers: a fold (it said "nothing to
    fold" before), verified against float64, in both IRs' plan."""
    m = _unit_gain_block()
    r = lnfold.fold_onnx(m, rotate="hadamard")
    assert r.criterion == "float64" and r.report.streams[0].rotation.startswith("rotated"), r.report.streams
    feeds = {"input_ids": np.random.default_rng(1).integers(0, V, (B, T))}
    import onnxruntime as ort

    run = lambda model: ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]  # noqa: E731
    assert np.abs(run(r.model) - run(m)).max() <= 1e-4 * np.abs(run(m)).max()
