"""The stream view: an IR-neutral picture of a graph, as the foldability analysis sees it.

A frontend builds one `View` from its IR: values (shape, constant or not) and nodes, each named
in the vocabulary of passes/rules.py (`Node.rule`). That is all a view stores. The analysis asks
each node these questions, answered from its rule and the view's shapes (`View.answers`):

- `transfer(i, axis)`: is the node shift-transparent through input `i` with feature axis `axis`?
  If so, which outputs carry the shift, on which axes.
- `backward(o, axis)`: the same asked from output `o`: which inputs carry the stream into it.
  Inputs left out are parameters (a scalar factor, a shape); an input whose share of the output
  cannot be placed must make it answer None.
- `centering(o, axis)`: which constants, along which of their axes, an edit makes output `o`
  zero-mean along `axis` (Lemma 3.1 of the paper); None where none does.
- `channel_scale(o, axis)`: output `o` is a per-channel constant scale of an input (LayerScale),
  which folds into the sources upstream before centering.
- `invariant(i, axis)`: the output is unchanged by a per-row shift of input `i` along 1.
- `linear(i, axis)`: the weight and bias of a linear map with a constant weight that reads input
  `i` as its input features (CRMSNorm folds γ, β and the decompression into them).
- `width_refs(o, axis)`: the places in the node's parameters that spell the size of output `o`
  along `axis` (a Reshape's target); [] where none does, None where no edit can change it
  (CRMSNorm shrinks the stream from d to d-1). A `SizeOf` among them follows the width only where
  its tensor is on the same stream (`compress.follows_stream`). On a `shape_only` node: [] when
  its result does not depend on the width.
- `transfer_block(i, axis, block)` / `backward_block(o, axis, block)`: the same for a tensor
  centered per block (`FeatureRuns`; None: the whole axis), as (index, axis, blocks) triples (an
  empty list: a slice that reads none of the edited runs): a reshape that splits the feature
  axis into (heads, head_dim) maps "feature axis head_dim" to "blocks of head_dim" on the merged axis.
- `block_centering`: `centering`'s refs hold the output features in order along their axis, so
  a per-block centering of the output is the same per-block centering of them.
- `layout`: the node only moves or copies elements: it commutes with any map along the features.
- `norm` on LayerNorms over one axis; `norm_rejection` on the others, saying why.
- `regroups`: the node only regroups its input's values in order (a reshape), so deferred
  normalization looks through it to the linear layers behind.

Tests build views by hand (`View.input`, `const`, `add`). Axes are non-negative ints; nothing
here imports a framework.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Protocol

class Rule(Protocol):
    """passes/rules.Rule as the view calls it: rules.py reads views, so it sits above this module."""

    kind: str

    def answers(self, view: "View", node: "Node") -> "Answers": ...


# (output index, feature axis of that output)
AxisMap = list[tuple[int, int]]
# (input or output index, feature axis, runs along it: None for the whole axis)
BlockMap = tuple[int, int, Optional["FeatureRuns"]]


@dataclass(frozen=True)
class FeatureRuns:
    """Runs of `size` entries along a feature axis, each centered on its own; only the runs in
    entries [lo, hi) (hi None: to the end) are edited (the q rows of a fused q/k/v projection).
    THEORY §1 says where the others arise: runs every `stride` entries (None: back to back;
    Persimmon's q); only index `row` = (axis, index) of another axis in the stream; one run's
    entries `spacing` apart on an axis merging the features with others (MobileViT's unfolding)."""

    size: int
    lo: int = 0
    hi: Optional[int] = None
    stride: Optional[int] = None
    row: Optional[tuple[int, int]] = None
    spacing: Optional[tuple] = None  # (integer coefficient, symbolic factors): passes/axes._product

    @property
    def step(self) -> int:
        return self.size if self.stride is None else self.stride

    def shifted(self, start: int, length: int) -> Optional["FeatureRuns"]:
        """The runs as seen by a slice [start, start + length), None where it reads none of them."""
        hi = start + length if self.hi is None else min(self.hi, start + length)
        lo = max(self.lo, start)
        return FeatureRuns(self.size, lo - start, hi - start) if lo < hi else None


@dataclass(frozen=True)
class ConstRef:
    """A constant tensor to edit along `axis`, reached by `user` through its input `user_input`,
    which the edit rewires to a clone where other nodes read the constant too (tied weights)."""

    value: str
    axis: int
    user: str
    user_input: int
    block: Optional[FeatureRuns] = None  # runs centered each on its own (a per-head q/k norm's); None: whole axis


@dataclass
class NormSpec:
    """A LayerNorm over exactly one axis of its input; or, with `rms`, an RMSNorm as the model
    gives it: its input need not be zero-mean, so the analysis never centers its stream."""

    input: int  # index of the normalized input among the node's inputs
    axis: int  # the normalized (feature) axis of that input
    gamma: Optional[str] = None  # value names, None when absent
    beta: Optional[str] = None
    epsilon: float = 1e-5
    rms: bool = False


@dataclass
class ChannelScale:
    """Output = input[`input`] * constant that varies along the feature axis (LayerScale)."""

    input: int
    input_axis: int
    scale: ConstRef


@dataclass(frozen=True)
class LinearRead:
    """`out = x · W (+ b)` over the feature axis of one data input: `weight.axis` is W's
    input-feature axis in the constant's own layout, `bias.axis` b's output-feature axis (None: a scalar)."""

    weight: ConstRef
    bias: Optional[ConstRef] = None


@dataclass(frozen=True)
class DimRef:
    """Entry `index` of a size list that `node` reads at `slot` (a frontend's own key)."""

    node: str
    slot: object
    index: int


@dataclass(frozen=True)
class SizeOf:
    """A size read at run time from `Shape(value)[axis]`; `known`: that size where it is static."""

    value: str
    axis: int
    known: Optional[int] = None


def no_answer(*_) -> None:
    """The answer of a node that does not pass the stream (the default of each question)."""
    return None


@dataclass
class Answers:
    """A node's answers to the analysis (the module docstring says what each means); the
    defaults: a node nothing passes."""

    transfer: Callable[[int, int], Optional[AxisMap]] = no_answer
    backward: Callable[[int, int], Optional[list[tuple[int, int]]]] = no_answer
    centering: Callable[[int, int], Optional[list[ConstRef]]] = no_answer
    channel_scale: Callable[[int, int], Optional[ChannelScale]] = no_answer
    invariant: Callable[[int, int], bool] = lambda i, axis: False
    linear: Callable[[int, int], Optional[LinearRead]] = no_answer
    width_refs: Callable[[int, int], Optional[list[DimRef]]] = lambda o, axis: []  # spells no width
    transfer_block: Callable[[int, int, Optional[FeatureRuns]], Optional[list[BlockMap]]] = no_answer
    backward_block: Callable[[int, int, Optional[FeatureRuns]], Optional[list[BlockMap]]] = no_answer
    block_centering: bool = False
    layout: bool = False
    regroups: bool = False
    norm: Optional[NormSpec] = None
    norm_rejection: Optional[str] = None
    shape_only: bool = False  # reads only its inputs' shapes: no weight edit can reach its output
    # computes a float weight from integers of this type ("int8"), which cannot hold a centered value
    stored_as: Optional[str] = None


@dataclass
class Node:
    """One op: what it reads and writes, and what it is (`rule`); its answers (`transfer`,
    `norm`, ...) are derived from the rule and its view on first use."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    rule: Optional[Rule] = None
    # the IR node this one stands for (several can stand for one fused op); "": its own name
    origin: str = ""

    def __post_init__(self) -> None:
        self.origin = self.origin or self.name

    def describe(self) -> str:
        return f"{self.op} `{self.name}`"

    @property
    def norm_input(self) -> str:
        """A norm's normalized input (the value its NormSpec names); only for a node whose `norm` is set."""
        return self.inputs[self.norm.input]

    def __getattr__(self, name: str):
        """The analysis' questions, `Answers`' fields: `node.transfer(i, axis)`, `node.norm`, ..."""
        if name not in _QUESTIONS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        view = self.__dict__.get("_view")
        if view is None:
            raise ValueError(f"{self.describe()} is in no view: add it to one (View.add_node) to ask it")
        return getattr(view.answers(self), name)


_QUESTIONS = frozenset(f.name for f in fields(Answers))


@dataclass
class Value:
    name: str
    rank: Optional[int] = None  # None: unknown
    shape: Optional[tuple] = None  # ints, strings (symbolic) or None per dim
    is_const: bool = False
    scalar: Optional[float] = None  # the value of a one-element constant (eps, an exponent)
    is_graph_input: bool = False
    is_graph_output: bool = False
    producer: Optional[str] = None  # node name
    consumers: list[tuple[str, int]] = field(default_factory=list)  # (node name, input index)

    def __str__(self) -> str:
        flags = [f for f, on in (("input", self.is_graph_input), ("const", self.is_const),
                                 ("output", self.is_graph_output)) if on]
        scalar = "" if self.scalar is None else f"={self.scalar:g}"
        return f"{self.name}{_shape_text(self)}{scalar}" + (f" {' '.join(flags)}" if flags else "")


class View:
    """Nodes and values of one graph, linked both ways; equal when their nodes and values are,
    and `str(view)` prints one line per node, so a test can compare or diff views. Code that edits
    a node's inputs or a value's shape in place calls `changed()` to drop the cached answers."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.values: dict[str, Value] = {}
        self._answers: dict[str, Answers] = {}
        # op chains that almost are a LayerNorm, by their first op's name: why not (a NoMatch)
        self.near_misses: dict = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, View) and self.nodes == other.nodes and self.values == other.values

    __hash__ = None  # mutable

    def value(self, name: str) -> Value:
        return self.values.setdefault(name, Value(name))

    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        if node.__dict__.get("_view") not in (None, self):
            raise ValueError(f"{node.describe()} belongs to another view")
        node.__dict__["_view"] = self  # not a field: equality and repr see the node's data only
        self.nodes[node.name] = node
        for i, v in enumerate(node.inputs):
            if v:
                self.value(v).consumers.append((node.name, i))
        for v in node.outputs:
            if v:
                self.value(v).producer = node.name
        self.changed()
        return node

    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name)
        node.__dict__.pop("_view", None)
        for i, v in enumerate(node.inputs):
            if v and v in self.values:
                self.values[v].consumers.remove((name, i))
        for v in node.outputs:
            if v and v in self.values and self.values[v].producer == name:
                self.values[v].producer = None
        self.changed()

    def changed(self) -> None:
        self._answers.clear()

    def answers(self, node: Node) -> Answers:
        got = self._answers.get(node.name)
        if got is None:
            got = self._answers[node.name] = node.rule.answers(self, node) if node.rule is not None else Answers()
        return got

    def norms(self) -> list[Node]:
        """Every node that is a LayerNorm, foldable in principle or not, in graph order."""
        return [n for n in self.nodes.values() if (n.norm is not None and not n.norm.rms) or n.norm_rejection]

    def rms_norms(self) -> list[Node]:
        """Every node that is an RMSNorm as given (`NormSpec.rms`), in graph order."""
        return [n for n in self.nodes.values() if n.norm is not None and n.norm.rms]

    # --- building a view by hand (tests, bug reports) ----------------------------------------

    def input(self, name: str, shape: Optional[tuple]) -> str:
        """A graph input of `shape` (ints; strings for symbolic sizes)."""
        v = self._shaped(name, shape)
        v.is_graph_input = True
        return name

    def const(self, name: str, shape: Optional[tuple], scalar: Optional[float] = None) -> str:
        """A constant of `shape`; `scalar`: its value when it has one element (an eps, a factor)."""
        v = self._shaped(name, shape)
        v.is_const, v.scalar = True, scalar
        return name

    def add(self, name: str, op: str, rule: Optional[Rule], inputs: list[str], outputs: dict) -> Node:
        """A node reading `inputs` (names added before; "" for an absent optional input) and
        writing `outputs`, {name: shape}."""
        for i in inputs:
            if i and i not in self.values:
                raise ValueError(f"{op} `{name}` reads {i!r}, which is not in the view yet")
        for out, shape in outputs.items():
            self._shaped(out, shape)
        return self.add_node(Node(name, op, list(inputs), list(outputs), rule=rule))

    def output(self, name: str) -> str:
        self.values[name].is_graph_output = True
        return name

    def _shaped(self, name: str, shape: Optional[tuple]) -> Value:
        v = self.value(name)
        v.shape = None if shape is None else tuple(shape)
        v.rank = None if shape is None else len(v.shape)
        return v

    # --- text form -----------------------------------------------------------------------------

    def dump(self) -> str:
        """One line per value that no node writes (inputs, constants), then one per node in
        graph order, its inputs and outputs with their shapes: `name = op[rule](inputs) -> outputs`."""
        lines = [str(v) for v in self.values.values() if v.producer is None]
        for node in self.nodes.values():
            rule = "" if node.rule is None else f"[{node.rule}]"
            ins = ", ".join(self._ref(v) for v in node.inputs)
            outs = ", ".join(str(self.values[v]) if v else "_" for v in node.outputs)
            lines.append(f"{node.name} = {node.op}{rule}({ins}) -> {outs}")
        return "\n".join(lines)

    def _ref(self, name: str) -> str:
        if not name:
            return "_"
        v = self.values.get(name)
        return name if v is None or v.producer is not None or not v.is_const else f"{name}{_shape_text(v)}"

    __str__ = dump

    def diff(self, other: "View") -> list[str]:
        """The lines of `dump()` that differ between this view and `other` (unified diff)."""
        return list(difflib.unified_diff(self.dump().splitlines(), other.dump().splitlines(),
                                         "this", "other", lineterm=""))


def _shape_text(v: Value) -> str:
    if v.shape is None:
        return "[?]" if v.rank is None else f"[rank {v.rank}]"
    return "[" + ", ".join("?" if d is None else str(d) for d in v.shape) + "]"
