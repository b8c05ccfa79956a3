"""lnfold as an Olive pass (onnx_rewrite/olive_pass.py, docs/guide/olive.md): a real `olive run` of the
committed workflow (lnfold's fold, then Olive's onnxruntime dynamic quantization) on a corpus GPT-2,
and the pass's options run in-process through Olive's own pass factory. Skipped where olive-ai is
not installed (`pip install 'lnfold[olive]'`). Importing Olive imports torch, transformers,
onnxscript and torchmetrics (~5-10 s here): every test is in the slow tier."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "guide" / "olive"
GPT2 = ROOT / "tests" / "corpus" / "dynamo_op18_fp32_gpt2.onnx"  # the workflow's input model

# find_spec, not an import: collecting this file in the fast tier must not import Olive
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("olive") is None,
                                                   reason="olive-ai is not installed: pip install 'lnfold[olive]'")]


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(path).graph.node)


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


def _ids(rows: int = 2, seq: int = 7) -> np.ndarray:
    vocab = min(t.dims[0] for t in onnx.load(GPT2).graph.initializer if len(t.dims) == 2)  # inside every table
    return np.random.default_rng(0).integers(0, vocab, (rows, seq)).astype(np.int64)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def test_olive_run_folds_then_quantizes_the_committed_workflow(tmp_path):
    """The workflow the guide shows, as committed; only its paths point into tmp_path (the input model
    by its absolute path, Olive's cache and output folders beside it)."""
    workflow = json.loads((EXAMPLE / "workflow.json").read_text())
    assert [p["type"] for p in workflow["passes"].values()] == ["LnfoldPass", "OnnxDynamicQuantization"]
    assert (ROOT / workflow["input_model"]["model_path"]) == GPT2
    workflow["input_model"]["model_path"] = str(GPT2)
    (tmp_path / "workflow.json").write_text(json.dumps(workflow))
    # CI=1: Olive's telemetry stays off (OLIVE_DISABLE_TELEMETRY still sends a heartbeat first)
    run = subprocess.run([shutil.which("olive") or "olive", "run", "--config", "workflow.json", "--package-config",
                          str(EXAMPLE / "olive_config.json")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "CI": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / workflow["output_dir"] / "model.onnx"
    ops = _ops(out)
    assert ops["SimplifiedLayerNormalization"] == 5 and not ops["LayerNormalization"], ops  # lnfold folded all 5
    assert ops["MatMulInteger"] > 0, ops  # then Olive quantized
    # not exact (quantized), but the fold under it is: the error is int8's, not a wrong centering's
    ids = _ids()
    assert _rel(_logits(GPT2, ids), _logits(out, ids)) < 0.05
    assert not list(ROOT.glob("olive-*")), "olive wrote into the repository"


def _run_pass(tmp_path: Path, **options) -> Path:
    """LnfoldPass with `options`, built by Olive's own factory (its config validation included)."""
    from olive.model import ONNXModelHandler
    from olive.passes.olive_pass import create_pass_from_dict

    from lnfold.onnx_rewrite.olive_pass import LnfoldPass

    olive_pass = create_pass_from_dict(LnfoldPass, options, disable_search=True)
    out = olive_pass.run(ONNXModelHandler(model_path=str(GPT2)), str(tmp_path / "out.onnx"))
    return Path(out.model_path)


def test_options_are_declared_as_olive_config_params_with_search_spaces():
    from olive.hardware.accelerator import DEFAULT_CPU_ACCELERATOR
    from olive.search.search_parameter import Categorical

    from lnfold.onnx_rewrite.olive_pass import ROTATIONS, SLICE_FRACTIONS, LnfoldPass, package_config

    params = LnfoldPass.default_config(DEFAULT_CPU_ACCELERATOR)
    for name in ("mode", "target", "rotate", "seed", "gamma_into_readers", "slice_fraction", "per_block",
                 "full_width_head", "center_embeddings", "quantize", "calibration", "verify"):
        assert params[name].description, name
    assert params["rotate"].default_value == "none" and params["slice_fraction"].default_value is None
    searched = {k: p.search_defaults for k, p in params.items() if p.search_defaults is not None}
    assert set(searched) == {"rotate", "slice_fraction"}, searched
    assert isinstance(searched["rotate"], Categorical) and searched["rotate"].get_support() == ROTATIONS
    assert searched["slice_fraction"].get_support() == SLICE_FRACTIONS
    passes = package_config()["passes"]  # Olive's own and this one: what `python -m ...olive_pass OUT.json` writes
    assert passes["LnfoldPass"]["module_path"] == "lnfold.onnx_rewrite.olive_pass.LnfoldPass"
    committed = json.loads((EXAMPLE / "olive_config.json").read_text())["passes"]
    assert committed == {k: passes[k] for k in committed}  # the example's two rows are Olive's own and ours


def test_rotate_is_exact_and_slice_is_not(tmp_path):
    ids = _ids()
    reference = _logits(GPT2, ids)
    rotated = _run_pass(tmp_path / "rot", rotate="hadamard", seed=1)
    ops = _ops(rotated)
    assert ops["SimplifiedLayerNormalization"] == 5 and not ops["LayerNormalization"], ops
    assert _rel(reference, _logits(rotated, ids)) < 1e-5  # exact, within float32's rounding
    weights = lambda p: {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(p).graph.initializer}  # noqa: E731
    folded, turned = weights(_run_pass(tmp_path / "fold")), weights(rotated)
    assert any(v.shape == turned[k].shape and not np.allclose(v, turned[k]) for k, v in folded.items() if k in turned)

    np.savez(tmp_path / "cal.npz", input_ids=_ids(16, 8))
    sliced = _run_pass(tmp_path / "slice", slice_fraction=0.25, calibration=str(tmp_path / "cal.npz"))
    meta = {p.key: p.value for p in onnx.load(sliced).metadata_props}
    assert "lnfold.slice" in meta, meta
    size = lambda p: sum(np.prod(t.dims) for t in onnx.load(p).graph.initializer)  # noqa: E731
    assert size(sliced) < size(rotated)
    assert 1e-5 < _rel(reference, _logits(sliced, ids)) < 0.5  # NOT exact, and says so


def test_bad_options_fail_the_pass_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="slice_fraction needs calibration"):
        _run_pass(tmp_path, slice_fraction=0.2)
    from lnfold import LnfoldError

    with pytest.raises(LnfoldError):
        _run_pass(tmp_path, rotate="sideways")
    assert not (tmp_path / "out.onnx").exists()



def test_quantize_option_folds_then_quantizes_in_one_pass(tmp_path):
    out = _run_pass(tmp_path, quantize="int8", rotate="hadamard")
    ops = _ops(out)
    assert ops["SimplifiedLayerNormalization"] == 5 and ops["MatMulInteger"] > 0, ops
    assert "lnfold.quantize" in {p.key for p in onnx.load(out).metadata_props}
    ids = _ids()
    assert 1e-5 < _rel(_logits(GPT2, ids), _logits(out, ids)) < 0.05  # NOT exact: int8's error


def test_olive_search_tries_every_rotation(tmp_path, monkeypatch):
    """The guide's search workflow, in-process (olive.workflows.run: no CLI start-up): Olive's sequential
    sampler runs the pass once per value of `rotate`'s search space; each is exact, so each lands in
    the run history with its latency."""
    from olive.workflows import run as olive_run

    from lnfold.onnx_rewrite.olive_pass import ROTATIONS

    monkeypatch.setenv("CI", "1")  # Olive's telemetry off
    workflow = json.loads((EXAMPLE / "search_rotation.json").read_text())
    workflow["input_model"]["model_path"] = str(GPT2)
    for key in ("cache_dir", "output_dir"):
        workflow[key] = str(tmp_path / workflow[key])
    output = Path(workflow["output_dir"])
    olive_run(workflow, package_config=str(EXAMPLE / "olive_config.json"))  # (it moves keys of `workflow`)
    history = (output / "run_history.txt").read_text()
    assert history.count("from_pass='lnfoldpass'") == len(ROTATIONS), history
    assert (output / "model.onnx").is_file()
