"""The benchmarked models: real architectures from `transformers` configs (random, adversarial
weights from fx_rewrite.zoo), their ONNX exports (cached on disk), and the ONNX-level variants
the tables compare: onnxruntime's transformer optimizer, lnfold's output, and the two
non-equivalent reference rows (every LayerNorm an RMSNorm without folding; no norm at all).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .common import HERE, log, quiet

CACHE = Path(os.environ.get("LNFOLD_BENCH_CACHE", HERE / ".cache"))
MS = "com.microsoft"


@dataclass(frozen=True)
class Spec:
    """One model shape. kind: gpt2 | gpt2-decode | vit."""

    name: str
    kind: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    positions: int = 1024
    image: int = 224
    patch: int = 16

    @property
    def ort_type(self) -> str:
        return "vit" if self.kind == "vit" else "gpt2"

    def key(self) -> str:
        return hashlib.sha1(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:10]


GPT2_SMALL = Spec("GPT-2 small", "gpt2", 12, 768, 12)
GPT2_MEDIUM = Spec("GPT-2 medium", "gpt2", 24, 1024, 16)
VIT_S16 = Spec("ViT-S/16", "vit", 12, 384, 6)
VIT_B16 = Spec("ViT-B/16", "vit", 12, 768, 12)


def decode(spec: Spec) -> Spec:
    return Spec(spec.name, "gpt2-decode", spec.layers, spec.hidden, spec.heads, spec.vocab, spec.positions)


# --- torch modules --------------------------------------------------------------------------------
def torch_module(spec: Spec):
    """(module, example args, input names) with adversarial weights, eval mode, float32."""
    from lnfold import zoo

    if spec.kind == "vit":
        m, args = zoo.vit(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, image=spec.image, patch=spec.patch)
        return m, args, ["pixel_values"]
    with quiet():
        m, args = zoo.gpt2(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, vocab=spec.vocab,
                           positions=spec.positions)
    if spec.kind == "gpt2":
        return m, args, ["input_ids"]
    dec = Decode(m.model)
    return dec, dec.example(batch=2, past=5), dec.input_names()


def _decode_cls():
    import torch
    from torch import nn

    class Decode(nn.Module):
        """One-token GPT-2 decode with a KV cache: (ids [B,1], k0, v0, k1, v1, ...) -> (logits, present...)."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm
            cfg = lm.config
            self.layers, self.heads, self.hd = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head

        def input_names(self):
            return ["input_ids", "past"]

        def example(self, batch: int, past: int, seed: int = 0):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, self.lm.config.vocab_size, (batch, 1), generator=g)
            kv = torch.randn(2 * self.layers, batch, self.heads, past, self.hd, generator=g)
            return (ids, kv)

        def forward(self, input_ids, past):
            """past: [2L, B, H, P, hd] (key, value of each layer) -> (logits, present [2L, B, H, P+1, hd])."""
            from transformers import DynamicCache

            cache = DynamicCache()
            for i in range(self.layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.lm(input_ids, past_key_values=cache, use_cache=True, return_dict=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return out.logits, torch.stack(present)

    return Decode


def Decode(lm):  # noqa: N802 - a class, built lazily so that importing this module needs no torch
    return _decode_cls()(lm)


# --- ONNX exports ---------------------------------------------------------------------------------
def export(spec: Spec, opset: int) -> Path:
    """The model exported by torch.onnx (dynamo) at `opset`, cached under benchmarks/.cache."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{spec.kind}-{spec.layers}x{spec.hidden}-{spec.key()}-op{opset}.onnx"
    if path.exists():
        return path
    import torch

    from lnfold import zoo

    log(f"exporting {spec.name} ({spec.kind}) at opset {opset}")
    m, args, names = torch_module(spec)
    if spec.kind == "gpt2-decode":
        model = _export_decode(m, args, names, opset)
    else:
        with quiet():
            model = zoo.export_onnx(m, args, names, opset=opset)
    save(model, path)
    return path


def _export_decode(m, args, names, opset):
    import io as _io
    import warnings

    import torch

    from lnfold.zoo import quiet_onnx_logs

    dyn = {"input_ids": {0: "batch"}, "past": {1: "batch", 3: "past"}}
    outs = ["logits", "present"]
    buf = _io.BytesIO()
    with warnings.catch_warnings(), quiet():
        warnings.simplefilter("ignore")
        quiet_onnx_logs()
        torch.onnx.export(m, args, buf, opset_version=opset, dynamo=True, input_names=names, output_names=outs,
                          dynamic_axes=dyn)
    return onnx.load_from_string(buf.getvalue())


def save(model: onnx.ModelProto, path: Path) -> None:
    from lnfold import save_onnx

    save_onnx(model, path)


def load(path: Path) -> onnx.ModelProto:
    from lnfold import load_onnx

    return load_onnx(path)


def derived(src: Path, tag: str) -> Path:
    return src.with_name(src.stem + f".{tag}.onnx")


# --- variants -------------------------------------------------------------------------------------
def ort_optimized(src: Path, spec: Spec, *, use_gpu: bool = False) -> Path:
    """onnxruntime.transformers.optimizer.optimize_model with its defaults for the model type."""
    out = derived(src, "ortopt" + ("-gpu" if use_gpu else ""))
    if out.exists():
        return out
    from onnxruntime.transformers.optimizer import optimize_model

    with quiet():
        opt = optimize_model(str(src), model_type=spec.ort_type, num_heads=spec.heads, hidden_size=spec.hidden,
                             use_gpu=use_gpu)
    save(opt.model, out)
    return out


def lnfold(src: Path, target: str) -> tuple[Path, dict]:
    """lnfold's output (verified) and a summary of its report."""
    out = derived(src, f"lnfold-{target}")
    meta = out.with_suffix(".json")
    if out.exists() and meta.exists():
        return out, json.loads(meta.read_text())
    from lnfold.onnx_rewrite import fold_model

    res = fold_model(load(src), target=target)
    save(res.model, out)
    info = {"folded": res.report.folded, "kept": res.report.kept, "recentered": res.report.recentered,
            "max_rel_err": res.max_rel_err, "timings": res.timings}
    meta.write_text(json.dumps(info))
    return out, info


def _norm_nodes(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "LayerNormalization"]


def ceiling(src: Path, op: str = "SimplifiedLayerNormalization") -> Path:
    """NOT equivalent: every LayerNormalization(x, γ, β) becomes `op`(x, γ), β dropped, weights
    untouched. The fastest a fold can make the norms (β folds into the linear readers for free)."""
    out = derived(src, "ceiling-" + ("sln" if op.startswith("Simplified") else "rms"))
    if out.exists():
        return out
    m = load(src)
    if op == "RMSNormalization" and _opset(m) < 23:
        raise ValueError("RMSNormalization needs opset 23")
    for n in _norm_nodes(m):
        eps = next((a.f for a in n.attribute if a.name == "epsilon"), 1e-5)
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        new = helper.make_node(op, [n.input[0], n.input[1]], [n.output[0]], name=n.name + "/ceiling", axis=axis,
                               epsilon=eps, stash_type=1)
        n.CopyFrom(new)
    _cleanup(m)
    save(m, out)
    return out


def no_norm(src: Path) -> Path:
    """NOT equivalent: every LayerNormalization removed (its output is its input)."""
    out = derived(src, "nonorm")
    if out.exists():
        return out
    m = load(src)
    rename = {}
    keep = []
    for n in m.graph.node:
        if n.op_type == "LayerNormalization":
            rename[n.output[0]] = n.input[0]
        else:
            keep.append(n)
    graph_outputs = {o.name for o in m.graph.output}
    for n in keep:
        for i, name in enumerate(n.input):
            while name in rename:
                name = rename[name]
            n.input[i] = name
    extra = []
    for o in graph_outputs & set(rename):  # a norm writing a graph output: keep a copy
        src_name = rename[o]
        while src_name in rename:
            src_name = rename[src_name]
        extra.append(helper.make_node("Identity", [src_name], [o]))
    del m.graph.node[:]
    m.graph.node.extend(keep + extra)
    _cleanup(m)
    save(m, out)
    return out


def unfuse_skip(src: Path) -> Path:
    """Equivalent: each Skip(Simplified)LayerNormalization becomes Add (+ bias Add) and the
    unfused norm. What the emitter would produce without residual fusion."""
    out = derived(src, "unfused")
    if out.exists():
        return out
    m = load(src)
    nodes = []
    for n in m.graph.node:
        if n.domain == MS and n.op_type in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization"):
            eps = next((a.f for a in n.attribute if a.name == "epsilon"), 1e-5)
            outs = list(n.output) + [""] * (4 - len(n.output))
            s = outs[3] or (n.output[0] + "/unfused_sum")
            ins = list(n.input)
            if len(ins) > 4 and ins[4]:  # bias
                mid = s + "/pre_bias"
                nodes.append(helper.make_node("Add", ins[:2], [mid]))
                nodes.append(helper.make_node("Add", [mid, ins[4]], [s]))
            else:
                nodes.append(helper.make_node("Add", ins[:2], [s]))
            if n.op_type == "SkipLayerNormalization":
                nins = [s, ins[2]] + ([ins[3]] if len(ins) > 3 and ins[3] else [])
                nodes.append(helper.make_node("LayerNormalization", nins, [outs[0]], axis=-1, epsilon=eps))
            else:
                nodes.append(helper.make_node("SimplifiedLayerNormalization", [s, ins[2]], [outs[0]], axis=-1,
                                              epsilon=eps, stash_type=1))
        else:
            nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    save(m, out)
    return out


def _opset(m: onnx.ModelProto) -> int:
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


def _cleanup(m: onnx.ModelProto) -> None:
    """Drop initializers no node reads any more (β of removed norms)."""
    used = {i for n in m.graph.node for i in n.input}
    for sub in m.graph.node:
        for a in sub.attribute:
            if a.g is not None:
                used |= {i for n in a.g.node for i in n.input}
    keep = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)


# --- inputs ---------------------------------------------------------------------------------------
def feeds(spec: Spec, batch: int, seq: int = 128, past: int = 127, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if spec.kind == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, spec.image, spec.image)).astype(np.float32)}
    if spec.kind == "gpt2":
        return {"input_ids": rng.integers(0, spec.vocab, (batch, seq)).astype(np.int64)}
    hd = spec.hidden // spec.heads
    return {"input_ids": rng.integers(0, spec.vocab, (batch, 1)).astype(np.int64),
            "past": rng.standard_normal((2 * spec.layers, batch, spec.heads, past, hd)).astype(np.float32)}


@dataclass
class Case:
    spec: Spec
    batch: int
    seq: int = 128
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.spec.kind == "vit":
            return f"{self.spec.name} b{self.batch} {self.spec.image}²"
        if self.spec.kind == "gpt2-decode":
            return f"{self.spec.name} decode b{self.batch} (past {self.seq - 1})"
        return f"{self.spec.name} b{self.batch}x{self.seq}"
