"""Issue 25: `lnfold fold CHECKPOINT_DIR` / `lnfold.fold_checkpoint` on a sharded `transformers`
checkpoint, folded shard by shard from a plan made on the meta device.

The checkpoints are OPTs (tied lm_head) with adversarial weights (lnfold.zoo: randomized γ/β, a
large mean on every stream source), saved by `save_pretrained` in several shards. The output must
load with `from_pretrained` in the stock class, be as exact as the original against float64 on
other inputs than verification's, generate the same tokens, and have every folded norm read a
zero-mean stream; a planted bug must be refused; bad folders are one-line errors with nothing
written.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import lnfold
from lnfold.passes import LnfoldError, VerificationError, gate
from lnfold.passes import weights as weights_mod

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lnfold.zoo import adversarial  # noqa: E402

VOCAB = 101


def build(folder: Path, dtype: torch.dtype, shard: str = "60KB", layers: int = 2) -> Path:
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, ffn_dim=256,
                                 num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64)
    torch.manual_seed(0)
    m = adversarial(transformers.OPTForCausalLM(cfg)).to(dtype)
    m.save_pretrained(folder, max_shard_size=shard)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def fp16(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("ck") / "opt16", torch.float16)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("ck") / "opt32", torch.float32)


def shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def logits(folder: Path, ids, dtype=None):
    m = transformers.OPTForCausalLM.from_pretrained(folder).eval()
    if dtype is not None:
        m = m.to(dtype)
    with torch.no_grad():
        return m(ids).logits


def lnfold_cli(capsys, *args):
    """`lnfold ARGS` in this process (the command's own main: exit code, stdout, stderr), sparing
    the suite a fresh interpreter's torch import per call."""
    from lnfold.onnx_rewrite.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


@pytest.fixture(scope="module")
def fp16_folded(fp16, tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "folded16"
    return out, lnfold.fold_checkpoint(fp16, out)


def test_sharded_fp16_checkpoint_folds_loads_and_is_exact(fp16, fp16_folded):
    assert len(shards(fp16)) >= 3 and "lm_head.weight" not in json.loads(
        (fp16 / "model.safetensors.index.json").read_text())["weight_map"]  # tied: stored once
    out, res = fp16_folded
    assert res.report.folded == 5 and res.report.kept == 0 and res.criterion == "float64"
    assert res.exact_err <= gate.FACTOR * res.original_exact_err + gate.FLOOR["float16"]
    assert shards(out) == shards(fp16) and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False  # untied, said so
    assert any("untied" in n for n in res.report.notes)

    folded = transformers.OPTForCausalLM.from_pretrained(out).eval()  # the stock class
    original = transformers.OPTForCausalLM.from_pretrained(fp16).eval()
    emb = folded.model.decoder.embed_tokens.weight.double()
    assert emb.mean(1).abs().max() < 1e-3 * emb.abs().max()  # centered rows (fp16 rounding)
    assert original.model.decoder.embed_tokens.weight.double().mean(1).abs().max() > 0.05  # it was not
    assert torch.equal(folded.lm_head.weight, original.lm_head.weight)  # the head reads the original table

    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(7))  # not verification's
    with torch.no_grad():
        exact = original.double()(ids).logits
        original = transformers.OPTForCausalLM.from_pretrained(fp16).eval()
        a, b = original(ids).logits, folded(ids).logits
    verdict = gate.judge([gate.Output("logits", "float16", a.numpy(), b.numpy(), exact.numpy())])
    assert verdict.ok and verdict.criterion == "float64", verdict.failure
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(original.generate(ids[:1], **kw), folded.generate(ids[:1], **kw))


def test_fp32_through_the_command_line(fp32, tmp_path, capsys):
    out = tmp_path / "out"
    r = lnfold_cli(capsys, "fold", fp32, "-o", out, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["report"]["folded"] == 5 and summary["criterion"] == "float64"
    assert set(summary["timings"]) == {"analysis", "editing", "verification", "flush"}
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    exact = logits(fp32, ids, torch.float64)
    a, b = logits(fp32, ids), logits(out, ids)
    own, now = weights_mod.max_rel_err(exact.numpy(), a.numpy()), weights_mod.max_rel_err(exact.numpy(), b.numpy())
    assert now <= gate.FACTOR * own + gate.FLOOR["float32"]


def test_a_skipped_centering_is_refused(fp32, tmp_path, monkeypatch):
    """LayerNorm hides a missed centering from the logits (it is shift-invariant): the check that
    every folded norm reads a zero-mean stream must catch it, and nothing is written."""
    real = weights_mod.center
    calls = []

    def skip_second(a, axis, *rest):
        calls.append(axis)
        return a if len(calls) == 2 else real(a, axis, *rest)

    monkeypatch.setattr(weights_mod, "center", skip_second)
    with pytest.raises(VerificationError, match="not an RMSNorm"):
        lnfold.fold_checkpoint(fp32, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".lnfold-*"))


def test_a_wrong_edit_is_refused_at_the_first_norm_it_breaks(fp32, tmp_path, monkeypatch):
    real = weights_mod.center
    monkeypatch.setattr(weights_mod, "center", lambda a, axis, *rest: real(a, 1 - axis if axis in (0, 1) and a.ndim == 2
                                                                          else axis, *rest))
    with pytest.raises(VerificationError, match="output of folded norm model.decoder.layers.0.self_attn_layer_norm "
                                                r"\(float32\) is .* away from a float64 run"):
        lnfold.fold_checkpoint(fp32, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tensor,change,message", [
    # one norm's γ off by 5%: its own output is refused, by name (not the first norm's, not the logits')
    ("model.decoder.layers.1.final_layer_norm.weight", lambda w: w * 1.05,
     r"output of folded norm model.decoder.layers.1.final_layer_norm \(float16\) is .* away from a float64 run"),
    # a constant on the stream (≈ its RMS): no output shows it, a LayerNorm ignores its input's mean;
    # the next norm's input is no longer zero-mean within fp16's MEAN_TOL (the correct fold: ~2e-4)
    ("model.decoder.layers.0.fc2.bias", lambda b: b + 0.3,
     "folded norm model.decoder.layers.1.self_attn_layer_norm: its input has mean .* not an RMSNorm there"),
], ids=["a norm's gamma", "a stream's mean"])
def test_verification_names_the_folded_norm_at_fault(fp16, fp16_folded, tmp_path, tensor, change, message):
    """The folded fp16 checkpoint (which passed verification as folded) altered in one tensor of
    its files."""
    from safetensors.torch import load_file, save_file

    from lnfold.fx_rewrite.checkpoint import plan_checkpoint, read_checkpoint
    from lnfold.fx_rewrite.checkpoint_verify import verify_checkpoint

    bad = _copy(fp16_folded[0], tmp_path / "bad")
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor] = change(tensors[tensor])
    save_file(tensors, shard, metadata={"format": "pt"})
    original = read_checkpoint(fp16)
    plan = plan_checkpoint(original)
    with pytest.raises(VerificationError, match=message):
        verify_checkpoint(original, read_checkpoint(bad), plan)


