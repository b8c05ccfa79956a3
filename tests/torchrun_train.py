"""Distributed training with the module-level fold, run under torchrun (gloo, CPU): DDP and FSDP2.

    torchrun --nproc-per-node 2 tests/torchrun_train.py --out result.json
             [--runs ddp:sgd,fsdp2:sgd,fsdp2:adamw] [--steps 4] [--compile BACKEND]

Each rank folds its own copy of GPT-2 (2 layers, adversarial weights, lnfold.zoo) with
`fold_for_training`, wraps it (DDP, or `fully_shard` per block + root), trains on its half of a
global batch and compares with plain eager training of the unfolded model on the whole batch,
which is what data-parallel training computes. Rank 0 writes, per wrapper: the losses, the
worst relative loss and parameter differences (and, for AdamW, the same plain fp32 run's own
difference from float64, the yardstick), how many norms are folded (in the report and as
modules in the wrapped model), and a checkpoint round trip: the folded model's full state_dict,
saved, loaded into a fresh unfolded model, gives the same outputs. tests/test_train.py runs it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lnfold
from lnfold import zoo
from lnfold.fx_rewrite.train import LayerNormAsRMSNorm

VOCAB, SEQ, PER_RANK = 101, 16, 2


def make_model() -> nn.Module:
    model, _ = zoo.gpt2(n_layer=2, vocab=VOCAB)
    return model  # eval mode: no dropout on the residual stream (see fold_for_training)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train(model: nn.Module, ids: torch.Tensor, opt_name: str, steps: int, distributed: bool = False) -> list[float]:
    opt = optimizer(opt_name, model.parameters())
    losses = []
    for _ in range(steps):
        loss = loss_of(model, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen = loss.detach().clone()
        if distributed:  # the mean over the global batch, as the eager run on all of it sees it
            dist.all_reduce(seen)
            seen /= dist.get_world_size()
        losses.append(seen.item())
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v  # FSDP2 shards are DTensors
        out[k.removeprefix("module.")] = v.detach().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


def wrap(model: nn.Module, wrapper: str, compile_backend: str | None) -> nn.Module:
    blocks = model.model.transformer.h
    if compile_backend:
        for block in blocks:
            block.compile(backend=compile_backend)
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(wrapper: str, opt_name: str, steps: int, compile_backend: str | None, ckpt_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    base = make_model()

    eager = copy.deepcopy(base)  # the reference: plain eager, unfolded, the whole global batch
    eager_losses = train(eager, ids, opt_name, steps)
    exact = copy.deepcopy(base).double()  # float64: the yardstick for the fp32 runs' own rounding
    train(exact, ids, opt_name, steps)

    folded = copy.deepcopy(base)
    result = lnfold.fold_for_training(folded, (mine,))
    names = [k for k, _ in folded.named_parameters()]
    assert names == [k for k, _ in base.named_parameters()], "parameter names changed"
    wrapped = wrap(folded, wrapper, compile_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(wrapped, mine, opt_name, steps, distributed=True)
    state = full_state(wrapped)

    ref, ref64 = eager.state_dict(), exact.state_dict()
    out = {
        "wrapper": wrapper, "optimizer": opt_name, "steps": steps, "compile": compile_backend,
        "losses": losses, "eager_losses": eager_losses,
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses)),
        "param_rel": max(rel(ref[k], state[k]) for k in ref),
        "param_rel_eager_vs_fp64": max(rel(ref64[k], ref[k]) for k in ref),
        "param_rel_folded_vs_fp64": max(rel(ref64[k], state[k]) for k in ref),
        "state_dict_keys_equal": sorted(state) == sorted(ref),
        "sharded_params": sum(type(p).__name__ == "DTensor" for p in wrapped.parameters()),
        "params": len(list(wrapped.parameters())),
        "report_folded": result.report.folded, "report_norms": len(result.report.norms),
        "rmsnorm_modules": sum(isinstance(m, LayerNormAsRMSNorm) for m in wrapped.modules()),
        "layernorm_modules": sum(isinstance(m, nn.LayerNorm) for m in wrapped.modules()),
        "lnfold_warnings": [str(w.message) for w in caught if "lnfold" in str(w.message)],
    }

    if opt_name == "adamw":
        # AdamW divides each gradient by its own running size, so fp32 noise in directions the loss
        # does not depend on (a centered weight's column means) moves parameters by ~lr whatever
        # the fold does: exactness is judged where there is no such noise, the fold run in float64
        folded64 = copy.deepcopy(base).double()
        lnfold.fold_for_training(folded64, (mine,))
        wrapped64 = wrap(folded64, wrapper, compile_backend)
        train(wrapped64, mine, opt_name, steps, distributed=True)
        out["param_rel_folded64_vs_fp64"] = max(rel(ref64[k], v) for k, v in full_state(wrapped64).items())

    # Checkpoint round trip: the folded model's state_dict into a fresh unfolded model.
    path = os.path.join(ckpt_dir, f"{wrapper}-{opt_name}.pt")
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    fresh = make_model()
    fresh.load_state_dict(torch.load(path))
    with torch.no_grad():
        got = wrapped(mine)
        want = fresh(mine)
    out["checkpoint_rel"] = rel(want, got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="ddp:sgd,fsdp2:sgd", help="wrapper:optimizer, ... (ddp|fsdp2, sgd|adamw)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", default=None, help="torch.compile each block with this backend")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = [tmp]
            dist.broadcast_object_list(ckpt, src=0)  # one folder for both ranks
            runs = [r.split(":") for r in a.runs.split(",")]
            results = [run(w, o, a.steps, a.compile, ckpt[0]) for w, o in runs]
            dist.barrier()
        if dist.get_rank() == 0:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
