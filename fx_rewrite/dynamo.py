"""What Dynamo hands the backend, made fit to fold: the parameters among the graph's inputs,
a working copy of its graph, the scalars it specialized, concrete sizes for a run."""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import fx


def constant_inputs(gm: fx.GraphModule, example_inputs: list) -> dict[str, int]:
    """Placeholders that hold parameters or buffers (name -> position), as Dynamo lifted them."""
    return {node.name: k for k, (node, t) in enumerate(zip(_placeholders(gm), example_inputs))
            if isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or _is_module_state(node))}


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_module_state(node: fx.Node) -> bool:
    src = getattr(node.meta.get("grapharg"), "source", None)
    name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")
    return "._parameters[" in str(name) or "._buffers[" in str(name)


def specialize_scalars(gm: fx.GraphModule) -> None:
    """Put the value in place of every scalar node that Dynamo has specialized: under dynamic shapes
    a LayerNorm's eps comes as a 0-d tensor input read through `.item()`, specialized and guarded
    (`ln.eps == 1e-05`); the guard guarantees the number, which the analysis needs as a constant."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            continue
        value = _constant_scalar(node.meta.get("example_value", node.meta.get("val")))
        if value is None:
            continue
        for user in list(node.users):
            swap = lambda n, node=node, value=value: value if n is node else n  # noqa: E731
            user.args, user.kwargs = fx.node.map_arg(user.args, swap), fx.node.map_arg(user.kwargs, swap)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


_SYMBOLIC = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}  # -> the Python type of its value


def _constant_scalar(v) -> Optional[Any]:
    """The Python number a specialized SymInt/SymFloat/SymBool stands for, else None."""
    if type(v) not in _SYMBOLIC or not v.node.expr.is_number:
        return None
    return _SYMBOLIC[type(v)](v.node.expr)


def concrete_inputs(gm: fx.GraphModule, example_inputs: list) -> Optional[list]:
    """The example inputs with each symbolic size replaced by the size it stands for in the
    example tensors (the ones Dynamo is compiling for), else by its hint; None where a symbol
    has neither (an unbacked size no input tensor carries)."""
    sizes: dict = {}  # sympy symbol -> the example tensors' size
    for node, x in zip(_placeholders(gm), example_inputs):
        fake = node.meta.get("example_value")
        if isinstance(x, torch.Tensor) and isinstance(fake, torch.Tensor) and fake.ndim == x.ndim:
            for d, n in zip(fake.shape, x.shape):
                if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                    sizes[d.node.expr] = n
    out = []
    for x in example_inputs:
        if type(x) in _SYMBOLIC:
            if x.node.expr in sizes:
                x = sizes[x.node.expr]
            elif x.node.has_hint():
                x = _SYMBOLIC[type(x)](x.node.hint)
            else:
                return None
        out.append(x)
    return out


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module to edit, with what AOTAutograd reads from the original."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    for attr in ("_param_name_to_source", "shape_env"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    for a, b in zip(_placeholders(gm), _placeholders(new)):
        if hasattr(a, "_dynamo_source"):
            b._dynamo_source = a._dynamo_source
    return new
