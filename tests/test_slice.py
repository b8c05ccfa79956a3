"""Slicing (issue 32; passes/slicing.py, onnx_rewrite/slice.py): NOT exact by design, so these
tests pin what is exact about it — at k = d a slice is a rotation (the exact fold's outputs to
float64 precision), and a stream that truly lies in k dimensions slices with zero error — and
show that a planted bug (a reader left unprojected, a wrong √(d/k)) breaks them.

The models are float64 ONNX graphs (so "exact" means ~1e-15) with random γ/β and large-mean
writers (tests/onnx_graphs.Builder), a dynamic batch (the calibration rows are split into a
calibrating and a held-out half), a Reshape on the stream that spells d (patched to k) and,
optionally, a final norm whose output is the graph's (a readout: un-projected to d).
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import lnfold
from lnfold.onnx_rewrite import calibration as calibration_io
from lnfold.onnx_rewrite import cli
from lnfold.passes import LnfoldError
from lnfold.passes import plan as plan_module
from lnfold.passes import slicing
from lnfold.passes.approx import relative_error
from tests.onnx_graphs import INT64, VOCAB, Builder
from tests.test_rotate import _toy

D, T = 16, 5


def stream_model(span=None, readout=False, seed=0, batch="batch") -> onnx.ModelProto:
    """ids [batch, T] -> embedding + positions -> 2 pre-LN blocks (a Reshape to [-1, T, d] on the
    stream between them) -> final LN -> lm head (or, `readout`, the final LN's output itself).
    `span`: every writer's output side lies in one `span`-dimensional subspace of the d features
    (so does the centered stream). `batch`: a number fixes it, as an exporter with a fixed batch does."""
    b = Builder(seed, np.float64)
    ids = b.input("ids", INT64, [batch, T])
    rng = np.random.default_rng(seed + 7)
    onto = None if span is None else np.linalg.qr(rng.standard_normal((D, span)))[0]  # d x span, orthonormal

    def writer(base, shape, mean):
        name = b.weight(base, shape, mean=mean)
        if onto is not None:  # project the output side (the last axis) onto span(onto)
            t = numpy_helper.to_array(b.inits[-1]) @ onto @ onto.T
            b.inits[-1].CopyFrom(numpy_helper.from_array(t, name))
        return name

    h = b.op("Add", [b.op("Gather", [writer("emb", (VOCAB, D), 4.0), ids], axis=0), writer("pos", (T, D), -2.0)])
    for layer in range(2):
        u = b.op("Relu", [b.linear(b.layernorm(h, D), D, 2 * D)])
        h = b.op("Add", [h, b.op("Add", [b.op("MatMul", [u, writer("W", (2 * D, D), 0.0)]), writer("b", (D,), 3.0)])])
        if layer == 0:
            h = b.op("Reshape", [h, b.const("shape", np.array([-1, T, D], np.int64))])
    n = b.layernorm(h, D)
    y = n if readout else b.op("MatMul", [n, b.weight("head", (D, VOCAB))])
    b.output(y, shape=[batch, T, D if readout else VOCAB])
    return b.model(17)


def recentered_model(softmax_reader: bool = False, heads: int = 3) -> onnx.ModelProto:
    """x -> h = Relu(linear) -> Σ_k head_k(LN(k·h)): folds with a recenter (no constant writer), and
    rotates by a MatMul after it (tests/test_rotate_recentered.py). `softmax_reader`: a Softmax over
    the features reads h too (shift-invariant, so the fold stands, but not rotation-invariant): the
    stream cannot be rotated, so nothing can be sliced. With 3 `heads` a slice to 12 of 16 features
    would add parameters (the 16 × 12 MatMul after the recenter outweighs what the readers lose), so
    the stream keeps its width; with 6 it pays."""
    b = Builder(3, np.float64)
    x = b.input("ids", onnx.TensorProto.DOUBLE, ["batch", T, D])
    h = b.op("Relu", [b.linear(x, D, D)])
    outs = [b.op("MatMul", [b.layernorm(b.op("Mul", [h, b.const("k", np.array(1.0 + k))]), D),
                            b.weight("head", (D, VOCAB))]) for k in range(heads)]
    if softmax_reader:
        outs[2] = b.op("Add", [outs[2], b.op("MatMul", [b.op("Softmax", [h], axis=-1), b.weight("head", (D, VOCAB))])])
    y = outs[0]
    for o in outs[1:]:
        y = b.op("Add", [y, o])
    b.output(y, shape=["batch", T, VOCAB])
    return b.model(17)


def calibration(rows: int = 16, seed: int = 1, floats: bool = False) -> dict:
    if floats:
        return {"ids": np.random.default_rng(seed).standard_normal((rows, T, D))}
    return {"ids": np.random.default_rng(seed).integers(0, VOCAB, (rows, T)).astype(np.int64)}


def error_against_exact(result) -> float:
    """The sliced model's relative error against the exact fold, on fresh rows."""
    rows = [calibration(8, seed=99)]
    return relative_error(calibration_io.run(result.exact.model, rows), calibration_io.run(result.model, rows))


@pytest.mark.parametrize("readout", [False, True])
def test_full_width_slice_is_the_exact_fold(readout):
    """F→0 (k = d): every writer and reader is rotated by the calibrated Q, nothing deleted: the
    exact fold's outputs to float64 precision, although the weights changed."""
    r = lnfold.slice_onnx(stream_model(readout=readout), calibration(), fraction=0.01)
    (s,) = r.report.streams
    assert s.sliced and s.dim == s.keep == D and s.variance_kept == pytest.approx(1.0)
    assert error_against_exact(r) < 1e-13 and r.report.error < 1e-13
    exact = {t.name: numpy_helper.to_array(t) for t in r.exact.model.graph.initializer}
    changed = [t.name for t in r.model.graph.initializer
               if t.name not in exact or not np.array_equal(exact[t.name], numpy_helper.to_array(t))]
    assert len(changed) >= 8  # the writers and readers carry Q (not a no-op)


@pytest.mark.parametrize("readout", [False, True])
def test_stream_in_k_dimensions_slices_with_zero_error(readout):
    """The writers span 12 of 16 dimensions: at F = 0.25 (k = 12) only zero directions go — zero
    error, fewer parameters, the Reshape's d patched to k; at F = 0.5 real directions go."""
    model = stream_model(span=12, readout=readout)
    r = lnfold.slice_onnx(model, calibration(), fraction=0.25)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (D, 12) and s.variance_kept == pytest.approx(1.0, abs=1e-12)
    assert error_against_exact(r) < 1e-12
    assert r.report.params_after < r.report.params_before
    shapes = [numpy_helper.to_array(t).tolist() for t in r.model.graph.initializer if t.data_type == onnx.TensorProto.INT64]
    assert [-1, T, 12] in shapes and [-1, T, D] not in shapes
    assert "NOT exact" in r.report.table()
    meta = {p.key: p.value for p in r.model.metadata_props}
    assert meta[slicing.METADATA_KEY].startswith("NOT exact") and "16->12" in meta[slicing.METADATA_KEY]
    deeper = lnfold.slice_onnx(model, calibration(), fraction=0.5)
    assert deeper.report.streams[0].variance_kept < 1 - 1e-3 and error_against_exact(deeper) > 1e-3


def test_planted_bug_reader_left_unprojected(monkeypatch):
    """One reader of the stream left in the original basis: the full-width slice is no longer exact."""
    real = plan_module.plan_rotation

    def drop_one_reader(*a, **kw):
        rot = real(*a, **kw)
        return dataclasses.replace(rot, readers=rot.readers[:-1])

    monkeypatch.setattr(plan_module, "plan_rotation", drop_one_reader)
    r = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.01)
    assert error_against_exact(r) > 1e-3
    m, args = _toy()  # the torch frontend too (its full-width slice without the bug: error 4e-15)
    assert lnfold.slice_module(m.double(), args, fraction=0.005).report.error > 1e-3


