"""Valid deep graphs fold: no recursion over a graph's depth (issue 43, item 5).

An 80-layer LLM export is not exotic. `float_dtype` walked back recursively through every op of a
stream without value_info, so a norm reached through ~330 ops raised RecursionError (exit 3):
300 layers folded, 400 did not, and the same file folded after `onnx.shape_inference`.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tests import onnx_graphs as G
from lnfold.onnx_rewrite import fold_model


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


def test_a_deep_stream_without_value_info_folds():
    model = G.pre_ln(layers=400)
    assert not model.graph.value_info  # (the exporter wrote no types: float_dtype walks back to the table)
    result = fold_model(model)  # verified against float64 (DESIGN §4)
    assert result.report.folded == 401
    ids = {"ids": np.random.default_rng(0).integers(0, G.VOCAB, (2, G.T))}
    ref, got = _run(model, ids), _run(result.model, ids)
    assert np.abs(ref - got).max() <= 1e-3 * np.abs(ref).max()
