"""A rotation that spares channels (issue 47: `spare_channels` / `--spare-channels`): the identity on
them, a rotation of the kind on the others; exact, verified against float64 in both IRs, and the
spared channels' weights untouched by it (what keeps a trained LM's massive-activation channels out
of every int4 block)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import lnfold
from lnfold.passes import LnfoldError, orthogonal
from lnfold.passes.errors import VerificationError
from tests.onnx_graphs import pre_ln
from tests.test_rms_streams import _ids, _run, llama_like

SPARED = (3, 17)


@pytest.mark.parametrize("kind", ("hadamard", "orthogonal", "orthogonal-keep-ln"))
def test_the_matrix_is_the_identity_on_the_spared_channels(kind):
    q = orthogonal.matrix(kind, 32, 5, SPARED)
    assert np.abs(q @ q.T - np.eye(32)).max() < 1e-12
    for c in SPARED:
        assert q[c, c] == 1.0 and np.count_nonzero(q[c]) == 1 and np.count_nonzero(q[:, c]) == 1
    rest = [c for c in range(32) if c not in SPARED]
    assert np.count_nonzero(q[np.ix_(rest, rest)]) > 30 * 29  # (the others are mixed among themselves)
    if kind.endswith("keep-ln"):
        assert np.abs(q @ np.ones(32) - 1).max() < 1e-12
    assert np.array_equal(orthogonal.matrix(kind, 32, 5, SPARED), orthogonal.matrix(kind, 32, 5, (17, 3, 3)))
    with pytest.raises(ValueError):
        orthogonal.matrix(kind, 32, 5, (32,))


@pytest.mark.parametrize("form", ("simplified", "decomposed", "gemma"))
def test_an_rmsnorm_stream_rotates_exactly_sparing_channels(form):
    m = llama_like(form)
    r = lnfold.fold_onnx(m, rotate="hadamard", spare_channels="3,17", gamma_in_float=True)  # verified (float64)
    assert r.criterion == "float64" and r.exact_err <= max(2 * r.original_exact_err, 1e-6), r
    (s,) = r.report.streams
    assert "channel(s) 3, 17 left unrotated" in s.rotation, s.rotation
    feeds = _ids()
    want, got = _run(m, feeds), _run(r.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_spared_channels_weights_are_untouched():
    """A reader's input rows of the spared channels are its own (γ kept in float: the rotation alone
    edits them); every other row is mixed."""
    m = llama_like("simplified")
    before = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    r = lnfold.fold_onnx(m, rotate="orthogonal", spare_channels=list(SPARED), gamma_in_float=True)
    after = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    g = next(iter(r.plan.gammas.values()))
    reader = g.readers[0]
    node = next(n for n in r.model.graph.node if n.name == reader.node)
    w = next(after[i] for i in node.input if i in after and after[i].ndim == 2)
    w0 = before[reader.weight.value]
    assert w.shape == w0.shape and w0.shape[0] == 32  # (x·W: the input rows are the stream's channels)
    for c in SPARED:
        np.testing.assert_allclose(w[c], w0[c], rtol=1e-6)
    rest = [c for c in range(32) if c not in SPARED]
    assert not np.allclose(w[rest], w0[rest], atol=1e-3)


def test_a_layernorm_stream_spares_channels_exactly():
    r = lnfold.fold_onnx(pre_ln(seed=3), rotate="hadamard-keep-ln", spare_channels=(1,))
    assert r.criterion == "float64" and "channel(s) 1 left unrotated" in r.report.streams[0].rotation


@pytest.mark.slow  # (three torch.export runs: ~10 s)
def test_torch_spares_channels_exactly_and_finds_massive_ones():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.test_rms_torch import Tiny, _ids as ids_of

    m = Tiny("gemma").eval()
    t = lnfold.fold_module(m, (ids_of(),), rotate="orthogonal", spare_channels=(1, 3), gamma_in_float=True)
    assert t.criterion == "float64" and "channel(s) 1, 3 left unrotated" in t.report.streams[0].rotation
    torch.testing.assert_close(t.module(ids_of(seed=2)), m(ids_of(seed=2)), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m.emb.weight[:, 5] *= 300.0  # (a massive channel)
    found = lnfold.fold_module(m, (ids_of(),), rotate="orthogonal", spare_channels="massive", gamma_in_float=True)
    assert "channel(s) 5 left unrotated" in found.report.streams[0].rotation, found.report.streams[0].rotation
    q = lnfold.quantize_module(m, (ids_of(),), weights="int8", rotate="orthogonal", spare_channels="massive",
                               gamma_in_float=True)
    assert "channel(s) 5 left unrotated" in q.report.rotation, q.report.rotation


def test_a_spared_channel_rotated_by_the_readers_fails_verification(monkeypatch):
    """Planted bug: the readers take the full rotation while the writers spare the channels."""
    from lnfold.passes import rotate

    real = rotate.StreamBasis.basis_of

    def readers_full(self, norm):
        basis = real(self, norm)
        return type(basis)(basis.kind, basis.dim, basis.seed) if getattr(basis, "spared", ()) else basis

    monkeypatch.setattr(rotate.StreamBasis, "basis_of", readers_full)
    with pytest.raises(VerificationError):
        lnfold.fold_onnx(llama_like("simplified"), rotate="orthogonal", spare_channels=SPARED)


def test_bad_channels_are_one_line(tmp_path, capsys):
    from lnfold.onnx_rewrite import cli

    with pytest.raises(LnfoldError, match="give --rotate too"):
        lnfold.fold_onnx(llama_like("simplified"), spare_channels=SPARED)
    with pytest.raises(LnfoldError, match="non-negative integers"):
        lnfold.fold_onnx(llama_like("simplified"), rotate="hadamard", spare_channels="3,x")
    r = lnfold.fold_onnx(llama_like("simplified"), rotate="hadamard", spare_channels=(32,))
    assert "not channels of its width 32" in r.report.streams[0].rotation  # (the stream stays as it is, said)
    src = tmp_path / "llama.onnx"
    onnx.save(llama_like("simplified"), src)
    with pytest.raises(SystemExit) as usage:  # (argparse's one-line usage error)
        cli.main(["fold", str(src), "-o", str(tmp_path / "x.onnx"), "--spare-channels", "3,-1", "--rotate", "hadamard"])
    assert usage.value.code == 2 and not (tmp_path / "x.onnx").exists()
    assert "non-negative integers" in capsys.readouterr().err
    assert cli.main(["fold", str(src), "-o", str(tmp_path / "y.onnx"), "--rotate", "hadamard",
                     "--spare-channels", "3,17"]) == 0
    assert "left unrotated" in capsys.readouterr().out


def test_quantize_spares_channels_and_auto_tries_them(tmp_path):
    m = llama_like("simplified")
    r = lnfold.quantize_onnx(m, weights="int8", rotate="orthogonal", spare_channels=SPARED, gamma_in_float=True)
    assert "channel(s) 3, 17 left unrotated" in r.report.rotation and r.report.rel_rms < 0.1, r.report.table()
    with pytest.raises(LnfoldError, match="give --rotate too"):
        lnfold.quantize_onnx(m, weights="int8", spare_channels=SPARED)
    auto = lnfold.quantize_onnx(m, weights="int4", rotate="auto", spare_channels=SPARED, block_size=16)
    labels = [t["candidate"] for t in auto.report.candidates]
    assert "orthogonal sparing channel(s) 3, 17, γ in float" in labels, labels


def _with_massive_channel(channel: int, scale: float = 300.0) -> onnx.ModelProto:
    """llama_like with one embedding channel `scale` times the others: the stream's massive channel."""
    m = llama_like("simplified")
    for t in m.graph.initializer:
        if t.name.startswith("embed"):
            w = numpy_helper.to_array(t).copy()
            w[:, channel] *= scale
            t.CopyFrom(numpy_helper.from_array(w, t.name))
    return m