def test_verification_reads_of_the_token_table_only_the_rows_it_runs(fp16, fp16_folded, monkeypatch):
    """Issue 35: verification never holds a whole token table (a checkpoint's largest tensor, often):
    the embedding reads the rows of its ids, the tied head a block of rows at a time. Every read of
    the table, in all three runs, is watched (the real reads, recorded as they happen)."""
    from lnfold.fx_rewrite import checkpoint_verify as cv
    from lnfold.fx_rewrite.checkpoint import plan_checkpoint, read_checkpoint

    monkeypatch.setattr(cv, "SLICE_BYTES", 4096)  # the head: blocks of 4096 / 8 / 64 = 8 rows in float64
    rows_read, load = [], cv.Streamed._load

    def watched(self, name, *a, **kw):
        t = load(self, name, *a, **kw)
        if self.stored[name] == self.stored["model.decoder.embed_tokens.weight"]:
            rows_read.append(t.shape[0])
        return t

    monkeypatch.setattr(cv.Streamed, "_load", watched)
    original = read_checkpoint(fp16)
    cv.verify_checkpoint(original, read_checkpoint(fp16_folded[0]), plan_checkpoint(original))
    assert rows_read and max(rows_read) <= 8 < VOCAB
    assert rows_read.count(1) == 3 * len(set(cv.torch.randint(0, VOCAB, cv.TOKENS, generator=cv.torch.Generator(
    ).manual_seed(0)).flatten().tolist()))  # one read per distinct id, per run


