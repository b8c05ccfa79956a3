"""Numerical verification (DESIGN §4): run the original, the folded model and a float64 copy of
the original on the same inputs (the user's, or made up by inputs.py until the original runs), and
let passes/gate.py judge the fold. sessions.py runs a model, exact.py makes and runs the float64
copy. A model onnxruntime refuses to load runs in onnx's reference evaluator throughout; where that
cannot run it in its own dtype either (onnxconverter-common's fp16 files), float64 copies of both
models are compared (gate.judge_float64_copies), and onnxruntime must refuse the folded model for the
input's reason, not a new one. Cost (issue 24): each model is read once and each session built once;
the folded norms' inputs become outputs (for the gate's fallback) only where no float64 run was possible.
Memory (issue 47): the original's session is released once its outputs are made, onnxruntime reads
every model from a file (sessions.session: no serialized copy kept), and the gate measures the
outputs piece by piece (weights.max_rel_err).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import onnx

from ..passes import LnfoldError, VerificationError
from ..passes import gate
from ..passes.weights import max_rel_err
from . import inputs as synth
from . import random_ops
from . import exact
from . import masks
from .already_rms import RMS_OPS
# (session, exact_run, float64_copy: what the rest of the frontend runs models with)
from .exact import Float64Run, exact_run, float64_copy, float_elems, prepare  # noqa: F401
from .sessions import (ModelLike, Runner, Source, first_line, in_background, refusal_kind, session,  # noqa: F401
                       skeleton_of, with_outputs)

_HINT = "give real inputs with --inputs FILE.npz or sizes with --dim NAME=SIZE (API: inputs=, dims=)"

# --- running the original on inputs it accepts ----------------------------------------------------

class _RefusedAndUnrunnable(LnfoldError):
    """onnxruntime refuses to load the original and onnx's reference evaluator cannot run it in
    its own dtype: check() then compares float64 copies."""

    def __init__(self, message: str, runner: Runner) -> None:
        super().__init__(message)
        self.runner = runner


def original_run(original: ModelLike, *, inputs: Optional[dict] = None, dims: Optional[dict] = None,
                 seed: int = 0) -> tuple[Runner, dict, list[np.ndarray]]:
    """Run the original on the user's inputs, or on made-up ones that it accepts; a LnfoldError
    naming the input(s) and the op that failed when no attempt runs."""
    original = Source.of(original)
    skel = original.skeleton
    try:
        runner = Runner(original, allow_reference=True)
    except Exception as e:  # neither onnxruntime nor the reference evaluator can load it
        raise LnfoldError(f"cannot verify: onnxruntime cannot load the input model ({first_line(e)}); "
                          "use --no-verify (API: verify=False) to skip it") from None
    if inputs is not None:
        feeds = synth.check_feeds(inputs, skel)
        try:
            return runner, feeds, runner.run(feeds)
        except Exception as e:
            error = LnfoldError if runner.sess is not None else lambda m: _RefusedAndUnrunnable(m, runner)
            raise error(f"cannot verify: {_where(skel, e)} on the given inputs: "
                        f"{first_line(e)}") from None
    if dims:
        synth.check_dims(dims, skel)
    first: Optional[Exception] = None
    for _, feeds in synth.candidates(skel, dims, seed):
        try:
            return runner, feeds, runner.run(feeds)
        except Exception as e:
            first = first or e
    assert first is not None
    if runner.sess is None:
        raise _RefusedAndUnrunnable(f"cannot verify: onnxruntime refuses to load the input model ({runner.load_error}), and "
                          f"onnx's reference evaluator cannot run it either ({_where(skel, first)}: "
                          f"{first_line(first)}); use --no-verify (API: verify=False) to skip it",
                                     runner) from None
    raise LnfoldError(f"cannot verify: onnxruntime cannot run the input model on made-up inputs: "
                      f"{_where(skel, first)}: {first_line(first)}; {_HINT}; or skip it with --no-verify "
                      "(API: verify=False)") from None


def _where(model: onnx.ModelProto, e: Exception) -> str:
    """'Gather `/x` (reached from position_ids)': the failing node and the inputs it depends on."""
    m = re.search(r"running (\w+) node\. Name:'([^']*)'", str(e))
    if not m:
        return "the model"
    op, name = m.group(1), m.group(2)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next((n for n in model.graph.node if n.name == name), None)
    stack, seen = list(node.input) if node is not None else [], set()
    while stack:
        t = stack.pop()
        if t not in seen:
            seen.add(t)
            stack.extend(producer[t].input if t in producer else ())
    order = [i.name for i in model.graph.input if i.name in seen]
    reach = f" (reached from input{'s' if len(order) > 1 else ''} {', '.join(order)})" if order else ""
    return f"{op} `{name}`{reach}"


# --- the verdict ---------------------------------------------------------------------------------

@dataclass
class Reference:
    """The original's side of the verdict, which does not depend on the fold: the inputs it
    accepts, its outputs and its float64 copy's. The ONNX frontend computes it in a thread while
    the fold is applied and written (OnnxFrontend.apply): onnxruntime and numpy release the GIL."""
    original: Source
    inputs: Optional[dict]
    dims: Optional[dict]
    seed: int
    seeds: str  # what random_ops pinned, for the criterion
    runner: Optional[Runner] = None
    feeds: Optional[dict] = None
    outputs: Optional[list] = None
    exact: Optional[list] = None
    how: str = ""  # how the float64 run was made, or why there is none
    refused: Optional[_RefusedAndUnrunnable] = None  # neither runtime runs it in its own dtype


def reference(original: Union[ModelLike, Source], *, inputs: Optional[dict] = None, dims: Optional[dict] = None,
              seed: int = 0) -> Reference:
    """Run the original (and its float64 copy) for `check_against`. Raises LnfoldError when it cannot
    be run at all (nothing to compare with)."""
    original = _pinned(original)
    ref = Reference(original, inputs, dims, seed, random_ops.describe(original.skeleton))
    # the float64 copy and its session need no inputs: made while the original runs (both release
    # the GIL; a ViT-B's copy and session take a second and a half)
    copy = in_background("float64", prepare, original)
    try:
        ref.runner, ref.feeds, ref.outputs = original_run(original, inputs=inputs, dims=dims, seed=seed)
    except _RefusedAndUnrunnable as e:
        ref.refused = e
        return ref
    ref.runner.release()  # (its copy of the weights: not alive beside the float64 copy's, nor the folded model's)
    ref.exact, ref.how = exact_run(original, ref.feeds, prepared=copy.result())
    return ref


def check(original: ModelLike, folded: ModelLike, *, inputs: Optional[dict] = None,
          dims: Optional[dict] = None, seed: int = 0) -> gate.Verdict:
    """The gate's verdict on `folded` (passes/gate.py). Raises LnfoldError when the original cannot
    be run (nothing to compare with) and VerificationError when only the folded model fails."""
    return check_against(reference(original, inputs=inputs, dims=dims, seed=seed), folded)


def check_against(ref: Reference, folded: Union[ModelLike, Source]) -> gate.Verdict:
    """`check` with the original's side already run."""
    original, folded = ref.original, _pinned(folded)
    if ref.refused is not None:
        verdict = _check_float64_copies(original, folded, ref.refused, inputs=ref.inputs, dims=ref.dims, seed=ref.seed)
        return verdict.noted(ref.seeds)
    runner, feeds, ra, exact = ref.runner, ref.feeds, ref.outputs, ref.exact
    # the folded norms' inputs are read only by the gate's fallback without float64
    norm_names = _new_rms_inputs(original.skeleton, folded.skeleton) if exact is None else []
    try:
        fr = Runner(folded, allow_reference=runner.sess is None, outputs=[name for name, _ in norm_names])
        rb_all = fr.run(feeds)
    except Exception as e:
        raise VerificationError(f"verification failed: {'onnxruntime' if runner.sess is not None else 'the reference evaluator'} "
                                f"cannot run the folded model ({first_line(e)})") from None
    rb, extra = rb_all[:len(ra)], rb_all[len(ra):]
    if len(rb_all) != len(ra) + len(norm_names):
        raise VerificationError(f"verification failed: the folded model has {len(rb_all) - len(norm_names)} outputs, "
                                f"the original {len(ra)}")
    compute = _compute_dtype(original.skeleton)
    mask = masks.padding_mask(original.skeleton, feeds)  # padded positions are not judged (masks.py)
    outs = [gate.Output(name, _narrower(a.dtype.name, compute),
                        *masks.read_positions(mask, a, b, None if exact is None else exact[k]))
            for k, (name, a, b) in enumerate(zip(runner.names, ra, rb))]
    restricted = [o.name for o, a in zip(outs, ra) if np.shape(o.original) != np.shape(a)]
    norm_inputs = {name: np.moveaxis(np.asarray(val), axis, -1) for (name, axis), val in zip(norm_names, extra)}
    verdict = gate.judge(outs, norm_inputs, norm_dtype=_narrowest(o.dtype for o in outs),
                         original_is_faithful=runner.sess is not None, no_float64=ref.how if exact is None else "")
    if runner.sess is None:
        erfc = "; tf2onnx writes Erfc, which is not an ONNX op: computed as math.erfc" \
            if any(n.op_type == "Erfc" and n.domain in ("", "ai.onnx") for n in original.skeleton.graph.node) else ""
        verdict = verdict.noted(f"onnxruntime refuses to load the model: {runner.load_error}; run with onnx's "
                                f"reference evaluator{erfc}")
    return verdict.noted(masks.describe(mask, restricted), ref.seeds)


