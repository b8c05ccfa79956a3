"""online_hadamard (QuaRot's R4, passes/online.py): each linear layer that writes a stream reads its
input times H (a constant MatMul before it) with Hᵀ folded into its weight — exact for any input,
verified against float64 like every fold; a planted bug (the weight not taking Hᵀ) fails. Quantizers
keep the online MatMuls float."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import lnfold
from lnfold.onnx_rewrite import calibration as calibration_io
from lnfold.onnx_rewrite import cli
from lnfold.passes import LnfoldError, VerificationError
from lnfold.passes import online
from lnfold.passes.approx import relative_error
from tests.test_rms_streams import B, T, V, llama_like, llama_span, _span_rows
from tests.test_rms_torch import Tiny, _ids
from tests.onnx_graphs import Builder
from tests.test_slice import stream_model, calibration


def _online_matmuls(model: onnx.ModelProto) -> list:
    return [n for n in model.graph.node if n.op_type == "MatMul" and any(i.startswith("lnfold_online_") for i in n.input)]


def _error(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict) -> float:
    return relative_error(calibration_io.run(a, [feeds]), calibration_io.run(b, [feeds]))


@pytest.mark.parametrize("rotate", [None, "hadamard"])
@pytest.mark.parametrize("form", ["decomposed", "simplified"])
def test_an_rmsnorm_model_takes_it_exactly_with_or_without_a_rotation(form, rotate):
    """Its two down projections (input 32 wide) read u·H, H = A ⊗ B (8 × 8 and 4 × 4: two small
    MatMuls each, the two constants shared by both layers); the float64 model's outputs are
    unchanged to rounding, γ in the norms where nothing asked to move it."""
    m = llama_span(form)
    r = lnfold.fold_onnx(m, online_hadamard=True, rotate=rotate)
    layers = _online_matmuls(r.model)
    assert len(layers) == 4 and {i for n in layers for i in n.input if i.startswith("lnfold_online_")} == {
        "lnfold_online_hadamard32_a", "lnfold_online_hadamard32_b"}
    assert any("online_hadamard: the input of 2 linear layer(s)" in n for n in r.report.notes)
    assert _error(m, r.model, {k: v[:4] for k, v in _span_rows().items()}) < 1e-12


def _odd_width_model() -> onnx.ModelProto:
    """x [batch, 5, 16] -> h = x + W2·relu(W1·x) (hidden 10: no Hadamard of order 10) -> LN -> head."""
    b = Builder(4, np.float64)
    x = b.input("x", onnx.TensorProto.DOUBLE, ["batch", 5, 16])
    h = b.op("Add", [x, b.linear(b.op("Relu", [b.linear(x, 16, 10)]), 10, 16)])
    b.output(b.op("MatMul", [b.layernorm(h, 16), b.weight("head", (16, 7))]), shape=["batch", 5, 7])
    return b.model(17)


def test_a_width_without_a_hadamard_takes_a_dense_orthogonal_matrix():
    m = _odd_width_model()
    r = lnfold.fold_onnx(m, online_hadamard=True)
    (layer,) = _online_matmuls(r.model)
    assert [i for i in layer.input if i.startswith("lnfold_online_")] == ["lnfold_online_orthogonal10"]
    assert _error(m, r.model, {"x": np.random.default_rng(2).standard_normal((3, 5, 16)) + 4.0}) < 1e-12


def test_a_layernorm_model_folds_and_takes_it_exactly():
    m = stream_model()
    r = lnfold.fold_onnx(m, online_hadamard=True)
    assert len(_online_matmuls(r.model)) == 4 and r.report.folded == 3
    assert _error(m, r.model, calibration(4, seed=5)) < 1e-12


def test_planted_bug_the_weight_takes_another_matrix(monkeypatch):
    """H before the layer, but the weight takes another orthogonal matrix's transpose: the fold's
    float64 verification refuses it (the test can fail)."""
    def wrong_edit(self):
        return online.Project(self.weight.axis, online.Seeded("hadamard", self.basis.dim, 9), self.basis.dim)

    monkeypatch.setattr(online.OnlineRotation, "edit", property(wrong_edit))
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_span("simplified"), online_hadamard=True)


def test_torch_takes_it_exactly():
    m, ids = Tiny("llama").eval(), _ids()
    r = lnfold.fold_module(m, (ids,), online_hadamard=True)
    buffers = [n for n in r.module.graph.nodes if n.op == "get_attr" and "lnfold_online" in n.target]
    assert len(buffers) == 4 and r.criterion == "float64"  # (A and B of each layer's H = A ⊗ B)
    torch.testing.assert_close(r.module(_ids(seed=2)), m(_ids(seed=2)), rtol=1e-5, atol=1e-5)


def test_quantizers_keep_the_online_matmuls_float(tmp_path, capsys):
    """W8A8 through the CLI: every linear layer quantized, the online MatMuls not (QDQ on neither
    of their inputs), the report's fold line says so."""
    src, cal, out = tmp_path / "m.onnx", tmp_path / "cal.npz", tmp_path / "q.onnx"
    onnx.save(llama_like("simplified"), src)  # (float32, batch fixed at B)
    np.savez(cal, input_ids=np.random.default_rng(3).integers(0, V, (4 * B, T)))
    assert cli.main(["quantize", str(src), "-o", str(out), "--weights", "int8", "--activations", "int8",
                     "--rotate", "hadamard", "--online-hadamard", "--calibrate", str(cal)]) == 0
    q = onnx.load(str(out))
    produced = {o: n for n in q.graph.node for o in n.output}
    matmuls = [n for n in q.graph.node if n.op_type == "MatMul" and n.name.startswith("lnfold/basis_change")]
    assert len(matmuls) == 4  # (H = A ⊗ B: two per layer)
    for n in matmuls:
        assert all(produced.get(i) is None or produced[i].op_type != "DequantizeLinear" for i in n.input), n
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) >= 5
    assert "an online Hadamard before 2 layer(s) that write a stream" in capsys.readouterr().out


