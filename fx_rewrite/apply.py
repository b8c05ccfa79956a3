"""Apply a fold plan to an FX graph: new constants, recenters, and the norms each target runs best;
every decision is the plan's. An edited constant is a new attribute computed once in float64
(fold_module: `AttrConstants`) or computed in the graph from the parameter at every call (the
backend: `GraphConstants`). A folded LayerNorm reads a zero-mean stream, where `layer_norm` and
`rms_norm` are both exact: `norm` says which one runs.
"""
from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx

from ..passes import LnfoldError, Plan, View, compute_constants
from ..passes.options import check_choice
from ..passes.edits import ConstEdit, apply_ops, centers_rows
from ..passes.plan import APPROXIMATE, AS_GIVEN, CRMS, DEFERRED, NormEmission

from . import crms
from .classify import GraphInfo, meta_val, norm_outputs
from .edits import from_numpy, graph_algebra, new_attr, rounded, to_numpy
from .ops import canonical, set_arg

NORMS = ("rms_norm", "layer_norm")
# the buffer (a prefix, the norm's name after it) of a readout's constant MatMul, by `Readout.rotated`:
# an un-rotation, or γ kept in float. No layer of the model: quantize_module keeps them float.
READOUT_BUFFERS = {False: "lnfold_unrotate_", True: "lnfold_float_gamma_"}
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


# --- where centered constants come from ------------------------------------------------------------

class AttrConstants:
    """fold_module: every edited tensor computed once (float64) and stored as a new attribute (Python
    numbers in the stream are the Applier's)."""

    def __init__(self, gm: fx.GraphModule, tensor_of: Callable[[str], torch.Tensor], plan: Plan,
                 info: GraphInfo) -> None:
        self.gm = gm
        self.tensor_of = tensor_of  # view value name -> its tensor
        ks = [k for k, e in enumerate(plan.const_edits) if e.value not in info.scalars]
        computed = compute_constants([plan.const_edits[k] for k in ks], lambda n: to_numpy(self.tensor_of(n)))
        self.arrays = {k: arr for k, (_, arr) in zip(ks, computed)}

    def node_for(self, applier, edit, k):
        like = self.tensor_of(edit.value)
        return new_attr(self.gm, f"lnfold_{edit.value}", from_numpy(self.arrays[k], like), applier.first_user(edit),
                        like)


class GraphConstants:
    """The backend: the edited weight computed in the graph from the parameter itself, at every call,
    so no copy can go stale (a write through `p.data`, or to an inference-mode tensor, bumps no
    version counter a cache could key on). `exact` (inference): in float64 from every source,
    rounded once to the parameter's dtype (fp16/bf16 round through float32, torch's conversion);
    otherwise (training) in the parameter's dtype, the gradient's own path. A table only looked up
    is centered after each lookup (`lookup_centered`)."""

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact

    def node_for(self, applier, edit, k):
        g, src = applier.graph, applier.node_named(edit.value)
        val = meta_val(src)
        if self.exact and _looked_up_rows(applier, edit, val):
            # Each row's centering reads that row alone: the table stays, and each lookup becomes "look
            # up, then center the rows" (tokens × d per call, not one pass over a 50k-row vocabulary).
            # The node keeps its name: the plan's later steps (a deferred norm reading the lookup)
            # read the centered rows.
            for user, _ in edit.users:
                applier.nodes[user].target = lookup_centered
            return src
        with g.inserting_before(applier.first_user(edit)):
            return self._edited(applier, src, edit, val)

    def _edited(self, applier, x: fx.Node, edit: ConstEdit, val) -> fx.Node:
        """`edit.ops` on `x` (of `val`'s shape and dtype), where the graph inserts."""
        g = applier.graph
        algebra = graph_algebra(g, applier.dialect, tuple(val.shape))
        if not self.exact or val.dtype == torch.float64:
            return apply_ops(x, edit.ops, applier.node_named, algebra)
        wide = lambda name: g.call_method("to", (applier.node_named(name), torch.float64))  # noqa: E731
        return g.call_method("to", (apply_ops(g.call_method("to", (x, torch.float64)), edit.ops, wide, algebra),
                                    val.dtype))