def _pinned(model: Union[ModelLike, Source]) -> Source:
    """The model as verification runs it: with seeds pinned on its random nodes (random_ops.py)."""
    src = Source.of(model)
    return Source(random_ops.pinned(src.proto)) if random_ops.random_nodes(src.skeleton) else src


def _check_float64_copies(original: ModelLike, folded: ModelLike, refused: _RefusedAndUnrunnable, *,
                          inputs: Optional[dict], dims: Optional[dict], seed: int) -> gate.Verdict:
    """The verdict on a fold of a model that neither onnxruntime nor onnx's reference evaluator
    runs in its own dtype (onnxconverter-common's fp16 files): float64 copies of both, where the
    fold is exact algebra but for the rounding of the weights it edits (gate.judge_float64_copies).
    The folded model must be refused by onnxruntime for the input's reason, not a new one."""
    skel, why = original.skeleton, str(refused)
    if float_elems(skel) > exact.EXACT_MAX_ELEMS:
        raise LnfoldError(f"{why}; a float64 copy of it is too big (more than {exact.EXACT_MAX_ELEMS} float weights)")
    load_error, refusal = refused.runner.load_error, refused.runner.refusal
    try:
        session(folded)
        same = "onnxruntime loads the folded model"
    except Exception as e:
        if refusal_kind(e) != refusal:
            raise VerificationError(f"verification failed: onnxruntime refuses to load the folded model for a reason "
                                    f"the input does not have ({first_line(e)}; the input's: {load_error})") from None
        same = "it refuses the folded model for the same reason"
    orig64, fold64 = Float64Run(original), Float64Run(folded)
    tries = [synth.check_feeds(inputs, skel)] if inputs is not None else \
        [feeds for _, feeds in synth.candidates(skel, dims, seed)]
    ra, first = None, None
    for feeds in tries:
        try:
            ra, how = orig64.run(feeds)
            break
        except RuntimeError as e:
            first = first or e
    if ra is None:
        raise LnfoldError(f"{why}; nor a float64 copy of it ({first})") from None
    try:
        rb, _ = fold64.run(feeds)
    except RuntimeError as e:
        raise VerificationError(f"verification failed: cannot run a float64 copy of the folded model ({e})") from None
    if len(rb) != len(ra):
        raise VerificationError(f"verification failed: the folded model has {len(rb)} outputs, the original {len(ra)}")
    names = [o.name for o in skel.graph.output]
    storage = _storage_dtype(skel)
    verdict = gate.judge_float64_copies([gate.Output(n, "float64", a, b) for n, a, b in zip(names, ra, rb)],
                                        storage, _rounding_sensitivity(((orig64, original), (fold64, folded)),
                                                                       storage, feeds, ra, rb))
    return verdict.noted(f"onnxruntime refuses to load the input ({load_error}), {same}, and onnx's reference "
                         f"evaluator cannot run it in its own dtype; both run as float64 in {how}")