def plant_unscaled(monkeypatch) -> None:
    """Planted bug: every sliced norm emitted without its √(d/k)."""
    real = plan_module._emissions

    def unscaled(*a, **kw):
        return {n: dataclasses.replace(e, scale=1.0) for n, e in real(*a, **kw).items()}

    monkeypatch.setattr(plan_module, "_emissions", unscaled)


def test_planted_bug_wrong_scale(monkeypatch):
    """The norm over k features without √(d/k) (or with ε not scaled and γ right): the zero-error
    slice is off by the factor."""
    plant_unscaled(monkeypatch)
    r = lnfold.slice_onnx(stream_model(span=12), calibration(), fraction=0.25)
    assert error_against_exact(r) > 1e-2


def _files(tmp_path, model: onnx.ModelProto):
    """(model file, calibration .npz, output path) for the command line."""
    src, cal, out = tmp_path / "m.onnx", tmp_path / "cal.npz", tmp_path / "sliced.onnx"
    onnx.save(model, src)
    np.savez(cal, **calibration())
    return src, cal, out


def _sliced_json(capsys, src, cal, out, *flags) -> dict:
    """`lnfold slice SRC -o OUT --calibrate CAL FLAGS --json` (it must succeed): its report."""
    assert cli.main(["slice", str(src), "-o", str(out), *flags, "--calibrate", str(cal), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_writes_the_slice_and_reports_it(tmp_path, capsys):
    src, cal, out = _files(tmp_path, stream_model(span=12))
    report = _sliced_json(capsys, src, cal, out, "--fraction", "0.25")
    assert report["exact"] is False and report["streams"][0]["keep"] == 12 and report["error"] < 1e-12
    assert report["params_after"] < report["params_before"]
    assert slicing.METADATA_KEY in {p.key for p in onnx.load(str(out)).metadata_props}
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal)]) == 0
    assert "NOT exact" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--fraction", "0.2"], "needs calibration inputs"),
    (["--fraction", "0", "--calibrate", "CAL"], "fraction must be in"),
    (["--fraction", "1", "--calibrate", "CAL"], "fraction must be in"),
    (["--fraction", "nan", "--calibrate", "CAL"], "fraction must be in"),
    (["--fraction", "0.2", "--calibrate", "CAL", "RECENTERED"], "no stream can be sliced"),
    (["--calibrate", "CAL"], "one of the arguments --fraction --budget is required"),
    (["--fraction", "0.2", "--budget", "0.1", "--calibrate", "CAL"], "not allowed with argument"),
    (["--budget", "-0.1", "--calibrate", "CAL"], "budget must be a finite number >= 0"),
    (["--budget", "nan", "--calibrate", "CAL"], "budget must be a finite number >= 0"),
    (["--budget", "x", "--calibrate", "CAL"], "invalid float value"),
    (["--budget", "0", "--calibrate", "CAL"], "no slicing that deletes a feature keeps the error within the budget 0"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, argv, msg):
    src, cal, out = tmp_path / "m.onnx", tmp_path / "cal.npz", tmp_path / "sliced.onnx"
    recentered = "RECENTERED" in argv
    onnx.save(recentered_model(softmax_reader=True) if recentered else stream_model(), src)
    np.savez(cal, **calibration(floats=recentered))
    argv = [str(cal) if a == "CAL" else a for a in argv if a != "RECENTERED"]
    try:
        code = cli.main(["slice", str(src), "-o", str(out), *argv])
    except SystemExit as usage:  # argparse's own errors (a missing or conflicting option): the parser's exit
        code = usage.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err
    assert set(tmp_path.iterdir()) == {src, cal}


