"""Training-step benchmark: forward + backward + AdamW step, four ways, interleaved.

    python -m benchmarks.train_bench --model gpt2|vit [--batch 8] [--seq 64] [--rounds 5]

Rows: plain eager; eager after `lnfold.fold_for_training` (centered weights computed in forward,
RMSNorm modules); `torch.compile` (default: Inductor) of the original; `torch.compile` of the
folded module. GPT-2 small (12 layers, 768, vocab 50257) on `--seq` tokens, ViT-S (12 layers,
384, 6 heads, patch 16) on images of `--seq`+1 tokens. Dropout off (p=0, train mode): dropout on
the residual stream would keep every norm, correctly. Each row owns its copy of the model and its
optimizer; the rows run in alternation (onnx_rewrite.timing.interleaved) after one warm-up step each
(the compiles). Prints one JSON line and a markdown row per variant.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

import lnfold
from lnfold import zoo
from lnfold.onnx_rewrite.timing import interleaved


def build(name: str, batch: int, seq: int):
    if name == "gpt2":
        model, _ = zoo.gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, positions=1024)
        ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(0))

        def loss(m):
            logits = m(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        return model, (ids,), loss
    side = 16 * round(math.sqrt(seq))  # patch 16: side/16 squared patches, plus the cls token
    model, _ = zoo.vit(layers=12, hidden=384, heads=6, image=side, patch=16)
    px = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0))
    target = torch.randn(batch, (side // 16) ** 2 + 1, 384, generator=torch.Generator().manual_seed(1))
    return model, (px,), lambda m: F.mse_loss(m(px), target)


def for_training(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def step_fn(model: nn.Module, run: nn.Module, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss = loss_fn(run)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["gpt2", "vit"], required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    base, args, loss_fn = build(a.model, a.batch, a.seq)
    base = for_training(base)
    t = time.perf_counter()
    folded = copy.deepcopy(base)
    report = lnfold.fold_for_training(folded, args).report
    fold_s = time.perf_counter() - t
    plain, plain_c, folded_c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(folded)
    steps = {
        "eager": step_fn(plain, plain, loss_fn),
        "fold_for_training, eager": step_fn(folded, folded, loss_fn),
        "torch.compile": step_fn(plain_c, torch.compile(plain_c), loss_fn),
        "fold_for_training + torch.compile": step_fn(folded_c, torch.compile(folded_c), loss_fn),
    }
    compile_s = {}
    for name, f in steps.items():  # warm-up: the compiles happen here
        t = time.perf_counter()
        f()
        compile_s[name] = time.perf_counter() - t
    res = interleaved(steps, rounds=a.rounds, warmup=1)
    out = {"model": a.model, "batch": a.batch, "seq": a.seq, "rounds": a.rounds, "threads": a.threads,
           "torch": torch.__version__, "machine": platform.machine(), "folded": report.folded,
           "norms": len(report.norms), "fold_s": fold_s, "first_step_s": compile_s, "steps": res}
    print(json.dumps(out))
    ref = res["eager"]["median"]
    for name, r in res.items():
        print(f"| {a.model} b{a.batch} s{a.seq} | {name} | {r['median'] * 1e3:.0f} ms | "
              f"{r['q1'] * 1e3:.0f}–{r['q3'] * 1e3:.0f} | {r['median'] / ref:.3f} | {compile_s[name]:.1f} s |")


if __name__ == "__main__":
    main()