def test_verification_reuses_only_memory_nothing_refers_to(monkeypatch):
    """Its pool of weight memory (fx_rewrite/checkpoint_verify.py `_Pool`): a module's dropped weight
    makes room for the next of its size, a tensor still alive keeps its memory, and the pool never
    holds more than 4 x SLICE_BYTES."""
    from lnfold.fx_rewrite import checkpoint_verify as cv

    if cv._use_count is None:
        pytest.skip("this torch has no storage use count: every tensor gets memory of its own")
    monkeypatch.setattr(cv, "SLICE_BYTES", 1 << 16)  # pooled: 1 kB to 256 kB in all
    pool = cv._Pool()
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    a = pool.empty((64, 64), torch.float32)  # 16 kB
    first, row = ptr(a), a[3]
    del a
    b = pool.empty((64, 64), torch.float32)
    assert ptr(b) != first  # a's row is still alive
    del row
    c = pool.empty((32, 64), torch.float64)  # the same size: a's memory, now free
    assert ptr(c) == first and c.dtype == torch.float64 and c.shape == (32, 64)
    big = [pool.empty((128, 64), torch.float32) for _ in range(8)]  # 32 kB each: room for 7 beside b, c
    assert sum(e[0] for e in pool.bufs) <= 4 * cv.SLICE_BYTES
    assert len({ptr(t) for t in big + [b, c]}) == 10  # the last one in memory of its own
    pooled = {ptr(t) for t in big[:7]}
    del big
    assert ptr(pool.empty((128, 64), torch.float32)) in pooled  # one of those freed
    d = pool.empty((256, 64), torch.float32)  # 64 kB: free ones of other sizes unmapped to make room
    assert ptr(d) in {ptr(e[1]) for e in pool.bufs} and sum(e[0] for e in pool.bufs) <= 4 * cv.SLICE_BYTES
    assert ptr(b) in {ptr(e[1]) for e in pool.bufs} and ptr(c) in {ptr(e[1]) for e in pool.bufs}  # alive: kept


def test_gpt_neox_whose_file_names_differ_from_the_model(tmp_path, monkeypatch):
    """Pythia's file says `embed_out`, transformers' model `lm_head` (its conversion mapping):
    parallel residual, rotary positions, an untied head; fp16. Verification reads in slices of 4 kB
    here, so that the head runs a block of rows at a time as a 50k-token head does."""
    from lnfold.fx_rewrite import checkpoint_verify

    monkeypatch.setattr(checkpoint_verify, "SLICE_BYTES", 4096)
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, rotary_pct=0.25, max_position_embeddings=64,
                                     use_parallel_residual=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    adversarial(transformers.GPTNeoXForCausalLM(cfg)).half().save_pretrained(tmp_path / "in", max_shard_size="100KB")
    res = lnfold.fold_checkpoint(tmp_path / "in", tmp_path / "out")
    assert res.report.folded == 5 and res.criterion == "float64" and not res.report.notes
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        original = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "in").eval()
        exact = original.double()(ids).logits
        a = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "in").eval()(ids).logits
        b = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    assert gate.judge([gate.Output("logits", "float16", a.numpy(), b.numpy(), exact.numpy())]).ok


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case,message", [
    ("missing shard", "missing: the shard index names it"),
    ("index names a tensor no shard has", "which has no such tensor"),
    ("truncated shard", "truncated"),
    ("untraceable architecture", "cannot trace ViTModel on the meta device"),
])
def test_bad_checkpoints_are_one_line_errors_and_write_nothing(fp32, tmp_path, capsys, case, message):
    src = _copy(fp32, tmp_path / "in")
    index = src / "model.safetensors.index.json"
    if case == "missing shard":
        (src / shards(src)[1]).unlink()
    elif case == "index names a tensor no shard has":
        data = json.loads(index.read_text())
        data["weight_map"]["model.decoder.layers.9.fc1.weight"] = shards(src)[0]
        index.write_text(json.dumps(data))
    elif case == "truncated shard":
        f = src / shards(src)[0]
        f.write_bytes(f.read_bytes()[:-100])
    else:  # an image model: the meta build cannot trace it on token ids
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     image_size=16, patch_size=8)
        for p in list(src.iterdir()):
            p.unlink()
        transformers.ViTModel(cfg).save_pretrained(src)
    out = tmp_path / "out"
    with pytest.raises(LnfoldError, match=message) as e:
        lnfold.fold_checkpoint(src, out)
    assert len(str(e.value).splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".lnfold-*"))
    if case == "truncated shard":  # the command line: one line on stderr, exit code 2, nothing written
        r = lnfold_cli(capsys, "fold", src, "-o", out)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()


