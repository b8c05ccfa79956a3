"""Real architectures from `transformers` config classes, with weights that make bugs visible.

Random init hides fold bugs: embeddings are nearly zero-mean and γ=1, β=0 hide affine mistakes
(DESIGN §5). `adversarial` randomizes every LayerNorm's γ/β and gives every stream source a large
mean, so that skipping any single centering changes the model's outputs. Nothing is downloaded.
"""
from __future__ import annotations

import io
import warnings
from typing import Callable

import torch
from torch import nn

# Mean added to sources, in units of the weights' own scale: large enough that a missed
# centering moves a LayerNorm's input far from zero-mean.
SOURCE_MEAN = 3.0


class Logits(nn.Module):
    """model(**inputs) -> one tensor: what exporters and tests want to compare."""

    def __init__(self, model: nn.Module, field: str) -> None:
        super().__init__()
        self.model = model
        self.field = field

    def forward(self, x):
        extra = {"use_cache": False} if _is_decoder(self.model) else {}
        return getattr(self.model(x, return_dict=True, **extra), self.field)


def _is_decoder(model) -> bool:
    return getattr(model.config, "is_decoder", False) or model.config.model_type in ("gpt2", "opt", "gpt_neox")


@torch.no_grad()
def adversarial(model: nn.Module, seed: int = 0) -> nn.Module:
    """Randomize γ/β and give every source (embeddings, linear/conv outputs) a large mean."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    for mod in model.modules():
        kind = type(mod).__name__
        if isinstance(mod, nn.LayerNorm):
            if mod.weight is not None:
                mod.weight.copy_(1 + 0.5 * rnd(*mod.weight.shape))
            if mod.bias is not None:
                mod.bias.copy_(0.5 * rnd(*mod.bias.shape))
        elif isinstance(mod, nn.Embedding):
            w = mod.weight
            w.add_(SOURCE_MEAN * w.std() * rnd(w.shape[0], 1))  # a per-row mean
        elif isinstance(mod, (nn.Linear, nn.Conv2d, nn.Conv1d)) or kind == "Conv1D":
            w = mod.weight
            # Conv1D (GPT-2) stores [in, out]; Linear/Conv store [out, in, ...]: shift along out.
            out_axis = 1 if kind == "Conv1D" else 0
            shape = [1] * w.ndim
            shape[1 - out_axis] = w.shape[1 - out_axis]
            w.add_(SOURCE_MEAN * w.std() * rnd(*shape))
            if mod.bias is not None:
                mod.bias.copy_(0.2 * rnd(*mod.bias.shape) + SOURCE_MEAN * 0.1)
    # Constant tables added to the stream (cls token, position tables held as parameters).
    for name, p in model.named_parameters():
        if any(k in name for k in ("cls_token", "position_embeddings", "mask_token")) and p.ndim >= 2:
            p.add_(SOURCE_MEAN * (p.std() + 0.02) * rnd(*p.shape[:-1], 1))
    return model.eval()


def gpt2(n_layer=2, n_embd=64, n_head=4, vocab=101, positions=64, seed=0):
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                  n_positions=positions, attn_implementation="eager")
    torch.manual_seed(seed)
    m = adversarial(transformers.GPT2LMHeadModel(cfg), seed)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    return Logits(m, "logits").eval(), (ids,)


def vit(layers=2, hidden=64, heads=4, image=32, patch=8, seed=0):
    import transformers

    cfg = transformers.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                 intermediate_size=hidden * 4, image_size=image, patch_size=patch,
                                 attn_implementation="eager")
    torch.manual_seed(seed)
    m = adversarial(transformers.ViTModel(cfg, add_pooling_layer=False), seed)
    px = torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(seed))
    return Logits(m, "last_hidden_state").eval(), (px,)


def bert(layers=2, hidden=64, heads=4, vocab=101, seed=0):
    import transformers

    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                  intermediate_size=hidden * 4, vocab_size=vocab, max_position_embeddings=64,
                                  attn_implementation="eager")
    torch.manual_seed(seed)
    m = adversarial(transformers.BertModel(cfg, add_pooling_layer=False), seed)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    return Logits(m, "last_hidden_state").eval(), (ids,)


def gpt_neox(layers=2, hidden=64, heads=4, vocab=101, seed=0):
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)), rotary positions, untied head."""
    import transformers

    cfg = transformers.GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                     intermediate_size=hidden * 4, vocab_size=vocab, max_position_embeddings=64,
                                     use_parallel_residual=True, attn_implementation="eager")
    torch.manual_seed(seed)
    m = adversarial(transformers.GPTNeoXForCausalLM(cfg), seed)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    return Logits(m, "logits").eval(), (ids,)


MODELS: dict[str, Callable] = {"gpt2": gpt2, "vit": vit, "bert": bert, "gpt_neox": gpt_neox}
INPUT_NAMES = {"gpt2": ["input_ids"], "vit": ["pixel_values"], "bert": ["input_ids"], "gpt_neox": ["input_ids"]}


def export_onnx(module: nn.Module, args: tuple, input_names: list[str], opset: int = 18, dynamo: bool = True):
    """torch.onnx.export to an in-memory ModelProto (batch and sequence dims dynamic for ids)."""
    import onnx

    dynamic = {}
    for name, a in zip(input_names, args):
        dynamic[name] = {0: "batch", 1: "seq"} if a.dtype == torch.int64 else {0: "batch"}
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _quiet_onnx_logs()
        torch.onnx.export(module, args, buf, opset_version=opset, dynamo=dynamo, input_names=input_names,
                          output_names=["output"], dynamic_axes=dynamic, verbose=False)
    return onnx.load_from_string(buf.getvalue())


def _quiet_onnx_logs() -> None:
    import logging

    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)
