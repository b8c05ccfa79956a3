"""The branches of an If, folded with the main graph as one (Optimum's merged decoders).

Optimum's merged decoder is one `If(use_cache_branch)` whose two branches share the outer graph's
initializers: folding one branch alone would edit weights the other reads. So the branches of every
top-level If join the one stream view, each under its own scope (`<If name>/then_branch::<name>`);
outer names stay unscoped, so a shared weight is one value read in both. A branch's outputs leave
through the If: stream tensors among them block as graph outputs do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from ..passes import Node, Plan, View
from ..passes.rules import rule

from . import crms
from .sessions import graph_reads
from .shapes import infer_shapes, infer_types

SEP = "::"


@dataclass
class Scope:
    """One inlined branch: its graph, its shapes and its norms, under `prefix`."""

    prefix: str
    graph: gs.Graph
    info: object  # classify.GraphInfo of the branch
    matches: dict  # unscoped name -> NormMatch
    outer: set

    def scoped(self, name: str) -> str:
        return name if not name or name in self.outer else f"{self.prefix}{SEP}{name}"

    def owns(self, scoped_name: str) -> bool:
        return scoped_name.startswith(self.prefix + SEP)

    def local(self, scoped_name: str) -> str:
        return scoped_name[len(self.prefix) + len(SEP):] if self.owns(scoped_name) else scoped_name


def _branch_model(model: onnx.ModelProto, branch: onnx.GraphProto, outer: set, types: dict) -> onnx.ModelProto:
    """A branch as a standalone model for shape inference: the outer names it reads become typed
    inputs (small initializers stay, their values matter: Reshape shapes, axes)."""
    g = model.graph
    used = graph_reads(branch)

    def small(t: onnx.TensorProto) -> bool:
        return int(np.prod(t.dims)) <= 4096 and t.data_location != onnx.TensorProto.EXTERNAL

    inits = [t for t in g.initializer if t.name in used and small(t)]
    inputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
              for t in g.initializer if t.name in used and not small(t)]
    weights = {t.name for t in g.initializer}  # (the used ones are inputs or inits already)
    inputs += [types[name] for name in sorted(used & outer - weights) if name in types]
    sub = helper.make_graph(list(branch.node), branch.name or "branch", inputs, list(branch.output), inits,
                            value_info=list(branch.value_info))
    m = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    m.functions.extend(model.functions)
    return m


def inline_branches(model: onnx.ModelProto, graph: gs.Graph, view: View, opset: int, rms: bool = False
                    ) -> list[Scope]:
    """Add the nodes of every top-level If's branches to `view`, scoped; returns the scopes. `rms`:
    their RMSNorms as given are norms of the view too (build_view's), as the main graph's are."""
    from .classify import GraphInfo, build_view

    ifs = [(k, n) for k, n in enumerate(graph.nodes) if n.op == "If"]
    if not ifs:
        return []
    g = model.graph
    outer = ({t.name for t in g.initializer} | {t.name for t in g.input} | {o for n in g.node for o in n.output}
             | {t.name for t in g.sparse_initializer})
    types = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    if any(o not in types for n in g.node if n.op_type != "If" for o in n.output):
        types = {**infer_types(model), **types}  # main-graph tensors the branches read need types
    scopes: list[Scope] = []
    seen = {n.name for n in graph.nodes}  # node names unique across the main graph and all branches
    for k, node in ifs:
        proto = g.node[k]  # graphsurgeon keeps the node order of the proto
        _drop_captured(view, node)
        for attr in ("then_branch", "else_branch"):
            branch = node.attrs.get(attr)
            bproto = next((a.g for a in proto.attribute if a.name == attr), None)
            if not isinstance(branch, gs.Graph) or bproto is None:
                continue
            dedupe_node_names(branch, seen)
            shapes = infer_shapes(_branch_model(model, bproto, outer, types))
            info = GraphInfo(branch, shapes)
            bview, matches = build_view(info, opset, rms=rms)
            scope = Scope(f"{node.name}/{attr}", branch, info, matches, outer)
            _merge(view, bview, scope)
            scopes.append(scope)
    _outer_weights(view, model)
    return scopes


def _outer_weights(view: View, model: onnx.ModelProto) -> None:
    """The main graph's initializers that only branches read (merge_decoders moves the weights both
    decoders share there) are constants of the view, with their shapes: a branch's shape inference
    saw the large ones as inputs, and a γ can move into a MatMul only through a constant weight."""
    for t in model.graph.initializer:
        v = view.values.get(t.name)
        if v is not None and v.producer is None and not v.is_const:
            v.is_const = True
            if v.shape is None or v.rank is None:
                v.rank, v.shape = len(t.dims), tuple(int(x) for x in t.dims)
    view.changed()


def _drop_captured(view: View, node: gs.Node) -> None:
    """The If's view node keeps its explicit inputs only: its branches' nodes read the rest."""
    vnode = view.nodes[node.name]
    explicit = len(node.inputs)
    for i, name in enumerate(vnode.inputs[explicit:], start=explicit):
        if name:
            view.values[name].consumers.remove((vnode.name, i))
    del vnode.inputs[explicit:]
    view.changed()


def _merge(view: View, bview: View, scope: Scope) -> None:
    """Add the branch's nodes to the main view under its scope, as `in_branch` rules."""
    s = scope.scoped
    for n in bview.nodes.values():
        view.add_node(Node(s(n.name), n.op, [s(i) for i in n.inputs], [s(o) for o in n.outputs],
                           rule=None if n.rule is None else rule("in_branch", op=n.rule), origin=s(n.origin)))
    for name, v in bview.values.items():
        tv = view.value(s(name))
        if tv.rank is None:
            tv.rank, tv.shape = v.rank, v.shape
        tv.is_const = tv.is_const or v.is_const
        tv.is_graph_output = tv.is_graph_output or v.is_graph_output  # leaves through the If
    view.changed()