def test_massive_finds_the_massive_channel_and_spares_it():
    from lnfold.passes.massive import MASSIVE_RATIO

    m = _with_massive_channel(11)
    r = lnfold.fold_onnx(m, rotate="orthogonal", spare_channels="massive", gamma_in_float=True)  # verified
    assert r.criterion == "float64" and "channel(s) 11 left unrotated" in r.report.streams[0].rotation, \
        r.report.streams[0].rotation
    # a model without one spares none (the rotation text says no channel), and the ratio is the rule
    plain = lnfold.fold_onnx(llama_like("simplified"), rotate="orthogonal", spare_channels="massive")
    assert "left unrotated" not in plain.report.streams[0].rotation
    weak = lnfold.fold_onnx(_with_massive_channel(11, scale=MASSIVE_RATIO / 4), rotate="orthogonal",
                            spare_channels="massive")
    assert "left unrotated" not in weak.report.streams[0].rotation


def test_quantize_finds_massive_channels_on_its_rows():
    m = _with_massive_channel(5)
    q = lnfold.quantize_onnx(m, weights="int4", rotate="auto", spare_channels="massive", block_size=16)
    labels = [t["candidate"] for t in q.report.candidates]
    assert any(lab.startswith("orthogonal sparing channel(s) 5 in `") for lab in labels), labels
    none = lnfold.quantize_onnx(llama_like("simplified"), weights="int4", rotate="auto", spare_channels="massive",
                                block_size=16)
    assert not any("sparing" in t["candidate"] for t in none.report.candidates)  # (none found: no candidate)
