"""Verify a folded checkpoint against its original without ever loading either whole.

Each model runs as its stock class built on the meta device, whose modules load their own
parameters from the shards just before they run and drop them right after: one module's tensors in
memory, whatever the model's size. The three runs and the gate: DESIGN §2 "Checkpoints", *Verification*.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
from collections import Counter
from typing import Optional

import numpy as np
import torch

from ..passes import LnfoldError, gate
from ..passes.weights import max_rel_err
from .checkpoint import Checkpoint, CheckpointPlan, FirstOutput, skeleton, stored_names
from .float64 import Float64Everywhere, suspended
from .safetensors_io import DTYPES, read_into, row_blocks

SLICE_BYTES = 64 << 20  # a tensor is read and converted this many float64 bytes at a time

TOKENS = (2, 8)  # made-up token ids: the smallest batch that judges a fold


class Streamed:
    """The stock model of a checkpoint whose parameters live in the files: each module holding
    parameters loads them (in `dtype`, or as stored) before it runs and frees them after."""

    def __init__(self, ck: Checkpoint, dtype: Optional[torch.dtype]) -> None:
        self.ck, self.dtype = ck, dtype
        self.buf = torch.empty(0, dtype=torch.uint8)  # (what _load reads into where it converts)
        self.pool = _Pool()  # (the memory of the parameters each module loads and drops)
        self.model = skeleton(ck.config)
        self.stored = stored_names(self.model, ck)
        counts = Counter(e.dtype for h in ck.shards.values() for e in h.entries.values()
                         if e.dtype in ("F16", "BF16", "F32", "F64"))
        self.stored_dtype = DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32
        run = dtype or self.stored_dtype
        holder = torch.empty(0, dtype=run)  # what a parameter is between its module's runs: cpu, the run's dtype
        for name, b in list(self.model.named_buffers()):
            owner, _, attr = name.rpartition(".")
            value = self._load(name, pooled=False) if name in self.stored else b.to(run) if b.is_floating_point() else b
            self.model.get_submodule(owner)._buffers[attr] = value
        self.hooks = []
        for path, mod in self.model.named_modules():
            own = [k for k, p in mod._parameters.items() if p is not None]
            if not own:
                continue
            for k in own:
                mod._parameters[k] = torch.nn.Parameter(holder, requires_grad=False)
            if self._big_linear(mod, path, run):  # (an lm_head: its rows a block at a time instead)
                mod.forward = self._blocked_linear(path, mod.bias is not None)
            elif type(mod) is torch.nn.Embedding and f"{path}.weight" in self.stored:
                # (a token table: only the rows of the ids it runs. Not a subclass: OPT's positions
                # override forward and call the class's own, which an instance's forward would not replace)
                mod.forward = self._row_lookup(path)
            else:
                self._load_around(path, mod, own, holder)

    def _entry(self, name: str):
        key = self.stored.get(name)
        if key is None:  # (fold_checkpoint's check_complete refuses such an output before it gets here)
            raise LnfoldError(f"{self.ck.folder}: holds no tensor {name}, which {type(self.model).__name__} loads")
        file = self.ck.where[key]
        return file, self.ck.shards[file].entries[key]

    def _big_linear(self, mod: torch.nn.Module, path: str, run: torch.dtype) -> bool:
        if not isinstance(mod, torch.nn.Linear) or f"{path}.weight" not in self.stored:
            return False
        _, e = self._entry(f"{path}.weight")
        return len(e.shape) == 2 and e.shape[0] * e.shape[1] * run.itemsize > SLICE_BYTES

    def _blocked_linear(self, path: str, has_bias: bool):
        """A linear layer's forward that reads its weight a block of output rows at a time: each
        output feature is its own row's product, so the blocks' outputs side by side are the
        layer's, and a float64 run never holds the whole matrix (a 50k-token head: 0.8–29 GB)."""
        def forward(x):
            _, e = self._entry(f"{path}.weight")
            bias = self._load(f"{path}.bias") if has_bias else None
            outs = [torch.nn.functional.linear(x, self._load(f"{path}.weight", rows=(lo, hi)),
                                               None if bias is None else bias[lo:hi])
                    for lo, hi in row_blocks(tuple(e.shape), SLICE_BYTES)]
            return torch.cat(outs, dim=-1)
        return forward

    def _row_lookup(self, path: str):
        """An embedding's forward that reads only the rows its ids pick, in the stored dtype (a
        lookup rounds nothing; a float64 run upcasts the picked rows: float64.py): the whole token
        table, often a checkpoint's largest tensor, is never in memory."""
        def forward(ids):
            picked, where = torch.unique(ids, return_inverse=True)
            name = f"{path}.weight"
            rows = torch.cat([self._load(name, keep_dtype=True, rows=(i, i + 1), pooled=False)
                              for i in picked.tolist()])
            return torch.nn.functional.embedding(where, rows)
        return forward

    def _load(self, name: str, keep_dtype: bool = False, rows: Optional[tuple] = None,
              pooled: bool = True) -> torch.Tensor:
        """The tensor (or its rows [lo, hi)) in the run's dtype, read into memory (no mapping of the
        file outlives the call): straight from the file where the run keeps the stored dtype, else
        through one buffer of the stored dtype, SLICE_BYTES at a time (never a second full copy).
        `pooled`: in self.pool's memory (a parameter, dropped after its module runs), else its own."""
        file, e = self._entry(name)
        stored = DTYPES[e.dtype]
        run = stored if keep_dtype or self.dtype is None or not stored.is_floating_point else self.dtype
        shape, skip = tuple(e.shape), 0
        if rows is not None:
            shape, skip = (rows[1] - rows[0],) + shape[1:], rows[0] * math.prod(shape[1:]) * stored.itemsize
        start = self.ck.shards[file].data_start + e.begin + skip
        with suspended():  # (outside the float64 run's dispatch mode: these are the file's own values)
            out = self.pool.empty(shape, run) if pooled else torch.empty(shape, dtype=run)
            with open(self.ck.folder / file, "rb", buffering=0) as f:
                if run == stored:
                    read_into(f, out, start)
                else:  # through one buffer of the stored dtype, reused by every tensor
                    flat = out.view(-1)
                    step = max(1, SLICE_BYTES // run.itemsize)
                    for lo in range(0, flat.numel(), step):
                        n = min(step, flat.numel() - lo)
                        if self.buf.numel() < n * stored.itemsize:
                            self.buf = torch.empty(n * stored.itemsize, dtype=torch.uint8)
                        buf = self.buf[:n * stored.itemsize].view(stored)
                        read_into(f, buf, start + lo * stored.itemsize)
                        flat[lo:lo + n].copy_(buf)
            return out

    def _load_around(self, path: str, module: torch.nn.Module, own: list, holder: torch.Tensor) -> None:
        """Hooks that load the `own` parameters of `module` just before it runs and drop them after."""
        lookup = isinstance(module, torch.nn.Embedding)  # (float64.py: rows, then upcast)

        def load(mod, args):
            for k in own:
                t = self._load(f"{path}.{k}" if path else k, keep_dtype=lookup)
                mod._parameters[k] = torch.nn.Parameter(t, requires_grad=False)

        def drop(mod, args, out):
            for k in own:
                mod._parameters[k] = torch.nn.Parameter(holder, requires_grad=False)

        self.hooks += [module.register_forward_pre_hook(load), module.register_forward_hook(drop)]

    def run(self, ids: torch.Tensor, norms: list[str]) -> tuple[torch.Tensor, dict, dict]:
        """The output on `ids`, and each named norm's input and output (feature axis last)."""
        ins, outs, hooks = {}, {}, []
        for n in norms:
            def keep(mod, args, out, n=n):
                ins[n], outs[n] = args[0].detach().clone(), out.detach().clone()
            hooks.append(self.model.get_submodule(n).register_forward_hook(keep))
        wrapper = FirstOutput(self.model)
        f64 = Float64Everywhere() if self.dtype == torch.float64 else contextlib.nullcontext()
        try:
            with torch.no_grad(), f64:
                out = wrapper(ids).detach().clone()
        finally:
            for h in hooks:
                h.remove()
        return out, ins, outs

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        # (the model and its blocked linear's forward refer to each other: memory now, not at gc)
        self.pool.bufs.clear()
        self.buf = torch.empty(0, dtype=torch.uint8)


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (None: no pool, each tensor its own memory)


class _Pool:
    """Memory for the parameters that modules load before they run and drop after: a buffer that
    nothing refers to any more (its storage's use count, as torch's CUDA-graph pools check it) is
    reused for the next tensor of its size, the next layer's same weight. Buffers are anonymous
    mappings, at most 4 x SLICE_BYTES in all, the least recently used free ones unmapped to make
    room; tensors below SLICE_BYTES / 64 or beyond the room get plain memory. Plain torch.empty
    left the C heap grown and fragmented (OPT-1.3B fp16: 1.0 GB over the start, the pool 0.35 GB),
    and a mapping per tensor pays its page faults every time (verification 2.5x slower)."""

    def __init__(self) -> None:
        self.bufs: list = []  # [nbytes, uint8 tensor, its storage's use count when nothing else holds it]

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize * math.prod(shape)
        if _use_count is None or n < SLICE_BYTES // 64 or n > 4 * SLICE_BYTES:
            return torch.empty(shape, dtype=dtype)
        for i, (size, b, free) in enumerate(self.bufs):
            if size == n and _uses(b) == free:
                self.bufs.append(self.bufs.pop(i))  # (most recently used last)
                return b.view(dtype).view(shape)
        room = 4 * SLICE_BYTES - sum(e[0] for e in self.bufs)
        for e in list(self.bufs):
            if room >= n:
                break
            if _uses(e[1]) == e[2]:
                self.bufs.remove(e)
                room += e[0]
        if room < n:
            return torch.empty(shape, dtype=dtype)
        b = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
        self.bufs.append([n, b, _uses(b)])
        return b.view(dtype).view(shape)


def _uses(b: torch.Tensor) -> int:
    return _use_count(b.untyped_storage()._cdata)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def verify_checkpoint(original: Checkpoint, folded: Checkpoint, plan: CheckpointPlan) -> gate.Verdict:
    """The gate's verdict on the folded checkpoint (raises VerificationError when it fails)."""
    vocab = getattr(original.config, "vocab_size", None) or 100
    ids = torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(0))

    def run(ck: Checkpoint, dtype: Optional[torch.dtype]) -> tuple:
        model = Streamed(ck, dtype)
        try:
            return model.run(ids, list(plan.norms)), model.stored_dtype
        finally:
            model.close()

    (ref, _, ref_out), _ = run(original, None)
    (exact, _, exact_out), _ = run(original, torch.float64)
    (got, got_in, got_out), folded_dtype = run(folded, None)
    a, b, x = _np(ref), _np(got), _np(exact)
    # The folded norms first, in the order they ran (the first one that fails is where the fold
    # broke), then the model's output: one criterion for all, the gate's.
    outputs = [gate.Output(f"of folded norm {n}", _name(ref_out[n].dtype), _np(ref_out[n]), _np(got_out[n]),
                           _np(exact_out[n])) for n in got_out]
    outputs.append(gate.Output("logits" if ref.ndim == 3 else "output", _name(ref.dtype), a, b, x))
    verdict = gate.judge(outputs)
    # (what is reported is the model output's: the norms' errors are checked, not summed up)
    verdict = dataclasses.replace(verdict, diff=max_rel_err(a, b), folded_err=max_rel_err(x, b),
                                  original_err=max_rel_err(x, a)) if verdict.judged else verdict
    if verdict.ok:
        mean_dtype = _name(folded_dtype)
        bad = gate.off_center({n: _np(x) for n, x in got_in.items()}, mean_dtype)
        if bad:
            verdict = dataclasses.replace(verdict, ok=False, failure=(
                f"folded norm {bad[0]}: its input has mean {bad[1]:.3g} of its RMS in the folded model run in "
                f"{mean_dtype} (above {gate.MEAN_TOL.get(mean_dtype, 1e-4):g}): it is not an RMSNorm there"))
    if not verdict.ok:
        raise verdict.error()
    return verdict


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