def _rounding_sensitivity(copies, storage: str, feeds: dict, ra: list, rb: list) -> Optional[float]:
    """How far one rounding to `storage` of its stored weights moves a model's outputs, for the
    folded model (its edited weights are what the fold rounded) and the original (the same weights
    before centering: a fold that missed one cannot widen its own bound), the smaller of the two
    (gate.rounding_bound). `copies`: ((original's Float64Run, original), (folded's, folded)), run
    again with their weights moved; `ra`, `rb`: their outputs as they are. None where one cannot run."""
    elem = {v: k for k, v in _FLOAT_NAMES.items()}[storage]
    worst = []
    for (m, model), as_they_are in zip(copies, (ra, rb)):
        rng = np.random.default_rng(0)
        moved_weights = dict(m.weights)  # (float64_copy: the float weights are inputs of the copy)
        for t in skeleton_of(model).graph.initializer:
            if t.data_type == elem and t.name in moved_weights:  # each one unit roundoff away, in a random direction
                a = moved_weights[t.name]
                moved_weights[t.name] = a * (1 + gate.UNIT_ROUNDOFF[storage] * rng.choice([-1.0, 1.0], size=a.shape))
        try:
            moved, _ = m.run(feeds, moved_weights)
        except RuntimeError:
            return None
        worst.append(max((max_rel_err(a, b) for a, b in zip(as_they_are, moved)), default=0.0))
    return min(worst)


