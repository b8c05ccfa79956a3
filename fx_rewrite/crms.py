"""Emit a CRMSNorm compression plan (passes/compress.py) into an FX graph.

Constants (sources dropping their last row, readers absorbing γ, β and the decompression) are
written by the Applier's constant edits; here: the size arguments that spell d, the CRMSNorm
(`crms_norm`, a few elementwise ops and two reductions that Inductor fuses into one kernel), the
decompression where a reader needs the d-vector, and biases for readers that had none.
"""
from __future__ import annotations

import torch
from torch import fx

from ..passes.compress import CrmsNorm
from ..passes.edits import apply_ops, compute_new_bias
from ..passes.plan import Plan

from .classify import meta_val, norm_outputs, varargs_sizes
from .deferred_norm import erase_unread
from .edits import LOW_PRECISION, from_numpy, graph_algebra, new_attr, to_numpy, weight_times
from .ops import canonical, set_arg


def crms_norm(x: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """CRMSNorm (seed 001 eq. 5) over the last axis of `x` (d-1 wide): the RMSNorm of the
    zero-mean d-vector concat(x, -Σx), in its first d-1 entries, without γ."""
    xs = x.float() if x.dtype in LOW_PRECISION else x
    s = xs.sum(-1, keepdim=True)
    ms = ((xs * xs).sum(-1, keepdim=True) + s * s) / d
    return (xs * torch.rsqrt(ms + eps)).to(x.dtype)


def decompress(n: torch.Tensor, gamma, beta) -> torch.Tensor:
    """γ ⊙ concat(n, -Σn) + β along the last axis: the LayerNorm's output, for readers that need it."""
    full = torch.cat([n, -n.sum(-1, keepdim=True)], -1)
    if gamma is not None:
        full = full * gamma
    if beta is not None:
        full = full + beta
    return full


def resize_dims(applier, plan: Plan) -> None:
    """Each size argument that spells d on a narrowed stream gets the new width (d-1 on a CRMS
    stream, k on a sliced one: `Plan.resized_dims`)."""
    for ref, shrink in dict(plan.resized_dims).items():
        node = applier.nodes[ref.node]
        varargs = isinstance(ref.slot, tuple)  # x.view(a, b, c): sizes as positional arguments
        sizes = varargs_sizes(node) if varargs else list(canonical(node).args[ref.slot])
        sizes[ref.index] = sizes[ref.index] - shrink
        if varargs:
            node.args = (node.args[0], *sizes)
        else:
            set_arg(node, ref.slot, sizes)


def swap(applier, node: fx.Node, crms: CrmsNorm) -> None:
    g = applier.graph
    written_out = applier.info.decomposed.get(node.name)  # its first mean, its last op
    if written_out is not None:
        x, w, b = (applier.nodes[v] if v else None for v in (written_out.x, written_out.gamma, written_out.beta))
        outs, out = [], applier.nodes[written_out.output]
    else:
        call = canonical(node)
        x, w, b = call.args["input"], call.args.get("weight"), call.args.get("bias")
        outs, out = norm_outputs(node)
    with g.inserting_before(node):
        n = g.call_function(crms_norm, (x, crms.width, float(crms.epsilon)))
    for reader, _ in crms.compressed_readers:
        applier.nodes[reader].replace_input_with(out, n)
    if out is not None and out.users and crms.decompress:
        with g.inserting_after(n):
            full = g.call_function(decompress, (n, w, b))
        out.replace_all_uses_with(full)
    for u in outs:
        if not u.users:
            g.erase_node(u)
    erase_unread(g, [node] + ([out] if out is not None else []))


def add_new_biases(applier, plan: Plan, tensor_of) -> None:
    """Readers without a bias absorb β as an added `W β`: computed once in float64 (`tensor_of`:
    fold_module), or in the graph from the parameters themselves (the backend)."""
    g = applier.graph
    for nb in plan.new_biases:
        node = applier.nodes[nb.node]
        if tensor_of is not None:
            t = from_numpy(compute_new_bias(nb, lambda name: to_numpy(tensor_of(name))), tensor_of(nb.op.weight))
            c = new_attr(applier.gm, f"lnfold_bias_{nb.node}", t, node.next)
        else:  # W β, then the reader's own source edits when it writes a stream (W β lacks W's input axis)
            w = applier.node_named(nb.op.weight)
            shape = tuple(n for k, n in enumerate(meta_val(w).shape) if k != nb.op.axis)
            with g.inserting_before(node.next):
                c = g.call_function(weight_times, (w, applier.node_named(nb.op.vector), nb.op.axis))
                c = apply_ops(c, nb.then, applier.node_named, graph_algebra(g, applier.dialect, shape))
        with g.inserting_after(c):
            y = applier.dialect.add(g, node, c)
        node.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