@pytest.mark.parametrize("where,message", [
    ("inside", "inside the input folder"), ("a full folder", "exists; choose another output folder"),
    ("a file", "exists; choose another output folder"), ("no parent", "output directory does not exist"),
])
def test_a_bad_output_folder_is_a_one_line_error(fp32, tmp_path, where, message):
    """The same rules as `lnfold fold DIR` (passes/outputs.py), the input untouched."""
    out = {"inside": fp32 / "out", "a full folder": tmp_path / "full", "a file": tmp_path / "f",
           "no parent": tmp_path / "none" / "out"}[where]
    if where == "a full folder":
        out.mkdir()
        (out / "x").write_text("")
    elif where == "a file":
        out.write_text("")
    before = sorted(p.name for p in fp32.iterdir())
    with pytest.raises(LnfoldError, match=message) as e:
        lnfold.fold_checkpoint(fp32, out)
    assert len(str(e.value).splitlines()) == 1 and sorted(p.name for p in fp32.iterdir()) == before


@pytest.mark.slow
def test_parallel_shards_write_the_same_bytes(fp32, tmp_path):
    lnfold.fold_checkpoint(fp32, tmp_path / "one", verify=False)
    lnfold.fold_checkpoint(fp32, tmp_path / "two", verify=False, jobs=2)
    for name in shards(fp32) + ["model.safetensors.index.json", "config.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_tensors_edited_a_few_rows_at_a_time_are_the_whole_tensors_edit(fp32, tmp_path, monkeypatch):
    """With a float64 budget of a few rows, every edited matrix is streamed in blocks: the
    embedding (centered along each row) and the output projections (centered along their rows:
    the mean summed over blocks first). The result is the whole-tensor centering of
    passes/weights.py, to the float64 summation order (within one unit of the last place)."""
    from safetensors import safe_open

    from lnfold.fx_rewrite import checkpoint_fold

    monkeypatch.setattr(checkpoint_fold, "SLICE_BYTES", 5 * 64 * 8)  # 5 rows of a 64-wide matrix
    lnfold.fold_checkpoint(fp32, tmp_path / "out")  # (verified)
    idx = json.loads((fp32 / "model.safetensors.index.json").read_text())["weight_map"]
    checked = 0
    for name, file in idx.items():
        if not (name.endswith("fc2.weight") or name.endswith("out_proj.weight") or name.endswith("embed_tokens.weight")):
            continue
        with safe_open(str(fp32 / file), "pt") as f:
            w = f.get_tensor(name).numpy()
        with safe_open(str(tmp_path / "out" / file), "pt") as f:
            got = f.get_tensor(name).numpy()
        axis = 1 if "embed" in name else 0
        want = weights_mod.center(w, axis)
        assert w.shape[0] > 5 and not np.array_equal(got, w), name
        np.testing.assert_array_max_ulp(got, want, maxulp=1)
        checked += 1
    assert checked == 5  # 2 blocks x (out_proj, fc2) + the embedding


def test_the_loaded_output_hands_off_to_the_rmsnorm_model_quantizers_take(fp32, tmp_path):
    """What a quantizer's user does next: from_pretrained, then the eager hand-off (issue 22):
    every LayerNorm becomes a unit-weight torch.nn.RMSNorm, and the logits stay the original's."""
    lnfold.fold_checkpoint(fp32, tmp_path / "out")
    model = transformers.OPTForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    lnfold.fold_to_rmsnorm(model, (ids,))  # (verified against float64 itself, else it raises)
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert len(norms) == 5 and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    with torch.no_grad():
        want = transformers.OPTForCausalLM.from_pretrained(fp32).eval().double()(ids).logits
        got = model(ids).logits.double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bf16_rows_go_through_float64_and_are_rounded_once(tmp_path, monkeypatch):
    """numpy has no bf16: its blocks are edited in float64 and rounded once (fx_rewrite/edits.py
    `rounded`), to exactly the whole tensor's centering rounded once, and the fold verifies."""
    from safetensors import safe_open

    from lnfold.fx_rewrite import checkpoint_fold
    from lnfold.fx_rewrite.edits import rounded

    src = build(tmp_path / "bf16", torch.bfloat16)
    monkeypatch.setattr(checkpoint_fold, "SLICE_BYTES", 5 * 64 * 8)
    res = lnfold.fold_checkpoint(src, tmp_path / "out")
    assert res.criterion == "float64"
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in idx if n.endswith("fc2.weight") or n.endswith("out_proj.weight")]
    for name in names:
        with safe_open(str(src / idx[name]), "pt") as f:
            w = f.get_tensor(name).double().numpy()
        with safe_open(str(tmp_path / "out" / idx[name]), "pt") as f:
            got = f.get_tensor(name)
        assert torch.equal(got, rounded(weights_mod.center(w, 0), torch.bfloat16)), name
    assert len(names) == 4  # 2 blocks x (out_proj, fc2)


