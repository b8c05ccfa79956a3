#!/usr/bin/env python
"""Regenerate issue 10's corpus: ONNX files made by *other people's tools*.

    python tests/corpus/build.py OUTDIR [--only SUBSTR ...]

NEVER run in CI: the exporters below are heavy and are not installed there. The committed files in
tests/corpus/ are the output of this script; tests only read them.

Self-contained on purpose (no import of lnfold / onnx_rewrite / fx_rewrite).

Environment used to build the committed corpus (a venv made with `--system-site-packages` over a
python that already had torch 2.13.0+cpu; the venv's own pins shadow the system ones):

    pip install torch==2.13.0                 # the local CPU wheel
    pip install optimum-onnx==0.1.0 optimum==2.1.0 transformers==4.57.6 \
                onnx==1.23.2 onnxruntime==1.32.0 onnxscript==0.7.2 onnx-ir==1.1.0 \
                onnxslim==0.1.98 onnxsim==0.8.1 onnxconverter-common==1.16.0 \
                rapidocr-onnxruntime==1.4.4 \
                tensorflow-cpu==2.21.0 tf2onnx==1.17.0 \
                jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 jax2onnx==0.17.1 \
                numpy==2.4.6 protobuf==7.36.2

(optimum-onnx 0.1.0 pins transformers<4.58, hence 4.57.6 rather than the project's 5.x.)

Models: tiny `transformers` configs (2 layers, width 32, vocab 100, 32 positions) with adversarial
weights: every LayerNorm gets γ = 1 + 0.5·randn, β = 0.5·randn; every embedding row a large
per-row mean; every Linear/Conv weight a large mean along its output axis and its bias a large
mean; cls tokens / class embeddings / position tables a large per-row mean. A missed centering
then breaks equivalence. (Same idea as `adversarial()` in fx_rewrite/zoo.py, copied.)

Issue 23's builders: `--only issue23` (onnxconverter-common fp16 decoders and a whole CLIP, onnxsim's
CLIP), `--only fp32ln` (TorchScript fp16 with fp32 LayerNorms), `--only keras_posemb`, `--only jax2tf`
(needs LNFOLD_JAX2TF_PYTHON, see JAX2TF_SRC). They were built with the project's transformers 5.24 and
keras 3.15.1 (not 4.57.6), onnxsim 0.8.1, onnxconverter-common 1.16.0.

Every file gets a manifest entry (manifest.json beside the files) with the hand-derived count of
LayerNorms that THEORY §1 says fold: see EXPECT below for the derivations.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_TORCH", "1")
os.environ.setdefault("USE_FLAX", "0")

SOURCE_MEAN = 3.0
L = 2          # layers
D = 32         # width
H = 2          # heads
FF = 64        # MLP width
V = 100        # vocab
P = 32         # positions

# --------------------------------------------------------------------------------------------
# Hand counts (THEORY §1). total = LayerNorm-like ops in the file (fused ones included),
# folded / recentered = what a correct lnfold does. Per-file overrides are given at the call.
# --------------------------------------------------------------------------------------------
EXPECT = {
    "gpt2": (2 * L + 1, 2 * L + 1, 0,
             "Pre-LN; stream written by wte/wpe Gathers and c_proj MatMuls (tied lm_head is cloned); "
             "sinks: ln_1, ln_2 per block + ln_f"),
    "opt": (2 * L + 1, 2 * L + 1, 0,
            "Pre-LN (do_layer_norm_before); stream = embed_tokens + learned positions (Gather) + out_proj/fc2; "
            "sinks self_attn_layer_norm, final_layer_norm per layer + decoder final_layer_norm"),
    "gpt_neox": (2 * L + 1, 2 * L + 1, 0,
                 "parallel residual x + attn(ln1 x) + mlp(ln2 x): both LNs read the same stream tensor; "
                 "sources embed_in + dense + dense_4h_to_h; + final_layer_norm"),
    "bloom": (2 * L + 2, 2 * L + 2, 1,
              "word_embeddings_layernorm folds (its input = Gather only); its affine output starts the "
              "residual stream (opaque): 1 recenter buys 2L+1 swaps (input/post_attention LNs + ln_f)"),
    "bert": (2 * L + 1, 1, 0,
             "Post-LN: only the embeddings LayerNorm folds (word+position+token_type Gathers); every block "
             "sum is read by the next Q/K/V MatMuls (non-invariant)"),
    "vit": (2 * L + 1, 2 * L + 1, 0,
            "Pre-LN; stream = conv patch stem (flatten+transpose) + cls token Concat + position table; "
            "sinks layernorm_before/after per layer + final layernorm"),
    "clip_vision_pooled": (2 * L + 2, 2 * L + 2, 1,
                           "pre_layrnorm folds (conv stem no bias + class_embedding + positions); its affine "
                           "output starts the stream (opaque): 1 recenter buys 2L+1 (layer_norm1/2 + "
                           "post_layernorm on the CLS row); only pooler_output is a graph output"),
    "clip_vision_lhs": (2 * L + 2, 1, 0,
                        "pre_layrnorm folds; but last_hidden_state (the residual stream itself, before "
                        "post_layernorm) is a graph output: non-invariant sink blocks the other 2L+1"),
    "clip": (4 * L + 3, 4 * L + 3, 1,
             "text tower: token + position Gathers and out_proj/fc2 write the stream, read by layer_norm1/2 per "
             "layer and final_layer_norm (EOS row -> text_projection): 2L+1 fold, no recenter; vision tower as "
             "clip_vision_pooled: pre_layrnorm folds, its affine output starts the stream (opaque), 1 recenter buys "
             "2L+1 (layer_norm1/2 + post_layernorm); logits = exp(logit_scale) * cosine similarities"),
    "whisper_enc": (2 * L + 1, 2 * L + 1, 1,
                    "stream starts at GELU(conv2) (opaque) + embed_positions: 1 recenter buys 2L+1 swaps "
                    "(self_attn_layer_norm, final_layer_norm per layer + encoder layer_norm)"),
    "whisper_enc_fp16": (2 * L + 1, 2 * L + 1, 1,
                         "fp16: HF clamps the stream after every encoder layer (torch.clamp to ±(finfo(fp16).max - "
                         "1000) -> Clip): an overflow guard, transparent on the stream (passes/guards.py: exact "
                         "while the stream stays below 64512 in magnitude); stream starts at GELU(conv2) (opaque) + "
                         "embed_positions: 1 recenter buys 2L+1 swaps"),
    "whisper_dec": (3 * L + 1, 3 * L + 1, 0,
                    "Pre-LN decoder; stream = embed_tokens + embed_positions Gathers + out_proj/fc2; sinks "
                    "self_attn/encoder_attn/final LNs per layer + decoder layer_norm; encoder_hidden_states only "
                    "feeds cross-attention K/V MatMuls (not the stream)"),
    "bart_dec": (3 * L + 1, 1, 0,
                 "BART is Post-LN: only layernorm_embedding folds (embed_tokens*scale + positions); every "
                 "block sum is read by MatMuls"),
    "falcon": (L + 1, L + 1, 0,
               "Falcon-7B layout (parallel_attn, one input_layernorm per layer, no biases) + ln_f"),
    "keras_block": (2 * L + 1, 2 * L + 1, 0,
                    "Keras Pre-LN: Embedding + position Embedding, per block LN->MHA->Add, LN->Dense->Dense->Add; "
                    "final LN; logits Dense"),
    "keras_posemb": (2 * L + 1, 2 * L + 1, 0,
                     "Keras Pre-LN: Embedding + Slice of a position table (a constant source), per block "
                     "LN->MultiHeadAttention->Add, LN->Dense->Dense->Add; final LN. The attention output "
                     "projections write the stream as Einsum abcd,cde->abe with a constant kernel (a linear "
                     "layer: its kernel centered along e); tf2onnx's GELU writes Erfc (no ONNX op)"),
    "linen_mlp": (2, 2, 0,
                  "flax.linen default LayerNorm (use_fast_variance: var = max(0, E[x²] - E[x]²), ReduceSum·1/n, "
                  "Sqrt + Reciprocal, BroadcastTo mean) x2: ln1 and ln_f; the stream is written by the stem Dense + "
                  "position table and fc2 (MatMul + bias): both fold, no recenter"),
    "nnx_block": (2 * L + 1, 2 * L + 1, 0,
                  "flax.nnx Pre-LN: nnx.Embed + position table, per block LN->attention(Linear)->Add, "
                  "LN->MLP->Add; final LN; logits Linear"),
}

MANIFEST: list[dict] = []
ONLY: list[str] | None = None
FAILED: list[tuple[str, str]] = []
OUT: Path


def versions() -> dict:
    import importlib.metadata as md
    out = {}
    for p in ["torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "onnxscript", "onnxslim",
              "onnxsim", "onnxconverter-common", "tensorflow-cpu", "tf2onnx", "keras", "jax", "flax", "jax2onnx",
              "rapidocr-onnxruntime"]:
        try:
            out[p] = md.version(p)
        except Exception:
            out[p] = None
    return out


VER: dict = {}


# --------------------------------------------------------------------------------------------
# counting LayerNorm-like ops in a file (check of the hand count; recurses into If/Loop bodies)
# --------------------------------------------------------------------------------------------
LN_OPS = {"LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization"}


def _graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.g is not None and a.HasField("g"):
                yield from _graphs(a.g)
            for sg in a.graphs:
                yield from _graphs(sg)


def count_layernorms(model) -> dict:
    """Fused LN ops + decomposed patterns: Sub(x, ReduceMean(x)) whose result is squared (Pow/Mul)
    and reduced again (the torch/Paddle decomposition), or tf's SquaredDifference-free form
    mean = ReduceMean(x); var = ReduceMean((x - mean)^2) which is the same pattern."""
    ops: dict = {}
    dec = 0
    for g in _graphs(model.graph):
        prod = {o: n for n in g.node for o in n.output}
        cons: dict = {}
        for n in g.node:
            for i in n.input:
                cons.setdefault(i, []).append(n)
        for n in g.node:
            if n.op_type in LN_OPS:
                ops[n.op_type] = ops.get(n.op_type, 0) + 1
            if n.op_type == "Sub" and len(n.input) == 2:
                # the variance of a decomposed LN: (x - mean)^2, as Pow(d, 2) or Mul(d, d); mean
                # from ReduceMean (torch, Paddle) or GlobalAveragePool behind layout ops (tf2onnx)
                d = n.output[0]
                sq = [c for c in cons.get(d, []) if c.op_type == "Pow" or
                      (c.op_type == "Mul" and list(c.input) == [d, d])]
                m = prod.get(n.input[1])
                centered = m is not None and m.op_type == "ReduceMean" and m.input and m.input[0] == n.input[0]
                # jax2tf: x - BroadcastTo(Reshape(ReduceSum(x) * 1/n)) (flax.linen's mean, axis dropped)
                t, chain = n.input[1], True
                for op in ("Expand", "Reshape", "Mul", "ReduceSum"):
                    p = prod.get(t)
                    if p is None or p.op_type != op:
                        chain = False
                        break
                    t = p.input[0]
                centered = centered or (chain and t == n.input[0])
                if sq or centered:     # flax: var = E[x^2] - E[x]^2, then (x - E[x]) * rsqrt(var + eps)
                    dec += 1
    if dec:
        ops["decomposed"] = dec
    ops["total"] = sum(ops.values())
    return ops


# --------------------------------------------------------------------------------------------
# adversarial weights
# --------------------------------------------------------------------------------------------
def adversarial(model, seed=0):
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    with torch.no_grad():
        for mod in model.modules():
            kind = type(mod).__name__
            if isinstance(mod, nn.LayerNorm):
                if mod.weight is not None:
                    mod.weight.copy_(1 + 0.5 * rnd(*mod.weight.shape))
                if mod.bias is not None:
                    mod.bias.copy_(0.5 * rnd(*mod.bias.shape))
            elif isinstance(mod, nn.Embedding):
                w = mod.weight
                w.add_(SOURCE_MEAN * (w.std() + 0.02) * rnd(w.shape[0], 1))   # a per-row mean
            elif isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d)) or kind == "Conv1D":
                w = mod.weight
                out_axis = 1 if kind == "Conv1D" else 0     # HF Conv1D stores [in, out]
                shape = [1] * w.ndim
                shape[1 - out_axis] = w.shape[1 - out_axis]
                w.add_(SOURCE_MEAN * (w.std() + 0.02) * rnd(*shape))   # constant along the output axis
                if getattr(mod, "bias", None) is not None:
                    mod.bias.copy_(0.2 * rnd(*mod.bias.shape) + SOURCE_MEAN * 0.1)
        for name, p in model.named_parameters():
            if any(k in name for k in ("cls_token", "class_embedding", "position_embeddings", "mask_token")):
                if p.ndim >= 2:
                    p.add_(SOURCE_MEAN * (p.std() + 0.02) * rnd(*p.shape[:-1], 1))
                else:
                    p.add_(SOURCE_MEAN * (p.std() + 0.02) * rnd(1))
    return model.eval()


# --------------------------------------------------------------------------------------------
# the tiny transformers models
# --------------------------------------------------------------------------------------------
def hf_model(name):
    import torch
    import transformers as T

    torch.manual_seed(0)
    kw = dict(attn_implementation="eager")
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=L, n_embd=D, n_head=H, n_inner=FF, vocab_size=V, n_positions=P, **kw)
        m = T.GPT2LMHeadModel(cfg)
    elif name == "opt":
        cfg = T.OPTConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, ffn_dim=FF, vocab_size=V,
                          max_position_embeddings=P, word_embed_proj_dim=D, do_layer_norm_before=True, **kw)
        m = T.OPTForCausalLM(cfg)
    elif name == "gpt_neox":
        cfg = T.GPTNeoXConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, intermediate_size=FF,
                              vocab_size=V, max_position_embeddings=P, use_parallel_residual=True, **kw)
        m = T.GPTNeoXForCausalLM(cfg)
    elif name == "bloom":
        cfg = T.BloomConfig(n_layer=L, hidden_size=D, n_head=H, vocab_size=V, **kw)
        m = T.BloomForCausalLM(cfg)
    elif name == "falcon":
        cfg = T.FalconConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, vocab_size=V,
                             new_decoder_architecture=False, parallel_attn=True, multi_query=True, alibi=False,
                             bias=False, max_position_embeddings=P, **kw)
        m = T.FalconForCausalLM(cfg)
    elif name == "bert":
        cfg = T.BertConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, intermediate_size=FF,
                           vocab_size=V, max_position_embeddings=P, **kw)
        m = T.BertModel(cfg, add_pooling_layer=False)
    elif name == "vit":
        cfg = T.ViTConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, intermediate_size=FF,
                          image_size=32, patch_size=8, **kw)
        m = T.ViTModel(cfg, add_pooling_layer=False)
    elif name == "clip_vision":
        cfg = T.CLIPVisionConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, intermediate_size=FF,
                                 image_size=32, patch_size=8, projection_dim=D, **kw)
        m = T.CLIPVisionModel(cfg)
    elif name == "clip":   # text + vision towers, logits = exp(logit_scale) * cosine similarities
        cfg = T.CLIPConfig(text_config=dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=H,
                                            intermediate_size=FF, vocab_size=V, max_position_embeddings=P),
                           vision_config=dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=H,
                                              intermediate_size=FF, image_size=32, patch_size=8),
                           projection_dim=D, logit_scale_init_value=4.6052, **kw)   # a trained CLIP's: exp = 100
        m = T.CLIPModel(cfg)
    elif name == "whisper":
        cfg = T.WhisperConfig(encoder_layers=L, decoder_layers=L, d_model=D, encoder_attention_heads=H,
                              decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, vocab_size=V,
                              num_mel_bins=8, max_source_positions=1500, max_target_positions=P,
                              decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              suppress_tokens=[], begin_suppress_tokens=[], **kw)
        m = T.WhisperForConditionalGeneration(cfg)
    elif name == "bart":
        cfg = T.BartConfig(encoder_layers=L, decoder_layers=L, d_model=D, encoder_attention_heads=H,
                           decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, vocab_size=V,
                           max_position_embeddings=P, **kw)
        m = T.BartForConditionalGeneration(cfg)
    else:
        raise KeyError(name)
    return adversarial(m)


# --------------------------------------------------------------------------------------------
# manifest helpers
# --------------------------------------------------------------------------------------------
def record(path: Path, producer: str, model: str, dtype: str, key: str, *, needs=(), note=None,
           expect=None, committed=True):
    import onnx

    total, folded, recentered, why = EXPECT[key] if expect is None else expect
    mult = 1
    m = onnx.load(str(path), load_external_data=False)
    counted = count_layernorms(m)
    if any(n.op_type == "If" for n in m.graph.node) and counted["total"] == 2 * total:
        mult = 2            # Optimum's merged decoder: the same decoder in both If branches
        why = why + " — twice: If(use_cache_branch) holds the no-past and the with-past decoder"
    entry = {
        "file": path.name,
        "producer": producer,
        "model": model,
        "dtype": dtype,
        "layernorms": total * mult,
        "expected_folded": folded * mult,
        "expected_recentered": recentered * mult,
        "why": why,
        "needs": list(needs),
        "graph_count": counted,
        "size": path.stat().st_size,
    }
    if note:
        entry["note"] = note
    if not committed:
        entry["committed"] = False
    if counted["total"] != total * mult:
        entry["count_mismatch"] = f"hand {total * mult} vs pattern counter {counted['total']}"
    MANIFEST.append(entry)
    print(f"  + {path.name}: {counted}  expect {folded * mult}/{total * mult}", flush=True)


def step(name):
    """Decorator-ish guard: a failing producer is recorded and the build goes on."""
    def deco(fn):
        def run(*a, **k):
            if ONLY and not any(s in name for s in ONLY):
                return None
            print(f"[{name}]", flush=True)
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                print(f"  ! {name} failed: {msg}", flush=True)
                traceback.print_exc(limit=3)
                FAILED.append((name, msg))
                return None
        return run
    return deco


# --------------------------------------------------------------------------------------------
# torch.onnx.export (TorchScript and dynamo)
# --------------------------------------------------------------------------------------------
def wrapped(model, out_key, mask=False, **fixed):
    """nn.Module returning one named output of a transformers model (one input, kwargs fixed).
    mask=True passes an all-ones attention_mask made from the ids (transformers 4.57's causal-mask
    code otherwise goes through torch.vmap / aten::diff, which neither exporter handles)."""
    import torch

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            o = self.m(x, attention_mask=torch.ones_like(x), **fixed) if mask else self.m(x, **fixed)
            return o[out_key] if isinstance(out_key, str) else tuple(o[k] for k in out_key)

    return W().eval()


def clip_logits(model):
    import torch

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, px):
            return self.m(input_ids=ids, pixel_values=px, attention_mask=torch.ones_like(ids)).logits_per_image

    return W().eval()


def torch_cases():
    """(key, module factory, example args, input names, output names, dynamic axes)."""
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, 7), generator=g)
    px = torch.randn(2, 3, 32, 32, generator=g)
    feats = torch.randn(2, 8, 3000, generator=g)   # Whisper insists on 2*max_source_positions frames
    tok = {0: "batch", 1: "seq"}
    cases = {
        "gpt2": (lambda: wrapped(hf_model("gpt2"), "logits", mask=True, use_cache=False), (ids,), ["input_ids"], ["logits"],
                 {"input_ids": tok, "logits": tok}),
        "opt": (lambda: wrapped(hf_model("opt"), "logits", mask=True, use_cache=False), (ids,), ["input_ids"], ["logits"],
                {"input_ids": tok, "logits": tok}),
        "gpt_neox": (lambda: wrapped(hf_model("gpt_neox"), "logits", mask=True, use_cache=False), (ids,), ["input_ids"],
                     ["logits"], {"input_ids": tok, "logits": tok}),
        "bloom": (lambda: wrapped(hf_model("bloom"), "logits", mask=True, use_cache=False), (ids,), ["input_ids"], ["logits"],
                  {"input_ids": tok, "logits": tok}),
        "falcon": (lambda: wrapped(hf_model("falcon"), "logits", mask=True, use_cache=False), (ids,), ["input_ids"],
                   ["logits"], {"input_ids": tok, "logits": tok}),
        "bert": (lambda: wrapped(hf_model("bert"), "last_hidden_state"), (ids,), ["input_ids"],
                 ["last_hidden_state"], {"input_ids": tok, "last_hidden_state": tok}),
        "vit": (lambda: wrapped(hf_model("vit"), "last_hidden_state"), (px,), ["pixel_values"],
                ["last_hidden_state"], {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}}),
        "clip_vision_pooled": (lambda: wrapped(hf_model("clip_vision"), "pooler_output"), (px,), ["pixel_values"],
                               ["pooler_output"], {"pixel_values": {0: "batch"}, "pooler_output": {0: "batch"}}),
        # issue 23: the whole CLIP (both towers, logits_per_image); image height/width dynamic
        "clip": (lambda: clip_logits(hf_model("clip")), (ids, px), ["input_ids", "pixel_values"], ["logits_per_image"],
                 {"input_ids": tok, "pixel_values": {0: "batch", 2: "height", 3: "width"},
                  "logits_per_image": {0: "batch", 1: "texts"}}),
        "whisper_enc": (lambda: wrapped(hf_model("whisper").model.encoder, "last_hidden_state"), (feats,),
                        ["input_features"], ["last_hidden_state"],
                        {"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}}),
    }
    return cases


MODEL_NAME = {"gpt2": "GPT-2 (GPT2LMHeadModel, tied head)", "opt": "OPT (OPTForCausalLM)",
              "gpt_neox": "GPT-NeoX/Pythia (parallel residual)", "bloom": "BLOOM (embedding LayerNorm)",
              "falcon": "Falcon (parallel_attn, 1 LN/layer)", "bert": "BERT (BertModel, Post-LN)",
              "vit": "ViT (ViTModel)", "clip_vision_pooled": "CLIP vision (pooler_output only)",
              "clip_vision_lhs": "CLIP vision (last_hidden_state + pooler_output)",
              "clip": "CLIP (CLIPModel: text + vision, logits_per_image)",
              "whisper_enc": "Whisper encoder", "whisper_enc_fp16": "Whisper encoder",
              "whisper_dec": "Whisper decoder (encoder_hidden_states input)", "bart_dec": "BART decoder (Post-LN)"}


def torch_export(key, opset, dtype, dynamo, fname, norms_fp32=False):
    import torch
    import warnings

    factory, args, inames, onames, axes = torch_cases()[key]
    # transformers 4.57 builds causal masks with torch.vmap, which neither TorchScript tracing
    # ("unordered_map::at") nor torch.export (".item() under vmap") gets through; use its own
    # vmap-free path (what Optimum's model patcher does too).
    import transformers.masking_utils as mu
    if hasattr(mu, "sdpa_mask_older_torch"):
        mu.sdpa_mask = mu.sdpa_mask_older_torch
    for k in ("sdpa", "eager") if hasattr(mu, "sdpa_mask_older_torch") else ():
        if mu.ALL_MASK_ATTENTION_FUNCTIONS.get(k) is mu.sdpa_mask_recent_torch:
            mu.ALL_MASK_ATTENTION_FUNCTIONS[k] = mu.sdpa_mask_older_torch
    mod = factory()
    if dtype == "fp16":
        mod = mod.half()
        args = tuple(a.half() if a.is_floating_point() else a for a in args)
    if norms_fp32:   # LayerNorms kept in fp32 (transformers' _keep_in_fp32_modules, mixed precision)
        for m in mod.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.float()
    path = OUT / fname
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            dyn = tuple({k: torch.export.Dim.AUTO for k in axes[n]} for n in inames)
            torch.onnx.export(mod, args, str(path), input_names=inames, output_names=onames, opset_version=opset,
                              dynamo=True, dynamic_shapes=dyn, external_data=False, verbose=False)
        else:
            torch.onnx.export(mod, args, str(path), input_names=inames, output_names=onames, opset_version=opset,
                              dynamo=False, dynamic_axes=axes, do_constant_folding=True)
    return path


def do_torch(key, opset, dtype, dynamo, norms_fp32=False):
    kind = "dynamo" if dynamo else "torchscript"
    fname = f"{kind}_op{opset}_{dtype}{'_fp32ln' if norms_fp32 else ''}_{key}.onnx"

    @step(fname)
    def go():
        path = torch_export(key, opset, dtype, dynamo, fname, norms_fp32)
        ekey = key
        if key == "whisper_enc" and dtype == "fp16":
            ekey = "whisper_enc_fp16"
        prod = f"torch {VER['torch']} torch.onnx.export(dynamo={dynamo}, opset_version={opset})" + \
               (", model.half()" if dtype == "fp16" else "") + \
               (" with every nn.LayerNorm kept in fp32 (fp16 input, fp32 scale/bias)" if norms_fp32 else "")
        note = ("issue 23: onnxruntime refuses to load it (Type parameter (T) of Optype (LayerNormalization) bound "
                "to different types); the folded norms take γ/β in fp16, and onnxruntime loads the folded model"
                if norms_fp32 else None)
        record(path, prod, MODEL_NAME.get(ekey, key), dtype, ekey, note=note)
        return path
    return go()


# --------------------------------------------------------------------------------------------
# Optimum
# --------------------------------------------------------------------------------------------
def optimum_export(name, task, *, dtype=None, extra=None):
    from optimum.exporters.onnx import main_export

    tmp = Path(tempfile.mkdtemp(prefix=f"corpus_{name}_"))
    src, dst = tmp / "hf", tmp / "onnx"
    m = hf_model(name)
    m.save_pretrained(src)
    with contextlib.redirect_stdout(io.StringIO()):
        main_export(str(src), dst, task=task, do_validation=False, dtype=dtype, **(extra or {}))
    return dst


def do_optimum(name, task, wanted: dict, *, dtype=None, tag=""):
    """wanted: optimum output file name -> (corpus key, needs)."""
    label = f"optimum_{name}{tag}"

    @step(label)
    def go():
        dst = optimum_export(name, task, dtype=dtype)
        print("  optimum wrote:", sorted(p.name for p in dst.glob("*.onnx")), flush=True)
        made = {}
        for f, (key, needs) in wanted.items():
            p = dst / f
            if not p.exists():
                print(f"  ! optimum did not write {f}", flush=True)
                FAILED.append((f"{label}/{f}", "not written"))
                continue
            out = OUT / f"optimum_{name}{tag}_{f}"
            shutil.copy(p, out)
            prod = f"optimum-onnx {VER['optimum-onnx']} (optimum {VER['optimum']}) main_export(task={task!r}" + \
                   (f", dtype={dtype!r}" if dtype else "") + ")"
            record(out, prod, MODEL_NAME.get(key, key), dtype or "fp32", key, needs=needs)
            made[f] = out
        return made
    return go() or {}


def do_merged(name):
    """optimum-onnx 0.1 exports decoder-only models as one model.onnx (with past, past may be empty);
    the two-branch decoder_model_merged.onnx comes from Optimum's own merge_decoders over the
    no-past export (task text-generation) and the with-past export."""
    fname = f"optimum_{name}_decoder_model_merged.onnx"

    @step(fname)
    def go():
        from optimum.exporters.onnx import export
        from optimum.exporters.tasks import TasksManager
        from optimum.onnx import merge_decoders
        tmp = Path(tempfile.mkdtemp(prefix=f"corpus_merged_{name}_"))
        m = hf_model(name)
        ctor = TasksManager.get_exporter_config_constructor("onnx", model=m, task="text-generation",
                                                             library_name="transformers")
        for use_past_in_inputs, f in [(False, "decoder_model.onnx"), (True, "decoder_with_past_model.onnx")]:
            cfg = ctor(m.config, use_past=True, use_past_in_inputs=use_past_in_inputs)
            with contextlib.redirect_stdout(io.StringIO()):
                export(m, cfg, tmp / f)
        with contextlib.redirect_stdout(io.StringIO()):
            merge_decoders(decoder=tmp / "decoder_model.onnx", decoder_with_past=tmp / "decoder_with_past_model.onnx",
                           save_path=OUT / fname, strict=False)
        record(OUT / fname, f"optimum-onnx {VER['optimum-onnx']}: optimum.exporters.onnx.export with the {name} "
               "OnnxConfig(use_past=True, use_past_in_inputs=False / True) (the legacy decoder_model + "
               "decoder_with_past_model pair) + optimum.onnx.merge_decoders(strict=False)",
               MODEL_NAME[name], "fp32", name,
               needs=["--dim past_sequence_length=N (attention_mask is past_sequence_length + sequence_length); "
                      "use_cache_branch is a bool input selecting the If branch"])
    go()


# --------------------------------------------------------------------------------------------
# onnxruntime transformer optimizer, fp16 converters, onnxslim, onnxsim
# --------------------------------------------------------------------------------------------
def entry_of(fname):
    return [e for e in MANIFEST if e["file"] == fname][-1]


def derived(src: Path, fname: str, producer: str, dtype=None, note=None, expect=None):
    e = entry_of(src.name)
    path = OUT / fname
    ex = expect or (e["layernorms"], e["expected_folded"], e["expected_recentered"], e["why"])
    EXPECT["_tmp"] = ex
    import onnx
    cnt = count_layernorms(onnx.load(str(path), load_external_data=False))["total"]
    if any(n.op_type == "If" for n in onnx.load(str(path)).graph.node):
        pass
    record(path, producer + f" on {src.name}", e["model"], dtype or e["dtype"], "_tmp", needs=e["needs"],
           note=note)
    # record() may double for If graphs: the source entry already carries the doubled count.
    last = MANIFEST[-1]
    if last["layernorms"] != ex[0] and cnt == ex[0]:
        last.update(layernorms=ex[0], expected_folded=ex[1], expected_recentered=ex[2], why=ex[3])
        last.pop("count_mismatch", None)


def do_ortopt(src: Path, model_type: str, fp16: bool, num_heads=H, hidden=D, note=None, opt_level=None):
    fname = f"ortopt_{'fp16_' if fp16 else ''}{src.stem}.onnx".replace("optimum_", "").replace("torchscript_", "ts_")

    @step(fname)
    def go():
        from onnxruntime.transformers import optimizer
        with contextlib.redirect_stdout(io.StringIO()):
            kw = {} if opt_level is None else {"opt_level": opt_level}
            m = optimizer.optimize_model(str(src), model_type=model_type, num_heads=num_heads, hidden_size=hidden,
                                         **kw)
            if fp16:
                m.convert_float_to_float16(keep_io_types=True)
            m.save_model_to_file(str(OUT / fname))
        stats = m.get_fused_operator_statistics()
        fused = {k: v for k, v in stats.items() if v}
        prod = (f"onnxruntime {VER['onnxruntime']} onnxruntime.transformers.optimizer.optimize_model("
                f"model_type={model_type!r}, num_heads={num_heads}, hidden_size={hidden}"
                + (f", opt_level={opt_level}" if opt_level is not None else "") + ")"
                + (" + convert_float_to_float16(keep_io_types=True)  [= optimizer --float16]" if fp16 else ""))
        derived(src, fname, prod, "fp16" if fp16 else None, note=(note or "") + f" fused: {fused}")
        return OUT / fname
    return go()


def do_occ_fp16(src: Path, keep_io_types: bool, tag=""):
    fname = f"occfp16{tag}_{src.stem}.onnx".replace("optimum_", "").replace("torchscript_", "ts_")

    @step(fname)
    def go():
        import onnx
        from onnxconverter_common import float16
        m = onnx.load(str(src))
        with contextlib.redirect_stdout(io.StringIO()):
            m16 = float16.convert_float_to_float16(m, keep_io_types=keep_io_types)
        onnx.save(m16, str(OUT / fname))
        note = ort_load_status(OUT / fname)
        derived(src, fname, f"onnxconverter-common {VER['onnxconverter-common']} "
                f"float16.convert_float_to_float16(keep_io_types={keep_io_types})", "fp16", note=note)
        return OUT / fname
    return go()


def do_ort_fp16(src: Path):
    fname = f"ortfp16_{src.stem}.onnx".replace("optimum_", "").replace("torchscript_", "ts_")

    @step(fname)
    def go():
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
        m = onnx.load(str(src))
        with contextlib.redirect_stdout(io.StringIO()):
            m16 = convert_float_to_float16(m, keep_io_types=True)
        onnx.save(m16, str(OUT / fname))
        derived(src, fname, f"onnxruntime {VER['onnxruntime']} onnxruntime.transformers.float16."
                "convert_float_to_float16(keep_io_types=True)", "fp16", note=ort_load_status(OUT / fname))
        return OUT / fname
    return go()


def ort_load_status(path):
    import onnxruntime as ort
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return "onnxruntime loads it"
    except Exception as e:  # noqa: BLE001
        return "onnxruntime REFUSES to load it: " + str(e).strip().splitlines()[0][:300]


def do_slim(src: Path):
    fname = f"onnxslim_{src.stem}.onnx".replace("optimum_", "").replace("torchscript_", "ts_")

    @step(fname)
    def go():
        r = subprocess.run([sys.executable, "-m", "onnxslim", str(src), str(OUT / fname)], capture_output=True,
                           text=True)
        if r.returncode:
            raise RuntimeError((r.stderr or r.stdout).strip().splitlines()[-1])
        derived(src, fname, f"onnxslim {VER['onnxslim']} (`onnxslim IN OUT`, defaults)")
        return OUT / fname
    return go()


def do_sim(src: Path):
    fname = f"onnxsim_{src.stem}.onnx".replace("optimum_", "").replace("torchscript_", "ts_")

    @step(fname)
    def go():
        import onnx
        import onnxsim
        m, ok = onnxsim.simplify(onnx.load(str(src)))
        if not ok:
            raise RuntimeError("onnxsim check failed")
        onnx.save(m, str(OUT / fname))
        derived(src, fname, f"onnxsim {VER['onnxsim']} onnxsim.simplify(model) (defaults)")
        return OUT / fname
    return go()


# --------------------------------------------------------------------------------------------
# Keras via tf2onnx, flax.nnx via jax2onnx  (run in subprocesses: TF and JAX are heavy)
# --------------------------------------------------------------------------------------------
# Both Keras sources: L Pre-LN blocks (Keras' MultiHeadAttention, a GELU MLP), final LN, head; then
# the weights made adversarial: γ, β random; every table a mean per row; kernels [in, ..., out] a
# mean constant along the output axes; biases large
KERAS_BODY = r'''for i in range(L):
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln1_{i}")(x)
    h = keras.layers.MultiHeadAttention(H, D // H, name=f"attn_{i}")(h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln2_{i}")(x)
    h = keras.layers.Dense(FF, activation="gelu", name=f"fc1_{i}")(h)
    x = x + keras.layers.Dense(D, name=f"fc2_{i}")(h)
x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
out = keras.layers.Dense(V, name="head")(x)
model = keras.Model(ids, out)
'''
KERAS_WEIGHTS = r'''for layer in model.layers:
    ws = layer.get_weights()
    if not ws:
        continue
    if isinstance(layer, keras.layers.LayerNormalization):
        ws = [1 + 0.5 * rng.standard_normal(w.shape) for w in ws[:1]] + [0.5 * rng.standard_normal(w.shape) for w in ws[1:]]
    elif isinstance(layer, keras.layers.Embedding) or layer.name == "posemb":   # a table: a mean per row
        w = ws[0]; ws = [w + 3.0 * (w.std() + .02) * rng.standard_normal((w.shape[0], 1))]
    else:   # Dense / attention kernels: [in, ..., out...]; shift constant along the output axes, biases large
        new = []
        for w in ws:
            if w.ndim >= 2:
                shape = [w.shape[0]] + [1] * (w.ndim - 1)
                new.append(w + 3.0 * (w.std() + .02) * rng.standard_normal(shape))
            else:
                new.append(0.2 * rng.standard_normal(w.shape) + 0.3)
        ws = new
    layer.set_weights([np.asarray(w, np.float32) for w in ws])
'''

KERAS_SRC = r'''
import sys, numpy as np, tensorflow as tf, tf2onnx, keras
L, D, H, FF, V, P, S = %(L)d, %(D)d, %(H)d, %(FF)d, %(V)d, %(P)d, 7
rng = np.random.default_rng(0)
ids = keras.Input((S,), dtype="int32", name="input_ids")
tok = keras.layers.Embedding(V, D, name="tok")
pos = keras.layers.Embedding(P, D, name="pos")
x = tok(ids) + pos(keras.ops.arange(S)[None, :])
%(keras_body)sspec = (tf.TensorSpec((None, S), tf.int32, name="input_ids"),)
opset = int(sys.argv[2])
tf2onnx.convert.from_keras(model, input_signature=spec, opset=opset, output_path=sys.argv[1])
'''

# issue 23: a dynamic sequence length and a hand-written position layer slicing its table to it
# (strided_slice of a constant); at opset 13 tf2onnx keeps attention output projections as Einsum
# ("abcd,cde->abe": their input's rank is unknown to tf2onnx after the unsupported Erfc). Not
# reproducible run to run: tf2onnx 1.17 kept both, one or neither in three builds; where it
# decomposes one (Gemm by Reshape(kernel, a computed shape)), lnfold recenters it (a needless
# recenter, not a wrong fold: the runtime-reshaped kernel is not followed). The committed file
# keeps both.
KERAS_POSEMB_SRC = r'''import sys, numpy as np, tensorflow as tf, tf2onnx, keras
L, D, H, FF, V, P = %(L)d, %(D)d, %(H)d, %(FF)d, %(V)d, %(P)d
rng = np.random.default_rng(0)

class PosEmb(keras.layers.Layer):
    """A learned position table sliced to the sequence length (the usual hand-written Keras layer)."""
    def build(self, shape):
        self.table = self.add_weight(shape=(P, D), name="table")
    def call(self, x):
        return x + self.table[None, : keras.ops.shape(x)[1]]

ids = keras.Input((None,), dtype="int32", name="input_ids")
x = keras.layers.Embedding(V, D, name="tok")(ids)
x = PosEmb(name="posemb")(x)
%(keras_body)sspec = (tf.TensorSpec((None, None), tf.int32, name="input_ids"),)
tf2onnx.convert.from_keras(model, input_signature=spec, opset=int(sys.argv[2]), output_path=sys.argv[1])
'''

# issue 23: flax.linen's default LayerNorm (fast variance) through jax2tf + tf2onnx. jax2tf's graph
# serialization (native_serialization=False, enable_xla=False: plain TF ops tf2onnx converts) is
# gone from recent jax (only XlaCallModule, which tf2onnx cannot convert), so this one runs in its
# own venv: LNFOLD_JAX2TF_PYTHON=/path/to/python with jax==0.4.30 jaxlib==0.4.30 flax==0.8.5
# tensorflow-cpu==2.21.0 tf2onnx==1.17.0 numpy==2.4.6. No nn.Embed: jnp.take's default mode
# "fill" becomes mask * rows + NaN * (1 - mask) in tf2onnx, NaN everywhere.
JAX2TF_SRC = r'''import sys, numpy as np, jax, jax.numpy as jnp, tensorflow as tf, tf2onnx
from jax.experimental import jax2tf
import flax.linen as nn
D, FF, V, S, F = %(D)d, %(FF)d, %(V)d, 7, 16
rng = np.random.default_rng(0)

class Model(nn.Module):
    """A Pre-LN residual MLP over feature sequences: stem Dense + position table, one block
    LN -> Dense -> gelu -> Dense -> Add, final LN, head Dense (two flax.linen LayerNorms)."""
    @nn.compact
    def __call__(self, feats):
        x = nn.Dense(D, name="stem")(feats) + self.param("pos", nn.initializers.normal(0.02), (S, D))
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.Dense(D, name="fc2")(nn.gelu(nn.Dense(FF, name="fc1")(h)))
        return nn.Dense(V, name="head")(nn.LayerNorm(name="ln_f")(x))

m = Model()
params = m.init(jax.random.PRNGKey(0), jnp.zeros((2, S, F), jnp.float32))
def adv(path, w):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    w = np.asarray(w)
    if name.endswith("scale"):
        return 1 + 0.5 * rng.standard_normal(w.shape)
    if "/ln" in name and name.endswith("bias"):
        return 0.5 * rng.standard_normal(w.shape)
    if name.endswith("pos"):
        return w + 3.0 * (w.std() + .02) * rng.standard_normal((w.shape[0], 1))
    if name.endswith("kernel"):
        return w + 3.0 * (w.std() + .02) * rng.standard_normal([w.shape[0]] + [1] * (w.ndim - 1))
    if name.endswith("bias"):
        return 0.2 * rng.standard_normal(w.shape) + 0.3
    return w
params = jax.tree_util.tree_map_with_path(lambda p, w: jnp.asarray(adv(p, w), jnp.float32), params)
f = jax2tf.convert(lambda x: m.apply(params, x), native_serialization=False, enable_xla=False,
                   polymorphic_shapes=["(b, 7, 16)"])
spec = [tf.TensorSpec((None, S, F), tf.float32, name="features")]
tf2onnx.convert.from_function(tf.function(f, autograph=False), input_signature=spec, opset=int(sys.argv[2]),
                              output_path=sys.argv[1])
'''

NNX_SRC = r'''
import sys, jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax2onnx import to_onnx
L, D, H, FF, V, P, S = %(L)d, %(D)d, %(H)d, %(FF)d, %(V)d, %(P)d, 7
rng = np.random.default_rng(0)

class Block(nnx.Module):
    def __init__(self, r):
        self.ln1 = nnx.LayerNorm(D, rngs=r)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=r)
        self.ln2 = nnx.LayerNorm(D, rngs=r)
        self.fc1 = nnx.Linear(D, FF, rngs=r)
        self.fc2 = nnx.Linear(FF, D, rngs=r)
    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h)
        h = self.ln2(x)
        return x + self.fc2(nnx.gelu(self.fc1(h)))

class Model(nnx.Module):
    def __init__(self, r):
        self.tok = nnx.Embed(V, D, rngs=r)
        self.pos = nnx.Param(jnp.zeros((S, D)))
        self.blocks = nnx.List([Block(r) for _ in range(L)]) if hasattr(nnx, "List") else [Block(r) for _ in range(L)]
        self.ln_f = nnx.LayerNorm(D, rngs=r)
        self.head = nnx.Linear(D, V, rngs=r)
    def __call__(self, ids):
        x = self.tok(ids) + self.pos[...][None]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

m = Model(nnx.Rngs(0))
for path, var in nnx.iter_graph(m):
    if not isinstance(var, nnx.Param):
        continue
    name = "/".join(str(p) for p in path)
    w = np.asarray(var[...])
    if name.endswith("scale"):
        w = 1 + 0.5 * rng.standard_normal(w.shape)
    elif name.startswith("ln") or "/ln" in name:
        w = 0.5 * rng.standard_normal(w.shape)
    elif name.endswith("embedding") or name == "pos":
        w = w + 3.0 * (w.std() + .02) * rng.standard_normal((w.shape[0], 1))
    elif name.endswith("kernel"):       # [in, ..., out]: constant along the output axes
        w = w + 3.0 * (w.std() + .02) * rng.standard_normal([w.shape[0]] + [1] * (w.ndim - 1))
    elif name.endswith("bias"):
        w = 0.2 * rng.standard_normal(w.shape) + 0.3
    var[...] = jnp.asarray(w, jnp.float32)
to_onnx(m, [jax.ShapeDtypeStruct(("B", S), jnp.int32)], return_mode="file", output_path=sys.argv[1],
        opset=int(sys.argv[2]))
'''


def sub_build(src, fname, opset, python=None):
    code = src % dict(L=L, D=D, H=H, FF=FF, V=V, P=P, keras_body=KERAS_BODY + KERAS_WEIGHTS)
    r = subprocess.run([python or sys.executable, "-c", code, str(OUT / fname), str(opset)], capture_output=True,
                       text=True, timeout=900)
    if r.returncode or not (OUT / fname).exists():
        tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        raise RuntimeError(tail[-1] if tail else f"exit {r.returncode}")
    return OUT / fname


def do_keras(opset):
    fname = f"tf2onnx_op{opset}_keras_block.onnx"

    @step(fname)
    def go():
        p = sub_build(KERAS_SRC, fname, opset)
        record(p, f"tf2onnx {VER['tf2onnx']} tf2onnx.convert.from_keras(opset={opset}); "
               f"tensorflow-cpu {VER['tensorflow-cpu']}", "Keras Pre-LN block (2 blocks, MHA causal)", "fp32",
               "keras_block")
    go()


def do_keras_posemb(opset):
    fname = f"tf2onnx_op{opset}_keras_posemb_einsum.onnx"

    @step(fname)
    def go():
        p = sub_build(KERAS_POSEMB_SRC, fname, opset)
        record(p, f"tf2onnx {VER['tf2onnx']} tf2onnx.convert.from_keras(opset={opset}); tensorflow-cpu "
               f"{VER['tensorflow-cpu']}, keras {VER.get('keras')}", "Keras Pre-LN block (2 blocks, Keras MHA, "
               "sliced position table, dynamic length)", "fp32", "keras_posemb")
    go()


def do_flax_jax2tf(opset):
    fname = f"jax2tf_tf2onnx_op{opset}_linen_mlp.onnx"

    @step(fname)
    def go():
        py = os.environ.get("LNFOLD_JAX2TF_PYTHON", sys.executable)
        ver = subprocess.run([py, "-c", "import jax, flax, tf2onnx, tensorflow as tf; print(jax.__version__, "
                              "flax.__version__, tf2onnx.__version__, tf.__version__)"], capture_output=True,
                             text=True).stdout.split()
        p = sub_build(JAX2TF_SRC, fname, opset, python=py)
        record(p, f"tf2onnx {ver[2]} tf2onnx.convert.from_function(opset={opset}) of jax2tf.convert("
               f"native_serialization=False, enable_xla=False); jax {ver[0]}, flax {ver[1]}, tensorflow-cpu {ver[3]}",
               "flax.linen Pre-LN residual MLP (1 block, default LayerNorm)", "fp32", "linen_mlp")
    go()


def do_nnx(opset):
    fname = f"jax2onnx_op{opset}_nnx_block.onnx"

    @step(fname)
    def go():
        p = sub_build(NNX_SRC, fname, opset)
        record(p, f"jax2onnx {VER['jax2onnx']} to_onnx(opset={opset}); flax {VER['flax']}, jax {VER['jax']}",
               "flax.nnx Pre-LN block (2 blocks)", "fp32", "nnx_block")
    go()


# --------------------------------------------------------------------------------------------
# PaddleOCR models shipped in rapidocr-onnxruntime
# --------------------------------------------------------------------------------------------
def do_rapidocr():
    @step("rapidocr")
    def go():
        import rapidocr_onnxruntime
        d = Path(rapidocr_onnxruntime.__file__).parent / "models"
        info = {
            "ch_PP-OCRv4_rec_infer.onnx": (
                "PaddleOCR PP-OCRv4 rec (PPLCNetV3 + SVTR neck, CTC head)", (5, 5, 1,
                "SVTR neck (EncoderWithSVTR): conv1, conv2 (Conv+BN+swish) -> flatten/transpose -> 2 Pre-LN "
                "blocks (norm1, norm2) -> final norm -> reshape -> conv3: 5 decomposed LNs. The stream starts "
                "at swish(BN(conv2)) (opaque); writers are attention proj / mlp fc2 (MatMul+Add, centerable); "
                "sinks are the 5 norms only: 1 recenter buys 5 swaps"), False),
            "ch_ppocr_mobile_v2.0_cls_infer.onnx": ("PaddleOCR mobile v2.0 text-direction cls (MobileNetV3)",
                                                   (0, 0, 0, "no LayerNorm (BatchNorm CNN): lnfold must say so (exit 2)"), True),
            "ch_PP-OCRv4_det_infer.onnx": ("PaddleOCR PP-OCRv4 det (DB, PPLCNetV3)",
                                          (0, 0, 0, "no LayerNorm (BatchNorm CNN)"), False),
        }
        for f, (model, ex, committed) in info.items():
            shutil.copy(d / f, OUT / f"rapidocr_{f}")
            record(OUT / f"rapidocr_{f}", f"Paddle2ONNX (shipped in rapidocr-onnxruntime {VER['rapidocr-onnxruntime']}, "
                   "copied unchanged)", model, "fp32", None, expect=ex, committed=committed,
                   needs=["sizes for the symbolic H/W (p2o.DynamicDimension.*, '?'): rec needs H=48, W a "
                          "multiple of 8 (e.g. 320); det H, W multiples of 32"] if "cls" not in f else [],
                   note=None if committed else f"not committed (size); copy it from the installed package: "
                   f"rapidocr_onnxruntime/models/{f}")
    go()


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
# issue 34: integer-stored weights and random ops (hand-built with onnx.helper; quantize_dynamic)
# --------------------------------------------------------------------------------------------
S = 6          # tokens of the hand-built encoder
ENC_WHY = ("tiny Pre-LN encoder: word table Gather + position table, 2 blocks h + fc2(relu(fc1(LN h))), final LN, "
           "head MatMul: 3 LayerNorms; ")


def tiny_encoder(seed=0, *, quantized=None, form="castmul", storage="int8", random_op=None):
    """The encoder as an onnx.ModelProto. `quantized` ("embed" or "proj"): the word table or every
    projection (fc1, fc2, head) stored as `storage` integers with a per-row (per-output) scale,
    dequantized by Cast -> [Sub zero point ->] Mul (`form` "castmul") or DequantizeLinear ("dql").
    `random_op`: that op once on the stream's path and once off it."""
    import numpy as np
    from onnx import TensorProto as TP, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, k = [], [], [0]

    def name(base):
        k[0] += 1
        return f"{base}_{k[0]}"

    def const(base, a):
        n = name(base)
        inits.append(numpy_helper.from_array(np.asarray(a), n))
        return n

    def op(t, ins, **at):
        out = name(t.lower())
        nodes.append(helper.make_node(t, ins, [out], name=name(t), **at))
        return out

    def dequantized(w, axis):
        """w (float) stored as integers with one scale per entry along `axis`, and its dequantization."""
        keep = tuple(a for a in range(w.ndim) if a != axis)
        if storage == "int8":
            s = np.abs(w).max(axis=keep, keepdims=True) / 127
            q, zp = np.clip(np.round(w / s), -127, 127).astype(np.int8), np.zeros_like(s)
        else:
            lo, hi = w.min(axis=keep, keepdims=True), w.max(axis=keep, keepdims=True)
            s = (hi - lo) / 255
            zp = np.clip(np.round(-lo / s), 0, 255)
            q = np.clip(np.round(w / s) + zp, 0, 255).astype(np.uint8)
        qn = const("wq", q)
        if form == "dql":
            return op("DequantizeLinear", [qn, const("s", s.reshape(-1).astype(np.float32)),
                                           const("zp", zp.reshape(-1).astype(q.dtype))], axis=axis)
        x = op("Cast", [qn], to=TP.FLOAT)
        if storage != "int8":
            x = op("Sub", [x, const("zp", zp.astype(np.float32))])
        return op("Mul", [x, const("s", s.astype(np.float32))])

    def weight(shape, quant_axis, row_mean=0.0, col_mean=0.0):
        w = rng.standard_normal(shape) * 0.5
        w += rng.standard_normal((shape[0], 1)) * row_mean + rng.standard_normal((1, shape[1])) * col_mean
        w = w.astype(np.float32)
        return dequantized(w, quant_axis) if quant_axis is not None else const("W", w)

    def linear(x, din, dout, quant):
        w = weight((din, dout), 1 if quant else None, col_mean=SOURCE_MEAN)
        return op("Add", [op("MatMul", [x, w]), const("b", (rng.standard_normal(dout) + SOURCE_MEAN).astype(np.float32))])

    def ln(x):
        g = const("gamma", (1 + 0.5 * rng.standard_normal(D)).astype(np.float32))
        b = const("beta", (0.5 * rng.standard_normal(D)).astype(np.float32))
        return op("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-5)

    def draw(like, shape, on_path):
        """random_op's output of `shape` (a `like` tensor of it for the *Like ops)."""
        if random_op in ("RandomNormal", "RandomUniform"):
            return op(random_op, [], dtype=TP.FLOAT, shape=shape)
        if random_op.endswith("Like"):
            return op(random_op, [like])
        if random_op == "Bernoulli":
            p = const("p", rng.random(shape).astype(np.float32)) if on_path else op("Sigmoid", [like])
            return op("Bernoulli", [p])
        raise ValueError(random_op)

    ids = "input_ids"
    proj = quantized == "proj"
    table = weight((V, D), 0 if quantized == "embed" else None, row_mean=SOURCE_MEAN)
    h = op("Add", [op("Gather", [table, ids], axis=0), const("pos", (rng.standard_normal((S, D)) * 0.5 +
                                                                   rng.standard_normal((S, 1)) * SOURCE_MEAN).astype(np.float32))])
    if random_op == "Multinomial":  # sampled ids index a second (constant) table into the stream
        sampled = op("Multinomial", [const("logits", rng.standard_normal((S, V)).astype(np.float32))], sample_size=1)
        extra = op("Gather", [const("table2", (rng.standard_normal((V, D)) + SOURCE_MEAN).astype(np.float32)),
                              op("Reshape", [sampled, const("shape", np.array([1, S], np.int64))])], axis=0)
        h = op("Add", [h, extra])
    elif random_op == "Dropout":
        h = op("Dropout", [h, const("ratio", np.array(0.1, np.float32)), const("training", np.array(True))])
    elif random_op is not None:
        h = op("Add", [h, op("Mul", [draw(h, [1, S, D], True), const("noise_scale", np.array(0.5, np.float32))])])
    for _ in range(L):
        hidden = op("Relu", [linear(ln(h), D, FF, proj)])
        if random_op == "Dropout":  # off the path: fc2 reads it, and fc2's weights still center its output
            hidden = op("Dropout", [hidden, const("ratio", np.array(0.1, np.float32)), const("training", np.array(True))])
        h = op("Add", [h, linear(hidden, FF, D, proj)])
    logits = op("MatMul", [ln(h), weight((D, V), 1 if proj else None)])
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, [1, S, V])]
    if random_op == "Multinomial":  # off the path: samples of the output
        sampled = op("Multinomial", [op("Reshape", [logits, const("shape", np.array([S, V], np.int64))])], sample_size=2)
        nodes.append(helper.make_node("Identity", [sampled], ["samples"], name="samples"))
        outputs.append(helper.make_tensor_value_info("samples", TP.INT32, [S, 2]))
    elif random_op not in (None, "Dropout"):
        logits = op("Add", [logits, draw(logits, [1, S, V], False)])
    nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
    graph = helper.make_graph(nodes, "tiny_encoder", [helper.make_tensor_value_info(ids, TP.INT64, [1, S])], outputs,
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10,
                             producer_name="lnfold tests/corpus/build.py")


