"""Every bug the fuzzer (tests/modelgen.py) found, as a small named model with its ground truth.

Each test is the shrunk model, written out by hand so that it does not depend on the generator's
random draws, and runs the same properties as the fuzzer (soundness, completeness, and the two
frontends' agreement once the torch frontend exists). pytest collects this file through
tests/test_fuzz.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import modelgen as mg

G = torch.Generator().manual_seed(0)


def _rand(*shape):
    return torch.randn(*shape, generator=G)


def _adversarial(m: nn.Module) -> nn.Module:
    roles = {n: "scale" if n.startswith("ls") else "table" for n, _ in m.named_parameters(recurse=False)}
    mg.adversarial(m, roles, seed=0)
    return m.eval()


def _assert_ok(case: mg.Case, paths=("onnx",)) -> None:
    outs = mg.check(case, paths)
    for o in outs:
        assert o.skipped is None or o.path == "fx", o.skipped
    fails = mg.failures(outs)
    assert not fails, case.describe() + "\n" + "\n".join(fails)


# --- bug 1: LayerScale after a TorchScript-exported conv stem -----------------------------------
class ConvStemLayerScale(nn.Module):
    """ViT-style conv stem, flatten(2).transpose(1, 2), then a LayerScale. The TorchScript exporter
    writes flatten as Shape -> Slice -> Concat -> Reshape, so the conv output has two readers:
    Reshape and Shape. lnfold counted the Shape node as a second reader of the tensor the scale
    would be folded through, gave up the LayerScale fold and kept the norm."""

    def __init__(self, d=4):
        super().__init__()
        self.conv = nn.Conv2d(3, d, 2, stride=2)
        self.ls = nn.Parameter(torch.ones(d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.conv(x).flatten(2).transpose(1, 2) * self.ls
        return self.head(self.ln(h))


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("torchscript", 14), ("dynamo", 18)])
def test_layerscale_after_flattened_conv_stem(exporter, opset):
    m = _adversarial(ConvStemLayerScale())
    case = mg.make_case(m, (_rand(2, 3, 4, 4),), {"ln": "fold"}, exporter=exporter, opset=opset)
    _assert_ok(case)


# --- bug 2: fp16 LayerNorms decomposed by the TorchScript exporter ------------------------------
class EmbedBlock(nn.Module):
    """An embedding, one pre-LN block, a final LayerNorm. Below opset 17 the TorchScript exporter
    decomposes LayerNorm; in fp16 it computes the variance in fp32: Sub -> Cast -> Pow/Div ->
    ... -> Div -> Cast. lnfold's matcher expected Sub -> Pow/Div directly, found no LayerNorm at
    all and raised NothingToFold."""

    def __init__(self, d=8, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(self.ln1(h))
        return self.head(self.ln2(h))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_decomposed_layernorm(dtype):
    m = _adversarial(EmbedBlock())
    ids = torch.randint(0, 11, (2, 5), generator=G)
    case = mg.make_case(m, (ids,), {"ln1": "fold", "ln2": "fold"}, exporter="torchscript", opset=14, dtype=dtype)
    _assert_ok(case)


# --- bug 3: zero Pad on token axes ---------------------------------------------------------------
class PadTokens(nn.Module):
    """F.pad of the stream on the token axis (zero rows are zero-mean, so the Pad is
    shift-transparent; DESIGN §1 lists zero Pad). lnfold had no Pad entry: the Pad became an
    opaque start, and a lone norm behind it was kept. The TorchScript exporter also computes
    Pad's pads at run time from constants (ConstantOfShape, Concat, Reshape, Slice, Transpose,
    Cast)."""

    def __init__(self, d=6, vocab=11, value=0.0, mode="constant"):
        super().__init__()
        self.value, self.mode = value, mode
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        if self.mode == "constant":
            h = F.pad(h, (0, 0, 1, 2), value=self.value)
        else:
            h = F.pad(h.transpose(1, 2), (1, 2), mode=self.mode).transpose(1, 2)
        return self.head(self.ln(h))


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("torchscript", 14), ("dynamo", 18)])
@pytest.mark.parametrize("mode", ["constant", "replicate", "reflect"])
def test_zero_pad_on_tokens(exporter, opset, mode):
    m = _adversarial(PadTokens(mode=mode))
    ids = torch.randint(0, 11, (2, 5), generator=G)
    case = mg.make_case(m, (ids,), {"ln": "fold"}, exporter=exporter, opset=opset)
    _assert_ok(case)


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("dynamo", 18)])
def test_nonzero_pad_is_not_transparent(exporter, opset):
    """Rows padded with 1.5 are not zero-mean and no constant edit can center them."""
    m = _adversarial(PadTokens(value=1.5))
    ids = torch.randint(0, 11, (2, 5), generator=G)
    case = mg.make_case(m, (ids,), {"ln": "keep"}, exporter=exporter, opset=opset)
    _assert_ok(case)
