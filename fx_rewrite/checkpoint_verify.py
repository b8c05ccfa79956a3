"""Verify a folded checkpoint against its original without ever loading either whole (issue 25).

Each model runs as its stock class built on the meta device (fx_rewrite/checkpoint.py
`skeleton`), whose modules load their own parameters from the checkpoint's shards just before
they run and drop them right after (forward hooks): a block at a time, one module's tensors in
memory, whatever the model's size. On made-up token ids, four such runs: the original and the
folded checkpoint in their stored dtype, and both in float64 (every op, fx_rewrite/float64.py).
The gate is the one of every fold (passes/gate.py, DESIGN §4): the folded model's output error
against the float64 run of the original may not exceed the original's own, times FACTOR, plus
the dtype's floor. And per folded norm, from the float64 runs: its output is the original's
(within the dtype's fixed `TOLERANCE`: the edited weights were rounded to the stored dtype), and
its input is zero-mean (within the dtype's `MEAN_TOL`): what makes it an RMSNorm. In the stock
class a missed centering does not show at the output (a LayerNorm ignores its input's mean); the
zero-mean check is what sees it.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from ..passes import gate
from ..passes.weights import max_rel_err
from .checkpoint import Checkpoint, CheckpointPlan, FirstOutput, skeleton, stored_names
from .float64 import Float64Everywhere, suspended
from .safetensors_io import DTYPES

SLICE_BYTES = 64 << 20  # a tensor is read and converted this many float64 bytes at a time

TOKENS = (2, 8)  # made-up token ids: the smallest batch that judges a fold


class Streamed:
    """The stock model of a checkpoint whose parameters live in the files: each module holding
    parameters loads them (in `dtype`, or as stored) before it runs and frees them after."""

    def __init__(self, ck: Checkpoint, dtype: Optional[torch.dtype]) -> None:
        self.ck, self.dtype = ck, dtype
        self.model = skeleton(ck.config)
        self.stored = stored_names(self.model, ck)
        stored_dtype = self._stored_dtype()
        run = dtype or stored_dtype
        holder = torch.empty(0, dtype=run)  # what a parameter is between its module's runs: cpu, the run's dtype
        for name, b in list(self.model.named_buffers()):
            owner, _, attr = name.rpartition(".")
            mod = self.model.get_submodule(owner) if owner else self.model
            value = self._load(name) if name in self.stored else (b.to(run) if b.is_floating_point() else b)
            mod._buffers[attr] = value
        self.hooks = []
        for path, mod in self.model.named_modules():
            own = [k for k, p in mod._parameters.items() if p is not None]
            if not own:
                continue
            for k in own:
                mod._parameters[k] = torch.nn.Parameter(holder, requires_grad=False)
            if self._big_linear(mod, path, run):  # (an lm_head: its rows a block at a time instead)
                mod.forward = self._blocked_linear(path, mod.bias is not None)
                continue
            self.hooks.append(mod.register_forward_pre_hook(self._loader(path, own)))
            self.hooks.append(mod.register_forward_hook(self._dropper(own, holder)))

    def _stored_dtype(self) -> torch.dtype:
        counts: dict = {}
        for h in self.ck.shards.values():
            for e in h.entries.values():
                if e.dtype in ("F16", "BF16", "F32", "F64"):
                    counts[e.dtype] = counts.get(e.dtype, 0) + 1
        return DTYPES[max(counts, key=counts.get)] if counts else torch.float32

    def _entry(self, name: str):
        key = self.stored[name]
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
            rows, cols = e.shape
            step = max(1, SLICE_BYTES // (cols * 8))
            bias = self._load(f"{path}.bias") if has_bias else None
            outs = [torch.nn.functional.linear(x, self._load(f"{path}.weight", rows=(lo, min(rows, lo + step))),
                                               None if bias is None else bias[lo:lo + step])
                    for lo in range(0, rows, step)]
            return torch.cat(outs, dim=-1)
        return forward

    def _load(self, name: str, keep_dtype: bool = False, rows: Optional[tuple] = None) -> torch.Tensor:
        """The tensor (or its rows [lo, hi)), read into memory of its own (no mapping of the file
        outlives the call), in the run's dtype, converted a slice at a time (no second full copy)."""
        file, e = self._entry(name)
        stored = DTYPES[e.dtype]
        run = stored if keep_dtype or self.dtype is None or not stored.is_floating_point else self.dtype
        shape, skip = tuple(e.shape), 0
        if rows is not None:
            per_row = 1
            for s in shape[1:]:
                per_row *= s
            shape, skip = (rows[1] - rows[0],) + shape[1:], rows[0] * per_row * stored.itemsize
        with suspended():  # (outside the float64 run's dispatch mode: these are the file's own values)
            out = torch.empty(shape, dtype=run)
            flat, size = out.view(-1), stored.itemsize
            step = max(1, SLICE_BYTES // 8)
            with open(self.ck.folder / file, "rb") as f:
                f.seek(self.ck.shards[file].data_start + e.begin + skip)
                for lo in range(0, flat.numel(), step):
                    n = min(step, flat.numel() - lo)
                    flat[lo:lo + n] = torch.frombuffer(bytearray(f.read(n * size)), dtype=stored)
            return out

    def _loader(self, path: str, own: list):
        lookup = isinstance(self.model.get_submodule(path), torch.nn.Embedding)  # (float64.py: rows, then upcast)

        def pre(mod, args):
            for k in own:
                t = self._load(f"{path}.{k}" if path else k, keep_dtype=lookup)
                mod._parameters[k] = torch.nn.Parameter(t, requires_grad=False)
        return pre

    @staticmethod
    def _dropper(own: list, holder: torch.Tensor):
        def post(mod, args, out):
            for k in own:
                mod._parameters[k] = torch.nn.Parameter(holder, requires_grad=False)
        return post

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


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def verify_checkpoint(original: Checkpoint, folded: Checkpoint, plan: CheckpointPlan) -> gate.Verdict:
    """The gate's verdict on the folded checkpoint (raises VerificationError when it fails)."""
    vocab = getattr(original.config, "vocab_size", None) or 100
    ids = torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(0))
    norms = list(plan.norms)
    runs = {}
    for which, ck in (("original", original), ("folded", folded)):
        for dtype in (None, torch.float64):
            m = Streamed(ck, dtype)
            try:
                runs[which, dtype] = m.run(ids, norms if dtype is torch.float64 else [])
            finally:
                m.close()
            del m
    ref, got, exact = runs["original", None][0], runs["folded", None][0], runs["original", torch.float64][0]
    dtype = str(ref.dtype).removeprefix("torch.")
    verdict = gate.judge([gate.Output("logits" if ref.ndim == 3 else "output", dtype, _np(ref), _np(got), _np(exact))])
    if verdict.ok:
        failure = _norm_failure(runs["original", torch.float64], runs["folded", torch.float64], norms, dtype)
        if failure:
            verdict = gate.Verdict(False, verdict.criterion, verdict.diff, verdict.folded_err, verdict.original_err,
                                   failure)
    if not verdict.ok:
        raise verdict.error()
    return verdict


def _norm_failure(orig64, fold64, norms: list[str], dtype: str) -> str:
    """Why a folded norm is not what the fold promises (empty: each is), from the float64 runs:
    its output is the original's, and its input is zero-mean."""
    # (float64 runs of two models whose edited weights differ by their rounding to the stored dtype:
    # gate.rounding_bound's floor is too tight for a 2048-wide fp16 model, 5e-3 measured on
    # Pythia-1B; without a measured sensitivity the gate's fixed tolerance of the dtype bounds it)
    bound = gate.TOLERANCE.get(dtype, 1e-4)
    for n in norms:
        a, b = orig64[2][n].numpy(), fold64[2][n].numpy()
        d = max_rel_err(a, b)
        if not d <= bound:
            return (f"folded norm {n}: its output differs from the original's by {d:.3g} (relative, both run in "
                    f"float64), above {bound:.3g}")
    bad = gate.off_center({n: fold64[1][n].numpy() for n in norms}, dtype)
    if bad:
        return (f"folded norm {bad[0]}: its input has mean {bad[1]:.3g} of its RMS (above "
                f"{gate.MEAN_TOL.get(dtype, 1e-4):g}): it is not an RMSNorm there")
    return ""
