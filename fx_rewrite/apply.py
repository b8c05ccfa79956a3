"""Apply a fold plan to an FX graph: new constants, recenters, and the norms each target runs best.

Where a centered constant comes from depends on who calls (see `Constants` below):
- `fold_module` computes it once in float64 and stores it as a new attribute of its own copy;
- the torch.compile backend at inference feeds cached centered copies as extra graph inputs, so
  the user's parameters stay untouched and a changed parameter is noticed;
- the backend under autograd computes `W - mean(W)` in the graph from the optimizer's own
  parameters, so gradients reach them unchanged (DESIGN §1, "Equivalence in training").

Norms: a folded LayerNorm reads a zero-mean stream, so both `layer_norm` and `rms_norm` are exact
there; `norm="rms_norm"` swaps it (β becomes an Add), `norm="layer_norm"` keeps the op as it is.
"""
from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx

from ..passes import Plan, View, compute_constants
from ..passes.plan import Center, ConstEdit, Ones, Scale, _op_sources

from . import crms
from .classify import GraphInfo, is_tuple_getitem, meta_val
from .ops import _ALIASES, canonical

NORMS = ("rms_norm", "layer_norm")
aten = torch.ops.aten


@dataclass(frozen=True)
class Dialect:
    """How to spell the few ops an edit inserts, in the graph's own vocabulary."""

    mean: Callable  # (x, axis) -> mean over axis, kept
    sub: Callable
    add: Callable
    mul: Callable
    rms_norm: Callable  # (x, normalized_shape, weight, eps)
    zeros_like: Callable
    ones_like: Callable



ATEN = Dialect(
    mean=lambda g, x, axis: g.call_function(aten.mean.dim, (x, [axis], True)),
    sub=lambda g, a, b: g.call_function(aten.sub.Tensor, (a, b)),
    add=lambda g, a, b: g.call_function(aten.add.Tensor, (a, b)),
    mul=lambda g, a, b: g.call_function(aten.mul.Tensor, (a, b)),
    rms_norm=lambda g, x, shape, w, eps: g.call_function(aten.rms_norm.default, (x, list(shape), w, eps)),
    zeros_like=lambda g, x: g.call_function(aten.zeros_like.default, (x,)),
    ones_like=lambda g, x: g.call_function(aten.ones_like.default, (x,)),
)

TORCH = Dialect(
    mean=lambda g, x, axis: g.call_function(torch.mean, (x,), {"dim": axis, "keepdim": True}),
    sub=lambda g, a, b: g.call_function(operator.sub, (a, b)),
    add=lambda g, a, b: g.call_function(operator.add, (a, b)),
    mul=lambda g, a, b: g.call_function(operator.mul, (a, b)),
    rms_norm=lambda g, x, shape, w, eps: g.call_function(F.rms_norm, (x, tuple(shape), w, eps)),
    zeros_like=lambda g, x: g.call_function(torch.zeros_like, (x,)),
    ones_like=lambda g, x: g.call_function(torch.ones_like, (x,)),
)


def center_blocks(x: torch.Tensor, axis: int, block: int, lo: int = 0, hi=None) -> torch.Tensor:
    """`x` with each run of `block` entries along `axis` in [lo, hi) minus its own mean
    (passes/weights.center)."""
    n = x.shape[axis]
    hi = n if hi is None else hi
    head, part, tail = x.narrow(axis, 0, lo), x.narrow(axis, lo, hi - lo), x.narrow(axis, hi, n - hi)
    runs = part.unflatten(axis, (-1, block))
    low = x.dtype in (torch.float16, torch.bfloat16)
    mean = runs.mean(axis + 1, keepdim=True, dtype=torch.float32 if low else None).to(x.dtype)
    return torch.cat([head, (runs - mean).flatten(axis, axis + 1), tail], axis)


def profile(by: torch.Tensor, by_axis: int, rank: int, axis: int) -> torch.Tensor:
    """The 1-D profile of a LayerScale vector, shaped to broadcast along `axis` of a rank-`rank` tensor.

    The same as passes.weights.vector_along, for graphs that compute it (training).
    """
    n = by.shape[by_axis]
    vec = by.movedim(by_axis, -1).reshape(-1, n)[0]
    shape = [1] * rank
    shape[axis] = n
    return vec.reshape(shape)


# --- numpy <-> torch, for the float64 weight math of passes/ ---------------------------------------

def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16; the math runs in float64 anyway
    return t.numpy()


def from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=like.dtype, device=like.device)


# --- where centered constants come from ------------------------------------------------------------

class Constants:
    """Strategy: make the graph read the edited version of a constant; returns the node to read."""

    def sources(self, edit: ConstEdit) -> list[str]:
        return [edit.value] + [n for op in edit.ops for n in _op_sources(op)]

    def node_for(self, applier: "Applier", edit: ConstEdit, k: int) -> fx.Node:  # pragma: no cover
        raise NotImplementedError