def test_api_bad_inputs():
    with pytest.raises(LnfoldError, match="needs calibration"):
        lnfold.slice_onnx(stream_model(), None, fraction=0.2)
    with pytest.raises(LnfoldError, match="fraction must be"):
        lnfold.slice_onnx(stream_model(), calibration(), fraction=1.5)
    with pytest.raises(LnfoldError, match="no stream can be sliced.*Softmax.*neither one of its norms nor transparent"):
        lnfold.slice_onnx(recentered_model(softmax_reader=True), calibration(floats=True), fraction=0.2)


# --- --budget B: the largest fraction whose held-out error is <= B ----------------------------------

def test_budget_finds_the_width_the_stream_truly_has():
    """The writers span 12 of 16 dimensions: every F with k >= 12 slices with ~1e-15 error, every F
    with k < 12 deletes real directions (> 1e-3). A budget between finds k = 12 exactly: the largest
    grid fraction with round(16·F) = 4 (F = 0.275), by bisection."""
    r = lnfold.slice_onnx(stream_model(span=12), calibration(), budget=1e-10)
    (s,) = r.report.streams
    assert (s.dim, s.keep) == (D, 12) and r.report.fraction == pytest.approx(0.275)
    assert r.report.error <= 1e-10 and error_against_exact(r) < 1e-12
    (note,) = r.report.notes
    assert note.startswith("budget 1e-10: F=0.275") and "F=0.025" in note and "F=0.3:" in note  # its neighbour, over


