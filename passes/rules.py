"""What an op means for the stream, written once for every IR.

A frontend names each op in this vocabulary (ATen `aten.permute.default` and ONNX `Transpose`
both become `Rule("permute", perm=...)`), attributes decoded, inputs given as indices into the
view node's inputs. It decides nothing: `Rule.answers(view, node)` derives every answer the
analysis, deferral and CRMSNorm ask (passes/view.py says what each means) from the rule and the
shapes in the view.

Vocabulary (params; `data` and friends are view input indices, axes are non-negative):

- `elementwise(data, op)`      same shape, value-wise (identity, float cast, neg, eval dropout)
- `broadcast(data, minus, sizes, slot, fixed)` numpy-broadcast sum of the `data` inputs (add,
                               sub, expand), `minus` the subtracted ones; an expand spells its
                               output sizes (see `reshape`)
- `scale(operands, divide)`    operands[0] * or / operands[1] (None: a Python number)
- `pow(data, exponent)`, `sqrt(data)`, `rsqrt(data)`, `reciprocal(data)`: opaque, named for
                               passes/patterns.py
- `reshape(data, axis_map, sizes, slot, fixed)` view/reshape/flatten/squeeze/unsqueeze, read
                               from the shapes (`axis_map` {input axis: output axis}: what the
                               frontend proved from a target shape computed at run time).
                               `sizes`: the target as spelled (int, -1, a `SizeOf` read at run
                               time from a tensor's shape, None: unknown) at the frontend's key
                               `slot`; without, the op spells none (flatten), unless `fixed`
                               (taken from another tensor)
- `permute(data, perm)`        output axis k is input axis perm[k]
- `along(data, outs, axes, starts, partition)` every axis in place, acting only along `axes`
                               (None: unknown): slice, concat, split, roll, flip, index_select;
                               `starts`: a step-1 slice's start along its one axis, as spelled;
                               `partition`: the outputs tile the input in order (split)
- `pad(data, axes, zero)`      pad along `axes` with zeros or copied rows (`zero` False: another
                               constant)
- `take(data, start, stop, q, outs, index)` input axes [start, stop) become q index axes
                               (gather, index; select/unbind: q = 0, `index` each output's)
- `gather_rows(data, index, axis)` out[.., t, .., f] = x[.., index[.., t, .., f], .., f]
                               (GatherElements, torch.gather)
- `tile(data, axes)`           repeat/Tile: copies along the output `axes` (new leading axes too),
                               the input right-aligned (None: not known)
- `resample(data, axes, sizes, slot, fixed)` interpolation along `axes`, every axis in place;
                               `sizes` where it spells them (see `reshape`; by scales: none)
- `zero_rows(data, mask)`      masked_fill(x, mask, 0)
- `reduce(data, axes, keepdims, op)` mean/sum over `axes` (None: not known)
- `invariant_along(data, axis)` softmax / argmax over `axis`
- `metadata(sized, reads, sizes_of)` reads shapes or dtypes only (`sized`: its result depends on
                               the sizes; `reads`: the input axes whose sizes the graph uses other
                               than as an op's output size, None: any; `sizes_of`: those it uses
                               as an op's output size)
- `clamp(data, lo, hi, dtype)` transparent only as an overflow guard (passes/guards.py)
- `nonfinite_test(data)`       isinf / isnan of the stream: invariant under the guard's assumption
- `linear(weight, w_axis, bias, out_axis, data, in_axis, alpha, beta, source)` output axis
                               `out_axis` (negative: from the end) holds the rows of `weight`'s
                               axis `w_axis` (+ bias); `data` is read along `in_axis`;
                               alpha·x·W + beta·b; `source` False: a fused op that computes more
                               from the product
- `matmul(a, b, bias_after)`   a @ b, either side possibly a constant; `bias_after`: the frontend
                               emits a lone constant Add after it as the product's bias (ONNX)
- `einsum(equation, operands)` a two-operand einsum (Keras' and flax's attention projections)
- `embedding(table, q)`        rows of a constant table (or the sum of several: a list) looked up
                               by a rank-q index
- `conv(weight, w_axis, bias, groups)` output channels are `weight`'s axis `w_axis`
- `layer_norm(data, axes, gamma, beta, eps, stats_used, rejection, rms)` a LayerNorm op
                               (`rejection`: a reason only its IR can see; `rms`: an RMSNorm as
                               given, whose input need not be zero-mean)
- `dequantized(stored)`        a float weight computed from integers of type `stored` ("int8"):
                               opaque, as no constant edit centers it
- `in_branch(op)`              the rule `op`, for an op of an inlined If branch
                               (onnx_rewrite/subgraphs.py): only the answers its emitter applies
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from .axes import (merge_row_runs, regroup_factor, reshape_axis, reshape_block_axis, same_axes_rules,
                   split_periodic_runs)
from .guards import is_overflow_guard
from .view import (Answers, ChannelScale, ConstRef, DimRef, FeatureRuns, LinearRead, Node, NormSpec, SizeOf, View,
                   no_answer)


@dataclass
class Rule:
    kind: str
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return " ".join([self.kind] + [f"{k}=({v})" if isinstance(v, Rule) else f"{k}={v!r}"
                                       for k, v in self.params.items()])

    def answers(self, view: View, node: Node) -> Answers:
        """What `node` (whose rule this is) answers the analysis (`View.answers` caches it)."""
        got = RULES[self.kind](view, node, **self.params)
        if self.kind in _BLOCK_AGNOSTIC and "transfer_block" not in got:
            got.update(transfer_block=_carry_block(got.get("transfer", no_answer)),
                       backward_block=_carry_block(got.get("backward", no_answer)))
        return Answers(**got, block_centering=self.kind in _CENTER_IN_ORDER)


def rule(kind: str, **params) -> Rule:
    if kind not in RULES:
        raise KeyError(f"unknown rule kind {kind!r}")
    return Rule(kind, params)


def kind_of(rule: Optional[Rule]) -> tuple[Optional[str], dict]:
    """A rule's kind and parameters (an inlined branch's op: its own rule's)."""
    if rule is None:
        return None, {}
    return kind_of(rule.params["op"]) if rule.kind == "in_branch" else (rule.kind, rule.params)


