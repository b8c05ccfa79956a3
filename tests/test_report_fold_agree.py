"""Issue 34: `report` says exactly what `fold` does, on every zoo architecture (ONNX frontend).

Every norm the report (analyze_model) calls foldable is folded by fold_model, verified, with the
same edits (per-norm verdicts and stream edits); where nothing folds, the refusal names the first
kept norm and its cause. The corpus files get the same check in tests/test_corpus.py.
"""
from __future__ import annotations

import pytest

from lnfold import zoo
from lnfold.onnx_rewrite import analyze_model, fold_model
from lnfold.passes import NothingToFold


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_report_predicts_fold_on_zoo_architecture(name):
    import warnings

    module, args = zoo.MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = zoo.export_onnx(module, args, ["x", "decoder_input_ids"][:len(args)])  # as test_differential.py
    said = analyze_model(model).to_dict()
    if not said["folded"]:
        with pytest.raises(NothingToFold) as e:
            fold_model(model)
        kept = next((n for n in said["norms"] if n["verdict"] == "keep"), None)
        assert kept is None or (kept["name"] in str(e.value) and kept["reason"] in str(e.value)), str(e.value)
        return
    done = fold_model(model).report.to_dict()  # verified: a refusal raises
    assert done["norms"] == said["norms"] and done["streams"] == said["streams"]