def test_budget_zero_refuses_and_a_generous_one_slices_to_the_grid_end():
    """A full-rank stream: even the smallest fraction has error > 0 (one try, then a refusal); a
    budget no slicing exceeds keeps the largest fraction (two tries: the grid's ends)."""
    with pytest.raises(LnfoldError, match=r"no slicing that deletes a feature keeps the error within the budget 0 "
                                          r"\(F=0.025 gives"):
        lnfold.slice_onnx(stream_model(), calibration(), budget=0)
    r = lnfold.slice_onnx(stream_model(), calibration(), budget=1e6)
    assert r.report.fraction == pytest.approx(0.975) and r.report.streams[0].keep == 1
    assert r.report.notes[0].count("F=") == 3  # the chosen one, and the two tried


def test_budget_api_needs_exactly_one_of_fraction_and_budget():
    for kw in ({}, {"fraction": 0.2, "budget": 0.1}):
        with pytest.raises(LnfoldError, match="exactly one of a fraction"):
            lnfold.slice_onnx(stream_model(), calibration(), **kw)
    with pytest.raises(LnfoldError, match="budget must be"):
        lnfold.slice_onnx(stream_model(), calibration(), budget="lots")


def test_cli_budget_writes_the_slice_it_chose(tmp_path, capsys):
    src, cal, out = _files(tmp_path, stream_model(span=12))
    report = _sliced_json(capsys, src, cal, out, "--budget", "1e-10")
    assert report["fraction"] == pytest.approx(0.275) and report["streams"][0]["keep"] == 12
    assert report["error"] <= 1e-10 and report["notes"][0].startswith("budget 1e-10")
    assert "16->12" in {p.key: p.value for p in onnx.load(str(out)).metadata_props}[slicing.METADATA_KEY]


def test_torch_budget():
    """slice_module takes the same budget (the search is passes/slicer's, tested above on ONNX): a
    generous one -> the grid's largest fraction, its folds sharing one export."""
    m, _, ids = _zoo_gpt2()
    r = lnfold.slice_module(m, (ids,), budget=1e6)
    assert r.report.fraction == pytest.approx(0.975) and r.report.streams[0].keep == 2  # 64 - round(62.4)


# --- torch (fx_rewrite/slice.py): the same plan through torch.export ---------------------------------

def _zoo_gpt2():
    from lnfold import zoo
    import torch

    m, args = zoo.gpt2()
    ids = torch.randint(0, 101, (8, 9), generator=torch.Generator().manual_seed(5))
    return m, args, ids


def test_torch_full_width_slice_is_the_exact_fold():
    """k = d (d = 64, F = 0.005) in float64: the calibrated rotation reproduces the exact fold."""
    m, _, ids = _zoo_gpt2()
    r = lnfold.slice_module(m.double(), (ids,), fraction=0.005)
    (s,) = r.report.streams
    assert s.sliced and s.dim == s.keep == 64
    assert r.report.error < 1e-12


def test_both_frontends_slice_the_same_streams_with_the_same_widths(zoo_onnx):
    m, args, ids = _zoo_gpt2()
    t = lnfold.slice_module(m, (ids,), fraction=0.25)
    o = lnfold.slice_onnx(zoo_onnx("gpt2")[2], {"input_ids": ids.numpy()}, fraction=0.25)
    widths = [[(s.norms and len(s.norms), s.dim, s.keep) for s in r.report.streams] for r in (t, o)]
    assert widths[0] == widths[1] == [(5, 64, 48)]
    assert t.report.streams[0].variance_kept == pytest.approx(o.report.streams[0].variance_kept, abs=1e-6)
    assert t.report.error == pytest.approx(o.report.error, rel=0.05)
    # (ONNX also counts its norms' unit γ vectors and a few scalar constants)
    assert t.report.params_after == pytest.approx(o.report.params_after, rel=1e-3)
    assert t.report.params_before == pytest.approx(o.report.params_before, rel=1e-2)


def test_slice_then_quantize(tmp_path, zoo_onnx):
    """The order is slice, then quantize: the sliced file's norms are RMSNorms already, so `quantize`
    quantizes it as given (nothing left to fold), and the int8 model stays near the sliced one."""
    m, args, ids = _zoo_gpt2()
    feeds = {"input_ids": ids.numpy()}
    sliced = lnfold.slice_onnx(zoo_onnx("gpt2")[2], feeds, fraction=0.25)
    onnx.save(sliced.model, tmp_path / "sliced.onnx")
    q = lnfold.quantize_onnx(tmp_path / "sliced.onnx", weights="int8", inputs=feeds)
    assert q.report.linear_layers > 0 and "nothing folded" in q.report.table()
    assert relative_error(calibration_io.run(sliced.model, [feeds]), calibration_io.run(q.model, [feeds])) < 0.1