# --- what other passes ask of a rule: only this module reads its params ---------------------------
# Each answers for an inlined branch's op as for the op itself (`kind_of`), `spelled_sizes` aside.

def is_sum_of_two(rule: Optional[Rule]) -> bool:
    """The rule adds two tensors (a `broadcast` of two data operands, none subtracted): a residual Add."""
    kind, p = kind_of(rule)
    return kind == "broadcast" and not p.get("minus") and sorted(p.get("data", ())) == [0, 1]


def is_product(rule: Optional[Rule]) -> bool:
    kind, p = kind_of(rule)
    return kind == "scale" and not p.get("divide")


def is_quotient(rule: Optional[Rule]) -> bool:
    kind, p = kind_of(rule)
    return kind == "scale" and bool(p.get("divide"))


def operands(rule: Optional[Rule]) -> Optional[tuple]:
    """The input indices of a two-operand `scale`'s operands (None: a Python number) or a
    `broadcast`'s data inputs, in order; None for any other rule."""
    kind, p = kind_of(rule)
    ops = p["operands"] if kind == "scale" else p["data"] if kind == "broadcast" else None
    return tuple(ops) if ops is not None and len(ops) == 2 else None


def difference(rule: Optional[Rule]) -> Optional[tuple[int, int]]:
    """(the input kept, the input subtracted) of a two-input `broadcast` x - u; None for any other rule."""
    kind, p = kind_of(rule)
    if kind != "broadcast" or len(p.get("data", ())) != 2 or len(p.get("minus", ())) != 1:
        return None
    m = p["minus"][0]
    return [d for d in p["data"] if d != m][0], m


def data_input(rule: Optional[Rule]) -> int:
    """The input index of the tensor a one-input rule reads (`elementwise`, `reduce`, `pow`, ...)."""
    return kind_of(rule)[1].get("data", 0)


def mean_axes(rule: Optional[Rule]) -> Optional[tuple[int, ...]]:
    """The sorted axes of a `reduce` mean that keeps its dims; None for any other rule or unknown axes."""
    kind, p = kind_of(rule)
    if kind != "reduce" or p.get("op") != "mean" or not p.get("keepdims") or p.get("axes") is None:
        return None
    return tuple(sorted(p["axes"]))


def squared_inputs(rule: Optional[Rule]) -> Optional[tuple[int, ...]]:
    """The inputs a rule multiplies together as a square: a `pow` by 2's data input, a product's two
    tensor operands (a square where both are one value); None otherwise."""
    kind, p = kind_of(rule)
    if kind == "pow":
        return (p.get("data", 0),) if p.get("exponent") == 2 else None
    return tuple(p["operands"]) if is_product(rule) and None not in p["operands"] else None


def is_cast_or_identity(rule: Optional[Rule]) -> bool:
    """A float cast or an identity (the casts around a norm's statistics)."""
    kind, p = kind_of(rule)
    return kind == "elementwise" and p.get("op") in ("cast", "identity")


def branch_op(rule: Optional[Rule]) -> Optional[Rule]:
    """The op an `in_branch` rule stands for; None for any other rule."""
    return rule.params["op"] if rule is not None and rule.kind == "in_branch" else None


def spelled_sizes(rule: Optional[Rule]) -> Optional[list]:
    """The output sizes a `reshape`, an expand or a `resample` spells (see the vocabulary); None
    where it spells none, as an `in_branch` rule does."""
    return rule.params.get("sizes") if rule is not None else None


# Ops that do not act along the feature axis (or only scale rows by a per-row factor): a shift
# per block of the feature axis passes through them as it is, the axis' size unchanged.
_BLOCK_AGNOSTIC = frozenset(("elementwise", "broadcast", "scale", "permute", "along", "pad", "take",
                             "gather_rows", "zero_rows", "resample", "tile", "reduce", "clamp"))
# Sources whose `centering` refs hold the output features in order along their axis.
_CENTER_IN_ORDER = frozenset(("linear", "matmul", "embedding", "conv"))


