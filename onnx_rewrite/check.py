"""`lnfold check ORIGINAL OTHER`: does anyone's transformed ONNX model still compute what the
original does? Not a second verifier: verify.py's gate, metric.py's error per output, and one run
of each model with the float tensors both compute under one name (at most MAX_SHARED) as extra
outputs, to name the first tensor where they part.

A tensor differs where its max relative error is above the gate's allowance (_allowance). An exact
transform may change intermediate values on purpose (a fold centers the stream and moves β into the
next bias; a rotation rotates it) that agree again further down, so the tensor named is the first, in
ORIGINAL's order, that differs and after which no shared tensor computed from it agrees again.
Tensors of different shapes (a sliced or CRMS stream) are skipped.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

import numpy as np
import onnx

from ..passes import LnfoldError, VerificationError, gate, metric
from . import inputs as synth
from . import verify
from .sessions import ModelLike, Runner, Source, first_line, with_outputs

MAX_SHARED = 300  # shared intermediate tensors checked at most (evenly spaced in ORIGINAL's order)


@dataclass
class Divergence:
    """The first shared tensor where the two models part for good."""
    tensor: str
    op: str  # ORIGINAL's node that computes it
    node: str
    max_rel: float
    rel_rms: float
    allowed: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CheckResult:
    """`check_onnx`'s answer. `equivalent`: the gate passes (exit code 0; else 1)."""
    verdict: gate.Verdict
    outputs: list[tuple[str, Optional[metric.OutputError]]]  # None: not a float output
    allowed: float  # the allowance the divergence search used
    shared: int = 0  # float tensors both graphs compute under one name
    checked: int = 0  # of them, compared (same shape, within MAX_SHARED)
    divergence: Optional[Divergence] = None
    divergence_note: str = ""  # why there is no divergence to name
    notes: list[str] = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return self.verdict.ok

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.ok else self.verdict.error().exit_code

    def verdict_line(self) -> str:
        """`lnfold fold`'s verification line, OTHER in the folded model's place."""
        v = self.verdict
        if not v.judged:
            return v.message()
        line = f"max relative output difference {v.diff:.2e}; {v.summary()}"
        return line if v.ok else f"{line}; NOT exact: {v.message()}"

    def divergence_line(self) -> str:
        d = self.divergence
        if d is None:
            return self.divergence_note
        return (f"{d.tensor} ({d.op} `{d.node}` in ORIGINAL): max rel. error {d.max_rel:.3g}, rel. RMS "
                f"{d.rel_rms:.3g}, allowed {d.allowed:.3g}; they do not agree again after it "
                f"({self.checked} of {self.shared} shared tensors compared)")

    def lines(self) -> list[str]:
        return [f"lnfold: verification: {self.verdict_line()}", "error per output (OTHER against ORIGINAL):",
                *(f"  {name}: " + (e.line() if e is not None else "not a float output: not compared")
                  for name, e in self.outputs),
                f"first tensor where they part: {self.divergence_line()}", *self.notes,
                "lnfold: check: " + ("EQUIVALENT (the gate of `lnfold fold` passes)" if self.equivalent
                                     else "NOT equivalent (the gate of `lnfold fold` refuses OTHER)")]

    def to_dict(self) -> dict:
        v = self.verdict
        return {
            "equivalent": self.equivalent, "exit_code": self.exit_code,
            "verdict": {"ok": v.ok, "judged": v.judged, "criterion": v.criterion, "line": self.verdict_line(),
                        "max_rel_diff": _num(v.diff), "other_err_vs_float64": _num(v.folded_err),
                        "original_err_vs_float64": _num(v.original_err), "failure": v.failure},
            "outputs": [{"name": n, **(e.to_dict() if e is not None else {"compared": None})} for n, e in self.outputs],
            "first_divergence": self.divergence.to_dict() if self.divergence is not None else None,
            "divergence_note": self.divergence_note, "shared_tensors": self.shared, "compared_tensors": self.checked,
            "allowed": self.allowed, "notes": self.notes,
        }


def _num(x: Optional[float]):
    """JSON has no NaN or infinity: those as strings."""
    return x if x is None or math.isfinite(x) else str(x)