# --- per-block bases (passes/segments.py): a basis per block input, the shortcuts re-expressed -----

def _shortcut_matmuls(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "MatMul" and any("lnfold_shortcut" in i for i in n.input))


@pytest.mark.parametrize("readout", [False, True])
def test_per_block_full_width_is_the_exact_fold(readout):
    """k = d with a basis per block input (3 norms: 3 bases) and a d×d MatMul on each of the 2
    residual shortcuts: a pure change of basis, the exact fold's outputs to float64 precision."""
    r = lnfold.slice_onnx(stream_model(readout=readout), calibration(), fraction=0.01, per_block=True)
    (s,) = r.report.streams
    assert s.sliced and s.dim == s.keep == D and s.bases == 3 and not s.one_basis_why
    assert _shortcut_matmuls(r.model) == 2 and "3 per-block bases" in r.report.table()
    assert error_against_exact(r) < 1e-13 and r.report.error < 1e-13


def test_per_block_beats_one_basis_on_the_test_stream():
    """F = 0.25 on the random-weight test stream (full rank): each block's own basis keeps more of its
    norm's input than the pooled one, and the held-out error is lower (measured: about half)."""
    one = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25)
    per = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True)
    assert per.report.streams[0].variance_kept > one.report.streams[0].variance_kept
    assert error_against_exact(per) < 0.75 * error_against_exact(one)


def test_per_block_bases_take_raw_moments_one_basis_unit_rms_rows(monkeypatch):
    """A segment's basis comes from its inputs' raw second moment (SliceGPT's: a few massive tokens
    set its leading directions); one basis pooled over every norm, from unit-RMS rows (pooled raw
    moments are the deepest layers' massive activations': SmolLM2 F=0.25, 161 against 76.5)."""
    x = np.ones((1, 4, 3))
    x[0, 0] = [100.0, 0.0, 0.0]  # (one massive row along e0; three small ones along 1 = (1, 1, 1))
    raw, unit = (slicing.principal_basis(slicing.second_moment([x], -1, unit_rms=u)[0])[0][:, 0] for u in (False, True))
    assert abs(raw[0]) > 0.99 and np.allclose(np.abs(unit), 1 / np.sqrt(3), atol=0.2)
    asked = []
    real = slicing.second_moment
    monkeypatch.setattr(slicing, "second_moment", lambda b, a, unit_rms=True: asked.append(unit_rms) or real(b, a, unit_rms))
    lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True)
    assert asked and not any(asked)
    asked.clear()
    lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25)
    assert asked and all(asked)


def test_per_block_planted_bug_shortcut_skipped(monkeypatch):
    """The shortcut MatMuls left out (x_l added in Q_l's basis to a sum in Q_l+1's): the full-width
    per-block slice is no longer exact (the plan is the frontends' shared one)."""
    real = plan_module.plan_rotation

    def no_shortcuts(*a, **kw):
        rot = real(*a, **kw)
        return dataclasses.replace(rot, shortcuts=())

    monkeypatch.setattr(plan_module, "plan_rotation", no_shortcuts)
    r = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.01, per_block=True)
    assert _shortcut_matmuls(r.model) == 0 and error_against_exact(r) > 1e-3


def test_per_block_falls_back_to_one_basis_with_why():
    """Six norms each read their own scaled copy of one tensor (parallel branches, no residual Add
    between them): no order of segments exists, so the stream keeps one basis and says why; the
    slice is then the one-basis slice."""
    one = lnfold.slice_onnx(recentered_model(heads=6), calibration(floats=True), fraction=0.25)
    per = lnfold.slice_onnx(recentered_model(heads=6), calibration(floats=True), fraction=0.25, per_block=True)
    (s,) = per.report.streams
    assert s.sliced and s.bases == 1 and "parallel branches" in s.one_basis_why
    assert "one basis:" in per.report.table() and _shortcut_matmuls(per.model) == 0
    assert per.report.error == pytest.approx(one.report.error, rel=1e-9)