def _carry_block(answer, row_axis=None):
    """A per-block shift carried as it is along the feature axis that `answer` maps; a block at
    one row of another axis only where `row_axis(k, r)` says where that axis goes (None: the op
    could mix or move that axis' rows)."""
    def blocked(k, axis, block):
        got = answer(k, axis)
        if got is not None and block is not None and block.spacing is not None and row_axis is None:
            return None  # a merged feature axis through an op that may not only move its entries
        if got is None or block is None or block.row is None:
            return None if got is None else [(j, a, block) for j, a in got]
        r = None if row_axis is None else row_axis(k, block.row[0])
        return None if r is None else [(j, a, replace(block, row=(r, block.row[1]))) for j, a in got]

    return blocked


# --- what the view knows about a node's inputs -------------------------------------------------

def _shape(view: View, node: Node, i: Optional[int]):
    if i is None:
        return ()  # a Python number
    name = node.inputs[i] if i < len(node.inputs) else ""
    return view.values[name].shape if name else None


def _rank(view: View, node: Node, i: Optional[int]) -> Optional[int]:
    s = _shape(view, node, i)
    return None if s is None else len(s)


def _out_rank(view: View, node: Node) -> Optional[int]:
    s = view.values[node.outputs[0]].shape if node.outputs[0] else None
    return None if s is None else len(s)


def _is_const(view: View, node: Node, i: Optional[int]) -> bool:
    return i is not None and i < len(node.inputs) and bool(node.inputs[i]) and view.values[node.inputs[i]].is_const


def const_ref(view: View, node: Node, i: int, axis: Optional[int]) -> Optional[ConstRef]:
    """The constant behind input `i` of `node`, through layout ops that only it reads
    (Falcon's `x @ self.weight.T`, an exported `addmm` reading `t(weight)`, a float cast)."""
    name = node.inputs[i]
    v = view.values[name]
    if v.is_const:
        return ConstRef(name, axis, node.name, i)
    p = view.nodes.get(v.producer) if v.producer else None
    kind, prm = kind_of(p.rule) if p is not None else (None, {})
    if kind is None or v.is_graph_output or len(v.consumers) != 1 or len(p.outputs) != 1:
        return None
    if kind == "elementwise":  # centering commutes with a cast, a copy, a negation
        return const_ref(view, p, prm.get("data", 0), axis)
    if kind == "permute" and axis is not None and axis < len(prm["perm"]) and prm["perm"][axis] is not None:
        return const_ref(view, p, prm.get("data", 0), prm["perm"][axis])
    return None


# --- transparent ops ---------------------------------------------------------------------------

def _elementwise(view, node, data=0, op="identity"):
    transfer = lambda i, b: [(0, b)] if i == data else None  # noqa: E731
    backward = lambda o, a: [(data, a)] if o == 0 else None  # noqa: E731
    same = lambda k, r: r  # noqa: E731  (every axis stays where it is)
    return dict(transfer=transfer, backward=backward, layout=op in ("identity", "cast", "dropout"),  # copies values
                transfer_block=_carry_block(transfer, same), backward_block=_carry_block(backward, same))


def _broadcast(view, node, data, minus=(), sizes=None, slot=None, fixed=False):
    R, n = _out_rank(view, node), len(node.inputs)
    ranks, const = [_rank(view, node, i) for i in range(n)], [_is_const(view, node, i) for i in range(n)]

    def transfer(i, b):
        return None if R is None or i not in data or ranks[i] is None else [(0, b + R - ranks[i])]

    def backward(o, a):
        if o != 0 or R is None or any(ranks[i] is None for i in data):
            return None
        got = [(i, a - (R - ranks[i])) for i in data]
        if any(b < 0 and not const[i] for i, b in got):
            return None
        # broadcast along the feature axis: a constant's per-row shift, zero once centered
        return [(i, None if b < 0 else b) for i, b in got]

    out = dict(transfer=transfer, backward=backward)
    if len(data) == 1 and not minus:  # expand: copies rows
        out.update(layout=True, width_refs=_width_refs(view, node, sizes, slot, fixed, expand_of=data[0]))
    return out


def _width_refs(view, node, sizes, slot, fixed, expand_of=None):
    """Where the op spells its output's size along an axis (CRMSNorm and slicing narrow the width):
    [] where nothing does (the size follows the input), None where no edit can change it. A size
    read at run time (`SizeOf`) goes to the caller, who knows the stream (compress.follows_stream)."""

    def width_refs(o, axis):
        s = view.values[node.outputs[0]].shape if node.outputs[0] else None
        if sizes is None:
            return [] if not fixed and s is not None else None
        if s is None or len(sizes) != len(s) or not isinstance(s[axis], int):
            return None
        entry = sizes[axis]
        if isinstance(entry, SizeOf):
            return [entry]
        if entry == -1:
            return []  # inferred (reshape) or kept (expand) from the input
        if expand_of is not None and entry == 1:
            xs = _shape(view, node, expand_of)
            k = axis - (len(s) - len(xs)) if xs is not None else -1
            if k >= 0 and xs[k] == s[axis]:
                return []  # broadcast from the input: follows its width
        return [DimRef(node.name, slot, axis)] if entry == s[axis] else None

    return width_refs


