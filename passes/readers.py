"""The linear layers that read a norm's output: where its β can go (passes/beta.py) and where a
deferred norm's row scale is applied (passes/defer.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .rules import branch_op, kind_of, writes_product
from .view import ConstRef, View


@dataclass(frozen=True)
class LinearReader:
    """A linear layer with a constant weight reading the norm's output, possibly through reshapes."""

    node: str
    input: int
    weight: ConstRef  # axis: the weight's input-feature axis
    bias: Optional[ConstRef]
    rank: int  # rank of the tensor it reads (a row scale is reshaped to it)
    out_width: Optional[int]  # output features (None: unknown)


def _copies_rows_of(view: View, node, i: int) -> bool:
    """Each output row of the layout op `node` is a copy of one row of its input `i` (a slice,
    gather, transpose, expand): a per-feature edit (γ, β, Q) moved past it reaches exactly the rows
    it reached before. Not a Pad (its new zero rows would get β) nor a Concat with other data (its
    other rows would get γ, β and Q too)."""
    if not node.layout or kind_of(node.rule)[0] == "pad":
        return False
    for j, x in enumerate(node.inputs):
        other = view.values.get(x) if j != i else None
        if other is not None and other.rank and node.transfer(j, other.rank - 1):
            return False  # another input's features reach the output too
    return True


def linear_in_branch(view: View, node, i: int, axis: int):
    """The linear read of an op of an inlined If branch (its `in_branch` rule answers none, so that
    deferral and CRMSNorm, which the branch emitter does not apply, leave it alone): for a per-feature
    constant edit (γ, β, a rotation), written once for all scopes like a source's centering."""
    op = branch_op(node.rule)
    return None if op is None else op.answers(view, node).linear(i, axis)


def linear_readers(view: View, value: str, axis: int, products_only: bool = False,
                   through_layout: bool = False) -> tuple[list[LinearReader], Optional[str]]:
    """Every linear layer that reads `value` along its feature axis `axis`, directly or through
    reshapes that keep that axis whole and last; or why some reader is not one. `products_only`:
    only readers whose output is their product (not a fused attention that starts with one).
    `through_layout`: through any layout op that keeps the feature axis whole and last (a slice or
    gather of rows: fine for a per-feature edit, γ or β, not for a per-row scale), and the linear
    layers of If branches (a per-feature edit of their weights)."""
    v = view.values[value]
    if v.is_graph_output:
        return [], f"`{value}` is a graph output"
    if not v.consumers:
        return [], f"`{value}` has no readers"
    out: list[LinearReader] = []
    for name, i in v.consumers:
        node = view.nodes[name]
        if node.shape_only:  # a Shape/Size reads no values: β, γ, a row scale or Q never reach it
            continue
        lin = node.linear(i, axis) if writes_product(node) or not products_only else None
        if lin is None and through_layout:
            lin = linear_in_branch(view, node, i, axis)
        if lin is not None:
            if lin.weight.axis is None:
                return [], f"{node.describe()} has no input-feature axis on its weight"
            o = view.values.get(node.outputs[0]) if node.outputs else None
            width = o.shape[-1] if o is not None and o.shape and isinstance(o.shape[-1], int) else None
            out.append(LinearReader(name, i, lin.weight, lin.bias, v.rank, width))
            continue
        if ((node.regroups or (through_layout and _copies_rows_of(view, node, i)))
                and len(node.outputs) == 1 and v.rank is not None and axis == v.rank - 1):
            o = view.values[node.outputs[0]]
            # the features stay whole and last; only the rows regroup
            if o.rank is not None and node.transfer(i, axis) == [(0, o.rank - 1)]:
                sub, why = linear_readers(view, o.name, o.rank - 1, products_only, through_layout)
                if why is not None:
                    return [], why
                out += sub
                continue
        return [], f"{node.describe()} reads it and is not a linear layer with a constant weight"
    return out, None