def test_cli_per_block(tmp_path, capsys):
    src, cal, out = _files(tmp_path, stream_model())
    report = _sliced_json(capsys, src, cal, out, "--fraction", "0.01", "--per-block")
    assert report["streams"][0]["bases"] == 3 and report["error"] < 1e-13
    assert _shortcut_matmuls(onnx.load(str(out))) == 2


def test_torch_per_block_full_width_is_the_exact_fold():
    """The torch frontend: 5 norms, 5 bases, 4 shortcuts (one per residual Add), exact at k = d."""
    m, _, ids = _zoo_gpt2()
    r = lnfold.slice_module(m.double(), (ids,), fraction=0.005, per_block=True)
    (s,) = r.report.streams
    assert s.dim == s.keep == 64 and s.bases == 5
    assert sum(1 for n in r.module.graph.nodes if n.op == "get_attr" and "lnfold_shortcut" in n.target) == 4
    assert r.report.error < 1e-12


# --- full_width_head: the last segment (what the head reads) keeps all d features, as SliceGPT's head

def _head_width(model: onnx.ModelProto) -> int:
    """The rows of the head's weight (the final norm's reader): d, or k where it is sliced."""
    inits = {t.name: t for t in model.graph.initializer}
    (head,) = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
               and inits[n.input[1]].dims[-1] == VOCAB]
    return inits[head.input[1]].dims[0]


def test_full_width_head_keeps_the_last_segment_d_wide():
    """F = 0.25 per block: the head reads all 16 features, the shortcut into its segment is 12 × 16,
    the other segments keep 12; what the last slice deleted is back, so the error falls."""
    sliced = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True)
    full = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True, full_width_head=True)
    (s,) = full.report.streams
    assert (s.keep, s.bases) == (12, 3) and len(s.full_width) == 1 and "read(s) all 16 features" in s.line()
    assert _head_width(sliced.model) == 12 and _head_width(full.model) == D
    inits = {t.name: t.dims for t in full.model.graph.initializer if "lnfold_shortcut" in t.name}
    assert sorted(tuple(d) for d in inits.values()) == [(12, 12), (12, D)]
    assert full.report.params_after > sliced.report.params_after
    assert error_against_exact(full) < 0.9 * error_against_exact(sliced)


def test_full_width_head_of_a_stream_in_k_dimensions_has_zero_error():
    """Writers spanning 12 of 16 dimensions, k = 12: the 12 × 16 shortcut into the full-width head
    segment re-expresses exactly what the sliced segments carry (zero error, float64)."""
    r = lnfold.slice_onnx(stream_model(span=12), calibration(), fraction=0.25, per_block=True, full_width_head=True)
    assert _head_width(r.model) == D and error_against_exact(r) < 1e-12


def test_full_width_head_planted_bug_shortcut_padded(monkeypatch):
    """The k features padded into the d-wide segment without the change of basis (the identity where
    B_sᵀ·B_t belongs): the zero-error slice above is no longer exact."""
    from lnfold.passes import rotate

    real = rotate.BasisShortcut.matrix
    monkeypatch.setattr(rotate.BasisShortcut, "matrix", lambda sc: np.eye(sc.source_keep, sc.target_keep)
                        if sc.source_keep != sc.target_keep else real(sc))
    r = lnfold.slice_onnx(stream_model(span=12), calibration(), fraction=0.25, per_block=True, full_width_head=True)
    assert error_against_exact(r) > 1e-2


def test_full_width_head_needs_per_block(tmp_path, capsys):
    src, cal, out = _files(tmp_path, stream_model())
    with pytest.raises(LnfoldError, match="give per_block"):
        lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, full_width_head=True)
    assert cli.main(["slice", str(src), "-o", str(out), "--fraction", "0.25", "--calibrate", str(cal),
                     "--full-width-head"]) != 0
    assert "--per-block" in capsys.readouterr().err and not out.exists()
    report = _sliced_json(capsys, src, cal, out, "--fraction", "0.25", "--per-block", "--full-width-head")
    assert _head_width(onnx.load(str(out))) == D and report["streams"][0]["full_width"]