class AttrConstants(Constants):
    """fold_module: centered tensors computed once (float64) and stored as new attributes."""

    def __init__(self, gm: fx.GraphModule, tensor_of: Callable[[str], torch.Tensor]) -> None:
        self.gm = gm
        self.tensor_of = tensor_of  # view value name -> its tensor
        self.arrays: dict[int, np.ndarray] = {}

    def prepare(self, plan: Plan, info: GraphInfo) -> None:
        """Compute every edited tensor (Python numbers in the stream are the Applier's)."""
        ks = [k for k, e in enumerate(plan.const_edits) if e.value not in info.scalars]
        sub = Plan(mode=plan.mode, const_edits=[plan.const_edits[k] for k in ks])
        for k, (_, arr) in zip(ks, compute_constants(sub, lambda n: to_numpy(self.tensor_of(n)))):
            self.arrays[k] = arr

    def node_for(self, applier, edit, k):
        like = self.tensor_of(edit.value)
        t = from_numpy(self.arrays[k], like)
        name = _unique_attr(self.gm, f"lnfold_{edit.value}")
        if isinstance(like, torch.nn.Parameter):
            self.gm.register_parameter(name, torch.nn.Parameter(t, requires_grad=like.requires_grad))
        else:
            self.gm.register_buffer(name, t)
        with applier.graph.inserting_before(applier.first_user(edit)):
            node = applier.graph.get_attr(name)
        node.meta["val"] = t
        return node


class GraphConstants(Constants):
    """Training: the edited weight is computed in the graph from the parameter itself."""

    def node_for(self, applier, edit, k):
        g = applier.graph
        src = applier.node_named(edit.value)
        with g.inserting_before(applier.first_user(edit)):
            x = src
            rank = len(meta_val(src).shape)
            for op in edit.ops:
                if isinstance(op, Center) and op.axis is None:
                    x = applier.dialect.zeros_like(g, x)  # uniform along the features: all shift
                elif isinstance(op, Center) and op.block is not None and meta_val(src).shape[op.axis] != 1:
                    x = g.call_function(center_blocks, (x, op.axis, op.block, op.lo, op.hi))
                elif isinstance(op, Center):
                    x = applier.dialect.sub(g, x, applier.dialect.mean(g, x, op.axis))
                elif isinstance(op, Scale):
                    vec = g.call_function(profile, (applier.node_named(op.by), op.by_axis, rank, op.axis))
                    x = applier.dialect.mul(g, x, vec)
                elif isinstance(op, Ones):
                    x = applier.dialect.ones_like(g, x)
                else:
                    x = crms.graph_op(applier, x, op, rank)
        return x


# --- the edits -----------------------------------------------------------------------------------

class Applier:
    def __init__(self, gm: fx.GraphModule, view: View, info: GraphInfo, dialect: Dialect,
                 constants: Constants, norm: str = "rms_norm") -> None:
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r} (expected one of {', '.join(NORMS)})")
        self.gm = gm
        self.graph = gm.graph
        self.view = view
        self.info = info
        self.dialect = dialect
        self.constants = constants
        self.norm = norm
        self.nodes = {n.name: n for n in self.graph.nodes}

    def node_named(self, name: str) -> fx.Node:
        return self.nodes[name]

    def first_user(self, edit: ConstEdit) -> fx.Node:
        users = [self.nodes[u] for u, _ in edit.users]
        order = {n: k for k, n in enumerate(self.graph.nodes)}
        return min(users, key=lambda n: order[n])

    def apply(self, plan: Plan) -> None:
        for k, edit in enumerate(plan.const_edits):
            self._const_edit(edit, k)
        for rc in plan.recenters:
            self._recenter(rc.value, rc.axis)
        crms_norms = {c.name: c for cc in plan.compressions if cc.compressed for c in cc.crms}
        for name in plan.swaps:
            if name in crms_norms:
                crms.swap(self, self.nodes[name], crms_norms[name])
            else:
                self._swap(self.nodes[name])
        crms.patch_dims(self, plan)
        if plan.new_biases:
            crms.add_new_biases(self, plan, getattr(self.constants, "tensor_of", None))
        self.graph.lint()
        self.gm.recompile()

    # --- constants ---------------------------------------------------------------------------
    def _const_edit(self, edit: ConstEdit, k: int) -> None:
        if edit.value in self.info.scalars:  # a Python number in the stream: write it in place
            node, arg = self.info.scalars[edit.value]
            _set_arg(node, arg, _scalar_after(edit, canonical(node).args[arg]))
            return
        new = self.constants.node_for(self, edit, k)
        for user, idx in edit.users:
            old = self.view.nodes[user].inputs[idx]
            self.nodes[user].replace_input_with(self.nodes[old], new)
        if edit.ops[0] == Ones():
            for user, _ in edit.users:
                self._bypass_mul(self.nodes[user])

    def _bypass_mul(self, mul: fx.Node) -> None:
        """Drop a multiplication by all-ones (a LayerScale folded into its sources)."""
        call = canonical(mul)
        if call is None or call.kind != "mul":
            return
        ops = [call.args.get("input"), call.args.get("other")]
        data = [x for x in ops if isinstance(x, fx.Node) and x.name not in self.info.consts
                and x.op != "get_attr"]
        if len(data) != 1 or _shape(data[0]) != _shape(mul):
            return
        mul.replace_all_uses_with(data[0])
        self.graph.erase_node(mul)

    # --- recenters ---------------------------------------------------------------------------
    def _recenter(self, value: str, axis: int) -> None:
        """x - mean(x) along the feature axis, for a stream start no constant edit can center."""
        x = self.nodes[value]
        where = x
        if x.op == "placeholder":
            where = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(where):
            mean = self.dialect.mean(self.graph, x, axis)
        with self.graph.inserting_after(mean):
            centered = self.dialect.sub(self.graph, x, mean)
        x.replace_all_uses_with(centered, delete_user_cb=lambda u: u is not mean and u is not centered)

    # --- norms -------------------------------------------------------------------------------
    def _swap(self, node: fx.Node) -> None:
        if node.name in self.info.decomposed:  # an RMSNorm once its mean subtraction goes
            drop_mean(self.graph, node, self.info.decomposed[node.name].centered, self.nodes)
            return
        if self.norm == "layer_norm":
            return  # the LayerNorm of a zero-mean stream already computes RMSNorm
        swap_norm(self.graph, node, self.dialect)