# --- emission -----------------------------------------------------------------------------------

def apply(plan: Plan, main_emitter, matches: dict, scopes: list[Scope], make_emitter) -> None:
    """Apply `plan` to the main graph and every scope: constant edits once, then per-graph swaps."""
    emitters = [(None, main_emitter)] + [(sc, make_emitter(sc.graph, sc.info)) for sc in scopes]
    names = set().union(*(em._names for _, em in emitters))
    for _, em in emitters:
        em._names = names  # one namespace: new tensors are hoisted to the main graph on export

    def where(scoped_name: str):
        return next(((sc, em) for sc, em in emitters[1:] if sc.owns(scoped_name)), (None, main_emitter))

    tensors = dict(main_emitter.info.tensors)
    for sc, _ in emitters[1:]:
        for name, t in sc.info.tensors.items():
            tensors.setdefault(sc.scoped(name), t)

    def node_of(scoped_name: str):
        sc, em = where(scoped_name)
        return em.nodes[sc.local(scoped_name) if sc else scoped_name]

    main_emitter.write_constants(plan, plan.const_edits, tensors.__getitem__, node_of)
    for name in plan.drop_muls:
        where(name)[1].bypass_mul(node_of(plan.origin(name)))
    # a new bias's reader is in one graph, its W β read from constants of any (an If's heads and k_projs)
    crms.add_new_biases(plan, tensors.__getitem__, lambda name: (where(name)[1], node_of(name)))

    for sc, em in emitters:
        # the scope's share of the plan, in its own graph's names
        mine = (lambda n: not any(s.owns(n) for s in scopes)) if sc is None else sc.owns
        local = (lambda n: n) if sc is None else sc.local
        em.apply(plan.scoped(mine, local, main=sc is None), matches if sc is None else sc.matches)


def hoistable(graph: gs.Graph) -> set:
    """Names of the constants that the branches of top-level Ifs read and that are one tensor
    wherever they are read (so one copy in the main graph serves every branch)."""
    seen: dict[str, set] = {}
    for node in graph.nodes:
        if node.op != "If":
            continue
        for attr in ("then_branch", "else_branch"):
            branch = node.attrs.get(attr)
            if isinstance(branch, gs.Graph):
                for name, t in branch.tensors().items():
                    if isinstance(t, gs.Constant):
                        seen.setdefault(name, set()).add(id(t))
    return {name for name, ids in seen.items() if len(ids) == 1}


def hoist_initializers(model: onnx.ModelProto, names: set) -> None:
    """Move the initializers graphsurgeon wrote into the branches of top-level Ifs (it copies an
    outer weight into each subgraph that reads it) back to the main graph, once per name."""
    g = model.graph
    have = {t.name for t in g.initializer}
    taken = {t.name for t in g.input} | {o for n in g.node for o in n.output}
    for node in g.node:
        if node.op_type != "If":
            continue
        for a in node.attribute:
            if not a.HasField("g"):
                continue
            keep = []
            for t in a.g.initializer:
                if t.name not in names or t.name in taken:
                    keep.append(t)
                elif t.name not in have:
                    g.initializer.append(t)
                    have.add(t.name)
            del a.g.initializer[:]
            a.g.initializer.extend(keep)


def dedupe_node_names(graph: gs.Graph, seen: set) -> None:
    """Non-empty node names, unique across the main graph and every inlined branch (`seen`), as
    api._import makes them in the main graph. Across branches too: graphsurgeon compares nodes by
    value when it unlinks one from a shared tensor, and would unlink the other branch's twin."""
    for k, node in enumerate(graph.nodes):
        if not node.name or node.name in seen:
            node.name = f"{node.op}_{k}" if not node.name else f"{node.name}_{k}"
        seen.add(node.name)
