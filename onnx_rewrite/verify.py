"""Numerical verification (DESIGN §4): run the original, the folded model and a float64 copy of
the original on the same inputs (the user's, or made up by inputs.py until the original runs), and
let passes/gate.py judge the fold. A model onnxruntime refuses to load runs in onnx's reference
evaluator throughout; where that cannot run it in its own dtype either (onnxconverter-common's fp16
files), float64 copies of both models are compared, and onnxruntime must refuse the folded model for
the input's reason, not a new one. An If that a bool graph input decides (Optimum's merged decoders'
`use_cache_branch`) is verified on each of its branches, one run per value of that input.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
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
from .sessions import ModelLike, Runner, Source, first_line, in_background, refusal_kind, session, skeleton_of

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
    runner = _runner(original)
    feeds, outputs = _run_on(runner, original.skeleton, inputs=inputs, dims=dims, seed=seed)
    return runner, feeds, outputs


def _runner(original: Source) -> Runner:
    try:
        return Runner(original, allow_reference=True)
    except Exception as e:  # neither onnxruntime nor the reference evaluator can load it
        raise LnfoldError(f"cannot verify: onnxruntime cannot load the input model ({first_line(e)}); "
                          "use --no-verify (API: verify=False) to skip it") from None


def _run_on(runner: Runner, skel: onnx.ModelProto, *, inputs: Optional[dict], dims: Optional[dict], seed: int,
            fixed: Optional[dict] = None) -> tuple[dict, list[np.ndarray]]:
    """(feeds, outputs) of `original_run`; `fixed`: {input: value} set in every made-up attempt
    (a branch's condition: `branch_inputs`)."""
    if inputs is not None:
        feeds = synth.check_feeds(inputs, skel)
        try:
            return feeds, runner.run(feeds)
        except Exception as e:
            error = LnfoldError if runner.sess is not None else lambda m: _RefusedAndUnrunnable(m, runner)
            raise error(f"cannot verify: {_where(skel, e)} on the given inputs: {first_line(e)}") from None
    if dims:
        synth.check_dims(dims, skel)
    first: Optional[Exception] = None
    known = synth.facts(skel)
    attempts = synth.candidates(skel, dims, seed, known)
    if fixed:  # then with an empty past: Optimum's merged GPT-2 and Llama name their mask's length as the
        # sequence's, so their cached branch runs only without a past (its nodes all run all the same)
        attempts = itertools.chain(attempts, synth.candidates(skel, dims, seed, known, empty_past=True))
    for _, feeds in attempts:
        feeds.update({name: np.full(np.shape(feeds[name]), value) for name, value in (fixed or {}).items()})
        try:
            return feeds, runner.run(feeds)
        except Exception as e:
            first = first or e
    if runner.sess is None:
        raise _RefusedAndUnrunnable(f"cannot verify: onnxruntime refuses to load the input model "
                                    f"({runner.load_error}), and onnx's reference evaluator cannot run it either "
                                    f"({_where(skel, first)}: {first_line(first)}); use --no-verify (API: "
                                    "verify=False) to skip it", runner) from None
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


# --- every branch of an If that a graph input decides ------------------------------------------------
# Made-up inputs take one branch (a random bool), so a fold wrong in the other would pass. Not
# covered: an If whose condition is computed from other values (a sequence length), an If nested in
# a branch, and the float64-copies path (_check_float64_copies: one run).

_CONDITION_PASSTHROUGH = {"Identity", "Cast", "Not"}


def branch_inputs(model: onnx.ModelProto) -> dict[str, list[str]]:
    """{bool graph input: the names of the main graph's Ifs whose condition it decides}."""
    bools = {s.name for s in synth.graph_inputs(model)
             if s.elem == onnx.TensorProto.BOOL and s.dims in ([], [1])}
    constants = {t.name for t in model.graph.initializer} | \
        {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.op_type != "If" or not n.input:
            continue
        name, seen = n.input[0], set()
        while name in producer and name not in seen:
            seen.add(name)
            p = producer[name]
            if p.op_type in _CONDITION_PASSTHROUGH and p.input:
                name = p.input[0]
            elif p.op_type == "Equal" and len(p.input) == 2 and sum(i in constants for i in p.input) == 1:
                name = next(i for i in p.input if i not in constants)
            else:
                break
        if name in bools:
            out.setdefault(name, []).append(n.name or n.output[0])
    return out


def _takes(values: dict[str, bool]) -> str:
    """'use_cache_branch False': the branch values one run's inputs take."""
    return ", ".join(f"{name} {value}" for name, value in values.items())


def _ifs(covered: dict[str, list[str]]) -> str:
    names = [f"`{n}`" for ifs in covered.values() for n in ifs]
    return f"If{'s' if len(names) > 1 else ''} {', '.join(names)}"


def _branches_note(covered: dict[str, list[str]], ran: list[dict[str, bool]],
                   missing: list[tuple[dict, LnfoldError]]) -> str:
    """The verdict's note on the branches verified: every one, or those the runs took and why not the rest."""
    if not missing:
        both = "; ".join(f"{name} False and True" for name in covered)
        return f"verified on both branches of {_ifs(covered)} ({both})"
    not_run = "; ".join(f"made-up inputs with {_takes(v)} do not run it ({_made_up_failure(str(e))})"
                        for v, e in missing)
    return (f"verified on some branches only of {_ifs(covered)} ({'; '.join(map(_takes, ran))}): {not_run}; "
            "give inputs for the others with --inputs FILE.npz (API: inputs=)")


def _taken(covered: dict[str, list[str]], feeds: dict) -> dict[str, bool]:
    """{input deciding an If: the value `feeds` give it}."""
    return {name: bool(np.asarray(feeds[name]).ravel()[0]) for name in covered if np.size(feeds[name])}


# --- the verdict ---------------------------------------------------------------------------------

@dataclass
class Run:
    """The original's outputs on one set of inputs, and its float64 copy's."""
    feeds: dict
    outputs: list
    exact: Optional[list] = None
    how: str = ""  # how the float64 run was made, or why there is none
    takes: dict = field(default_factory=dict)  # {input deciding an If: its value} where the run covers a branch


@dataclass
class Reference:
    """The original's side of the verdict, which does not depend on the fold: the inputs it
    accepts, its outputs and its float64 copy's, one Run for each branch value covered
    (`branch_inputs`), else one. The ONNX frontend computes it in a thread while the fold is
    applied and written (OnnxFrontend.apply): onnxruntime and numpy release the GIL."""
    original: Source
    inputs: Optional[dict]
    dims: Optional[dict]
    seed: int
    seeds: str  # what random_ops pinned, for the criterion
    runner: Optional[Runner] = None
    runs: list[Run] = field(default_factory=list)
    branches: str = ""  # the verdict's note on the If branches the runs cover ("" where no input decides an If)
    refused: Optional[_RefusedAndUnrunnable] = None  # neither runtime runs it in its own dtype

    # the first run's (check.py measures and searches on one set of inputs)
    @property
    def feeds(self) -> Optional[dict]:
        return self.runs[0].feeds if self.runs else None

    @property
    def outputs(self) -> Optional[list]:
        return self.runs[0].outputs if self.runs else None

    @property
    def exact(self) -> Optional[list]:
        return self.runs[0].exact if self.runs else None


def reference(original: Union[ModelLike, Source], *, inputs: Optional[dict] = None, dims: Optional[dict] = None,
              seed: int = 0, other_branches: bool = False) -> Reference:
    """Run the original (and its float64 copy) for `check_against`. Raises LnfoldError when it cannot
    be run at all (nothing to compare with). `other_branches`: with `inputs`, also one run on made-up
    inputs for each branch value they do not take (quantize's rows take one branch)."""
    original = _pinned(original)
    ref = Reference(original, inputs, dims, seed, random_ops.describe(original.skeleton))
    # the float64 copy and its session need no inputs: made while the original runs (both release
    # the GIL; a ViT-B's copy and session take a second and a half)
    copy = in_background("float64", prepare, original)
    skel, covered = original.skeleton, branch_inputs(original.skeleton)
    try:
        ref.runner = _runner(original)
        if inputs is not None or not covered:
            ref.runs = [Run(*_run_on(ref.runner, skel, inputs=inputs, dims=dims, seed=seed))]
            if inputs is not None and covered and other_branches:
                _run_other_branches(ref, covered)
            elif inputs is not None and covered:
                taken = _takes(_taken(covered, ref.feeds))
                ref.branches = f"the given inputs take one branch only of {_ifs(covered)} ({taken})"
        else:  # one run per branch value, one after the other in the same session
            missing = _made_up_branch_runs(ref, covered)
            if not ref.runs:
                raise missing[0][1]
            ref.branches = _branches_note(covered, [r.takes for r in ref.runs], missing)
    except _RefusedAndUnrunnable as e:
        ref.refused = e
        return ref
    ref.runner.release()  # (its copy of the weights: not alive beside the float64 copy's, nor the folded model's)
    prepared = copy.result()
    for run in ref.runs:
        run.exact, run.how = exact_run(original, run.feeds, prepared=prepared)
    return ref


def _run_other_branches(ref: Reference, covered: dict[str, list[str]]) -> None:
    """After the run on the given inputs (`ref.runs[0]`): one run on made-up inputs for each branch
    value those do not take, in the same session, and the note says which inputs took which."""
    given = ref.runs[0]
    given.takes = _taken(covered, given.feeds)
    missing = _made_up_branch_runs(ref, covered, skip=given.takes)
    made_up = "; ".join(_takes(r.takes) for r in ref.runs[1:])
    which = f"the given inputs take {_takes(given.takes)}" + (f", made-up inputs {made_up}" if made_up else "")
    note = _branches_note(covered, [r.takes for r in ref.runs], missing)
    ref.branches = f"{which}; {note}" if missing else f"{note}: {which}"  # (the note ends on its advice)


def _made_up_branch_runs(ref: Reference, covered: dict[str, list[str]],
                         skip: Optional[dict] = None) -> list[tuple[dict, LnfoldError]]:
    """A run on made-up inputs for each branch value but `skip`, appended to `ref.runs`, one after
    the other in its one session; returns the values no made-up input runs, with why (said in the
    note where another branch runs)."""
    missing = []
    for assignment in itertools.product((False, True), repeat=len(covered)):
        values = dict(zip(covered, assignment))
        if values == skip:
            continue
        try:
            ref.runs.append(Run(*_run_on(ref.runner, ref.original.skeleton, inputs=None, dims=ref.dims, seed=ref.seed,
                                         fixed=values), takes=values))
        except LnfoldError as e:
            missing.append((values, e))
    return missing


def _made_up_failure(message: str) -> str:
    """The op that failed, from original_run's message on made-up inputs."""
    return message.split("made-up inputs: ", 1)[-1].split(f"; {_HINT}", 1)[0]


def check(original: ModelLike, folded: ModelLike, *, inputs: Optional[dict] = None,
          dims: Optional[dict] = None, seed: int = 0, other_branches: bool = False) -> gate.Verdict:
    """The gate's verdict on `folded` (passes/gate.py). Raises LnfoldError when the original cannot
    be run (nothing to compare with) and VerificationError when only the folded model fails.
    `other_branches`: `reference`'s."""
    return check_against(reference(original, inputs=inputs, dims=dims, seed=seed, other_branches=other_branches),
                         folded)


def check_against(ref: Reference, folded: Union[ModelLike, Source]) -> gate.Verdict:
    """`check` with the original's side already run: the folded model runs on each Run's inputs in
    turn (its outputs dropped once judged), and the verdict is the first that fails, else the worst."""
    original, folded = ref.original, _pinned(folded)
    if ref.refused is not None:
        return _check_float64_copies(ref, folded).noted(ref.seeds)
    runner = ref.runner
    # the folded norms' inputs are read only by the gate's fallback without float64
    no_exact = any(run.exact is None for run in ref.runs)
    norm_names = _new_rms_inputs(original.skeleton, folded.skeleton) if no_exact else []
    runtime = 'onnxruntime' if runner.sess is not None else 'the reference evaluator'
    try:
        fr = Runner(folded, allow_reference=runner.sess is None, outputs=[name for name, _ in norm_names])
    except Exception as e:
        raise VerificationError(f"verification failed: {runtime} cannot run the folded model ({first_line(e)})") from None
    judged = []
    for run in ref.runs:
        on = f" on inputs with {_takes(run.takes)}" if run.takes else ""
        try:
            rb_all = fr.run(run.feeds)
        except Exception as e:
            raise VerificationError(f"verification failed: {runtime} cannot run the folded model{on} "
                                    f"({first_line(e)})") from None
        verdict, mask_note = _judge_run(ref, run, rb_all, norm_names)
        del rb_all  # (one run's outputs at a time)
        if not verdict.ok:
            judged = [(replace(verdict, failure=f"{verdict.failure}{on}"), mask_note)]
            break
        judged.append((verdict, mask_note))
    # (a failed run ends the loop alone: the worst of the rest is by error)
    verdict, mask_note = max(judged, key=lambda vm: vm[0].diff if vm[0].folded_err is None else vm[0].folded_err)
    if runner.sess is None:
        erfc = "; tf2onnx writes Erfc, which is not an ONNX op: computed as math.erfc" \
            if any(n.op_type == "Erfc" and n.domain in ("", "ai.onnx") for n in original.skeleton.graph.node) else ""
        verdict = verdict.noted(f"onnxruntime refuses to load the model: {runner.load_error}; run with onnx's "
                                f"reference evaluator{erfc}")
    return verdict.noted(mask_note, ref.seeds, ref.branches)


def _judge_run(ref: Reference, run: Run, rb_all: list, norm_names: list[tuple[str, int]]) -> tuple[gate.Verdict, str]:
    """The gate's verdict on one Run (the folded model's outputs `rb_all`, the folded norms' inputs
    after them), and its note on padded positions."""
    original, runner, ra, exact = ref.original, ref.runner, run.outputs, run.exact
    rb, extra = rb_all[:len(ra)], rb_all[len(ra):]
    if len(rb_all) != len(ra) + len(norm_names):
        raise VerificationError(f"verification failed: the folded model has {len(rb_all) - len(norm_names)} outputs, "
                                f"the original {len(ra)}")
    compute = _compute_dtype(original.skeleton)
    mask = masks.padding_mask(original.skeleton, run.feeds)  # padded positions are not judged (masks.py)
    outs = [gate.Output(name, _narrower(a.dtype.name, compute),
                        *masks.read_positions(mask, a, b, None if exact is None else exact[k]))
            for k, (name, a, b) in enumerate(zip(runner.names, ra, rb))]
    restricted = [o.name for o, a in zip(outs, ra) if np.shape(o.original) != np.shape(a)]
    norm_inputs = {name: np.moveaxis(np.asarray(val), axis, -1) for (name, axis), val in zip(norm_names, extra)}
    verdict = gate.judge(outs, norm_inputs, norm_dtype=_narrowest(o.dtype for o in outs),
                         original_is_faithful=runner.sess is not None, no_float64=run.how if exact is None else "")
    return verdict, masks.describe(mask, restricted)


def _pinned(model: Union[ModelLike, Source]) -> Source:
    """The model as verification runs it: with seeds pinned on its random nodes (random_ops.py)."""
    src = Source.of(model)
    return Source(random_ops.pinned(src.proto)) if random_ops.random_nodes(src.skeleton) else src


def _check_float64_copies(ref: Reference, folded: Source) -> gate.Verdict:
    """The verdict on a fold of a model that neither onnxruntime nor onnx's reference evaluator
    runs in its own dtype (onnxconverter-common's fp16 files): float64 copies of both, where the
    fold is exact algebra but for the rounding of the weights it edits (gate.judge_float64_copies).
    The folded model must be refused by onnxruntime for the input's reason, not a new one."""
    original, skel, why = ref.original, ref.original.skeleton, str(ref.refused)
    if float_elems(skel) > exact.EXACT_MAX_ELEMS:
        raise LnfoldError(f"{why}; a float64 copy of it is too big (more than {exact.EXACT_MAX_ELEMS} float weights)")
    load_error, refusal = ref.refused.runner.load_error, ref.refused.runner.refusal
    try:
        session(folded)
        same = "onnxruntime loads the folded model"
    except Exception as e:
        if refusal_kind(e) != refusal:
            raise VerificationError(f"verification failed: onnxruntime refuses to load the folded model for a reason "
                                    f"the input does not have ({first_line(e)}; the input's: {load_error})") from None
        same = "it refuses the folded model for the same reason"
    orig64, fold64 = Float64Run(original), Float64Run(folded)
    tries = [synth.check_feeds(ref.inputs, skel)] if ref.inputs is not None else \
        (feeds for _, feeds in synth.candidates(skel, ref.dims, ref.seed))
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
        if n.op_type != "SkipSimplifiedLayerNormalization":
            out.append((n.input[0], next((a.i for a in n.attribute if a.name == "axis"), -1)))
        elif len(n.output) >= 4 and n.output[3]:  # (else the sum is not exposed: the outputs alone judge it)
            out.append((n.output[3], -1))
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
