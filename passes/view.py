"""The stream view: an IR-neutral picture of a graph, as the foldability analysis sees it.

A frontend (ONNX, torch.fx) builds one `View` from its IR. Each node carries the answers the
analysis needs, as small callables the frontend fills in from its op classification table:

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
  is set in a way no edit can change (CRMSNorm shrinks the stream from d to d-1). On a
  `shape_only` node: [] when its result does not depend on the width (a dtype assert).
- `transfer_block(i, axis, block)` / `backward_block(o, axis, block)`: the same questions for a
  tensor centered per block (`Blocks`: runs of `size` entries, those in [lo, hi) edited; None:
  the whole axis), answered with (index, axis, blocks) triples (an empty list: a slice that
  reads none of the edited runs, its output unchanged): a reshape that splits the feature axis into (heads,
  head_dim) maps "feature axis head_dim" to "blocks of head_dim" on the merged axis.
- `block_centering`: the refs `centering` returns hold the output's features in order along
  their axis, so a per-block centering of the output is the same per-block centering of them.
- `layout`: the node only moves or copies elements (a reshape, transpose, slice, gather on other
  axes): it commutes with any map applied along the feature axis.
- `norm`: set on LayerNorms (over one axis) — the nodes this whole tool is about.
- `regroups`: the node only regroups its input's values in order (a reshape/view), so a per-row
  scale can follow it: deferred normalization looks through it to the linear layers behind.

A frontend does not write these callables itself: it names each op in the vocabulary of
passes/rules.py (`Node.rule`, one table row per op) and `rules.attach` derives them, so both IRs
get the same answers from one rule set (passes/patterns.py finds the multi-op LayerNorms).

Axes are non-negative ints; every value carries its rank. Nothing here imports a framework.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .rules import Rule

# (output index, feature axis of that output)
AxisMap = list[tuple[int, int]]


@dataclass(frozen=True)
class Blocks:
    """Runs of `size` entries along a feature axis, each centered on its own; only the runs in
    entries [lo, hi) (hi None: to the end) are edited (the q rows of a fused q/k/v projection)."""

    size: int
    lo: int = 0
    hi: Optional[int] = None

    def shifted(self, start: int, length: int) -> Optional["Blocks"]:
        """The runs as seen by a slice [start, start + length), None where it reads none of them."""
        hi = start + length if self.hi is None else min(self.hi, start + length)
        lo = max(self.lo, start)
        return Blocks(self.size, lo - start, hi - start) if lo < hi else None


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
    block: Optional[Blocks] = None


@dataclass
class NormSpec:
    """A LayerNorm over exactly one axis of its input."""

    input: int  # index of the normalized input among the node's inputs
    axis: int  # the normalized (feature) axis of that input
    gamma: Optional[str] = None  # value names, None when absent
    beta: Optional[str] = None
    epsilon: float = 1e-5


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


def _never_transfer(i: int, axis: int) -> Optional[AxisMap]:
    return None


def _never_backward(o: int, axis: int) -> Optional[list[tuple[int, int]]]:
    return None


def _never_center(o: int, axis: int) -> Optional[list[ConstRef]]:
    return None


def _no_scale(o: int, axis: int) -> Optional[ChannelScale]:
    return None


def _not_invariant(i: int, axis: int) -> bool:
    return False


def _not_linear(i: int, axis: int) -> Optional[LinearRead]:
    return None


def _never_block(k: int, axis: int, block: Optional[Blocks]) -> Optional[list[tuple[int, int, Optional[Blocks]]]]:
    return None


def _names_no_width(o: int, axis: int) -> Optional[list[DimRef]]:
    return []


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    transfer: Callable[[int, int], Optional[AxisMap]] = _never_transfer
    backward: Callable[[int, int], Optional[list[tuple[int, int]]]] = _never_backward
    centering: Callable[[int, int], Optional[list[ConstRef]]] = _never_center
    channel_scale: Callable[[int, int], Optional[ChannelScale]] = _no_scale
    invariant: Callable[[int, int], bool] = _not_invariant
    linear: Callable[[int, int], Optional[LinearRead]] = _not_linear
    width_refs: Callable[[int, int], Optional[list[DimRef]]] = _names_no_width
    transfer_block: Callable[[int, int, Optional[Blocks]], Optional[list[tuple[int, int, Optional[Blocks]]]]] = _never_block
    backward_block: Callable[[int, int, Optional[Blocks]], Optional[list[tuple[int, int, Optional[Blocks]]]]] = _never_block
    block_centering: bool = False
    layout: bool = False
    regroups: bool = False
    norm: Optional[NormSpec] = None
    # Why a norm-like node is not a foldable LayerNorm (e.g. it normalizes two axes).
    # Set by the frontend on LayerNorms that get no NormSpec, so the report can say why.
    norm_rejection: Optional[str] = None
    # Reads only the shapes of its inputs (ONNX Shape/Size): no weight edit can reach its output.
    shape_only: bool = False
    # What the op is, in the vocabulary of passes/rules.py; the callables above derive from it.
    rule: Optional["Rule"] = None

    def describe(self) -> str:
        return f"{self.op} `{self.name}`"


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


class View:
    """Nodes and values of one graph, linked both ways."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.values: dict[str, Value] = {}

    def value(self, name: str) -> Value:
        if name not in self.values:
            self.values[name] = Value(name)
        return self.values[name]

    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        self.nodes[node.name] = node
        for i, v in enumerate(node.inputs):
            if v:
                self.value(v).consumers.append((node.name, i))
        for v in node.outputs:
            if v:
                self.value(v).producer = node.name
        return node

    def remove_node(self, name: str) -> None:
        """Unlink a node: its inputs lose a consumer, its outputs their producer."""
        node = self.nodes.pop(name)
        for i, v in enumerate(node.inputs):
            if v and v in self.values:
                self.values[v].consumers.remove((name, i))
        for v in node.outputs:
            if v and v in self.values and self.values[v].producer == name:
                self.values[v].producer = None

    def norms(self) -> list[Node]:
        """Every node that is a LayerNorm, foldable in principle or not, in graph order."""
        return [n for n in self.nodes.values() if n.norm is not None or n.norm_rejection]
