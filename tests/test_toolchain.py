"""Issue 24 item 7: a folded file goes on through the tools a user ran on the original.

Each tool runs on the fold of a corpus file (other people's exporters) for every target and on the
original; its result must load and run in onnxruntime and stay as close to the original's fp32
output as the same tool's result on the original (quantization is not exact: the quantized fold
is compared with the quantized original's error, not with zero).
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from lnfold.onnx_rewrite import inputs as synth
from lnfold.onnx_rewrite.api import fold_model
from lnfold.onnx_rewrite.targets import names as target_names

TARGETS = target_names()

CORPUS = Path(__file__).parent / "corpus"
VIT = "optimum_vit_model.onnx"  # quant_pre_process's symbolic shape inference completes on it
GPT2 = "torchscript_op17_fp32_gpt2.onnx"  # (on the GPT-2s it stops at their causal mask, folded or not)


@pytest.fixture(autouse=True)
def _quiet_quantizer():
    logging.disable(logging.WARNING)  # onnxruntime's quantizer logs advice on every call
    yield
    logging.disable(logging.NOTSET)


def _fold_all(name: str, tmp: Path):
    """({'original' and each target: its file}, made-up inputs, the original's fp32 output)."""
    src = CORPUS / name
    model = onnx.load(str(src))
    files = {"original": src}
    for target in TARGETS:
        files[target] = tmp / f"{target}.onnx"
        onnx.save(fold_model(model, target=target, verify=False).model, str(files[target]))
    feeds = _feeds(model, src)
    return files, feeds, _run(src, feeds)


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """name -> _fold_all(name), folded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _fold_all(name, tmp_path_factory.mktemp(Path(name).stem))
        return cache[name]

    return get


def _feeds(model: onnx.ModelProto, path: Path) -> dict:
    """The first made-up inputs the original runs on (the verifier's candidates)."""
    sess = ort.InferenceSession(str(path))
    for _, feeds in synth.candidates(model):
        try:
            sess.run(None, feeds)
            return feeds
        except Exception:  # a candidate size the model does not take: the next one
            continue
    raise AssertionError("no made-up inputs run")


def _run(path, feeds) -> np.ndarray:
    return ort.InferenceSession(str(path)).run(None, feeds)[0]


def _err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _through(tool, name: str, folded, tmp_path: Path) -> dict[str, float]:
    """`tool(src, dst)` on the original and on each target's fold: each result's error against
    the original's fp32 output."""
    files, feeds, ref = folded(name)
    errs = {}
    for which, src in files.items():
        dst = tmp_path / f"{which}.out.onnx"
        tool(str(src), str(dst))
        errs[which] = _err(_run(dst, feeds), ref)
    return errs


def _as_close_as_original(errs: dict[str, float], slack: float) -> None:
    for target in TARGETS:
        assert errs[target] <= 2 * errs["original"] + slack, (target, errs)


def test_quant_pre_process(folded, tmp_path):
    from onnxruntime.quantization.shape_inference import quant_pre_process

    errs = _through(quant_pre_process, VIT, folded, tmp_path)
    _as_close_as_original(errs, 1e-5)  # not a quantization: graph optimizations and shapes only


@pytest.mark.parametrize("name", [VIT, GPT2])
def test_quantize_dynamic(name, folded, tmp_path):
    """The ort target's RMS op is unknown to onnx's shape inference: before its outputs were typed,
    the quantizer stopped with "Unable to find data type for weight_name=..."."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    errs = _through(lambda s, d: quantize_dynamic(s, d, weight_type=QuantType.QInt8), name, folded, tmp_path)
    _as_close_as_original(errs, 0.01)


def test_quantize_static(folded, tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    _, feeds, _ = folded(VIT)

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([feeds, {k: v * 0.5 for k, v in feeds.items()}])

        def get_next(self):
            return next(self.batches, None)

    errs = _through(lambda s, d: quantize_static(s, d, Calibration()), VIT, folded, tmp_path)
    _as_close_as_original(errs, 0.01)


def test_onnxslim(folded, tmp_path):
    import onnxslim

    errs = _through(lambda s, d: onnxslim.slim(s, d), VIT, folded, tmp_path)
    _as_close_as_original(errs, 1e-5)


def test_transformer_optimizer(folded, tmp_path):
    """The portable target's RMSNorm, once squared by Mul(x, x), crashed the optimizer's RMS fusion;
    its ε as a 1-element tensor crashed it too. Squared by Pow and with a scalar ε it fuses."""
    from onnxruntime.transformers.optimizer import optimize_model

    def optimize(src, dst):
        optimize_model(src, model_type="vit", num_heads=2, hidden_size=32).save_model_to_file(dst)

    errs = _through(optimize, VIT, folded, tmp_path)
    _as_close_as_original(errs, 1e-5)
    fused = onnx.load(str(tmp_path / "portable.out.onnx"))
    assert "SimplifiedLayerNormalization" in {n.op_type for n in fused.graph.node}


@pytest.mark.parametrize("target", TARGETS)
def test_lnfold_again(target, folded, tmp_path):
    """Folding a folded file: nothing to fold, said in one line (exit 2), nothing written."""
    files, _, _ = folded(VIT)
    out = tmp_path / "again.onnx"
    r = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(files[target]), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "RMSNorms already" in r.stderr and "nothing to fold" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
