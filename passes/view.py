"""The stream view: an IR-neutral picture of a graph, as the foldability analysis sees it.

A frontend (ONNX, torch.fx) builds one `View` from its IR: values (shape, constant or not) and
nodes, each named in the vocabulary of passes/rules.py (`Node.rule`: a kind and its parameters).
That is all a view stores. The analysis asks each node these questions (`node.transfer(i, axis)`,
...), answered from its rule and the view's shapes (`View.answers`, derived once per node):

- `transfer(i, axis)`: is the node shift-transparent through input `i` when that input's
  feature axis is `axis`? If so, which outputs carry the shift and on which axis.
- `backward(o, axis)`: the same question asked from output `o`: which inputs carry the stream
  into it, on which axes. Inputs it leaves out are parameters (a scalar factor, a shape); an
  input whose share of the output cannot be placed must make it answer None.
- `centering(o, axis)`: can output `o` be made zero-mean along `axis` by editing constants?
  If so, which constants along which of their axes (Lemma 3.1 of the paper).
- `channel_scale(o, axis)`: is output `o` a per-channel constant scale of input `i` (LayerScale),
  which can be folded into the source(s) upstream before centering?
- `invariant(i, axis)`: is the node's output unchanged by a per-row shift of input `i` along 1?
- `linear(i, axis)`: does the node read input `i` (feature axis `axis`) as the input features of
  a linear map with a constant weight? If so, the weight and bias (CRMSNorm folds γ, β and the
  decompression into them).
- `width_refs(o, axis)`: the places in the node's parameters that spell the size of output `o`
  along `axis` (a Reshape's target shape, an Expand's); [] where none does, None where the size
  is set in a way no edit can change (CRMSNorm shrinks the stream from d to d-1). A `SizeOf`
  among them: the size is read at run time from another tensor's shape, and follows the width
  only where that tensor's axis is on the same stream (`compress.follows_stream` judges it). On a
  `shape_only` node: [] when its result does not depend on the width (a dtype assert).
- `transfer_block(i, axis, block)` / `backward_block(o, axis, block)`: the same questions for a
  tensor centered per block (`FeatureRuns`; None: the whole axis), answered with (index, axis,
  blocks) triples (an empty list: a slice that reads none of the edited runs, its output
  unchanged): a reshape that splits the feature axis into (heads, head_dim) maps "feature axis
  head_dim" to "blocks of head_dim" on the merged axis.
- `block_centering`: the refs `centering` returns hold the output's features in order along
  their axis, so a per-block centering of the output is the same per-block centering of them.
- `layout`: the node only moves or copies elements (a reshape, transpose, slice, gather on other
  axes): it commutes with any map applied along the feature axis.
- `norm`: on LayerNorms (over one axis) — the nodes this whole tool is about; `norm_rejection`
  on the LayerNorms that are not foldable, saying why.
- `regroups`: the node only regroups its input's values in order (a reshape/view), so a per-row
  scale can follow it: deferred normalization looks through it to the linear layers behind.

A frontend does not answer these itself: one rule set answers for both IRs (passes/patterns.py
finds the multi-op LayerNorms). Tests build views by hand (`View.input`, `const`, `add`).

Axes are non-negative ints; every value carries its rank. Nothing here imports a framework.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Protocol

class Rule(Protocol):
    """What a node's rule is to the view (passes/rules.Rule): it answers the analysis' questions.
    The view only calls it, so rules.py (which reads views) is above this module, not beside it."""

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

    THEORY §1 says where the other fields arise: `stride`, the runs start every `stride` entries
    from `lo` (None: back to back; Persimmon's q, every 3·head_dim); `row` (axis, index), only
    that index of another axis is in the stream; `spacing`, one run is `size` entries `spacing`
    apart (None: adjacent) on an axis merging the features with others (MobileViT's unfolding),
    followed only by layout ops and a reshape that splits the features back out."""

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
    """A constant tensor to edit along `axis`, reached by `user` through its input `user_input`.

    The edit rewires `user.inputs[user_input]` when the constant must be cloned (because other
    nodes read it too), so shared and tied weights are never changed for their other readers.
    """

    value: str
    axis: int
    user: str
    user_input: int
    # Center each run of `block.size` entries along `axis` on its own (a per-head q/k norm reads
    # the source's output features in blocks of head_dim); None: the whole axis.
    block: Optional[FeatureRuns] = None