def _scale(view, node, operands, divide=False):
    """Mul/Div by a factor constant along the feature axis is transparent; a per-channel
    constant factor is LayerScale, folded into the sources upstream."""
    R = _out_rank(view, node)
    shapes = [_shape(view, node, i) for i in operands]
    carriers = (0,) if divide else (0, 1)

    def aligned_dim(j, a):
        s = shapes[j]
        if s is None or R is None:
            return "unknown"
        k = a - (R - len(s))
        return 1 if k < 0 else s[k]

    def transfer(i, b):
        if R is None:
            return None
        for j in carriers:
            if operands[j] == i and operands[1 - j] != i and shapes[j] is not None:
                a = b + R - len(shapes[j])
                return [(0, a)] if aligned_dim(1 - j, a) == 1 else None
        return None

    def backward(o, a):
        cands = [j for j in carriers if operands[j] is not None and shapes[j] is not None
                 and operands[1 - j] != operands[j] and aligned_dim(1 - j, a) == 1]
        if len(cands) != 1:
            return None
        j = cands[0]
        b = a - (R - len(shapes[j]))
        return [(operands[j], b)] if b >= 0 else None

    def channel_scale(o, a):
        if divide or R is None:
            return None
        for j in (0, 1):  # operand j a constant factor along the feature axis only, 1 - j the stream
            x, s, shape, xs = operands[1 - j], operands[j], shapes[j], shapes[1 - j]
            if x is None or not _is_const(view, node, s) or _is_const(view, node, x) or shape is None or xs is None:
                continue
            k, b = a - (R - len(shape)), a - (R - len(xs))
            if k >= 0 and b >= 0 and all(d == 1 for n, d in enumerate(shape) if n != k):
                return ChannelScale(x, b, ConstRef(node.inputs[s], k, node.name, s))
        return None

    return dict(transfer=transfer, backward=backward, channel_scale=channel_scale)


def _opaque(view, node, **_):
    return {}


def _dequantized(view, node, stored):
    return dict(stored_as=stored)


def _reshape(view, node, data=0, axis_map=None, sizes=None, slot=None, fixed=False):
    axis_map = axis_map or {}

    def transfer(i, b):
        if i != data:
            return None
        axis = reshape_axis(_shape(view, node, data), view.values[node.outputs[0]].shape, b)
        axis = axis_map.get(b) if axis is None else axis
        return None if axis is None else [(0, axis)]

    def backward(o, a):
        if o != 0:
            return None
        axis = reshape_axis(view.values[node.outputs[0]].shape, _shape(view, node, data), a)
        if axis is None:
            axis = next((k for k, v in axis_map.items() if v == a), None)
        return None if axis is None else [(data, axis)]

    def merged(got, size, dst):
        """The blocks `regroup_factor` found: the feature axis whole, groups of `size` in a
        run (a static axis: the runs of a head_dim merge), or groups `spacing` apart."""
        if got is None:
            return None
        k, spacing = got
        if spacing is None or (spacing == (1, ()) and isinstance(dst[k], int)):
            return k, FeatureRuns(size)
        return k, FeatureRuns(size, spacing=spacing)

    def regroup(src, dst, axis, block):
        """Only whole runs regroup: a reshape of partly edited rows is not followed, except runs
        at one index of the axis just before (Persimmon's (heads, 3, head_dim): q at index 0)
        merged into, or split back out of, runs every few entries of one wider axis."""
        if block is not None and block.row is not None:
            if block.lo or block.hi is not None or block.step != block.size or block.spacing is not None or src is None \
                    or axis >= len(src) or src[axis] != block.size:
                return None
            got = merge_row_runs(src, dst, axis, *block.row)
            return None if got is None else (got[0], FeatureRuns(block.size, got[1], None, got[2]))
        if block is not None and block.spacing is not None:
            if block.lo or block.hi is not None or block.stride is not None or block.row is not None:
                return None
            return merged(regroup_factor(src, dst, axis, block.size, block.spacing), block.size, dst)
        if block is not None and block.step != block.size:
            got = split_periodic_runs(src, dst, axis, block.size, block.lo, block.step)
            return None if got is None else (got[0], FeatureRuns(block.size, row=got[1:]))
        if block is not None and (block.lo or block.hi is not None):
            return None
        got = reshape_block_axis(src, dst, axis, None if block is None else block.size)
        if got is None and block is None and src is not None and 0 <= axis < len(src) and isinstance(src[axis], int):
            return merged(regroup_factor(src, dst, axis, src[axis], 1), src[axis], dst)  # merged with the axes before
        return None if got is None else (got[0], FeatureRuns(got[1]))

    def transfer_block(i, b, block):
        got = None if i != data else regroup(_shape(view, node, data), view.values[node.outputs[0]].shape, b, block)
        return None if got is None else [(0, *got)]

    def backward_block(o, a, block):
        got = None if o != 0 else regroup(view.values[node.outputs[0]].shape, _shape(view, node, data), a, block)
        return None if got is None else [(data, *got)]

    return dict(transfer=transfer, backward=backward, layout=True, regroups=True,
                width_refs=_width_refs(view, node, sizes, slot, fixed),
                transfer_block=transfer_block, backward_block=backward_block)


