"""γ kept in float beside a rotation (`gamma_in_float`, issue 47): each rotated norm is emitted with
unit weight and followed by a constant MatMul by Qᵀ·diag γ·Q, its readers taking Q alone — exact,
verified against float64, in both IRs, for RMSNorm streams as given (every form) and folded
LayerNorm streams. The product is a basis change (kept float by the quantizers)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import lnfold
from lnfold.passes import LnfoldError
from lnfold.passes import plan as plan_module
from lnfold.passes.errors import VerificationError
from tests.onnx_graphs import pre_ln
from tests.test_rms_streams import _ids, _run, llama_like


def _inits(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("form", ("simplified", "decomposed", "gemma"))
def test_an_rmsnorm_stream_keeps_gamma_in_float_exactly(form):
    m = llama_like(form)
    r = lnfold.fold_onnx(m, rotate="hadamard", gamma_in_float=True)  # verified against float64 (raises otherwise)
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert "γ kept in float after 3 norm(s) by a constant 32×32 MatMul" in s.rotation, s.rotation
    assert all(x.gamma.startswith("kept in float after the norm") for x in r.report.rms_norms), r.report.rms_norms
    products = {k: v for k, v in _inits(r.model).items() if k.endswith("lnfold_float_gamma")}
    assert len(products) == 3
    for p in products.values():  # Qᵀ·diag γ·Q: symmetric, with γ's values as its eigenvalues (none of them 1)
        assert np.allclose(p, p.T, atol=1e-6)
        assert not np.allclose(np.linalg.eigvalsh(p.astype(np.float64)), 1.0, atol=0.1)
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_readers_take_the_rotation_alone():
    """γ in the readers' weights changes their singular values; Q alone does not."""
    m = llama_like("simplified")
    before = _inits(m)
    moved = lnfold.fold_onnx(m, rotate="hadamard")
    kept = lnfold.fold_onnx(m, rotate="hadamard", gamma_in_float=True)
    (first,) = [g for g in kept.plan.gammas.values()][:1]
    reader, name = first.readers[0].node, first.readers[0].weight.value

    def weight(model):  # (the edited weight is a new initializer, read by the same node)
        node = next(n for n in model.graph.node if n.name == reader)
        return _inits(model)[next(i for i in node.input if i in _inits(model))]

    sv = lambda w: np.linalg.svd(w.astype(np.float64), compute_uv=False)  # noqa: E731
    assert not np.array_equal(weight(kept.model), before[name])  # (rotated)
    assert np.allclose(sv(weight(kept.model)), sv(before[name]), rtol=1e-5)
    assert not np.allclose(sv(weight(moved.model)), sv(before[name]), rtol=1e-3)


def test_a_layernorm_stream_keeps_gamma_in_float_exactly():
    m = pre_ln(seed=3)
    r = lnfold.fold_onnx(m, rotate="hadamard", gamma_in_float=True)
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert s.rotation.startswith("rotated (hadamard") and "γ kept in float after 3 norm(s)" in s.rotation, s.rotation
    assert all("kept in float" in v.gamma for v in r.report.norms), [v.gamma for v in r.report.norms]


@pytest.mark.parametrize("bug", ("gamma dropped", "un-rotated"))
def test_a_wrong_float_product_fails_verification(monkeypatch, bug):
    """Planted bugs: the product without γ (Qᵀ·Q), or Qᵀ·diag γ (taking the output out of the basis
    its rotated readers expect)."""
    real = plan_module.Readout.matrix

    def wrong(self, gamma):
        if not self.rotated:
            return real(self, gamma)
        if bug == "gamma dropped":
            return real(self, None)
        return plan_module.Readout(self.basis, self.keep, self.gamma).matrix(gamma)

    monkeypatch.setattr(plan_module.Readout, "matrix", wrong)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_like("simplified"), rotate="hadamard", gamma_in_float=True)