def test_torch_full_width_head_matches_onnx(zoo_onnx):
    """The torch frontend keeps the head segment d wide too: same widths, same error as ONNX."""
    m, args, ids = _zoo_gpt2()
    t = lnfold.slice_module(m, (ids,), fraction=0.25, per_block=True, full_width_head=True)
    o = lnfold.slice_onnx(zoo_onnx("gpt2")[2], {"input_ids": ids.numpy()}, fraction=0.25, per_block=True,
                          full_width_head=True)
    assert len(t.report.streams[0].full_width) == len(o.report.streams[0].full_width) == 1
    assert t.report.error == pytest.approx(o.report.error, rel=0.1)
    head = lnfold.slice_module(m, (ids,), fraction=0.25, per_block=True)
    assert t.report.error < head.report.error and t.report.params_after > head.report.params_after


# --- sequential per-block bases (passes/slicer.sequential): segment i's basis on the model sliced before it

def _sequential_pieces(model: onnx.ModelProto, fraction: float):
    """The ONNX slicer's pieces: its frontend, the exact fold's captures, and the per-block decision
    over any captures (passes/slicer.slice_with's, taken apart)."""
    from lnfold.onnx_rewrite import targets
    from lnfold.onnx_rewrite.slice import slicing_frontend

    frontend = slicing_frontend(model, targets.resolve("ort", "cpu"), calibration_io.calibration_data(model, calibration()),
                                None)
    exact = frontend.exact(plan_module.make_plan)
    captured = frontend.capture(exact, list(exact.plan.needs))
    view, plan = exact.view, exact.plan
    stream_of = {v.name: v.stream for v in plan.report.norms if v.verdict == "fold"}

    def decide(captures):
        return slicing.plan_slices(view, list(plan.components), plan.gammas, stream_of, captures, fraction, True)

    return frontend, captured, decide


def _kept_projector(decided, head) -> np.ndarray:
    q, k = decided.bases[head]
    return q.array[:, :k] @ q.array[:, :k].T


@pytest.mark.parametrize("plant", [None, "rotated"])
def test_sequential_capture_shows_the_sliced_upstream_at_full_width(monkeypatch, plant):
    """Segment 1's norm input in the model sliced at segment 0 (d = 16, k = 12), captured in one fold
    with segment 1 kept at all 16 features in the stream's own basis, is the full-width tensor:
    slicing segment 1 in a random orthogonal basis instead shows exactly its projection (float64).
    It is not the exact fold's (the upstream deletion changed it). Planted bug — segment 1 carried in
    another basis than the stream's own — breaks the identity."""
    from lnfold.passes import edits, slicer
    from lnfold.passes.edits import DataBasis

    if plant == "rotated":
        turn = np.linalg.qr(np.random.default_rng(5).standard_normal((D, D)))[0]
        monkeypatch.setattr(edits, "Identity", lambda d: DataBasis("planted", turn))
    frontend, captured, decide = _sequential_pieces(stream_model(), 0.25)
    decided = decide(captured)
    ((s, heads),) = decided.order
    got = slicer.full_width_inputs(frontend, plan_module.make_plan, decided, [(s, heads[1])])
    (value,) = got
    assert all(g.shape[-1] == D for g in got[value])
    r = np.linalg.qr(np.random.default_rng(4).standard_normal((D, D)))[0]
    bases = {**decided.bases, heads[1]: (DataBasis("random", r), s.keep)}
    seen = frontend.capture(frontend.sliced(bases, plan_module.make_plan), [value])[value]
    mismatch = max(np.abs(g @ r[:, :s.keep] - x).max() / np.abs(x).max() for g, x in zip(got[value], seen))
    if plant is None:
        assert mismatch < 1e-12
        moved = max(np.abs(g - c).max() / np.abs(c).max() for g, c in zip(got[value], captured[value]))
        assert moved > 1e-3
    else:
        assert mismatch > 1e-3


def test_sequential_bases_differ_from_one_shot_and_slice_as_well():
    """Full-rank test stream, F = 0.25, 3 segments: segment 0's basis is the exact fold's (nothing is
    sliced before it), segments 1 and 2 get other kept subspaces; 2 steps, a sliced fold each, said in
    the report; the slice has the same widths and shortcuts as the one-shot one,
    and its held-out error is no worse than 1.1× it."""
    from lnfold.passes import slicer

    frontend, captured, decide = _sequential_pieces(stream_model(), 0.25)
    one = decide(captured)
    seq, folds = slicer.sequential(frontend, plan_module.make_plan, decide, captured)
    ((_, heads),) = seq.order
    assert folds == 2 and len(heads) == 3
    assert np.allclose(_kept_projector(seq, heads[0]), _kept_projector(one, heads[0]), atol=1e-10)
    for head in heads[1:]:
        assert np.abs(_kept_projector(seq, head) - _kept_projector(one, head)).max() > 1e-3
    r = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25, per_block=True)
    (s,) = r.report.streams
    assert (s.dim, s.keep, s.bases) == (D, 12, 3) and _shortcut_matmuls(r.model) == 2
    assert any("2 sliced fold(s)" in n for n in r.report.notes)
    one_shot = lnfold.slice_onnx(stream_model(), calibration(), fraction=0.25)  # one basis: the floor to beat
    assert error_against_exact(r) < error_against_exact(one_shot)