def _permute(view, node, perm, data=0):
    """A None entry of `perm`: an output axis that holds no input axis whole."""
    perm = list(perm)
    to_out = lambda k, r: perm.index(r) if r in perm else None  # noqa: E731
    to_in = lambda k, r: perm[r] if r < len(perm) else None  # noqa: E731
    transfer = lambda i, b: [(0, to_out(i, b))] if i == data and b in perm else None  # noqa: E731
    backward = lambda o, a: [(data, perm[a])] if o == 0 and to_in(o, a) is not None else None  # noqa: E731
    return dict(transfer=transfer, backward=backward, layout=True, transfer_block=_carry_block(transfer, to_out),
                backward_block=_carry_block(backward, to_in))


def _along(view, node, data, outs=(0,), axes=None, starts=None, partition=False):
    out = dict(same_axes_rules(list(data), list(outs), None if axes is None else set(axes)), layout=True)
    if axes is None or len(axes) != 1 or len(data) != 1 or (starts is None and not partition):
        return out
    (cut,) = axes
    sizes = [view.values[node.outputs[o]].shape if node.outputs[o] else None for o in outs]
    lengths = [None if s is None or cut >= len(s) or not isinstance(s[cut], int) else s[cut] for s in sizes]
    if partition:
        starts = None if None in lengths else [sum(lengths[:k]) for k in range(len(lengths))]
    elif starts is not None:  # as spelled: negative from the end, clamped to the axis
        xs = _shape(view, node, data[0])
        size = xs[cut] if xs is not None and cut < len(xs) else None
        if not isinstance(size, int) or not all(isinstance(a, int) for a in starts):
            return out
        starts = [min(max(a + size if a < 0 else a, 0), size) for a in starts]
    if starts is None or len(starts) != len(outs) or None in lengths:
        return out
    carry = _carry_block(out.get("transfer", no_answer)), _carry_block(out.get("backward", no_answer))

    def whole(k, axis, block):  # None: the whole axis of the tensor, one run
        s = (sizes[k] if k is not None else _shape(view, node, data[0]))
        return block if block is not None else (FeatureRuns(s[axis]) if s is not None and isinstance(s[axis], int) else None)

    def transfer_block(i, b, block):
        if b != cut:
            return carry[0](i, b, block)
        block = whole(None, b, block)
        if i != data[0] or block is None or block.step != block.size or block.row is not None or block.spacing:
            return None  # runs every few entries, cut into slices: not followed
        if any(start % block.size or n % block.size for start, n in zip(starts, lengths)):
            return None  # a slice across a run boundary: its runs are not the source's
        parts = [(o, block.shifted(start, n)) for o, start, n in zip(outs, starts, lengths)]
        return [(o, b, part) for o, part in parts if part is not None]

    def backward_block(o, a, block):
        if a != cut:
            return carry[1](o, a, block)
        if o not in outs:
            return None
        k = outs.index(o)
        block = whole(k, a, block)
        if block is None or starts[k] % block.size or block.step != block.size or block.row is not None or block.spacing:
            return None
        hi = lengths[k] if block.hi is None else block.hi
        return [(data[0], a, FeatureRuns(block.size, starts[k] + block.lo, starts[k] + hi))]

    return dict(out, transfer_block=transfer_block, backward_block=backward_block)


def _pad(view, node, data=0, axes=None, zero=True):
    # Zero rows are zero-mean and copied rows carry their source rows' shift; rows of any other
    # constant are neither.
    return _along(view, node, [data], [0], axes) if zero else dict(layout=True)