def _same_names(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    names = [([s.name for s in synth.graph_inputs(m)], [o.name for o in m.graph.output]) for m in (a, b)]
    for what, x, y in zip(("inputs", "outputs"), *names):
        if set(x) != set(y):
            only_a, only_b = [n for n in x if n not in y], [n for n in y if n not in x]
            raise LnfoldError(f"ORIGINAL and OTHER differ in their {what}: only in ORIGINAL: "
                              f"{', '.join(only_a) or '-'}; only in OTHER: {', '.join(only_b) or '-'}")


def _in_order(other: Source, names: list[str]) -> Source:
    """OTHER with its outputs in ORIGINAL's order (the gate compares them by position)."""
    if [o.name for o in other.skeleton.graph.output] == names:
        return other
    m = onnx.ModelProto()
    m.CopyFrom(other.proto)
    by = {o.name: copy.deepcopy(o) for o in m.graph.output}
    del m.graph.output[:]
    m.graph.output.extend(by[n] for n in names)
    return Source(m)


def _allowance(ref: verify.Reference) -> float:
    """The gate's allowance (gate.allowance: from ORIGINAL's own error against float64 where there is
    a float64 run, else the dtype's tolerance), the largest over ORIGINAL's float outputs."""
    compute, fp32 = verify._compute_dtype(ref.original.skeleton), gate.TOLERANCE["float32"]
    exact = ref.exact if ref.runner.sess is not None else None
    bounds = []
    for k, a in enumerate(ref.outputs):
        dtype = verify._narrower(a.dtype.name, compute)
        if a.dtype.kind == "f":
            bounds.append(gate.allowance(metric.compare(exact[k], a).max_rel, dtype, True) if exact is not None
                          else gate.allowance(0.0, dtype, False) or fp32)
    return max((b for b in bounds if math.isfinite(b)), default=fp32)


def _shared_tensors(a: onnx.ModelProto, b: onnx.ModelProto) -> list[str]:
    """Tensors both top-level graphs compute under one name, in ORIGINAL's node order, float where
    shape inference knows the type (unknown types are tried; non-float results are dropped later)."""
    outputs = {o.name for o in a.graph.output}
    made_b = {o for n in b.graph.node for o in n.output if o}
    types = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(a)
        types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    except Exception:  # a model shape inference refuses: every shared tensor is tried
        pass
    return [o for n in a.graph.node for o in n.output
            if o and o in made_b and o not in outputs and types.get(o, onnx.TensorProto.FLOAT) in verify._FLOAT_NAMES]


def _sample(names: list[str], k: int) -> list[str]:
    if len(names) <= k:
        return names
    return [names[round(i * (len(names) - 1) / (k - 1))] for i in range(k)]


def _double_centered(x: np.ndarray) -> np.ndarray:
    """`x` (float64) less each row's mean along the last axis and each feature's mean over the rows."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    x = x - x.mean(axis=1, keepdims=True)
    return x - x.mean(axis=0, keepdims=True)


def _offsets_agree(a: np.ndarray, b: np.ndarray, allowed: float) -> bool:
    """Do `a` and `b` agree up to a constant added along each row (a fold's centering of the
    stream) and a constant per feature (β moved into the next bias)? Only for tensors with more
    than one row and feature, where neither offset is the whole tensor."""
    if a.ndim < 2 or a.shape[-1] < 2 or a.size // a.shape[-1] < 2:
        return False
    ca, cb = _double_centered(a), _double_centered(b)
    if not np.isfinite(ca).all() or not np.abs(ca).max() > 0:
        return False
    return metric.compare(ca, cb).max_rel <= allowed


def _first_divergence(skel: onnx.ModelProto, errors: dict[str, metric.OutputError],
                      allowed: float, offsets: set[str]) -> Optional[str]:
    """The first tensor (ORIGINAL's order) that differs and from which no compared tensor agrees
    again downstream (module docstring). `offsets`: tensors that agree up to constant offsets."""
    agree = {t: e.max_rel <= allowed or t in offsets for t, e in errors.items()}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in skel.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    agrees_later: dict[str, bool] = {}
    for n in reversed(skel.graph.node):  # (topological: consumers come after their producers)
        for t in n.output:
            agrees_later[t] = any(agree.get(o, False) or agrees_later.get(o, False)
                                  for c in consumers.get(t, ()) for o in c.output)
    for n in skel.graph.node:
        for t in n.output:
            if not agree.get(t, True) and not agrees_later.get(t, False):
                return t
    return None


def check_onnx(original: Union[ModelLike, Source], other: Union[ModelLike, Source], *,
               inputs: Union[None, dict, str] = None, dims: Optional[dict] = None) -> CheckResult:
    """Judge OTHER against ORIGINAL (module docstring). `inputs`: a dict of arrays or an .npz path
    (else made-up inputs, sized by `dims`). Raises LnfoldError (exit code 2) for bad input: models
    with different input or output names, inputs the models do not take, a model that cannot run."""
    original, other = verify._pinned(original), verify._pinned(other)
    skel_a, skel_b = original.skeleton, other.skeleton
    _same_names(skel_a, skel_b)
    names = [o.name for o in skel_a.graph.output]
    other = _in_order(other, names)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = synth.load_npz(inputs, skel_a)
    ref = verify.reference(original, inputs=inputs, dims=dims)
    try:
        verdict = verify.check_against(ref, other)
    except VerificationError as e:  # OTHER does not run on inputs ORIGINAL takes
        raise LnfoldError(f"OTHER: {e}".replace("the folded model", "OTHER")) from None
    if ref.refused is not None:  # neither runtime runs ORIGINAL in its own dtype
        return CheckResult(verdict, [(name, None) for name in names], math.nan,
                           divergence_note="not searched: ORIGINAL runs only as a float64 copy",
                           notes=["error per output: not measured (ORIGINAL runs only as a float64 copy)"])
    allowed = _allowance(ref)
    shared = _shared_tensors(skel_a, skel_b)
    picked = _sample(shared, MAX_SHARED)
    sess_ref = ref.runner.sess is None
    # the error per output as the gate measured it: ORIGINAL's run of the gate against a plain run of
    # OTHER (extra outputs can change what onnxruntime fuses, and so the last digits of the outputs)
    plain = Runner(other.proto, allow_reference=sess_ref).run(ref.feeds)
    try:
        ra = Runner(with_outputs(original.proto, picked), allow_reference=sess_ref).run(ref.feeds)
        rb = Runner(with_outputs(other.proto, picked), allow_reference=sess_ref).run(ref.feeds)
        note = ""
    except Exception as e:  # (an extra output a runtime will not give: the outputs alone)
        note = f"not searched: the models do not run with their shared tensors as outputs ({first_line(e)})"
        picked, shared = [], []
        ra, rb = ref.outputs, plain
    errs = metric.compare_outputs(ref.outputs, plain[:len(names)])
    result = CheckResult(verdict, list(zip(names, errs)), allowed)
    result.shared = sum(1 for t, a in zip(picked, ra[len(names):]) if np.asarray(a).dtype.kind == "f") \
        + len(shared) - len(picked)
    compared: dict[str, metric.OutputError] = {}
    offsets: set[str] = set()  # equal up to constant offsets: they agree
    for t, a, b in zip(picked, ra[len(names):], rb[len(names):]):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f" and a.shape == b.shape:
            compared[t] = metric.compare(a, b)
            if compared[t].max_rel > allowed and _offsets_agree(a, b, allowed):
                offsets.add(t)
    for name, a, b in zip(names, ra, rb):  # the outputs end every path: they count as agreeing or not
        if np.asarray(a).dtype.kind == "f":
            compared[name] = metric.compare(a, b)
    result.checked = sum(t not in names for t in compared)
    first = _first_divergence(skel_a, compared, allowed, offsets)
    if note:
        result.divergence_note = note
    elif not shared:
        result.divergence_note = "no shared intermediate names"
    elif first is not None:
        node = next(n for n in skel_a.graph.node if first in n.output)  # (_first_divergence found it there)
        e = compared[first]
        result.divergence = Divergence(first, node.op_type, node.name, e.max_rel, e.rel_rms, allowed)
    else:
        result.divergence_note = (f"none: every shared tensor that differs by more than {allowed:.3g} (beyond a fold's constant "
                                  f"offsets) agrees again downstream "
                                  f"({result.checked} of {result.shared} shared tensors compared)")
    return result