QUANT_WHY = {
    "embed": (3, 3, 1, ENC_WHY + "the word table is stored as {storage} and dequantized by {how} before the Gather: no "
              "constant edit centers integers, so the dequantized table is an opaque start; 1 recenter buys 3 folds"),
    "proj": (3, 0, 0, ENC_WHY + "fc1, fc2 and head weights are stored as {storage}, dequantized by {how}: the 2 fc2 "
             "MatMuls write the stream through weights no constant edit centers (2 opaque starts); 2 recenters "
             "would buy only 3 folds (< 2x): all kept, the reason naming the storage"),
}
RANDOM_WHY = {
    "Multinomial": (3, 3, 0, "on the path: sampled ids Gather rows of a constant table into the stream (a centerable "
                    "source, no recenter); off it: a second output samples the logits"),
    "Dropout": (3, 3, 1, "training-mode Dropout on the path (it zeroes and scales: opaque, 1 recenter buys 3 folds); "
                "off it: between relu and fc2, whose weights still center its output"),
}


QUANT_DYNAMIC = (3, 0, 0, ENC_WHY + "quantize_dynamic stores the word table as uint8 (Gather -> DequantizeLinear) and "
                 "every MatMul weight as int8 (DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul by the two "
                 "scales): 3 opaque starts (the table, both fc2) would buy only 3 folds: all kept, the reason naming "
                 "int8")