def _take(view, node, data, start, stop, q, outs=(0,), index=None):
    def transfer(i, b):
        if i != data or start <= b < stop:
            return None
        return [(o, b if b < start else b - (stop - start) + q) for o in outs]

    def plain_backward(o, a):
        if o not in outs or start <= a < start + q:
            return None
        return [(data, a if a < start else a + (stop - start) - q)]

    def row_of(o) -> Optional[tuple[int, int]]:
        """(axis, index) that output `o` selects, where it is one known index."""
        xs = _shape(view, node, data)
        if index is None or q != 0 or stop != start + 1 or o not in outs or xs is None or start >= len(xs):
            return None
        n, k = xs[start], index[outs.index(o)]
        if not isinstance(n, int) or not isinstance(k, int):
            return None
        k = k + n if k < 0 else k
        return (start, k) if 0 <= k < n else None

    def backward_block(o, a, block):
        """A select's input holds the stream at the selected index only: the other rows (v's, of
        Persimmon's (heads, 3, head_dim) view) are not the stream, whatever reads them."""
        got, row = plain_backward(o, a), row_of(o)
        if got is None or (block is not None and (block.row is not None or (row is not None and block.spacing))):
            return None
        if row is None:
            return [(j, b, block) for j, b in got]
        (j, b), = got
        xs = _shape(view, node, data)
        size = block.size if block is not None else xs[b]
        if not isinstance(size, int):
            return None
        return [(j, b, replace(block, row=row) if block is not None else FeatureRuns(size, row=row))]

    def transfer_block(i, b, block):
        got = transfer(i, b)
        if got is None or block is None or block.row is None:
            return None if got is None else [(o, a, block) for o, a in got]
        if block.row[0] != start or index is None:
            return None  # another axis' rows moved or mixed: not followed
        return [(o, a, replace(block, row=None)) for o, a in got if row_of(o) == block.row]

    def backward(o, a):
        """As `plain_backward`, except where only the selected rows of a reshape's regrouped
        axis are the stream: there the input is followed per block (`backward_block`)."""
        got, row = plain_backward(o, a), row_of(o)
        if got is None or row is None:
            return got
        x = view.values[node.inputs[data]]
        p = view.nodes.get(x.producer) if x.producer else None
        if p is None or kind_of(p.rule)[0] != "reshape" or p.backward(0, got[0][1]) is not None:
            return got
        rows = backward_block(o, a, None)
        return got if rows is None or p.backward_block(0, got[0][1], rows[0][2]) is None else None

    return dict(transfer=transfer, backward=backward, layout=True,
                transfer_block=transfer_block, backward_block=backward_block)


def uniform_along(view: View, value: str, axis: int) -> bool:
    """Is `value` constant along `axis` (an index `idx.unsqueeze(-1).expand(..., d)`)?"""
    v = view.values.get(value)
    if v is None or v.shape is None or not 0 <= axis < len(v.shape):
        return False
    if v.shape[axis] == 1:
        return True
    p = view.nodes.get(v.producer) if v.producer else None
    kind, prm = kind_of(p.rule) if p is not None else (None, {})
    if kind == "elementwise":
        return uniform_along(view, p.inputs[prm.get("data", 0)], axis)
    expand = kind == "broadcast" and not prm.get("minus") and len(prm["data"]) == 1
    if expand or (kind == "tile" and prm.get("axes") is not None):  # `idx.unsqueeze(-1).repeat(1, 1, d)`
        d = prm["data"][0] if expand else prm.get("data", 0)
        s = _shape(view, p, d)
        k = None if s is None else axis - (len(v.shape) - len(s))
        tiled = not expand and axis in prm["axes"]  # copies of the whole input along it
        return s is not None and (k < 0 or s[k] == 1 or (not tiled and uniform_along(view, p.inputs[d], k)))
    return False


def _gather_rows(view, node, data=0, index=1, axis=0):
    """Whole rows move when the index is the same for every feature (random token masking:
    `gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, d))`)."""

    def keeps_rows(f):
        xs, ix = _shape(view, node, data), _shape(view, node, index)
        return (f != axis and xs is not None and ix is not None and len(xs) == len(ix) and f < len(xs)
                and isinstance(xs[f], int) and xs[f] == ix[f] and uniform_along(view, node.inputs[index], f))

    return dict(transfer=lambda i, b: [(0, b)] if i == data and keeps_rows(b) else None,
                backward=lambda o, a: [(data, a)] if o == 0 and keeps_rows(a) else None)


def _tile(view, node, data=0, axes=None):
    """ViT-MAE repeats its mask token over the batch and the masked positions: an axis not tiled
    keeps its place (counted from the end), and its rows are the input's, shift included."""
    xs, R = _shape(view, node, data), _out_rank(view, node)
    if xs is None or R is None or axes is None or R < len(xs):
        return {}
    d = R - len(xs)

    def transfer(i, b):
        return [(0, b + d)] if i == data and b + d not in axes else None

    def backward(o, a):
        return [(data, a - d)] if o == 0 and a >= d and a not in axes else None

    return dict(transfer=transfer, backward=backward)


def _resample(view, node, data=0, axes=None, sizes=None, slot=None, fixed=False):
    """YOLOS resizes its patch position table to the image: a per-row map of the shift off `axes`
    (THEORY §1) that computes new values, so no layout op."""
    return dict(same_axes_rules([data], [0], None if axes is None else set(axes)),
                width_refs=_width_refs(view, node, sizes, slot, fixed))


def _zero_rows(view, node, data=0, mask=1):
    """ESM's token dropout: where the mask is one value along a row's features, the row is x's or
    zeros, a per-row map of the shift (THEORY §1). Another fill value writes rows of its mean: opaque."""
    R = _out_rank(view, node)

    def along_rows(a):  # the mask is one value along output axis a
        ms = _shape(view, node, mask)
        if ms is None or R is None:
            return False
        k = a - (R - len(ms))
        return k < 0 or ms[k] == 1 or uniform_along(view, node.inputs[mask], k)

    def offset():
        xs = _shape(view, node, data)
        return None if xs is None or R is None else R - len(xs)

    def transfer(i, b):
        d = offset()
        return [(0, b + d)] if i == data and d is not None and along_rows(b + d) else None

    def backward(o, a):
        d = offset()
        return [(data, a - d)] if o == 0 and d is not None and a >= d and along_rows(a) else None

    return dict(transfer=transfer, backward=backward)


