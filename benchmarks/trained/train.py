"""Train the three small models lnfold is measured on, deterministically, on the CPU.

    python -m benchmarks.trained.train                     # all three, into benchmarks/trained/
    python -m benchmarks.trained.train --out DIR --steps-scale 0.01 --only gpt2_stdlib   # a quick check

- `gpt2_stdlib`: Pre-LN decoder (transformers' GPT2LMHeadModel, tied head), bytes as tokens, trained as a
  language model on the Python standard library's own source files;
- `bert_stdlib`: Post-LN encoder (BertForMaskedLM), the same bytes, masked-LM objective;
- `vit_digits`: Pre-LN ViT classifier (ViTForImageClassification) on scikit-learn's bundled 8x8 digits;
- `opt_stdlib` (only with `--only opt_stdlib`; not committed, 30 MB: benchmarks train it into their cache
  when it is missing): Pre-LN OPT decoder (OPTForCausalLM, tied head, d=384), gpt2_stdlib's data and
  objective; SliceGPT's own code has an adapter for this class (issue 32's side-by-side).

Each goes to DIR/<name>/ as a `save_pretrained` folder (config.json, model.safetensors), its held-out
inputs as heldout.npz, and a manifest.json (architecture, parameters, data, steps, held-out metric,
the loss curve, the command and its time). The held-out split of the stdlib is by file (a hash of
the relative path), so no held-out file's text is ever trained on. Everything is seeded, runs on one
thread with `torch.use_deterministic_algorithms(True)`: two runs on one machine give identical
weights. The stdlib differs between Python versions; the manifest records the version and a digest
of the files read, and the committed heldout.npz means nothing needs the stdlib after training.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from .harness import DECODERS

HERE = Path(__file__).resolve().parent
CONTEXT = 128
MASK_ID, PAD_ID = 256, 257  # the encoder's two ids beyond the 256 bytes
HELDOUT_PER_MILLE = 50  # 5% of the stdlib's files, chosen by a hash of their relative path
HELDOUT_WINDOWS = 64  # held-out sequences of CONTEXT bytes per stdlib model

# name -> (steps, batch, peak learning rate); sized to run in minutes on one shared CPU core.
RECIPES = {
    "gpt2_stdlib": dict(steps=700, batch=12, lr=2e-3),
    "bert_stdlib": dict(steps=900, batch=12, lr=1e-3),
    "vit_digits": dict(steps=1200, batch=64, lr=1e-3),
    "opt_stdlib": dict(steps=700, batch=12, lr=1e-3),
}
COMMITTED = ("gpt2_stdlib", "bert_stdlib", "vit_digits")  # what a plain run trains


# ---------------------------------------------------------------- data

def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's .py files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return root, rel


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def stdlib_bytes() -> tuple[np.ndarray, np.ndarray, dict]:
    """(train bytes, held-out bytes, a description for the manifest): files joined by a blank line."""
    root, rel = stdlib_files()
    parts = {False: [], True: []}
    digest = hashlib.sha256()
    for r in rel:
        data = (root / r).read_bytes()
        digest.update(r.encode() + b"\0" + hashlib.sha256(data).digest())
        parts[is_heldout(r)].append(data + b"\n\n")
    train, held = (np.frombuffer(b"".join(parts[k]), dtype=np.uint8) for k in (False, True))
    info = {"source": "sysconfig.get_paths()['stdlib'] (*.py, site-packages excluded)",
            "python": platform.python_version(), "files": len(rel), "heldout_files": len(parts[True]),
            "files_sha256": digest.hexdigest(), "train_bytes": int(train.size), "heldout_bytes": int(held.size),
            "split": f"held out: sha256(relative path)[:8] as int % 1000 < {HELDOUT_PER_MILLE}"}
    return train, held, info


def heldout_windows(held: np.ndarray) -> np.ndarray:
    """HELDOUT_WINDOWS windows of CONTEXT bytes, evenly spaced over the held-out text."""
    starts = np.linspace(0, held.size - CONTEXT - 1, HELDOUT_WINDOWS).astype(np.int64)
    return np.stack([held[s:s + CONTEXT] for s in starts]).astype(np.int64)


def mask_tokens(ids: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of positions are predicted; of those 80% -> [MASK], 10% a random byte, 10% kept."""
    pick = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=g)
    out = torch.where(pick & (roll < 0.8), torch.full_like(ids, MASK_ID), ids)
    random_bytes = torch.randint(0, 256, ids.shape, generator=g)
    out = torch.where(pick & (roll >= 0.8) & (roll < 0.9), random_bytes, out)
    return out, labels


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
    """sklearn's digits as [N, 1, 8, 8] floats in [0, 1]; 20% held out by a seeded permutation."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    n_held = len(y) // 5
    held, train = perm[:n_held], perm[n_held:]
    info = {"source": "sklearn.datasets.load_digits (8x8, 10 classes, bundled)", "samples": int(len(y)),
            "heldout": int(n_held), "split": "numpy default_rng(0).permutation; first 20% held out"}
    return x[train], y[train], x[held], y[held], info


# ---------------------------------------------------------------- models

def build(name: str):
    import transformers as tf

    common = dict(attn_implementation="eager")
    if name == "gpt2_stdlib":
        cfg = tf.GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=192, n_layer=4, n_head=6,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=True, **common)
        return tf.GPT2LMHeadModel(cfg)
    if name == "bert_stdlib":
        cfg = tf.BertConfig(vocab_size=258, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
                            intermediate_size=768, max_position_embeddings=CONTEXT, type_vocab_size=1,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD_ID,
                            **common)
        return tf.BertForMaskedLM(cfg)
    if name == "vit_digits":
        cfg = tf.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                           num_attention_heads=4, intermediate_size=256, num_labels=10, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, **common)
        return tf.ViTForImageClassification(cfg)
    if name == "opt_stdlib":  # no padding id: byte 1 is text here, not OPT's pad
        cfg = tf.OPTConfig(vocab_size=256, hidden_size=384, num_hidden_layers=4, ffn_dim=1536, num_attention_heads=6,
                           max_position_embeddings=CONTEXT, word_embed_proj_dim=384, do_layer_norm_before=True,
                           dropout=0.0, attention_dropout=0.0, pad_token_id=None, bos_token_id=0, eos_token_id=0,
                           tie_word_embeddings=True, **common)
        return tf.OPTForCausalLM(cfg)
    raise ValueError(name)


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases or 1-d parameters)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n.lower()]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n.lower())]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98))


def schedule(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


# ---------------------------------------------------------------- training

def batches(name: str, data, batch: int, g: torch.Generator):
    """An endless stream of training batches: (model kwargs)."""
    if name == "vit_digits":
        x, y = (torch.from_numpy(a) for a in data)
        while True:
            idx = torch.randint(0, len(y), (batch,), generator=g)
            yield {"pixel_values": x[idx], "labels": y[idx]}
    text = torch.from_numpy(data.astype(np.int64))
    while True:
        starts = torch.randint(0, text.numel() - CONTEXT, (batch,), generator=g)
        ids = torch.stack([text[s:s + CONTEXT] for s in starts.tolist()])
        if name in DECODERS:
            yield {"input_ids": ids, "labels": ids}
        else:
            masked, labels = mask_tokens(ids, g)
            yield {"input_ids": masked, "labels": labels}


def train_one(name: str, out: Path, steps_scale: float, command: str) -> dict:
    recipe = dict(RECIPES[name])
    recipe["steps"] = max(2, int(round(recipe["steps"] * steps_scale)))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = build(name)
    if name == "vit_digits":
        xtr, ytr, xho, yho, data_info = digits_split()
        train_data, held = (xtr, ytr), {"pixel_values": xho, "labels": yho}
    else:
        train_bytes, held_bytes, data_info = stdlib_bytes()
        train_data = train_bytes
        ids = heldout_windows(held_bytes)
        if name in DECODERS:
            held = {"input_ids": ids}
        else:
            masked, labels = mask_tokens(torch.from_numpy(ids), torch.Generator().manual_seed(2))
            held = {"input_ids": masked.numpy(), "labels": labels.numpy(), "original_ids": ids}
    opt = optimizer(model, recipe["lr"])
    model.train()
    stream = batches(name, train_data, recipe["batch"], g)
    curve, window, t0 = [], [], time.perf_counter()
    every = max(1, recipe["steps"] // 12)
    for step in range(recipe["steps"]):
        for group in opt.param_groups:
            group["lr"] = schedule(step, recipe["steps"], recipe["lr"])
        loss = model(**next(stream)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % every == 0 or step + 1 == recipe["steps"]:
            curve.append({"step": step + 1, "train_loss": round(float(np.mean(window)), 4)})
            print(f"{name} step {step + 1}/{recipe['steps']} loss {curve[-1]['train_loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            window = []
    seconds = time.perf_counter() - t0
    model.eval()

    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    np.savez_compressed(folder / "heldout.npz", **held)
    from .harness import evaluate_module

    metric = evaluate_module(name, model, out)
    manifest = {
        "name": name, "architecture": type(model).__name__, "config": model.config.model_type,
        "norms": "Post-LN" if name == "bert_stdlib" else "Pre-LN",
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": data_info, "heldout": {k: list(v.shape) for k, v in held.items()},
        "training": {**recipe, "optimizer": "AdamW(betas=(0.9, 0.98)), weight decay 0.1 on matrices only, "
                                            "linear warmup 5% + cosine, grad clip 1.0",
                     "seconds": round(seconds, 1), "loss_curve": curve},
        "heldout_metric": metric.as_dict(),
        "command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), 1 thread",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{name}: {metric} in {seconds:.0f} s -> {folder}", flush=True)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--only", action="append", choices=list(RECIPES),
                    help=f"train only this model (repeatable; default: {', '.join(COMMITTED)})")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every recipe's steps (a quick check)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    command = "python -m benchmarks.trained.train" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    for name in args.only or COMMITTED:
        train_one(name, args.out, args.steps_scale, command)


if __name__ == "__main__":
    main()