def do_issue34():
    @step("issue34")
    def go():
        import onnx
        for quantized in ("embed", "proj"):
            for form, how in (("castmul", "Cast -> Mul (per-row scale)"), ("dql", "DequantizeLinear (per-axis)")):
                for storage in ("int8", "uint8"):
                    fname = f"hand_{form}_{storage}_{quantized}.onnx"
                    onnx.save(tiny_encoder(1, quantized=quantized, form=form, storage=storage), str(OUT / fname))
                    total, folded, rec, why = QUANT_WHY[quantized]
                    how_ = how if storage == "int8" or form == "dql" else "Cast -> Sub(zero point) -> Mul"
                    record(OUT / fname, "hand-built (onnx.helper), weight-only quantized", "tiny Pre-LN encoder",
                           f"fp32 + {storage}", "_", expect=(total, folded, rec, why.format(storage=storage, how=how_)))
                    if folded == 0:
                        MANIFEST[-1]["expected_reason"] = f"stored as {storage}: fold the float model, then quantize"
        for random_op in ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                          "Multinomial", "Dropout"):
            fname = f"hand_random_{random_op}.onnx"
            onnx.save(tiny_encoder(2, random_op=random_op), str(OUT / fname))
            total, folded, rec, why = RANDOM_WHY.get(random_op, (3, 3, 1, f"{random_op} on the path (its draw added "
                                                     "to the stream: opaque, 1 recenter buys 3 folds) and off it (added "
                                                     "to the logits)"))
            record(OUT / fname, "hand-built (onnx.helper), unseeded random op", "tiny Pre-LN encoder", "fp32", "_",
                   expect=(total, folded, rec, ENC_WHY + why))
            MANIFEST[-1]["expected_criterion"] = "pinned seeds"
        from onnxruntime.quantization import quantize_dynamic
        src, fname = OUT / "hand_float_encoder.onnx", "ortquant_dynamic_encoder.onnx"
        onnx.save(tiny_encoder(3), str(src))
        quantize_dynamic(str(src), str(OUT / fname))
        src.unlink()
        record(OUT / fname, f"onnxruntime {VER.get('onnxruntime')} quantization.quantize_dynamic (defaults: QInt8)",
               "tiny Pre-LN encoder", "fp32 + int8", "_", expect=QUANT_DYNAMIC)
        if QUANT_DYNAMIC[1] == 0:
            MANIFEST[-1]["expected_reason"] = "stored as int8/uint8: fold the float model, then quantize"
    go()