def _reduce(view, node, data=0, axes=None, keepdims=True, op="mean"):
    """Pooling over token axes: the shift survives, the feature axis moves up."""
    rank = _rank(view, node, data)
    if rank is None or axes is None:
        return {}
    axes = set(axes)

    def transfer(i, b):
        if i != data or b in axes:
            return None
        return [(0, b if keepdims else b - sum(x < b for x in axes))]

    def backward(o, a):
        kept = [d for d in range(rank) if keepdims or d not in axes]
        if o != 0 or a >= len(kept) or kept[a] in axes:
            return None
        return [(data, kept[a])]

    return dict(transfer=transfer, backward=backward)


def _invariant_along(view, node, data=0, axis=None):
    return dict(invariant=lambda i, b: i == data and b == axis)


def _metadata(view, node, sized=False, reads=None, sizes_of=()):
    """`width_refs(0, axis)`: [] where the result does not depend on the size along `axis`;
    [SizeOf(input, axis)] where that size is used only as ops' output sizes, each such op judged
    by its own sizes (compress.sized_off_stream)."""
    def width_refs(o, axis):
        if not sized or (reads is not None and axis not in reads and axis not in sizes_of):
            return []
        return [SizeOf(node.inputs[0], axis)] if reads is not None and axis not in reads else None

    return dict(invariant=lambda i, b: True, shape_only=True, width_refs=width_refs)


def _clamp(view, node, data=0, lo=None, hi=None, dtype=None):
    """Transparent only as an overflow guard (passes/guards.py says why that is sound); it stays
    in the folded graph, guarding the centered stream."""
    if dtype is None or not is_overflow_guard(lo, hi, dtype):
        return {}
    return _elementwise(view, node, data, "clamp")


def _nonfinite_test(view, node, data=0):
    return dict(invariant=lambda i, b: i == data)


# --- sources ----------------------------------------------------------------------------------

def _refs(view, node, wanted) -> Optional[list[ConstRef]]:
    refs = [const_ref(view, node, i, axis) for i, axis in wanted]
    return None if any(r is None for r in refs) else refs


def _row_bias(view, node, i) -> Optional[ConstRef]:
    """Input `i` as a bias added to every row: a constant varying along its last axis only."""
    s = _shape(view, node, i)
    if s is None or any(d != 1 for d in s[:-1]):
        return None
    return const_ref(view, node, i, len(s) - 1 if s else None)


def _linear(view, node, weight, w_axis, bias=None, out_axis=-1, data=None, in_axis=-1, alpha=1.0, beta=1.0,
            source=True):
    # source=False: the op reads its input linearly but computes more from the product (a fused
    # attention op): its output is no linear image that editing W could center
    def centering(o, a):
        R, rb = _out_rank(view, node), _rank(view, node, bias)
        if not source or R is None or rb is None or a != (out_axis if out_axis >= 0 else R + out_axis):
            return None
        # a scalar bias is a per-row shift: centered to zero
        return _refs(view, node, [(weight, w_axis)] + ([(bias, rb - 1 if rb else None)] if bias is not None else []))

    def linear(i, a):
        """x·W (+ b) over x's last axis, W 2-D: what deferral and CRMS fold into (passes/view.py)."""
        r, R = _rank(view, node, data), _out_rank(view, node)
        if data is None or i != data or r is None or R is None or a != r - 1 or alpha != 1 or beta != 1:
            return None
        if (in_axis if in_axis >= 0 else r + in_axis) != r - 1 or (out_axis if out_axis >= 0 else R + out_axis) != R - 1:
            return None
        if _rank(view, node, weight) != 2 or node.inputs[weight] == node.inputs[data]:
            return None
        w = const_ref(view, node, weight, 1 - w_axis)
        b = None if bias is None else _row_bias(view, node, bias)
        return None if w is None or (bias is not None and b is None) else LinearRead(w, b)

    return dict(centering=centering, linear=linear)


def writes_product(node: Node) -> bool:
    """A linear reader whose output is its product `x·W (+ b)` (deferral scales that product;
    CRMS narrows it), not an op that only starts with one (a fused attention)."""
    return kind_of(node.rule)[1].get("source", True)


def _bias_after(view, node, w: int) -> Optional[ConstRef]:
    """The constant bias of the lone Add that alone reads the product (ONNX's MatMul + Add)."""
    out = view.values[node.outputs[0]]
    if out.is_graph_output or len(out.consumers) != 1:
        return None
    add = view.nodes[out.consumers[0][0]]
    if len(add.inputs) != 2 or not is_sum_of_two(add.rule):
        return None
    slot = 1 - out.consumers[0][1]
    b, ws = _shape(view, add, slot), _shape(view, node, w)
    if b is None or ws is None or not b or b[-1] != ws[-1]:
        return None
    return _row_bias(view, add, slot)


