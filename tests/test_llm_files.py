"""RMSNorm LLM files from the tools LLM users run (issue 47): onnxruntime-genai's model builder (fp32 CPU:
GroupQueryAttention with rotary inside, packed QKV, SkipSimplifiedLayerNormalization, the embedding a
Gather of the transposed lm_head), Optimum's export with and without past key/values and its merged
decoder (an If holding both), and onnxruntime's transformers optimizer on a dynamo export. The files
are committed in tests/corpus/ (tests/corpus/build_llm.py made them; their manifest entries carry
`rms_norms`), so no tool is needed here.

Each rotates exactly: verified against a float64 run (the genai file's GroupQueryAttention in
onnx_rewrite/contrib_attention.py, itself checked against onnxruntime's kernel below), and slices at a
fraction that keeps every direction to the exact fold. Planted bugs: a reader left unrotated fails the
float64 gate (the genai file, the merged decoder); a GroupQueryAttention whose rotary turns the wrong
way differs from onnxruntime's kernel.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import lnfold
from lnfold.passes import VerificationError

CORPUS = Path(__file__).parent / "corpus"
ENTRIES = [e for e in json.loads((CORPUS / "manifest.json").read_text())["files"]
           if "rms_norms" in e and (CORPUS / e["file"]).exists()]
GENAI = "genai_fp32_cpu_llama.onnx"
MERGED = "optimum_llama_decoder_model_merged.onnx"
# the fast tier folds the builder's file; the others are slow (a second or two each, and the same code)
FAST = {GENAI}


def _marks(name: str):
    return () if name in FAST else (pytest.mark.slow,)


def _params(names):
    return [pytest.param(n, marks=_marks(n), id=n) for n in names]


def rows(model: onnx.ModelProto, n: int = 16, t: int = 8, seed: int = 1) -> dict:
    """Calibration rows: token ids (the tokenizer's 125 words), an all-ones mask, positions, an
    empty past (a first prompt)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 125, (n, t)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((n, t), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(t), (n, t)).astype(np.int64).copy()
        elif i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((n, 2, 0, 16), np.float32)  # 2 kv heads of 16
        elif i.name == "use_cache_branch":  # the merged decoder: its branch without past (no batch axis)
            feeds[i.name] = np.array([False])
        else:
            raise AssertionError(f"no rows for input {i.name}")
    return feeds


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(str(CORPUS / name))


def _entry(name: str) -> dict:
    return next(e for e in ENTRIES if e["file"] == name)


@pytest.mark.parametrize("name", _params([e["file"] for e in ENTRIES]))
def test_an_llm_file_rotates_exactly(name):
    entry = _entry(name)
    r = lnfold.fold_onnx(_load(name), rotate="hadamard")  # raises unless verified
    both = "; verified on both branches of If `optimum::if` (use_cache_branch False and True)" if "merged" in name else ""
    assert r.criterion == "float64" + both and r.exact_err <= max(2 * r.original_exact_err, 1e-6), (r.criterion, r)
    rotated = [s for s in r.report.streams if s.rotation.startswith("rotated (hadamard, d=64")]
    assert len(rotated) == entry["expected_rotated"] * (2 if "If" in entry["graph_count"]["ops"] else 1), \
        r.report.table()
    assert len(r.report.rms_norms) == entry["rms_norms"]
    assert all(x.gamma.startswith("into the weight of") for x in r.report.rms_norms), r.report.table()


def test_the_genai_builders_file_keeps_its_fused_ops():
    m = _load(GENAI)
    r = lnfold.fold_onnx(m, rotate="hadamard")
    ops = [n.op_type for n in r.model.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and ops.count("SkipSimplifiedLayerNormalization") == 4
    feeds = rows(m, n=2)
    want = ort.InferenceSession(m.SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(r.model.SerializeToString()).run(None, feeds)
    for w, g in zip(want, got):  # logits and the KV cache (head space: untouched by the rotation)
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max()


# genai_config.json as the builder wrote it for the corpus file (model part; search defaults)
_GENAI_CONFIG = {"model": {"bos_token_id": 126, "context_length": 128, "eos_token_id": 127, "pad_token_id": 127,
                           "type": "llama", "vocab_size": 128, "decoder": {
                               "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                               "filename": "model.onnx", "head_size": 16, "hidden_size": 64,
                               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                               "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                          "past_key_names": "past_key_values.%d.key",
                                          "past_value_names": "past_key_values.%d.value"},
                               "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                           "present_value_names": "present.%d.value"}}},
                 "search": {"do_sample": False, "max_length": 128, "num_beams": 1, "past_present_share_buffer": True}}


@pytest.mark.slow
def test_the_rotated_genai_file_decodes_in_onnxruntime_genai(tmp_path):
    """The rotated file in the runtime it was built for: a prompt, then 7 tokens decoded through its
    shared-buffer KV cache (the past GroupQueryAttention reads, which verification's first prompt does
    not), logits as the original's."""
    og = pytest.importorskip("onnxruntime_genai")
    logits = []
    for name in ("original", "rotated"):
        d = tmp_path / name
        d.mkdir()
        (d / "genai_config.json").write_text(json.dumps(_GENAI_CONFIG))
        m = _load(GENAI)
        onnx.save(m if name == "original" else lnfold.fold_onnx(m, rotate="hadamard").model, str(d / "model.onnx"))
        model = og.Model(str(d))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=16, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([[5, 17, 42, 99, 3, 7]], np.int32))
        steps = []
        for _ in range(8):
            steps.append(np.array(gen.get_logits()).reshape(-1).copy())
            gen.generate_next_token()
        logits.append(np.stack(steps))
    want, got = logits
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow
def test_the_merged_decoder_rotates_both_branches():
    m = _load(MERGED)
    r = lnfold.fold_onnx(m, rotate="hadamard")
    a, b = (ort.InferenceSession(x.SerializeToString()) for x in (m, r.model))
    rng = np.random.default_rng(0)
    for use_cache, past in ((False, 1), (True, 3)):  # (the no-past branch still takes a past input)
        feeds = {"input_ids": rng.integers(0, 125, (2, 5)), "use_cache_branch": np.array([use_cache]),
                 "attention_mask": np.ones((2, (past if use_cache else 0) + 5), np.int64),
                 "position_ids": np.broadcast_to(np.arange(5) + (past if use_cache else 0), (2, 5)).astype(np.int64)}
        feeds.update({i.name: rng.standard_normal((2, 2, past, 16)).astype(np.float32)
                      for i in a.get_inputs() if i.name.startswith("past")})
        for w, g in zip(a.run(None, feeds), b.run(None, feeds)):
            assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), use_cache


@pytest.mark.parametrize("name", _params([e["file"] for e in ENTRIES if "If" not in e["graph_count"]["ops"]]))
def test_an_llm_file_slices_to_the_exact_fold(name):
    m = _load(name)
    calib = rows(m)
    full = lnfold.slice_onnx(m, calib, fraction=0.005)  # round(0.005 · 64) = 0 directions deleted
    assert full.report.streams[0].keep == 64 and full.report.error < 1e-5, full.report
    sliced = lnfold.slice_onnx(m, calib, fraction=0.2)
    assert sliced.report.streams[0].keep == 51 and sliced.report.params_after < sliced.report.params_before
    assert 0 < sliced.report.error < 0.1, sliced.report


@pytest.mark.parametrize("name", _params([GENAI, MERGED]))
def test_a_reader_left_unrotated_fails_verification(monkeypatch, name):
    from lnfold.passes import plan as plan_module

    real = plan_module.plan_rotation

    dropped = []

    def drop_one_reader(*args, **kw):  # the last reader weight (the lm_head) keeps the old basis, in
        rot = real(*args, **kw)       # every stream that reads it (the merged decoder's branches share it)
        if rot.readers and not dropped:
            dropped.append(rot.readers[-1][0].value)
        return replace(rot, readers=type(rot.readers)(r for r in rot.readers if r[0].value not in dropped))

    monkeypatch.setattr(plan_module, "plan_rotation", drop_one_reader)
    with pytest.raises(VerificationError, match="float64"):
        lnfold.fold_onnx(_load(name), rotate="hadamard")


def test_a_full_width_slice_with_a_reader_left_in_the_old_basis_is_far_from_the_exact_fold(monkeypatch):
    """The slice tests' bound can fail: the planted bug of the rotation test, at F → 0."""
    from lnfold.passes import plan as plan_module

    real = plan_module.plan_rotation
    monkeypatch.setattr(plan_module, "plan_rotation", lambda *a, **k: (lambda rot: replace(
        rot, readers=type(rot.readers)(list(rot.readers)[:-1])))(real(*a, **k)))
    m = _load(GENAI)
    assert lnfold.slice_onnx(m, rows(m), fraction=0.005).report.error > 1e-2


# --- GroupQueryAttention in float64 against onnxruntime's kernel ------------------------------------

def _gqa_model(packed: bool, interleaved: int, window: int, softcap: float) -> onnx.ModelProto:
    ins = ["q", "" if packed else "k", "" if packed else "v", "pk", "pv", "sk", "tot", "cos", "sin"]
    node = helper.make_node("GroupQueryAttention", ins, ["o", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=4, kv_num_heads=2, do_rotary=1, rotary_interleaved=interleaved,
                            local_window_size=window, softcap=softcap)
    floats = ["q"] + ([] if packed else ["k", "v"]) + ["pk", "pv"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in floats] + [
        helper.make_tensor_value_info("sk", TensorProto.INT32, None),
        helper.make_tensor_value_info("tot", TensorProto.INT32, None),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, None)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o", "present_k", "present_v")]
    return helper.make_model(helper.make_graph([node], "gqa", inputs, outputs), ir_version=10,
                             opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


# (batch, new tokens, past buffer, past tokens): a first prompt, a later prompt, decoding, a static
# cache (buffer longer than the past) decoding and prompting (onnxruntime takes batch 1 for S > 1 with a past)
_GQA_CASES = [(2, 5, 0, 0), (1, 5, 3, 3), (2, 1, 6, 6), (2, 1, 8, 4), (1, 3, 8, 4)]


def _gqa_feeds(rng, packed, batch, seq, buffer, past):
    ang = rng.uniform(0, 6, (32, 8))
    feeds = {"pk": rng.standard_normal((batch, 2, buffer, 16)).astype(np.float32),
             "pv": rng.standard_normal((batch, 2, buffer, 16)).astype(np.float32),
             "sk": np.full(batch, past + seq - 1, np.int32), "tot": np.array(past + seq, np.int32),
             "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    if packed:
        feeds["q"] = rng.standard_normal((batch, seq, 8 * 16)).astype(np.float32)
    else:
        feeds.update(q=rng.standard_normal((batch, seq, 64)).astype(np.float32),
                     k=rng.standard_normal((batch, seq, 32)).astype(np.float32),
                     v=rng.standard_normal((batch, seq, 32)).astype(np.float32))
    return feeds


def _gqa_worst(packed, interleaved, window, softcap) -> float:
    from lnfold.onnx_rewrite.contrib_attention import group_query_attention

    rng = np.random.default_rng(0)
    sess = ort.InferenceSession(_gqa_model(packed, interleaved, window, softcap).SerializeToString())
    worst = 0.0
    for case in _GQA_CASES:
        f = _gqa_feeds(rng, packed, *case)
        want = sess.run(None, f)
        got = group_query_attention(f["q"], f.get("k"), f.get("v"), f["pk"], f["pv"], f["sk"], f["tot"], f["cos"],
                                    f["sin"], num_heads=4, kv_num_heads=2, do_rotary=1, rotary_interleaved=interleaved,
                                    local_window_size=window, softcap=softcap)
        for w, g in zip(want, got):
            assert w.shape == g.shape, case
            worst = max(worst, float(np.abs(w - g).max()))
    return worst


@pytest.mark.parametrize("packed,interleaved,window,softcap",
                         [(True, 0, -1, 0.0), (False, 1, -1, 0.0), (True, 1, 3, 0.0), (False, 0, -1, 2.0)])
def test_group_query_attention_in_float64_is_onnxruntimes(packed, interleaved, window, softcap):
    assert _gqa_worst(packed, interleaved, window, softcap) < 1e-5


def test_a_rotary_turned_the_wrong_way_differs_from_onnxruntime(monkeypatch):
    from lnfold.onnx_rewrite import contrib_attention

    real = contrib_attention.rotate
    monkeypatch.setattr(contrib_attention, "rotate", lambda x, pos, cos, sin, inter: real(x, pos, cos, -sin, inter))
    assert _gqa_worst(True, 0, -1, 0.0) > 1e-2