def main():
    global OUT, VER, ONLY
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--only", nargs="*", default=None, help="build only files / steps whose name contains one of these")
    a = ap.parse_args()
    OUT = Path(a.outdir).resolve()
    OUT.mkdir(parents=True, exist_ok=True)
    VER = versions()
    ONLY = a.only
    want = (lambda g: True)   # every step filters itself by ONLY
    man = OUT / "manifest.json"
    old = json.loads(man.read_text()) if man.exists() else {"files": []}
    MANIFEST.extend(old["files"])

    # 1. TorchScript / dynamo, opsets 14..23, fp32 and fp16
    if want("torch"):
        for key in ["gpt2", "opt", "gpt_neox", "bloom", "falcon", "bert", "vit", "clip_vision_pooled", "whisper_enc"]:
            do_torch(key, 17, "fp32", dynamo=False)
        for key in ["gpt2", "bloom", "whisper_enc"]:
            do_torch(key, 14, "fp32", dynamo=False)
        for key in ["gpt2", "vit", "whisper_enc"]:
            do_torch(key, 17, "fp16", dynamo=False)
        for key in ["gpt2", "opt", "gpt_neox", "falcon", "bert", "vit", "clip_vision_pooled", "whisper_enc"]:
            do_torch(key, 18, "fp32", dynamo=True)
        for key in ["gpt2", "vit", "whisper_enc"]:
            do_torch(key, 23, "fp32", dynamo=True)
        for key in ["gpt2", "bloom", "whisper_enc"]:
            do_torch(key, 18, "fp16", dynamo=True)
        for key in ["gpt2", "vit"]:     # issue 23: fp16 model, fp32 LayerNorms
            do_torch(key, 17, "fp16", dynamo=False, norms_fp32=True)

    # 2. Optimum
    past = ["--dim past_sequence_length=N (attention_mask is past_sequence_length + sequence_length)"]
    opt_files = {}
    if want("optimum"):
        for name in ["gpt2", "opt", "gpt_neox", "bloom", "falcon"]:
            opt_files[name] = do_optimum(name, "text-generation-with-past",
                                         {"model.onnx": (name, past)})
        for name in ["gpt2", "opt"]:
            do_merged(name)
        opt_files["bert"] = do_optimum("bert", "feature-extraction", {"model.onnx": ("bert", [])})
        img = ["--dim num_channels=3 height=32 width=32 (pixel_values is [batch_size, num_channels, height, width])"]
        opt_files["vit"] = do_optimum("vit", "feature-extraction", {"model.onnx": ("vit", img)})
        opt_files["clip"] = do_optimum("clip_vision", "feature-extraction", {"model.onnx": ("clip_vision_lhs", img)})
        opt_files["whisper"] = do_optimum("whisper", "automatic-speech-recognition-with-past",
                                          {"encoder_model.onnx": ("whisper_enc", []),
                                           "decoder_model_merged.onnx": ("whisper_dec", past),
                                           "decoder_model.onnx": ("whisper_dec", []),
                                           "decoder_with_past_model.onnx": ("whisper_dec", past)})
        opt_files["whisper16"] = do_optimum("whisper", "automatic-speech-recognition",
                                            {"encoder_model.onnx": ("whisper_enc_fp16", [])}, dtype="fp16",
                                            tag="_fp16")
        opt_files["bart"] = do_optimum("bart", "text2text-generation",
                                       {"decoder_model.onnx": ("bart_dec", [])})

    # 3. derived: ORT optimizer, fp16 converters, onnxslim, onnxsim
    if want("derived"):
        def have(f):
            p = OUT / f
            return p if p.exists() and any(e["file"] == f for e in MANIFEST) else None
        for src, mt in [("optimum_bert_model.onnx", "bert"), ("optimum_gpt2_model.onnx", "gpt2"),
                        ("optimum_vit_model.onnx", "vit"),
                        ("optimum_clip_vision_model.onnx", "clip"), ("optimum_whisper_encoder_model.onnx", "bart"),
                        ("optimum_bart_decoder_model.onnx", "bart"), ("torchscript_op17_fp32_gpt2.onnx", "gpt2"),
                        ("torchscript_op17_fp32_bert.onnx", "bert")]:
            if have(src):
                do_ortopt(OUT / src, mt, fp16=False)
        for src, mt in [("optimum_bert_model.onnx", "bert"), ("optimum_gpt2_model.onnx", "gpt2"),
                        ("optimum_whisper_encoder_model.onnx", "bart"), ("optimum_vit_model.onnx", "vit")]:
            if have(src):
                do_ortopt(OUT / src, mt, fp16=True)
        for src in ["torchscript_op17_fp32_gpt2.onnx", "optimum_gpt2_model.onnx", "torchscript_op17_fp32_vit.onnx"]:
            if have(src):
                do_occ_fp16(OUT / src, keep_io_types=False)
        for src in ["torchscript_op17_fp32_bert.onnx", "optimum_gpt2_model.onnx"]:
            if have(src):
                do_ort_fp16(OUT / src)
        for src in ["torchscript_op17_fp32_gpt2.onnx", "dynamo_op18_fp32_gpt2.onnx", "torchscript_op17_fp32_vit.onnx",
                    "optimum_gpt2_decoder_model_merged.onnx", "torchscript_op17_fp32_whisper_enc.onnx"]:
            if have(src):
                do_slim(OUT / src)
        for src in ["torchscript_op17_fp32_gpt2.onnx", "torchscript_op17_fp32_bloom.onnx",
                    "torchscript_op14_fp32_whisper_enc.onnx"]:
            if have(src):
                do_sim(OUT / src)

    # 3b. issue 23: onnxconverter-common fp16 decoders and CLIP, an onnxsim'd CLIP with dynamic image size
    if want("issue23"):
        do_torch("clip", 17, "fp32", dynamo=False)
        for src in ["optimum_opt_model.onnx", "optimum_bart_decoder_model.onnx", "torchscript_op17_fp32_clip.onnx"]:
            if (OUT / src).exists():
                do_occ_fp16(OUT / src, keep_io_types=False)
        if (OUT / "torchscript_op17_fp32_clip.onnx").exists():
            do_sim(OUT / "torchscript_op17_fp32_clip.onnx")

    # 4. Keras / flax.nnx / PaddleOCR
    if want("keras"):
        do_keras(17)
        do_keras(13 + 2)
    if want("keras_posemb"):
        do_keras_posemb(13)
    if want("jax2tf"):
        do_flax_jax2tf(17)
    if want("nnx"):
        do_nnx(17)
        do_nnx(21)
    if want("rapidocr"):
        do_rapidocr()
    do_issue34()

    for e in MANIFEST:               # recount with the current counter
        p = OUT / e["file"]
        if p.exists():
            import onnx
            e["graph_count"] = count_layernorms(onnx.load(str(p), load_external_data=False))
            e.pop("count_mismatch", None)
            if e["graph_count"]["total"] != e["layernorms"]:
                e["count_mismatch"] = f"hand {e['layernorms']} vs pattern counter {e['graph_count']['total']}"
    by_name = {}
    for e in MANIFEST:               # later entries (this run) replace older ones
        by_name[e["file"]] = e
    files = sorted((e for e in by_name.values() if (OUT / e["file"]).exists()), key=lambda e: e["file"])
    doc = {"versions": VER, "config": dict(layers=L, width=D, heads=H, ffn=FF, vocab=V, positions=P,
                                           source_mean=SOURCE_MEAN),
           "failed": sorted({f"{n}: {m}" for n, m in FAILED}) if ONLY is None else
                     sorted(set(old.get("failed", [])) | {f"{n}: {m}" for n, m in FAILED}),
           "files": files}
    man.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(files)} files in manifest; {len(FAILED)} failures this run")
    for n, m in FAILED:
        print("  FAILED", n, m)


if __name__ == "__main__":
    main()