def lookup_centered(*args, **kwargs) -> torch.Tensor:
    """`F.embedding(*args, **kwargs)`, its rows centered along the features in float64 and rounded
    once to the table's dtype (GraphConstants.node_for)."""
    rows = F.embedding(*args, **kwargs)
    wide = rows.to(torch.float64)
    return (wide - wide.mean(-1, keepdim=True)).to(rows.dtype)


def _looked_up_rows(applier, edit: ConstEdit, val) -> bool:
    """`edit` centers a 2-D table along its features (`centers_rows`), and every node it edits for
    reads it as the table of `F.embedding` (no max_norm: the classifier never centers those)."""
    if val is None or val.ndim != 2 or not centers_rows(edit.ops, 1):
        return False
    calls = [(n, canonical(n)) for n in (applier.nodes[user] for user, _ in edit.users)]
    return all(n.target is F.embedding and c.get("weight") is applier.node_named(edit.value)
               and c.get("max_norm") is None for n, c in calls)


# --- the edits -----------------------------------------------------------------------------------

class Applier:
    def __init__(self, gm: fx.GraphModule, view: View, info: GraphInfo, dialect: Dialect,
                 constants: AttrConstants | GraphConstants, norm: str = "rms_norm") -> None:
        check_choice("norm", norm, NORMS)  # resolved: FoldOptions turned "auto" into one of these
        self.gm, self.graph, self.view, self.info = gm, gm.graph, view, info
        self.dialect, self.constants, self.norm = dialect, constants, norm
        self.nodes = {n.name: n for n in self.graph.nodes}

    def node_named(self, name: str) -> fx.Node:
        return self.nodes[name]

    def first_user(self, edit: ConstEdit) -> fx.Node:
        users = [self.nodes[u] for u, _ in edit.users]
        order = {n: k for k, n in enumerate(self.graph.nodes)}
        return min(users, key=lambda n: order[n])

    def apply(self, plan: Plan) -> None:
        """Execute `plan` (every decision is in it): constant edits, recenters, bypassed Muls, swaps
        of the norms that are not deferred."""
        for k, edit in enumerate(plan.const_edits):
            self._const_edit(edit, k)
        for rc in plan.recenters:
            self._recenter(rc.value, rc.axis, rc.matrix())
        for sc in plan.shortcuts:
            self._shortcut(sc.node, sc.input, sc.matrix())
        for o in plan.online:
            self._online(o)
        for name in plan.drop_muls:
            self._bypass_mul(name)
        for how in plan.emissions.values():
            node = self.nodes[how.norm]
            if how.how == DEFERRED:
                # the caller's to emit after this (where W β + b lives depends on it: a buffer for
                # fold_module, a recomputed graph input for the backend)
                continue
            if how.how == CRMS:
                crms.swap(self, node, how.crms)
            elif how.how == AS_GIVEN:  # RMSNorms as given, γ in their readers: emitted anew with unit weight
                self._swap_rms(how.norm, how)
            elif how.how == APPROXIMATE:  # not exact (passes/approx.py): RMSNorm on the uncentered stream, β kept
                if node.name in self.info.decomposed:
                    self._swap(node, True)
                else:  # even where folded norms stay layer_norm: on this stream only rms_norm is the swap
                    swap_norm(self.graph, node, self.dialect, True)
            else:
                self._swap(node, how.beta_add, how.unit_gamma, how.rms_only, self._readout(how), self._resized(how))
        crms.resize_dims(self, plan)
        crms.add_new_biases(self, plan, getattr(self.constants, "tensor_of", None))
        self.graph.lint()
        self.gm.recompile()

    # --- constants ---------------------------------------------------------------------------
    def _const_edit(self, edit: ConstEdit, k: int) -> None:
        if edit.value in self.info.scalars:  # a Python number in the stream: write it in place
            node, arg = self.info.scalars[edit.value]
            value = np.asarray(canonical(node).args[arg], np.float64)
            set_arg(node, arg, float(compute_constants([edit], lambda _: value)[0][1]))
            return
        new = self.constants.node_for(self, edit, k)
        for user, idx in edit.users:
            old = self.view.nodes[user].inputs[idx]
            self.nodes[user].replace_input_with(self.nodes[old], new)

    def _bypass_mul(self, name: str) -> None:
        """A multiplication by all-ones (a LayerScale folded into its sources; the plan checked
        that it changes no shape) reads through: its users read its one data input."""
        (data,) = [v for v in self.view.nodes[name].inputs if v and not self.view.values[v].is_const]
        mul = self.nodes[name]
        mul.replace_all_uses_with(self.nodes[data])
        self.graph.erase_node(mul)

    # --- recenters ---------------------------------------------------------------------------
    def _recenter(self, value: str, axis: int, project: Optional[np.ndarray] = None) -> None:
        """x - mean(x) along the feature axis, for a stream start no constant edit can center;
        `project` (d × k, float64): then times it along that axis (a rotated stream, passes/rotate.py:
        `c·M` on the last axis, `Mᵀ·c` on the second-to-last).

        Two passes, as in onnx_rewrite/emit.py (DESIGN §4 says why): c = x - mean(x), then
        c - mean(c), which removes the rounding of mean(x) that one pass leaves along 1."""
        x = self.nodes[value]
        where = [n for n in self.graph.nodes if n.op == "placeholder"][-1] if x.op == "placeholder" else x
        g, d = self.graph, self.dialect
        with g.inserting_before(where.next):  # (in this order, right after `where`)
            mean = d.mean(g, x, axis)
            rough = d.sub(g, x, mean)
            residual = d.mean(g, rough, axis)
            centered = d.sub(g, rough, residual)
            if project is not None:
                like = meta_val(x)
                last = axis == like.dim() - 1
                matrix = self._buffer(f"lnfold_projection_{value}", project if last else project.T, like, centered)
                centered = g.call_function(aten.matmul.default, (centered, matrix) if last else (matrix, centered))
        x.replace_all_uses_with(centered, delete_user_cb=lambda u: u is not mean and u is not rough)

    def _shortcut(self, add: str, i: int, matrix: np.ndarray) -> None:
        """Per-block bases: input `i` of the residual Add `add` times the constant (k × k) change of
        basis between its segment and the next (features on the last axis: the plan checked)."""
        node, x = self.nodes[add], self.nodes[self.view.nodes[add].inputs[i]]
        m = self._buffer(f"lnfold_shortcut_{add}", matrix, meta_val(x), node)
        with self.graph.inserting_before(node):
            mm = self.graph.call_function(aten.matmul.default, (x, m))
        node.replace_input_with(x, mm)

    def _online(self, o) -> None:
        """online_hadamard (passes/online.py): the linear layer's activation input times H before it
        (its weight took Hᵀ among the constant edits): a constant matmul, or where H = A ⊗ B,
        `Aᵀ · unflatten(u, [p, m]) · B` flattened back (n·(p+m) multiply-adds instead of n²)."""
        node, x = self.nodes[o.node], self.nodes[o.value]
        factors = o.factors()
        if factors is None:
            m = self._buffer(f"lnfold_online_{o.node}", o.basis.matrix(), meta_val(x), node)
            with self.graph.inserting_before(node):
                mm = self.graph.call_function(aten.matmul.default, (x, m))
        else:
            a_t = self._buffer(f"lnfold_online_a_{o.node}", factors[0].T, meta_val(x), node)
            b = self._buffer(f"lnfold_online_b_{o.node}", factors[1], meta_val(x), node)
            p, m = factors[0].shape[0], factors[1].shape[0]
            with self.graph.inserting_before(node):
                grouped = self.graph.call_function(aten.unflatten.int, (x, -1, [p, m]))
                right = self.graph.call_function(aten.matmul.default, (grouped, b))
                left = self.graph.call_function(aten.matmul.default, (a_t, right))
                mm = self.graph.call_function(aten.flatten.using_ints, (left, -2, -1))
        node.replace_input_with(x, mm)

    # --- norms -------------------------------------------------------------------------------
    def _readout(self, how: NormEmission) -> Optional[fx.Node]:
        """A norm whose output leaves a stream carried in another basis (`Bᵀ·diag γ`) or keeps γ in
        float in it (`Bᵀ·diag γ·B`), as a buffer (passes/plan.Readout, float64, in the stream's dtype)."""
        if how.readout is None:
            return None
        name, gamma = how.norm, how.readout.gamma
        like = self.constants.tensor_of(gamma) if gamma is not None else None
        arr = how.readout.matrix(None if like is None else to_numpy(like))
        return self._buffer(READOUT_BUFFERS[how.readout.rotated] + name, arr, like, self.nodes[name])

    def _resized(self, how: NormEmission, dtype: Optional[torch.dtype] = None) -> Optional[tuple]:
        """A sliced stream's norm: (k, its weight √(d/k) as a buffer of `dtype` (default: the norm's
        output's), ε·d/k's factor); None: as it was."""
        if how.width is None:
            return None
        out = meta_val(self.nodes[how.norm])  # (native_layer_norm: (y, mean, rstd))
        out = out[0] if isinstance(out, (tuple, list)) else out
        out = torch.empty(0, dtype=dtype) if dtype is not None else out
        # in the norm's own dtype: a float32 √(d/k) would cost a float64 model 3e-8
        weight = self._buffer(f"lnfold_sliced_gamma_{how.norm}", np.full([how.width], how.scale),
                              out if isinstance(out, torch.Tensor) else None, self.nodes[how.norm])
        return how.width, weight, how.eps_scale

    def _buffer(self, base: str, arr: np.ndarray, like: Optional[torch.Tensor], before: fx.Node) -> fx.Node:
        """A float64 constant as a buffer of `like`'s dtype (float32 without one), read before node `before`;
        rounded once (edits.rounded: torch's own float64 -> float16 cast rounds twice)."""
        t = rounded(np.ascontiguousarray(arr, dtype=np.float64), like.dtype if like is not None else torch.float32)
        return new_attr(self.gm, base, t, before)

    def _swap(self, node: fx.Node, beta_add: bool, unit_gamma: bool = False, rotated: bool = False,
              readout: Optional[fx.Node] = None, resized: Optional[tuple] = None) -> None:
        """The norm as RMSNorm; `beta_add` False: the plan moved β into the readers' biases;
        `unit_gamma`: γ too, into their weights (the norm's weight goes); `rotated`: its stream is
        rotated and no longer zero-mean (an RMSNorm, never a LayerNorm, whatever `self.norm`);
        `readout`: its unit-weight output is multiplied by this constant (Qᵀ·diag γ) before β;
        `resized`: a sliced stream's (k, weight √(d/k), ε factor d/k)."""
        decomposed = self.info.decomposed.get(node.name)
        if resized is not None and decomposed is not None:
            raise LnfoldError(f"slicing the stream of a written-out LayerNorm ({node.name}) is not implemented "
                              "in the torch frontend")
        if decomposed is not None:  # an RMSNorm once its mean subtraction goes
            drop_mean(self.graph, node, decomposed.centered, self.nodes)
            # its last op adds β (after γ, where it has one); `normed` is what that Add reads
            normed = self.nodes[decomposed.nodes[-2 if decomposed.beta is not None else -1]]
            if decomposed.beta is not None and not beta_add:
                add = self.nodes[decomposed.nodes[-1]]
                add.replace_all_uses_with(normed)
                self.graph.erase_node(add)
            if readout is not None and decomposed.gamma is None:  # un-rotate the unit-weight output: · Qᵀ
                with self.graph.inserting_after(normed):
                    mm = self.graph.call_function(aten.matmul.default, (normed, readout))
                normed.replace_all_uses_with(mm, delete_user_cb=lambda user: user is not mm)
            if unit_gamma and decomposed.gamma is not None:  # its γ Mul reads through
                # (by the FX inputs: the view holds the collapsed norm, named after its first op, which
                # lists γ among its inputs too)
                mul = next(self.nodes[n] for n in decomposed.nodes if n in self.nodes
                           and decomposed.gamma in [a.name for a in self.nodes[n].all_input_nodes])
                (data,) = [a for a in mul.all_input_nodes if a.name != decomposed.gamma]
                if readout is not None:
                    with self.graph.inserting_after(mul):
                        data = self.graph.call_function(aten.matmul.default, (data, readout))
                mul.replace_all_uses_with(data)
                self.graph.erase_node(mul)
            return
        if unit_gamma:
            set_arg(node, "weight", None if resized is None else resized[1])
        if self.norm == "layer_norm" and not rotated and readout is None:  # a LayerNorm of a zero-mean stream is an RMSNorm
            if not beta_add:
                set_arg(node, "bias", None)
            return
        swap_norm(self.graph, node, self.dialect, beta_add, readout,
                  None if resized is None else (resized[0], resized[2]))

    def _swap_rms(self, name: str, how: NormEmission) -> None:
        """An RMSNorm as given (aten.rms_norm, or written out: `info.decomposed_rms`) as
        aten.rms_norm of its input with unit weight (γ went into the readers, or into the readout
        `how` carries), over a sliced stream's k features where `how` says so; its output cast to
        the dtype the original's had. It computes in the wider of its input's dtype and the dtype the
        original computed in (LlamaRMSNorm's fp32 upcast of an fp16 x; a float64 model's norm is not
        cast down to fp32 as LlamaRMSNorm does: never less precise than the original)."""
        written = self.info.decomposed_rms.get(name)
        node = self.nodes[name]
        if written is None:
            call = canonical(node)
            x, out, covered = call.args["input"], node, [node]
            eps = call.get("eps")
            eps = torch.finfo(meta_val(x).dtype).eps if eps is None else float(eps)
        else:
            x, out, eps = self.nodes[written.x], self.nodes[written.output], written.epsilon
            covered = [self.nodes[n] for n in written.nodes]
        dtype = meta_val(x).dtype
        if written is not None and meta_val(node).dtype.itemsize > dtype.itemsize:  # (node: its mean square)
            dtype = meta_val(node).dtype
        resized = self._resized(how, dtype)
        width = meta_val(out).shape[-1] if resized is None else resized[0]
        readout = self._readout(how)
        with self.graph.inserting_before(out):
            y = self.graph.call_function(aten.to.dtype, (x, dtype)) if dtype != meta_val(x).dtype else x
            y = self.dialect.rms_norm(self.graph, y, [width], None if resized is None else resized[1],
                                      eps * how.eps_scale)
            for want, matrix in ((readout.meta["val"].dtype, readout) if readout is not None else (dtype, None),
                                 (meta_val(out).dtype, None)):
                if want != dtype:
                    y, dtype = self.graph.call_function(aten.to.dtype, (y, want)), want
                if matrix is not None:
                    y = self.graph.call_function(aten.matmul.default, (y, matrix))
        out.replace_all_uses_with(y)
        # the original's ops, and torch.export's dtype asserts on their values, in reverse order
        gone = set(covered)
        for n in reversed(list(self.graph.nodes)):
            if not n.users and (n in gone or (n.op == "call_function" and any(a in gone for a in n.all_input_nodes))):
                self.graph.erase_node(n)