@dataclass
class NormSpec:
    """A LayerNorm over exactly one axis of its input; or, with `rms`, an RMSNorm as the model
    gives it (issue 47): its input need not be zero-mean, so the analysis never centers its stream,
    and a stream whose norms are all such RMSNorms can be rotated once γ is in the readers."""

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
    """`out = x · W (+ b)` over the feature axis of one data input.

    `weight.axis` is the weight's input-feature axis in the constant's own layout (through a
    Transpose the frontend looked behind); `bias`, if any, is added after the product, and
    `bias.axis` is its output-feature axis (None for a scalar).
    """

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
    """A size computed at run time: the size of tensor `value` along its `axis` (a shape entry
    read from `Shape(value)`); `known`: that size where the shapes say it is static."""

    value: str
    axis: int
    known: Optional[int] = None


def no_answer(*_) -> None:
    """The answer of a node that does not pass the stream (the default of each question)."""
    return None


@dataclass
class Answers:
    """A node's answers to the analysis (the module docstring says what each means), derived by
    passes/rules.py from the node's rule and the view; the defaults: a node nothing passes."""

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
    norm_rejection: Optional[str] = None  # e.g. it normalizes two axes
    # Reads only the shapes of its inputs (ONNX Shape/Size): no weight edit can reach its output.
    shape_only: bool = False
    # Computes a float weight from one stored as this integer type ("int8"): no constant edit
    # can center it (the integers cannot hold a centered value), so the node is opaque.
    stored_as: Optional[str] = None


@dataclass
class Node:
    """One op: what it reads and writes, and what it is (`rule`, in the vocabulary of
    passes/rules.py). Nothing else is stored: its answers (`transfer`, `norm`, ...) are derived
    from the rule and the view it belongs to, on first use."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    rule: Optional[Rule] = None
    # The IR node this view node stands for (several view nodes can stand for one fused op, or
    # a view node for one Python-number argument); "" means the node's own name.
    origin: str = ""

    def __post_init__(self) -> None:
        self.origin = self.origin or self.name

    def describe(self) -> str:
        return f"{self.op} `{self.name}`"

    @property
    def norm_input(self) -> str:
        """A norm's normalized input (the value its NormSpec names); only for a node whose `norm` is set."""
        return self.inputs[self.norm.input]

    def _answers(self) -> Answers:
        view = self.__dict__.get("_view")
        if view is None:
            raise ValueError(f"{self.describe()} is in no view: add it to one (View.add_node) to ask it")
        return view.answers(self)

    def __getattr__(self, name: str):
        """The analysis' questions, `Answers`' fields: `node.transfer(i, axis)`, `node.norm`, ..."""
        if name not in _QUESTIONS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._answers(), name)


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
    """Nodes and values of one graph, linked both ways.

    Data only: two views are equal when their nodes and values are, and `str(view)` prints one
    line per node, so a test or a bug report can compare or diff them. A node's answers are
    derived from its rule on first use and cached; adding or removing a node drops the cache, and
    code that edits a node's inputs or a value's shape in place after that calls `changed()`.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.values: dict[str, Value] = {}
        self._answers: dict[str, Answers] = {}
        # Op chains that almost are a LayerNorm, by the name of their first op: why each is not
        # one (a passes.match.NoMatch); the report lists them.
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
        """Unlink a node: its inputs lose a consumer, its outputs their producer."""
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
        """Forget the derived answers (the graph or a shape changed)."""
        self._answers.clear()

    def answers(self, node: Node) -> Answers:
        """What `node` answers the analysis, from its rule (passes/rules.py) and this view."""
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
        import difflib

        return list(difflib.unified_diff(self.dump().splitlines(), other.dump().splitlines(),
                                         "this", "other", lineterm=""))


def _shape_text(v: Value) -> str:
    if v.shape is None:
        return "[?]" if v.rank is None else f"[rank {v.rank}]"
    return "[" + ", ".join("?" if d is None else str(d) for d in v.shape) + "]"