def test_sequential_bases_of_a_stream_in_k_dimensions_are_the_one_shot_ones():
    """Writers spanning 12 of 16 dimensions, k = 12: slicing the upstream deletes nothing, so every
    segment sees the exact fold's rows and keeps the same subspace; the slice has zero error."""
    from lnfold.passes import slicer

    frontend, captured, decide = _sequential_pieces(stream_model(span=12), 0.25)
    one = decide(captured)
    seq, _ = slicer.sequential(frontend, plan_module.make_plan, decide, captured)
    for head in seq.bases:
        assert np.allclose(_kept_projector(seq, head), _kept_projector(one, head), atol=1e-9)
    assert error_against_exact(lnfold.slice_onnx(stream_model(span=12), calibration(), fraction=0.25,
                                                 per_block=True)) < 1e-12


def test_torch_sequential_per_block_matches_onnx(zoo_onnx):
    """The torch frontend captures segment inputs in its sliced graph modules too: at F = 0.25 it
    takes the same sliced folds as ONNX and lands on the same error."""
    m, args, ids = _zoo_gpt2()
    t = lnfold.slice_module(m, (ids,), fraction=0.25, per_block=True)
    o = lnfold.slice_onnx(zoo_onnx("gpt2")[2], {"input_ids": ids.numpy()}, fraction=0.25, per_block=True)
    assert t.report.notes == o.report.notes and "4 sliced fold(s)" in t.report.notes[0]
    assert t.report.streams[0].bases == o.report.streams[0].bases == 5
    # (per-block bases come from raw second moments, where a row weighs its norm²: the two runtimes'
    # float32 captures differ in the last bits and move near-equal eigenvectors a little more)
    assert t.report.error == pytest.approx(o.report.error, rel=0.1)


def _tied_model(vocab: int = 400) -> onnx.ModelProto:
    """ids -> Gather(E) + positions -> one pre-LN block -> final LN -> MatMul(Transpose(E)): a table
    shared by the embedding (the stream's writer) and the head (a reader). γ into the head writes the
    table apart, so a fold has one more V×d table than the model; with V ≫ d a small slice cannot pay for it."""
    b = Builder(0, np.float64)
    ids = b.input("ids", INT64, ["batch", T])
    table = b.weight("emb", (vocab, D), mean=2.0)
    h = b.op("Add", [b.op("Gather", [table, ids], axis=0), b.weight("pos", (T, D), mean=-1.0)])
    u = b.op("Relu", [b.linear(b.layernorm(h, D), D, 2 * D)])
    h = b.op("Add", [h, b.linear(u, 2 * D, D)])
    b.output(b.op("MatMul", [b.layernorm(h, D), b.op("Transpose", [table], perm=[1, 0])]), shape=["batch", T, vocab])
    return b.model(17)


def test_a_slice_that_unties_a_shared_table_never_adds_parameters():
    """Issue 45 item 4 at the whole model (SmolLM2 at F = 0.1: 1.09x its parameters): against the
    model's own count, not the exact fold's (which has the table twice already). Refused with the
    clone named; a fraction that pays for the clone slices."""
    model = _tied_model()
    rows = {"ids": np.random.default_rng(1).integers(0, 400, (16, T)).astype(np.int64)}
    with pytest.raises(LnfoldError, match=r"^slicing at F=0.05 would leave [\d,]+ parameters, more than the model's "
                                          r"own 7,616 \(a weight shared .*`emb_1`.*give a larger fraction$"):
        lnfold.slice_onnx(model, rows, fraction=0.05)
    r = lnfold.slice_onnx(model, rows, fraction=0.6)
    assert r.report.params_after < r.report.params_original == 7616 < r.report.params_before
    assert "the model's own: 7,616" in r.report.table()
