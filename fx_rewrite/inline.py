"""Inline torch.export's no-grad regions into the graph the classifier reads.

torch.export wraps code run under `torch.no_grad()` (M2M100's and Speech2Text's sinusoidal positions)
in one `wrap_with_set_grad_enabled(False, submodule, *args)` call, an opaque op to the classifier: the
stream it starts would need a Recenter where its table could be centered. Grad mode changes no value,
so the region's nodes replace the call, each result detached as no_grad made it.
"""
from __future__ import annotations

import operator

import torch
from torch import fx


def inline_no_grad_regions(gm: fx.GraphModule) -> None:
    """Replace every `wrap_with_set_grad_enabled(False, ...)` call of `gm` by its submodule's nodes
    (nested regions too); a region that reads attributes of its own, writes to a tensor or returns
    no tuple stays."""
    try:
        from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled as op
    except ImportError:  # a torch without it exports no such regions
        return
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is op and node.args and node.args[0] is False:
                changed |= _inline(gm, node)
    gm.graph.lint()
    gm.recompile()


def _inline(gm: fx.GraphModule, call: fx.Node) -> bool:
    sub = getattr(gm, call.args[1].target, None) if isinstance(call.args[1], fx.Node) else None
    if not isinstance(sub, fx.GraphModule) or any(n.op == "get_attr" or _writes(n) for n in sub.graph.nodes):
        return False
    output = next(n for n in sub.graph.nodes if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)) or any(
            u.target is not operator.getitem or not isinstance(u.args[1], int)
            or not isinstance(results[u.args[1]], fx.Node) for u in call.users):
        return False
    env: dict[fx.Node, fx.Node] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], call.args[2:]))
    with gm.graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op not in ("placeholder", "output"):
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
        detached = {}
        for u in call.users:
            r = env[results[u.args[1]]]
            if r not in detached:
                detached[r] = gm.graph.call_function(torch.ops.aten.detach.default, (r,))
                detached[r].meta = dict(r.meta)
    for u in list(call.users):
        u.replace_all_uses_with(detached[env[results[u.args[1]]]])
        gm.graph.erase_node(u)
    gm.graph.erase_node(call)
    return True


def _writes(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