# --- BERT: a second tie the untied config breaks too (cls.predictions.decoder.bias) ----------------------------

def safetensors_entries(folder: Path) -> dict:
    """Every tensor of the folder's safetensors files: name -> (dtype, shape), from the headers."""
    from lnfold.fx_rewrite.safetensors_io import read_header

    return {n: (e.dtype, e.shape) for f in folder.glob("*.safetensors") for n, e in read_header(f).entries.items()}


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A tiny BertForMaskedLM, adversarial (its decoder bias random, not the zeros a fresh head or
    a missing tensor would get), saved as one safetensors file: the decoder's weight and bias are
    tied to the word embeddings and `cls.predictions.bias`, and stored once, under those names."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, type_vocab_size=1)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("ck") / "bert"
    adversarial(transformers.BertForMaskedLM(cfg)).save_pretrained(folder)
    stored = safetensors_entries(folder)
    assert "cls.predictions.bias" in stored and "cls.predictions.decoder.bias" not in stored
    assert "cls.predictions.decoder.weight" not in stored
    return folder


def test_bert_folds_verified_with_every_tensor_and_its_tied_decoder_bias(bert, tmp_path):
    """The fold centers the word embeddings, so it unties them from the decoder, and the untied
    config.json unties the decoder's bias from `cls.predictions.bias` as well: both must be in the
    output, or from_pretrained fills the bias at random (the bug: verification's KeyError, and
    with verify=False a model 2e-2 off)."""
    out = tmp_path / "out"
    res = lnfold.fold_checkpoint(bert, out)
    assert res.report.folded == 1 and res.criterion == "float64"  # the embedding LayerNorm (Post-LN blocks: kept)
    assert any("cls.predictions.decoder.bias" in n for n in res.report.notes)
    (stream,) = res.report.streams  # the report names the centered table by its tensor in the file, not the head's alias
    assert any(c.startswith("`bert.embeddings.word_embeddings.weight`") for c in stream.centered), stream.centered
    before, after = safetensors_entries(bert), safetensors_entries(out)
    assert all(after.get(n) == v for n, v in before.items())  # every input tensor, its dtype and shape
    assert set(after) - set(before) == {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}

    folded, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = transformers.BertForMaskedLM.from_pretrained(bert).eval()
    head, old = folded.cls.predictions, original.cls.predictions
    assert torch.equal(head.decoder.bias, head.bias) and torch.equal(head.bias, old.bias)  # tied values kept
    assert torch.equal(head.decoder.weight, old.decoder.weight)  # the head reads the original table
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(7))  # not verification's
    with torch.no_grad():
        a, b = original(ids).logits, folded.eval()(ids).logits
        exact = original.double()(ids).logits
    verdict = gate.judge([gate.Output("logits", "float32", a.numpy(), b.numpy(), exact.numpy())])
    assert verdict.ok and verdict.criterion == "float64", verdict.failure


@pytest.mark.parametrize("planted,message", [
    # the bug itself: the plan as it was, writing only the second half of the group it meant to untie
    ("tied bias not written", r"BertForMaskedLM loads cls.predictions.decoder.bias from the input \(tensor "
                              r"cls.predictions.bias\) and the output does not hold it"),
    # any input tensor dropped on the way to the output
    ("input tensor dropped", r"input tensor bert.encoder.layer.1.output.dense.bias \(F32 \[32\]\): the output lacks it"),
])
def test_a_tensor_missing_from_the_output_is_refused_verified_or_not(bert, tmp_path, monkeypatch, planted, message):
    from lnfold.fx_rewrite import checkpoint, checkpoint_fold

    if planted == "tied bias not written":
        monkeypatch.setattr(checkpoint, "_as_loaded", lambda plan, ck: plan)
    else:
        real = checkpoint_fold.shard_work

        def dropping(*args):
            jobs = real(*args)
            for j in jobs:
                j.tensors = [t for t in j.tensors if t.name != "bert.encoder.layer.1.output.dense.bias"]
            return jobs

        monkeypatch.setattr(checkpoint_fold, "shard_work", dropping)
    with pytest.raises(LnfoldError, match=message) as e:
        lnfold.fold_checkpoint(bert, tmp_path / "out", verify=False)
    assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".lnfold-*"))
