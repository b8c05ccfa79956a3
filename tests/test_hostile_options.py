"""Issue 43, item 7, item 11 and its last line: options checked before any work, a sparse
initializer edited as the values it stands for, duplicate initializer names refused.

Every refusal is the command's contract (README): one line on stderr starting `lnfold: error:`,
exit code 2, nothing written, and no work done first (the bench refusals name model files that
do not exist: a check made after loading would say that instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from lnfold.onnx_rewrite.cli import main as cli_main
from lnfold.passes import LnfoldError

from . import onnx_graphs as G


@dataclass
class Run:
    rc: int
    out: str
    err: str


@pytest.fixture
def cli(capfd, monkeypatch):
    """cli(*args, cwd=dir) -> Run: `lnfold ARGS` in this process (argparse's exit as the code)."""
    monkeypatch.delenv("LNFOLD_DEBUG", raising=False)

    def run(*args, cwd) -> Run:
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        try:
            rc = cli_main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
        out, err = capfd.readouterr()
        return Run(rc, out, err)

    return run


def refused(r: Run, *words: str) -> None:
    assert r.rc == 2, (r.rc, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lnfold: error:"), r.err
    for w in words:
        assert w in lines[0], (w, lines[0])


# --- item 11: options ---------------------------------------------------------------------------

@pytest.mark.parametrize("option,value,words", [
    ("--threads", "1000000", ["--threads", "1000000", "cores"]),  # before: onnxruntime hung making threads
    ("--seconds", "-1", ["--seconds", "-1"]),
    ("--seconds", "0", ["--seconds", "0"]),
    ("--seconds", "nan", ["--seconds", "nan"]),
    ("--seconds", "inf", ["--seconds", "inf"]),
])
def test_bench_refuses_bad_numbers_before_any_work(cli, tmp_path, option, value, words):
    """The model files do not exist: a refusal after loading them would name them instead."""
    r = cli("bench", "a.onnx", "b.onnx", option, value, cwd=tmp_path)
    refused(r, *words)
    assert "a.onnx" not in r.err


@pytest.mark.parametrize("value", ["nan", "-1", "0"])
def test_demo_refuses_bad_seconds_before_any_work(cli, tmp_path, value):
    r = cli("demo", "--seconds", value, cwd=tmp_path)
    refused(r, "--seconds")
    assert not r.out  # nothing exported, nothing folded


def test_bench_api_refuses_the_same_numbers():
    from lnfold.onnx_rewrite.bench import run_bench

    for kw in ({"threads": 10**6}, {"seconds": float("nan")}, {"seconds": -1.0}):
        with pytest.raises(LnfoldError) as e:
            run_bench("a.onnx", "b.onnx", **kw)
        assert "a.onnx" not in str(e.value) and "\n" not in str(e.value)


@pytest.fixture
def small(tmp_path) -> Path:
    return G.save_model(G.pre_ln(layers=1), tmp_path / "m.onnx")


def test_int4_block_size_onnxruntime_cannot_quantize_is_refused(cli, small):
    """Before: exit 3 after the fold (MLAS: 'Only block sizes 16, 32, 64, 128, 256 are supported').
    Not the layers' width: D = 8 features in blocks of 256 quantize (onnxruntime pads the block)."""
    for block in ("512", "65536"):
        r = cli("quantize", small, "-o", "q.onnx", "--weights", "int4", "--block-size", block, cwd=small.parent)
        refused(r, "block size", block, "256")
        assert not (small.parent / "q.onnx").exists() and not r.out
    r = cli("quantize", small, "-o", "q.onnx", "--weights", "int4", "--block-size", "256", cwd=small.parent)
    assert r.rc == 0, r.err


def test_an_empty_output_is_refused_for_a_file(cli, small):
    """Before: `-o ''` was taken as no -o, and the fold wrote m.folded.onnx."""
    r = cli("fold", small, "-o", "", cwd=small.parent)
    refused(r, "-o", "empty")
    assert sorted(p.name for p in small.parent.iterdir()) == ["m.onnx"]


def test_an_empty_output_is_refused_for_a_folder(cli, tmp_path):
    """Before: `lnfold fold DIR -o ''` wrote DIR.folded."""
    src = tmp_path / "export"
    src.mkdir()
    G.save_model(G.pre_ln(layers=1), src / "model.onnx")
    r = cli("fold", src, "-o", "", cwd=tmp_path)
    refused(r, "-o", "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.mark.parametrize("command", ["quantize", "slice"])
def test_an_empty_output_is_refused_by_the_file_commands(cli, small, command):
    extra = ["--weights", "int8"] if command == "quantize" else ["--fraction", "0.5"]
    r = cli(command, small, "-o", "", *extra, cwd=small.parent)
    refused(r, "-o", "empty")


# --- item 7: a sparse initializer as a reader's bias --------------------------------------------

def sparse_reader_model(weight_sparse: bool) -> onnx.ModelProto:
    """ids -> embedding (large means) -> LayerNorm (nonzero β) -> MatMul W + b, b a sparse
    initializer with 1-D (linearized) indices; with `weight_sparse`, W too, with [NNZ, 2] indices."""
    b = G.Builder(0)
    h = b.embed(b.input("ids", G.INT64, [2, G.T]))
    n = b.layernorm(h)
    w = b.rng.standard_normal((G.D, 4)).astype(np.float32)
    w[::2, 1] = 0
    bias = np.array([0.0, 1.5, 0.0, -2.0], np.float32)
    y = b.op("Add", [b.op("MatMul", [n, "W_sparse" if weight_sparse else b.const("W", w)]), "b_sparse"])
    b.output(y, shape=[2, G.T, 4])
    m = b.model(17)
    nz = np.nonzero(bias)[0]
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        numpy_helper.from_array(bias[nz], "b_sparse"), numpy_helper.from_array(nz.astype(np.int64), "b_idx"), [4]))
    if weight_sparse:
        at = np.argwhere(w != 0)
        m.graph.sparse_initializer.append(helper.make_sparse_tensor(
            numpy_helper.from_array(w[w != 0], "W_sparse"), numpy_helper.from_array(at.astype(np.int64), "W_idx"),
            list(w.shape)))
    onnx.checker.check_model(m)
    return m


def _run(path: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"ids": ids})[0]