_FLOAT_NAMES = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
                onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}


def _storage_dtype(model: onnx.ModelProto) -> str:
    """The narrowest float type of the model's weights, where the fold stores those it edits."""
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    return _narrowest(_FLOAT_NAMES.get(t.data_type) for t in tensors)


def _compute_dtype(model: onnx.ModelProto) -> Optional[str]:
    """The narrowest float type of the model's weights: an fp16 model with fp32 inputs and
    outputs (onnxruntime's optimizer, converters' keep_io_types) computes, and rounds, in fp16."""
    narrowest = _narrowest(_FLOAT_NAMES.get(t.data_type) for t in model.graph.initializer)
    return narrowest if narrowest in ("float16", "bfloat16") else None


def _narrower(dtype: str, compute: Optional[str]) -> str:
    if compute is None or dtype not in gate.FLOOR:
        return dtype
    return max((dtype, compute), key=lambda d: gate.FLOOR[d])


def _narrowest(dtypes) -> str:
    """The narrowest of the float type names `dtypes` (those gate.FLOOR knows), else float32."""
    return max((d for d in dtypes if d in gate.FLOOR), key=gate.FLOOR.__getitem__, default="float32")


def _new_rms_inputs(original: onnx.ModelProto, folded: onnx.ModelProto) -> list[tuple[str, int]]:
    """(input tensor, axis) of every RMSNorm the fold emitted (not one the original had).
    A Skip variant normalizes input + skip, which its optional 4th output holds."""
    before = {n.name for n in original.graph.node if n.op_type in RMS_OPS}
    out = []
    for n in folded.graph.node:
        if n.op_type not in RMS_OPS or n.name in before:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        if n.op_type == "SkipSimplifiedLayerNormalization":
            if len(n.output) < 4 or not n.output[3]:
                continue  # the sum is not exposed; this norm is judged by the outputs alone
            out.append((n.output[3], -1))
        else:
            out.append((n.input[0], axis))
    return out


def compare(original: ModelLike, folded: ModelLike, *, seed: int = 0, inputs: Optional[dict] = None,
            dims: Optional[dict] = None) -> tuple[float, float]:
    """(worst relative difference between the two models' outputs, the fallback tolerance for
    their dtypes) on the same inputs: a measure for tests and tools, not the gate."""
    runner, feeds, ra = original_run(_pinned(original), inputs=inputs, dims=dims, seed=seed)
    try:
        rb = Runner(_pinned(folded), allow_reference=runner.sess is None).run(feeds)
    except Exception as e:
        raise VerificationError(f"verification failed: cannot run the folded model ({first_line(e)})") from None
    fp32 = gate.TOLERANCE["float32"]  # outputs of other types are held to float32's
    tol = min((gate.TOLERANCE.get(a.dtype.name, fp32) for a in ra), default=fp32)
    if len(ra) != len(rb):
        return float("inf"), tol
    return max((max_rel_err(x, y) for x, y in zip(ra, rb)), default=0.0), tol