def drop_mean(graph: fx.Graph, mean: fx.Node, subs: list[str], nodes: dict) -> None:
    """A LayerNorm written out (passes/patterns.py) minus its `x - mean(x)`: an RMSNorm."""
    for name in subs:
        sub = nodes[name]
        (x,) = [n for n in sub.all_input_nodes if n is not mean]
        sub.replace_all_uses_with(x)
        graph.erase_node(sub)
    if not mean.users:
        graph.erase_node(mean)


def swap_norm(graph: fx.Graph, node: fx.Node, dialect: Dialect, beta_add: bool = True,
              readout: Optional[fx.Node] = None, resized: Optional[tuple[int, float]] = None) -> None:
    """Replace a LayerNorm node by rms_norm(x, γ) (+ β unless it went into the readers' biases):
    exact once its input is zero-mean. `readout`: a rotated stream's un-rotation, `· Qᵀ·diag γ`
    between the unit-weight norm and β. `resized`: (k, ε factor) of a sliced stream's norm, which
    normalizes k features with ε·d/k."""
    call = canonical(node)
    x, w, b = call.args["input"], call.args.get("weight"), call.args.get("bias") if beta_add else None
    shape = call.get("normalized_shape")
    shape = [shape] if isinstance(shape, int) else list(shape)
    eps = float(call.get("eps", 1e-5))
    if resized is not None:
        shape, eps = shape[:-1] + [resized[0]], eps * resized[1]
    outs, out = norm_outputs(node)
    with graph.inserting_before(node):
        y = dialect.rms_norm(graph, x, shape, w, eps)
        if readout is not None:
            y = graph.call_function(aten.matmul.default, (y, readout))
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


def rms_probe(gm: fx.GraphModule, norms: list[str], dialect: Dialect, decomposed: Optional[dict] = None) -> fx.GraphModule:
    """A twin of `gm` (sharing its tensors) whose folded LayerNorms are RMSNorms: exact only if every
    stream the plan centered really is zero-mean (a kept LayerNorm is exact either way)."""
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
