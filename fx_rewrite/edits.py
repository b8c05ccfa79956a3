"""The constant edits of passes/edits.py over torch: `TENSOR` on eager tensors in their own dtype
(the training fold), `graph_algebra` as nodes of an FX graph (the backend); `to_numpy` / `from_numpy`
to and from the float64 numpy of passes/ for what is computed once; a graph module's constants as
attributes. Only centering and the LayerScale profile are spelled here (fp16/bf16 means in float32).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import fx

from ..passes import weights
from ..passes.edits import Algebra

LOW_PRECISION = (torch.float16, torch.bfloat16)  # their means are taken in float32


def center(x: torch.Tensor, axis, block=None, lo: int = 0, hi=None, stride=None) -> torch.Tensor:
    """`x` minus its mean along `axis` (passes/weights.center): `axis` None, all of it is a shift;
    `block`, each run of `block` entries in [lo, hi) minus its own mean (a per-head norm's rows);
    `stride`, the runs start every `stride` entries from `lo` (Persimmon's q rows).

    A float16/bfloat16 mean is taken in float32. Written as `x * 0` rather than zeros so that
    the Parameter keeps a gradient path (DDP, AdamW decay)."""
    if axis is None:
        return x * 0
    if block is not None and stride not in (None, block) and x.shape[axis] != 1:
        # [.., periods, stride, ..]: the run of each period is [lo, lo + block)
        return center(x.unflatten(axis, (-1, stride)), axis + 1, block, lo, lo + block).flatten(axis, axis + 1)
    if block is not None and x.shape[axis] != 1:
        n = x.shape[axis]
        hi = n if hi is None else hi
        head, part, tail = x.narrow(axis, 0, lo), x.narrow(axis, lo, hi - lo), x.narrow(axis, hi, n - hi)
        runs = part.unflatten(axis, (-1, block))
        return torch.cat([head, center(runs, axis + 1).flatten(axis, axis + 1), tail], axis)
    mean = x.mean(axis, keepdim=True, dtype=torch.float32).to(x.dtype) if x.dtype in LOW_PRECISION \
        else x.mean(axis, keepdim=True)
    return x - mean


def profile(by: torch.Tensor, by_axis: int, rank: int, axis: int) -> torch.Tensor:
    """The 1-D profile of a LayerScale vector (passes/weights.vector_along), shaped to broadcast
    along `axis` of a rank-`rank` tensor."""
    n = by.shape[by_axis]
    vec = by.movedim(by_axis, -1).reshape(-1, n)[0]
    shape = [1] * rank
    shape[axis] = n
    return vec.reshape(shape)


def weight_times(w: torch.Tensor, v: torch.Tensor, axis: int) -> torch.Tensor:
    return weights.weight_times(w, v, axis, torch.tensordot)


def add_weight_times(a: torch.Tensor, w: torch.Tensor, axis: int, v: torch.Tensor) -> torch.Tensor:
    return weights.add_weight_times(a, w, axis, v, torch.tensordot)


TENSOR = Algebra(
    center=center,
    center_blocks=center,
    scale=lambda x, by, by_axis, axis: x * profile(by, by_axis, x.ndim, axis),
    ones=lambda x: x * 0 + 1,  # not ones_like: the parameter keeps a gradient path
    fold_decompression=weights.fold_decompression,
    add_weight_times=add_weight_times,
    # a change of the stream's basis (passes/edits.Project), in the tensor's own dtype
    project=lambda x, q, keep, axis: weights.project(
        x, None if q is None else torch.from_numpy(np.asarray(q)).to(x.dtype), keep, axis, torch.matmul),
)


def graph_algebra(graph: fx.Graph, dialect, shape: tuple) -> Algebra:
    """`TENSOR` as graph-building functions in `dialect` (fx_rewrite/apply.Dialect): nodes inserted
    where `graph` inserts, for a constant of `shape` (the edit computed in the forward graph)."""
    g, d = graph, dialect

    def center_(x, axis):  # axis None: uniform along the features, all shift
        return d.zeros_like(g, x) if axis is None else d.sub(g, x, d.mean(g, x, axis))

    def call(fn):
        return lambda *args: g.call_function(fn, args)

    def project(x, q, keep, axis):
        if q is not None:  # the plan rotates no trained constant (passes/plan.py)
            raise TypeError("the training fold cannot change a trained constant's basis")
        return g.call_function(weights.project, (x, None, keep, axis))

    return Algebra(
        center=center_,
        center_blocks=lambda x, axis, block, lo, hi, stride:
            center_(x, axis) if shape[axis] == 1 else g.call_function(center, (x, axis, block, lo, hi, stride)),
        scale=lambda x, by, by_axis, axis: d.mul(g, x, g.call_function(profile, (by, by_axis, len(shape), axis))),
        ones=lambda x: d.ones_like(g, x),
        fold_decompression=call(weights.fold_decompression),
        add_weight_times=call(add_weight_times),
        project=project,
    )


# --- numpy <-> torch, for the float64 weight math of passes/ ---------------------------------------

def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16; the math runs in float64 anyway
    return t.numpy()


def from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    t = rounded(a, like.dtype) if a.dtype == np.float64 else torch.from_numpy(a).to(like.dtype)
    return t.to(device=like.device)


def rounded(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Float64 `a` rounded once to `dtype` (to nearest, ties to even). torch's own float64 ->
    float16/bfloat16 conversion goes through float32 and so rounds twice: one entry in ~50,000 of
    a centered fp16 weight lands one unit off. numpy rounds float64 -> float16 directly; for
    bfloat16, rounding to float32 *to odd* first keeps the second rounding exact (24 >= 8 + 2 bits)."""
    if dtype in (torch.float16, torch.float32, torch.float64):
        return torch.from_numpy(a.astype(torch.empty((), dtype=dtype).numpy().dtype))
    if dtype != torch.bfloat16:
        return torch.from_numpy(a).to(dtype)
    f = a.astype(np.float32)
    inexact = f.astype(np.float64) != a
    bits = f.view(np.uint32)
    even = (bits & 1) == 0
    fix = inexact & even  # move to the odd neighbour on a's side
    f[fix] = np.nextafter(f[fix], np.where(a[fix] > f[fix], np.inf, -np.inf).astype(np.float32))
    return torch.from_numpy(f).to(torch.bfloat16)


def attr_of(gm: torch.nn.Module, target: str) -> Any:
    """The attribute a get_attr node's `target` names (None: `gm` has none)."""
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr, None)


def tensor_attrs(gm: fx.GraphModule) -> dict[str, str]:
    """get_attr node name -> its target, for the nodes that read a tensor (the graph's constants)."""
    return {n.name: n.target for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(attr_of(gm, n.target), torch.Tensor)}


def new_attr(gm: fx.GraphModule, base: str, t: torch.Tensor, before: fx.Node,
             like: Optional[torch.Tensor] = None) -> fx.Node:
    """`t` as a new attribute of `gm` named from `base` (a Parameter when `like` is one, else a
    buffer), read by a get_attr inserted before node `before`."""
    base = base.replace(".", "_")
    name, k = base, 0
    while hasattr(gm, name):  # a fresh attribute name
        k += 1
        name = f"{base}_{k}"
    if isinstance(like, torch.nn.Parameter):
        gm.register_parameter(name, torch.nn.Parameter(t, requires_grad=like.requires_grad))
    else:
        gm.register_buffer(name, t)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = t
    return node
