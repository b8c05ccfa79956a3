"""Shape inference that stays cheap on big models (weights as typed inputs, not data)."""
from __future__ import annotations

import functools
import logging
import re
from math import prod
from pathlib import Path

import onnx
from onnx import helper

from ..passes.axes import Shape

# Initializers above this many elements are replaced by typed graph inputs before inference:
# inference needs their shapes, not their data, and a >2 GB proto cannot be serialized.
_SKELETON_ELEMS = 4096


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its big initializers as typed graph inputs (shapes, not data)."""
    g = model.graph
    small = [init for init in g.initializer if prod(init.dims) <= _SKELETON_ELEMS]
    fake_inputs = [helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                   for init in g.initializer if prod(init.dims) > _SKELETON_ELEMS]
    skel_graph = helper.make_graph([_shaped_like_onnx(n) for n in g.node], g.name or "g", list(g.input) + fake_inputs,
                                   list(g.output), small, value_info=list(g.value_info))
    skel_graph.sparse_initializer.extend(g.sparse_initializer)
    skel = helper.make_model(skel_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    skel.functions.extend(model.functions)
    return skel


def _shaped_like_onnx(node: onnx.NodeProto) -> onnx.NodeProto:
    """tf2onnx writes Erfc (its GELU), which is not an ONNX op: inference would stop at it and know
    no shape downstream. For shapes and types it is Erf (elementwise, same type)."""
    if node.op_type != "Erfc" or node.domain not in ("", "ai.onnx"):
        return node
    shaped = onnx.NodeProto()
    shaped.CopyFrom(node)
    shaped.op_type = "Erf"
    return shaped


def infer_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """name -> typed value info of every value onnx's inference can type (best effort)."""
    try:
        g = _onnx_inference(_skeleton(model)).graph
    except Exception:
        return {}
    return {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}


def infer_shapes(model: onnx.ModelProto) -> dict[str, Shape]:
    """name -> shape of every value onnx can infer (inputs, outputs, initializers, internals)."""
    g = model.graph
    skel = _skeleton(model)
    shapes: dict[str, Shape] = {}
    # onnx's inference first; onnxruntime's symbolic inference then fills what it could not
    # (shapes computed at run time from Shape/Concat, as older exporters emit for flatten).
    # The second costs a slow import, so it runs only where the first left gaps.
    for infer in (_onnx_inference, _symbolic_inference):
        if infer is _symbolic_inference and not _has_gaps(skel, shapes):
            break
        try:
            inferred = infer(skel)
        except Exception:  # inference is best effort: unknown shapes only make the analysis careful
            continue
        for name, shape in _read_shapes(inferred).items():
            if _known(shape) > _known(shapes.get(name)):
                shapes[name] = shape
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _onnx_inference(m: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)


@functools.cache
def _symbolic_module():
    """onnxruntime's symbolic_shape_infer, loaded from its file: importing it the usual way runs
    `onnxruntime/tools/__init__.py`, which imports torch for helpers this does not use."""
    import importlib.util
    import sys

    try:
        spec = importlib.util.find_spec("onnxruntime")
        path = Path(next(iter(spec.submodule_search_locations))) / "tools" / "symbolic_shape_infer.py"
        mod_spec = importlib.util.spec_from_file_location("_lnfold_symbolic_shape_infer", path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = mod  # (its dataclasses and logging look themselves up)
        mod_spec.loader.exec_module(mod)
    except Exception:  # another layout: the ordinary import
        sys.modules.pop("_lnfold_symbolic_shape_infer", None)
        from onnxruntime.tools import symbolic_shape_infer as mod
    # Its warnings ("Unable to determine if NonZero_... <= ..., treat as equal") are about its
    # own guesses, which the analysis treats as unknowns anyway: not the user's concern.
    mod.logger.setLevel(logging.ERROR)
    return mod


def _symbolic_inference(m: onnx.ModelProto) -> onnx.ModelProto:
    SymbolicShapeInference = _symbolic_module().SymbolicShapeInference

    # `SymbolicShapeInference.infer_shapes` throws away a partial result (and saves the model
    # into the current folder) when some shape stays unknown; its own loop keeps what it found.
    ssi = SymbolicShapeInference(2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    ssi._preprocess(m)
    while ssi.run_:
        ssi._infer_impl()
    ssi._update_output_from_vi()
    return ssi.out_mp_


def _has_gaps(m: onnx.ModelProto, shapes: dict[str, Shape]) -> bool:
    """Does some node output lack a shape, or have a dim that is neither a number nor made of the
    graph inputs' named dims (onnx names the dims it cannot place `unk__N`; the ones it computes
    from inputs' dims, `seq*batch`, are as known as symbolic inference would make them)?"""
    names = {d for i in m.graph.input for d in (shapes.get(i.name) or ()) if isinstance(d, str)}
    for node in m.graph.node:
        for o in node.output:
            s = shapes.get(o)
            if o and (s is None or any(not isinstance(d, int) and not _made_of(d, names) for d in s)):
                return True
    return False


def _made_of(dim: str, names: set) -> bool:
    """Is `dim` an expression over `names` and integers (onnx's data propagation: `seq + 1`)?"""
    return all(word in names or word.isdigit() for word in re.findall(r"[A-Za-z_0-9.]+", dim))


def dims_of(t: onnx.TypeProto.Tensor) -> Shape:
    """A tensor type's dims: ints, dim names, None (unnamed)."""
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)


def _read_shapes(m: onnx.ModelProto) -> dict[str, Shape]:
    return {vi.name: dims_of(vi.type.tensor_type) for vi in list(m.graph.value_info) + list(m.graph.input)
            + list(m.graph.output) if vi.type.tensor_type.HasField("shape")}


def _known(shape: Shape) -> int:
    """How much a shape tells: -1 nothing, else 1 + the number of static dims."""
    return -1 if shape is None else 1 + sum(isinstance(d, int) for d in shape)
