"""Padding masks in verification: positions an attention mask zeroes are not outputs a user reads.
A hidden state at a padded position is computed from nothing meaningful (a pad token attending real
ones), and its rounding says nothing of the fold (an ALBERT sliced on real padded rows was refused
for error that sat there alone). So the gate judges each output whose leading axes are the mask's
on the positions the mask keeps, and the verdict says so.

A mask is recognized by what it does, not by its name: a graph input of shape [batch, positions]
holding only 0 and 1 (at least one 0) whose values reach a Softmax's input as data (_moves_scores).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

# ops through which a value does not reach the scores as a mask would: its shape only, or mixed
# with weights as data
_SHAPE_ONLY = frozenset(("Shape", "Size"))
_MIXING = frozenset(("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "QLinearMatMul"))
_LOOKUP = frozenset(("Gather", "GatherElements", "GatherND"))  # (input 1, the indices, looks up)


def padding_mask(model: onnx.ModelProto, feeds: dict) -> Optional[tuple[str, np.ndarray]]:
    """(the mask input's name, True where a position is read) for the first graph input that is
    an attention mask on `feeds` with a position it zeroes (module docstring); None where none is."""
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            if name:
                consumers.setdefault(name, []).append((n, i))
    for inp in model.graph.input:
        value = np.asarray(feeds.get(inp.name))  # (an input not fed: 0-D, skipped)
        if value.ndim != 2 or value.size == 0 or not np.isin(value, (0, 1)).all() or value.all():
            continue
        if _moves_scores(inp.name, consumers):
            return inp.name, value != 0
    return None


def _moves_scores(name: str, consumers: dict) -> bool:
    """Does `name` reach a Softmax's input as data (not a lookup's indices, not a weight's operand,
    not only its shape)?"""
    stack, seen = [name], {name}
    while stack:
        value = stack.pop()
        for node, i in consumers.get(value, ()):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Softmax":
                return True
            if node.op_type in _SHAPE_ONLY or node.op_type in _MIXING or (node.op_type in _LOOKUP and i == 1):
                continue
            for out in node.output:
                if out and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return False


def read_positions(mask: Optional[tuple[str, np.ndarray]], *arrays: Optional[np.ndarray]) -> tuple:
    """`arrays` (one output's runs) at the positions the mask keeps, where their leading axes are
    the mask's; as given otherwise (or without a mask, or where it keeps no position)."""
    if mask is None:
        return arrays
    keep = mask[1]
    first = next(a for a in arrays if a is not None)
    if np.ndim(first) < keep.ndim or np.shape(first)[:keep.ndim] != keep.shape or not keep.any():
        return arrays
    return tuple(None if a is None else np.asarray(a)[keep] for a in arrays)


def describe(mask: Optional[tuple[str, np.ndarray]], restricted: list[str]) -> str:
    """The verdict's note on the positions left out, "" where none were."""
    if mask is None or not restricted:
        return ""
    name, keep = mask
    return (f"positions `{name}` zeroes ({int((~keep).sum())} of {keep.size}) are padding, not outputs a user reads: "
            f"{', '.join(restricted)} judged on the {int(keep.sum())} positions it keeps")
