"""Streams started by a recentered op rotate and slice (issue 33, "rotate every stream the fold can
make zero-mean"; issue 32): the explicit recenter makes the stream zero-mean as a centered writer
does, and an emitted MatMul by Q right after it carries the start into the rotated basis
(passes/rotate.py `StreamBasis.starts`, passes/edits.Recenter.project).

The model is Whisper's encoder in small: conv → GELU → conv → GELU (the stream starts here, its
features on axis 1 of [batch, d, T]: the MatMul is `Qᵀ·x`), the tokens transposed, a position table
added, two Pre-LN blocks, a final norm and a head; zoo.adversarial randomizes γ/β and gives every
source a large mean. tests/test_rotate.py's tanh toy covers the last-axis start (`x·Q`).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import lnfold
from lnfold import fx_rewrite, onnx_rewrite, zoo
from lnfold.passes import VerificationError
from tests.test_rotate import _toy_onnx, _toy_program
from tests.test_slice import calibration, recentered_model

warnings.filterwarnings("ignore", category=UserWarning)

D, T, MELS = 32, 6, 8
PROJECTED = "1 recentered start(s) projected by a constant"


class ConvStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(MELS, D, 3, padding=1)
        self.conv2 = nn.Conv1d(D, D, 3, padding=1)
        self.positions = nn.Parameter(torch.randn(T, D))
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.fc1 = nn.ModuleList(nn.Linear(D, 2 * D) for _ in range(2))
        self.fc2 = nn.ModuleList(nn.Linear(2 * D, D) for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        h = nn.functional.gelu(self.conv2(nn.functional.gelu(self.conv1(x))))
        h = h.transpose(1, 2) + self.positions
        for k in range(2):
            h = h + self.fc2[k](torch.relu(self.fc1[k](self.ln[k](h))))
        return self.head(self.ln_f(h))


def _stem(dtype=torch.float32):
    torch.manual_seed(0)
    m = zoo.adversarial(ConvStem(), 0).eval().to(dtype)
    return m, (torch.randn(2, MELS, T, generator=torch.Generator().manual_seed(1), dtype=dtype),)


@functools.lru_cache(maxsize=None)
def _stem_onnx():
    return zoo.export_onnx(*_stem(), ["x"])


def _fold(frontend: str, model: str = "conv", **kw):
    if frontend == "onnx":
        return lnfold.fold_onnx(_stem_onnx() if model == "conv" else _toy_onnx("opaque"), **kw)
    return lnfold.fold_module(*(_stem() if model == "conv" else _toy_program("opaque")), **kw)


@pytest.mark.parametrize("frontend, model, kind", [
    ("onnx", "conv", "hadamard"), ("fx", "conv", "hadamard"),
    ("onnx", "conv", "orthogonal"), ("fx", "conv", "orthogonal-keep-ln"),
    ("onnx", "tanh", "hadamard"), ("fx", "tanh", "orthogonal"),
])
def test_a_recentered_stream_rotates_exactly(frontend, model, kind):
    res = _fold(frontend, model, rotate=kind, seed=2)
    assert res.report.recentered == 1
    (stream,) = res.report.streams
    assert stream.rotation.startswith(f"rotated ({kind}, d=") and PROJECTED in stream.rotation, stream.rotation
    # the float64 gate (DESIGN §4): no further from float64 than the original, up to fp32 noise
    assert res.criterion == "float64" and res.exact_err <= 2 * res.original_exact_err
    if frontend == "onnx":
        (mm,) = [n for n in res.model.graph.node if n.output[0].endswith("lnfold_projected")]
        assert mm.op_type == "MatMul"


def test_both_frontends_report_the_recentered_rotation_alike():
    t, o = (_fold(f, rotate="hadamard") for f in ("fx", "onnx"))
    assert t.report.streams[0].rotation == o.report.streams[0].rotation


def _without_projection(make_plan):
    def plan(*a, **kw):  # the planted bug: the recentered start stays in the original basis
        p = make_plan(*a, **kw)
        assert any(rc.project is not None for rc in p.recenters)
        return replace(p, recenters=[replace(rc, project=None) for rc in p.recenters])
    return plan


@pytest.mark.parametrize("frontend", ["onnx", "fx"])
def test_a_start_left_unprojected_is_refused(frontend, monkeypatch):
    api = onnx_rewrite.api if frontend == "onnx" else fx_rewrite.api
    monkeypatch.setattr(api, "make_plan", _without_projection(api.make_plan))
    with pytest.raises(VerificationError, match="float64"):
        _fold(frontend, rotate="hadamard")


# --- slicing (issue 32): the same MatMul, d × k -------------------------------------------------------

def test_onnx_slice_of_a_recentered_stream():
    """tests/test_slice.py's float64 model whose only stream starts at Relu(linear), read by six heads:
    F→0 (k = d) is the exact fold to float64 precision; F = 0.25 slices it (d → 12, a 16 × 12 MatMul
    after the recenter, which the six heads' lost rows outweigh)."""
    full = lnfold.slice_onnx(recentered_model(heads=6), calibration(floats=True), fraction=0.01)
    (s,) = full.report.streams
    assert s.sliced and s.dim == s.keep == 16 and full.report.error < 1e-13
    sliced = lnfold.slice_onnx(recentered_model(heads=6), calibration(floats=True), fraction=0.25)
    (s,) = sliced.report.streams
    assert (s.dim, s.keep) == (16, 12) and 0 < sliced.report.error < 1
    inits = {t.name: t.dims for t in sliced.model.graph.initializer}
    (mm,) = [n for n in sliced.model.graph.node if n.output[0].endswith("lnfold_projected")]
    assert list(inits[mm.input[1]]) == [16, 12]


def test_torch_full_width_slice_of_the_conv_stem_is_the_exact_fold():
    m, _ = _stem(torch.float64)
    rows = torch.randn(8, MELS, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = lnfold.slice_module(m, (rows,), fraction=0.01)
    (s,) = r.report.streams
    assert s.sliced and s.dim == s.keep == D and r.report.error < 1e-12
    half = lnfold.slice_module(m, (rows,), fraction=0.5)
    assert half.report.streams[0].keep == D // 2 and half.report.error > 1e-6


def test_cli_slices_a_recentered_stream(tmp_path, capsys):
    import json

    import onnx

    from lnfold.onnx_rewrite import cli

    src, cal, out = tmp_path / "m.onnx", tmp_path / "cal.npz", tmp_path / "sliced.onnx"
    np.savez(cal, **calibration(floats=True))
    # three heads: the 16 × 12 MatMul after the recenter outweighs what their 16-wide weights lose
    # (884 -> 932 parameters before issue 45): the stream keeps its width, and nothing is sliced
    onnx.save(recentered_model(), src)
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal)]) == 2
    err = capsys.readouterr().err
    assert "would add parameters" in err and "192" in err and not out.exists(), err
    onnx.save(recentered_model(heads=6), src)
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["streams"][0]["keep"] == 12 and report["error"] > 0
    assert report["params_after"] < report["params_before"]