def test_it_needs_a_rotation(tmp_path, capsys):
    from lnfold.onnx_rewrite import cli

    with pytest.raises(LnfoldError, match="give --rotate too"):
        lnfold.fold_onnx(llama_like("simplified"), gamma_in_float=True)
    src = tmp_path / "llama.onnx"
    onnx.save(llama_like("simplified"), src)
    assert cli.main(["fold", str(src), "-o", str(tmp_path / "x.onnx"), "--gamma-in-float"]) == 2
    assert "give --rotate too" in capsys.readouterr().err and not (tmp_path / "x.onnx").exists()
    assert cli.main(["fold", str(src), "-o", str(tmp_path / "y.onnx"), "--rotate", "hadamard",
                     "--gamma-in-float"]) == 0
    assert "γ kept in float after" in capsys.readouterr().out


def test_torch_keeps_gamma_in_float_exactly():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.test_rms_torch import Tiny, _ids as ids_of

    for form in ("llama", "gemma"):
        m = Tiny(form).eval()
        r = lnfold.fold_module(m, (ids_of(),), rotate="hadamard", gamma_in_float=True)
        assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
        assert "γ kept in float after 3 norm(s)" in r.report.streams[0].rotation
        buffers = [n for n, _ in r.module.named_buffers() if n.startswith("lnfold_float_gamma")]
        assert len(buffers) == 3, [n for n, _ in r.module.named_buffers()]
        torch.testing.assert_close(r.module(ids_of(seed=2)), m(ids_of(seed=2)), rtol=1e-5, atol=1e-5)


def test_quantize_keeps_the_float_gamma_products_float(tmp_path, capsys):
    """The products are basis changes: onnxruntime's quantizer never sees them (the point of keeping
    γ out of the quantized weights); --rotate auto tries them as one more candidate."""
    from lnfold.onnx_rewrite import cli
    from lnfold.onnx_rewrite.quantize import quantize_model

    m = llama_like("simplified")
    r = quantize_model(m, weights="int8", rotate="hadamard", gamma_in_float=True)
    assert len(r.report.basis_changes) == 3 and "γ kept in float after 3 norm(s)" in r.report.rotation
    assert "γ into the readers" not in r.report.fold_line()
    products = [k for k in _inits(r.model) if k.endswith("lnfold_float_gamma")]
    readers = {i for n in r.model.graph.node if n.op_type == "MatMul" for i in n.input}
    assert len(products) == 3 and set(products) <= readers  # float MatMuls, as written
    auto = quantize_model(m, weights="int8", rotate="auto")
    assert any(t["candidate"] == "hadamard, γ in float" for t in auto.report.candidates), auto.report.candidates
    with pytest.raises(LnfoldError, match="give --rotate too"):
        quantize_model(m, weights="int8", gamma_in_float=True)
    src = tmp_path / "llama.onnx"
    onnx.save(m, src)
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--weights", "int8", "--rotate",
                     "hadamard", "--gamma-in-float"]) == 0
    assert "γ kept in float after" in capsys.readouterr().out


def test_quantize_module_keeps_the_float_gamma_products_float():
    pytest.importorskip("transformers")
    from tests.test_rms_torch import Tiny, _ids as ids_of

    r = lnfold.quantize_module(Tiny("llama").eval(), (ids_of(),), weights="int8", rotate="hadamard",
                               gamma_in_float=True, backend="torch.ao")
    assert len(r.report.basis_changes) == 3, r.report.basis_changes
    assert r.report.errors["output"]["rel_rms"] < 0.05, r.report.errors


def test_a_stream_that_cannot_rotate_keeps_gamma_in_its_norms():
    """Where the stream stays unrotated (a Softmax over the features reads it), γ in float means γ
    stays in the norms as given: an RMSNorm model then has nothing to change, and says why."""
    from lnfold.passes import NothingToFold

    with pytest.raises(NothingToFold, match=r"not rotated: Softmax .*γ kept in the norm \(gamma_in_float, and its "
                                            r"stream is not rotated\)"):
        lnfold.fold_onnx(llama_like("simplified", softmax=True), rotate="hadamard", gamma_in_float=True)