def _matmul(view, node, a=0, b=1, bias_after=False):
    def centering(o, ax):
        R = _out_rank(view, node)
        if R is None or R < 2:
            return None
        # x @ W: W's last axis holds the output features; W @ x: its rows
        for w, out_axis, w_axis in ((b, R - 1, -1), (a, R - 2, -2)):
            rank = _rank(view, node, w)
            ref = const_ref(view, node, w, rank + w_axis) if ax == out_axis and rank is not None and rank >= 2 else None
            if ref is not None:
                return [ref]
        return None

    def linear(i, ax):
        """x @ W with a constant [in, out] W (behind a transpose: a tied head)."""
        r0 = _rank(view, node, a)
        if i != a or r0 is None or r0 < 2 or ax != r0 - 1 or _rank(view, node, b) != 2 or node.inputs[a] == node.inputs[b]:
            return None
        w = const_ref(view, node, b, 0)
        return None if w is None else LinearRead(w, _bias_after(view, node, b) if bias_after else None)

    return dict(centering=centering, linear=linear)


def einsum_weight_axes(equation: str, weight: int) -> dict[int, int]:
    """{output axis: axis of operand `weight`} for the output letters that only that operand
    carries, once (explicit two-operand equations without an ellipsis; else {}). Centering the
    operand along such an axis centers the output along it: out[.., e, ..] = Σ x[..] W[.., e, ..]."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return {}
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return {}
    w, x = ops[weight], ops[1 - weight]
    return {k: w.index(c) for k, c in enumerate(out) if w.count(c) == 1 and c not in x and out.count(c) == 1}


def _einsum(view, node, equation, operands=(0, 1)):
    def centering(o, a):
        for k in (0, 1):  # the constant operand (through layout ops only it reads: const_ref)
            axes = einsum_weight_axes(equation, k)
            ref = const_ref(view, node, operands[k], axes[a]) if o == 0 and a in axes else None
            if ref is not None:
                return [ref]
        return None

    return dict(centering=centering)


def _embedding(view, node, table, q):
    tables = table if isinstance(table, list) else [table]

    def centering(o, a):  # center each row of the table(s)
        return _refs(view, node, [(t, a - q + 1) for t in tables]) if a >= q else None

    return dict(centering=centering)


def _conv(view, node, weight, w_axis=0, bias=None, groups=1):
    def centering(o, a):
        if a != 1 or groups != 1:
            return None
        return _refs(view, node, [(weight, w_axis)] + ([(bias, 0)] if bias is not None else []))

    return dict(centering=centering)


# --- norms ------------------------------------------------------------------------------------

def norm_axis(axes, rank: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    """The one normalized axis, or why there is not one."""
    if rank is None:
        return None, "rank of its input is unknown"
    norm = sorted({a + rank if a < 0 else a for a in axes})
    if len(norm) != 1:
        return None, f"normalizes over axes {norm} of a rank-{rank} tensor, not one feature axis"
    return norm[0], None


def _layer_norm(view, node, data=0, axes=(-1,), gamma=None, beta=None, eps=1e-5, stats_used=False, rejection=None,
                rms=False):
    if rejection is not None:
        return dict(norm_rejection=rejection)
    axis, why = norm_axis(axes, _rank(view, node, data))
    if why is None and stats_used:
        why = "its mean/variance outputs are used"
    if why is None and not isinstance(eps, (int, float)):
        why = "its eps is not a constant"
    if why is not None:
        return dict(norm_rejection=why)
    name = lambda i: node.inputs[i] if i is not None and node.inputs[i] else None  # noqa: E731
    return dict(norm=NormSpec(data, axis, name(gamma), name(beta), float(eps), rms=bool(rms)))


# --- inlined If branches -------------------------------------------------------------------------

# What the analysis may ask an op of an If branch: the stream is followed through it and its
# sources are centered, but the branch emitter (onnx_rewrite/subgraphs.py) defers no norm, edits
# no width for CRMSNorm and centers no blocks, so a branch op offers none of those.
_BRANCH_ANSWERS = ("transfer", "backward", "centering", "channel_scale", "invariant", "norm",
                   "norm_rejection", "shape_only", "stored_as")


def _in_branch(view, node, op: Rule):
    got = RULES[op.kind](view, node, **op.params)
    return {k: v for k, v in got.items() if k in _BRANCH_ANSWERS}


RULES: dict[str, Callable[..., dict]] = {
    "elementwise": _elementwise,
    "broadcast": _broadcast,
    "scale": _scale,
    **dict.fromkeys(("pow", "sqrt", "rsqrt", "reciprocal"), _opaque),
    "reshape": _reshape,
    "permute": _permute,
    "along": _along,
    "pad": _pad,
    "take": _take,
    "gather_rows": _gather_rows,
    "zero_rows": _zero_rows,
    "resample": _resample,
    "tile": _tile,
    "reduce": _reduce,
    "invariant_along": _invariant_along,
    "metadata": _metadata,
    "clamp": _clamp,
    "nonfinite_test": _nonfinite_test,
    "linear": _linear,
    "matmul": _matmul,
    "einsum": _einsum,
    "embedding": _embedding,
    "conv": _conv,
    "layer_norm": _layer_norm,
    "dequantized": _dequantized,
    "in_branch": _in_branch,
}