def test_it_needs_the_fold():
    with pytest.raises(LnfoldError, match="need fold=True"):
        lnfold.quantize_onnx(llama_span("simplified"), weights="int8", fold=False, online_hadamard=True)


def test_auto_chooses_it_itself():
    """--rotate auto tries the online Hadamard alone and with a rotation (passes/quantize's candidates):
    asked beside auto, a one-line refusal before any work."""
    from lnfold.passes.quantize import AUTO_CANDIDATES

    assert [opts for _, opts in AUTO_CANDIDATES if opts.get("online_hadamard")] == [
        dict(online_hadamard=True), dict(rotate="hadamard", online_hadamard=True)]
    with pytest.raises(LnfoldError, match="drop .*online_hadamard"):
        lnfold.quantize_onnx(llama_span("simplified"), weights="int8", rotate="auto", online_hadamard=True)


def test_torch_quantize_keeps_the_online_matmuls_float():
    """quantize_module (torch.ao int8 dynamic) on a real transformers GPT-2: its 2 stream writers (the
    attention's and the MLP's output projections, Conv1D: addmm) read u·H; the same 5 linear layers are
    quantized, the H factors stay float buffers; the fold under it is verified; the error is small."""
    from lnfold import zoo

    model, args = zoo.gpt2(n_layer=1, n_embd=32, n_head=2)
    r = lnfold.quantize_module(model, args, backend="torch.ao", rotate="hadamard", online_hadamard=True,
                               dynamic=False)
    assert r.report.online_layers == 2 and r.report.linear_layers == 5
    assert r.report.ops_after == {"DynamicQuantizedLinear": 5}
    assert r.fold.criterion == "float64" and r.fold.max_rel_err < 1e-5
    floats = [n for n, t in r.module.named_buffers() if n.startswith("lnfold_online_")]
    assert len(floats) == 4, floats  # (A and B per layer: 32 = 8 ⊗ 4, 128 = 16 ⊗ 8)
    with torch.no_grad():
        want, got = model(*args).double(), r.module(*args).double()
    assert 0 < float((got - want).norm() / want.norm()) < 0.05


def _online_in_all_graphs(graph: onnx.GraphProto) -> int:
    count = len([n for n in graph.node if n.op_type == "MatMul" and any(i.startswith("lnfold_online_") for i in n.input)])
    return count + sum(_online_in_all_graphs(a.g) for n in graph.node for a in n.attribute if a.g and a.g.node)


def test_a_merged_decoders_branch_layers_take_it_verified_on_both_branches(monkeypatch):
    """Optimum's merged Llama decoder: the 2 writers of each of 2 blocks in each If branch (8 layers,
    2 MatMuls each), verified on both branches; the planted wrong weight fails there too."""
    m = onnx.load("tests/corpus/optimum_llama_decoder_model_merged.onnx")
    r = lnfold.fold_onnx(m, online_hadamard=True, rotate="hadamard")
    assert "both branches" in r.criterion and _online_in_all_graphs(r.model.graph) == 16
    assert any("online_hadamard: the input of 8 linear layer(s)" in n for n in r.report.notes)
    monkeypatch.setattr(online.OnlineRotation, "edit", property(
        lambda self: online.Project(self.weight.axis, online.Seeded("hadamard", self.basis.dim, 9), self.basis.dim)))
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(m, online_hadamard=True)
