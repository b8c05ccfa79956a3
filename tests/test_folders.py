"""Issue 24 item 4: `lnfold fold DIR` on an exporter's folder, `-o` by default, external data
kept in its layout, atomic output.

The folder is built in each test from corpus files Optimum wrote (optimum-onnx `main_export` of a
Whisper: encoder, decoder, decoder-with-past and the merged decoder, under the names Optimum gives
them), the encoder saved with its weights in `encoder_model.onnx_data` as Optimum does for big
models, a PaddleOCR classifier with no LayerNorm, and a config and tokenizer file.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests import onnx_graphs as G

CORPUS = Path(__file__).parent / "corpus"
OPTIMUM_WHISPER = {
    "decoder_model.onnx": "optimum_whisper_decoder_model.onnx",
    "decoder_with_past_model.onnx": "optimum_whisper_decoder_with_past_model.onnx",
    "decoder_model_merged.onnx": "optimum_whisper_decoder_model_merged.onnx",
}
NORMS = {"LayerNormalization", "SkipLayerNormalization"}


def lnfold(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lnfold", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def optimum_folder(where: Path) -> Path:
    d = where / "whisper_onnx"
    d.mkdir()
    for name, corpus in OPTIMUM_WHISPER.items():
        shutil.copy(CORPUS / corpus, d / name)
    encoder = onnx.load(str(CORPUS / "optimum_whisper_encoder_model.onnx"))
    onnx.save_model(encoder, str(d / "encoder_model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="encoder_model.onnx_data", size_threshold=1024)
    shutil.copy(CORPUS / "rapidocr_ch_ppocr_mobile_v2.0_cls_infer.onnx", d / "classifier.onnx")
    (d / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    (d / "tokenizer.json").write_text("{}")
    return d


def locations(model_file: Path) -> set[str]:
    m = onnx.load(str(model_file), load_external_data=False)
    return {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}


def test_optimum_folder_folds_every_file_in_one_report(tmp_path):
    src = optimum_folder(tmp_path)
    before = digest(src)
    r = lnfold("fold", src, "-o", tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    js = json.loads(r.stdout)
    assert sorted(js["folded"]) == ["decoder_model.onnx", "decoder_model_merged.onnx",
                                    "decoder_with_past_model.onnx", "encoder_model.onnx"]
    assert all(f["verified"] and f["report"]["kept"] == 0 for f in js["folded"].values())
    assert list(js["unchanged"]) == ["classifier.onnx"] and "no LayerNorm" in js["unchanged"]["classifier.onnx"]
    assert sorted(js["copied"]) == ["config.json", "tokenizer.json"]
    assert sorted(digest(out)) == sorted(before)  # the same files, the data file included
    after = digest(out)
    for same in ("classifier.onnx", "config.json", "tokenizer.json"):
        assert after[same] == before[same]
    for name in js["folded"]:
        m = onnx.load(str(out / name))
        ops = {n.op_type for n in m.graph.node} | {n.op_type for n in m.graph.node for a in n.attribute
                                                   for n in a.g.node}  # (the merged file's If branches)
        assert not ops & NORMS and "SimplifiedLayerNormalization" in ops, name
    assert digest(src) == before  # the input is untouched
    assert not list(tmp_path.glob(".lnfold-*"))


def test_external_data_comes_back_in_its_layout(tmp_path):
    """The encoder's weights were in `encoder_model.onnx_data`: so are the folded encoder's, and
    onnxruntime runs it from there; before, the fold came back as one file."""
    src = optimum_folder(tmp_path)
    out = tmp_path / "out"
    assert lnfold("fold", src, "-o", out).returncode == 0
    folded = out / "encoder_model.onnx"
    assert locations(folded) == {"encoder_model.onnx_data"}
    assert folded.stat().st_size < (out / "encoder_model.onnx_data").stat().st_size
    sess = ort.InferenceSession(str(folded))
    (x,) = sess.get_inputs()
    feeds = {x.name: np.random.default_rng(0).standard_normal([1, 8, 3000]).astype(np.float32)}
    ref = ort.InferenceSession(str(src / "encoder_model.onnx")).run(None, feeds)[0]
    assert np.allclose(sess.run(None, feeds)[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_default_outputs_and_a_single_file_keeps_its_data_file_name(tmp_path):
    model = G.save_model(G.pre_ln(d=64), tmp_path / "model.onnx", external=True)  # model.onnx.data
    r = lnfold("fold", model)
    assert r.returncode == 0, r.stderr
    assert locations(tmp_path / "model.folded.onnx") == {"model.folded.onnx.data"}  # beside, renamed along
    (tmp_path / "elsewhere").mkdir()
    assert lnfold("fold", model, "-o", tmp_path / "elsewhere" / "model.onnx").returncode == 0
    assert locations(tmp_path / "elsewhere" / "model.onnx") == {"model.onnx.data"}  # the same name
    folder = optimum_folder(tmp_path)
    assert lnfold("fold", folder, "--no-verify").returncode == 0
    assert (tmp_path / "whisper_onnx.folded" / "decoder_model.onnx").is_file()


def test_a_failing_file_leaves_no_output_folder(tmp_path):
    src = optimum_folder(tmp_path)
    (src / "zz_broken.onnx").write_bytes(b"not an onnx model")
    r = lnfold("fold", src, "-o", tmp_path / "out")
    assert r.returncode == 2 and "zz_broken.onnx" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".lnfold-*"))


@pytest.mark.parametrize("kind,message", [
    ("checkpoint", "config.json: cannot read it as a transformers config"),  # (a checkpoint now: issue 25)
    ("empty", "is a directory with no ONNX file in it"),
    ("output exists", "exists; choose another output folder"),
    ("output inside", "inside the input folder"),
])
def test_folders_it_cannot_fold_are_one_line_errors(tmp_path, kind, message):
    src = tmp_path / "in"
    src.mkdir()
    out = tmp_path / "out"
    if kind == "checkpoint":
        (src / "config.json").write_text("{}")
        (src / "model.safetensors").write_bytes(b"\0" * 8)
    elif kind != "empty":
        G.save_model(G.pre_ln(), src / "model.onnx")
    if kind == "output exists":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    if kind == "output inside":
        out = src / "sub"
    r = lnfold("fold", src, "-o", out)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if kind == "output exists":
        assert (out / "mine.txt").read_text() == "keep me"