@pytest.mark.parametrize("extra", [[], ["--no-verify"], ["--gamma-into-readers"],
                                   ["--gamma-into-readers", "--no-verify"]])
@pytest.mark.parametrize("weight_sparse", [False, True])
def test_a_sparse_bias_takes_beta_and_the_folded_model_computes_the_same(cli, tmp_path, extra, weight_sparse):
    """Before: β folded into a float64 zero bias (graphsurgeon's reading of a sparse tensor):
    verification refused it (exit 1); --no-verify wrote a model onnxruntime cannot load."""
    src = G.save_model(sparse_reader_model(weight_sparse), tmp_path / "m.onnx")
    r = cli("fold", src, "-o", "f.onnx", *extra, cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "β into the bias" in r.out or "γ" in r.out or "--gamma" in " ".join(extra), r.out
    ids = np.random.default_rng(1).integers(0, G.VOCAB, size=(2, G.T)).astype(np.int64)
    want, got = _run(src, ids), _run(tmp_path / "f.onnx", ids)
    assert got.dtype == want.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


# --- last line: duplicate initializer names -----------------------------------------------------

def _duplicated(where: str) -> onnx.ModelProto:
    m = G.pre_ln(layers=1)
    first = m.graph.initializer[0]
    twin = numpy_helper.from_array(numpy_helper.to_array(first) * 0 + 5, first.name)
    if where == "initializer":
        m.graph.initializer.append(twin)
    else:  # a sparse initializer of the same name
        flat = numpy_helper.to_array(twin).reshape(-1)
        m.graph.sparse_initializer.append(helper.make_sparse_tensor(
            numpy_helper.from_array(flat, first.name), numpy_helper.from_array(np.arange(flat.size, dtype=np.int64),
                                                                                "idx"), list(twin.dims)))
    with pytest.raises(onnx.checker.ValidationError, match="not unique|unique"):
        onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("where", ["initializer", "sparse"])
@pytest.mark.parametrize("command", ["fold", "report"])
def test_duplicate_initializer_names_are_refused(cli, tmp_path, where, command):
    """Before: folded (exit 0), whichever copy graphsurgeon kept deciding the weights."""
    src = G.save_model(_duplicated(where), tmp_path / "m.onnx")
    r = cli(command, src, *(["-o", "f.onnx"] if command == "fold" else []), cwd=tmp_path)
    refused(r, "emb_1", "twice")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_sparse_indices_outside_the_shape_are_the_inputs_fault(cli, tmp_path):
    """Index 7 of a 4-element bias: one line, exit 2 (before: folded as zeros, then exit 1)."""
    m = sparse_reader_model(False)
    idx = m.graph.sparse_initializer[0].indices
    idx.CopyFrom(numpy_helper.from_array(np.array([1, 7], np.int64), idx.name))
    src = G.save_model(m, tmp_path / "m.onnx")
    refused(cli("fold", src, "-o", "f.onnx", "--no-verify", cwd=tmp_path), "b_sparse", "do not fit")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