def drop_mean(graph: fx.Graph, mean: fx.Node, subs: list[str], nodes: dict) -> None:
    """A LayerNorm written out (passes/patterns.py) minus its `x - mean(x)`: an RMSNorm."""
    for name in subs:
        sub = nodes[name]
        (x,) = [n for n in sub.all_input_nodes if n is not mean]
        sub.replace_all_uses_with(x)
        graph.erase_node(sub)
    if not mean.users:
        graph.erase_node(mean)


def swap_norm(graph: fx.Graph, node: fx.Node, dialect: Dialect) -> fx.Node:
    """Replace a LayerNorm node by rms_norm(x, γ) (+ β): exact once its input is zero-mean."""
    call = canonical(node)
    x, w, b = call.args["input"], call.args.get("weight"), call.args.get("bias")
    shape = call.get("normalized_shape")
    shape = [shape] if isinstance(shape, int) else list(shape)
    eps = float(call.get("eps", 1e-5))
    tuple_out = isinstance(meta_val(node), (tuple, list))  # native_layer_norm: (y, mean, rstd)
    outs = [u for u in node.users if is_tuple_getitem(u)] if tuple_out else []
    out = next((u for u in outs if u.args[1] == 0), None) if tuple_out else node
    with graph.inserting_before(node):
        y = dialect.rms_norm(graph, x, shape, w, eps)
        if b is not None:
            y = dialect.add(graph, y, b)
    if out is not None:
        if meta_val(out) is not None:
            y.meta["val" if "val" in out.meta else "example_value"] = meta_val(out)
        out.replace_all_uses_with(y)
    for u in outs:
        if not u.users:
            graph.erase_node(u)
    if not node.users:
        graph.erase_node(node)
    return y


def rms_probe(gm: fx.GraphModule, norms: list[str], dialect: Dialect, decomposed: Optional[dict] = None) -> fx.GraphModule:
    """A twin of `gm` (sharing its tensors) whose folded LayerNorms are RMSNorms.

    A LayerNorm is exact whether or not its input was centered, so checking a module that kept
    them proves little about the centering; its RMSNorm twin is exact only if every stream the
    plan centered really is zero-mean.
    """
    with warnings.catch_warnings():  # torch's own deprecation, raised by copying its pytree specs in node meta
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        probe = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    nodes = {n.name: n for n in probe.graph.nodes}
    decomposed = decomposed or {}
    for name in norms:
        if name in decomposed:
            if name in nodes:  # (already an RMSNorm in `gm`)
                drop_mean(probe.graph, nodes[name], decomposed[name].centered, nodes)
        else:
            swap_norm(probe.graph, nodes[name], dialect)
    probe.recompile()
    return probe


def _shape(n: Any):
    v = meta_val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _scalar_after(edit: ConstEdit, value: float) -> float:
    out = compute_constants(Plan(mode="rms", const_edits=[edit]), lambda _: np.asarray(value, np.float64))
    return float(out[0][1])


def _set_arg(node: fx.Node, name: str, value: Any) -> None:
    """Replace argument `name` (as canonical() bound it) of `node` by `value`."""
    names = list(canonical(node).args)  # bound positionally first, in order, then by keyword
    k = names.index(name)
    if k < len(node.args):
        args = list(node.args)
        args[k] = value
        node.args = tuple(args)
        return
    key = next(key for key in node.kwargs if _ALIASES.get(key, key) == name)
    node.update_kwarg(key, value)


def _unique_attr(gm: torch.nn.Module, base: str) -> str:
    base = base.replace(".", "_")
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name
