"""The properties lnfold must keep on every generated model: soundness (the folded model computes
what the original does), completeness (it folds exactly the ground truth's norms) and agreement
(the ONNX and torch frontends give the same verdicts, recenters and reasons)."""
from __future__ import annotations

import re
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from lnfold.passes import gate

from .export import export
from .truth import Case

# fp32: the folded model's outputs equal the original's to this relative error (max |a-b| / max |a|),
# a bound of the fuzzer's own, stricter than passes/gate.py's;
FP32_RTOL = 1e-5
# above it, the folded model's error against a float64 reference may be this many times the
# original's own error plus FP32_FLOOR (adversarial means can cost the original's LayerNorm digits).
FP32_FACTOR = 2.0
FP32_FLOOR = 1e-6
# fp16/bf16 are judged against float64 like every fold lnfold verifies: by the gate itself
# (passes/gate.py: per output, FACTOR x the original's own error + FLOOR[dtype]).


@dataclass
class Outcome:
    path: str
    verdicts: Optional[list[str]] = None  # mapped to the case's calls
    failures: list[str] = field(default_factory=list)  # "kind: message"
    skipped: Optional[str] = None
    err: Optional[float] = None
    bound: Optional[float] = None
    seconds: float = 0.0
    report: Any = None  # the frontend's Report


def rel_err(ref, got) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if ref.shape != got.shape:
        return float("inf")
    if ref.size == 0:
        return 0.0
    if not (np.isfinite(ref).all() and np.isfinite(got).all()):
        return 0.0 if np.array_equal(ref, got, equal_nan=True) else float("inf")
    denom = float(np.abs(ref).max())
    d = float(np.abs(ref - got).max())
    return d / denom if denom > 0 else d


def flat(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat(o)]
    return [out]


def _float64_reference(case: Case) -> list[np.ndarray]:
    import copy

    m = copy.deepcopy(case.module).double()
    ins = tuple(a.double() if a.is_floating_point() else a for a in case.inputs)
    with torch.no_grad():
        return [t.numpy() for t in flat(m(*ins))]


def np_inputs(case: Case) -> dict:
    return {n: a.numpy() for n, a in zip(case.input_names, case.inputs)}


_MODULE_RE = re.compile(r"(?:^|/)(ln\w*?)(?:_\d+)?/")


def _onnx_norm_modules(proto, names: list[str]) -> list[Optional[str]]:
    """The module each reported norm came from, read from node names (TorchScript exporter:
    `/ln3/LayerNormalization`) or metadata (dynamo exporter: `pkg.torch.onnx.name_scopes`)."""
    nodes = {n.name: n for n in proto.graph.node}
    out = []
    for name in names:
        n = nodes.get(name) or nodes.get(re.sub(r"_\d+$", "", name))
        found = None
        if n is not None:
            m = _MODULE_RE.search(n.name)
            if m:
                found = m.group(1)
            for p in n.metadata_props:
                if p.key == "pkg.torch.onnx.name_scopes":
                    scopes = [s.strip(" '\"") for s in p.value.strip("[]").split(",")]
                    found = next((s for s in scopes if re.fullmatch(r"ln\w*", s)), found)
        out.append(found)
    return out


def map_report(case: Case, names: list[str], verdicts: list[str], modules: Optional[list] = None,
               path: str = "") -> tuple[Optional[list[str]], list[str]]:
    """Report entries -> the case's calls, by graph order (the report lists norms in graph order,
    which is the order of the calls in `forward`). Where the IR names the module a norm came
    from, the name must agree with the order: a disagreement is a mapping failure, not a guess."""
    fails = []
    if len(names) != len(case.calls):
        fails.append(f"completeness: {path} reports {len(names)} LayerNorm(s), the model calls "
                     f"{len(case.calls)}: {names}")
        return None, fails
    if modules is not None:
        for k, (mod, call) in enumerate(zip(modules, case.calls)):
            if mod is not None and mod != call.module:
                fails.append(f"mapping: {path} norm #{k} `{names[k]}` comes from {mod}, the model's "
                             f"call #{k} is {call.module}")
    return list(verdicts), fails


def _compare(case: Case, ref_orig: list, ref_fold: list, f64: Optional[list]) -> tuple[float, float, list[str]]:
    """(error, bound, failures) of folded outputs `ref_fold` against the original's `ref_orig`."""
    if len(ref_orig) != len(ref_fold):
        return float("inf"), 0.0, [f"soundness: {len(ref_fold)} outputs, the original has {len(ref_orig)}"]
    if case.dtype == torch.float32:
        err = max((rel_err(a, b) for a, b in zip(ref_orig, ref_fold)), default=0.0)
        if err <= FP32_RTOL:
            return err, FP32_RTOL, []
        # Above 1e-5: exact folds cannot beat the original's own rounding, which adversarial
        # means (a mean 100x a row's spread costs LayerNorm 2 digits) can push past 1e-5. Then
        # the folded model must be as close to float64 as the original is, output by output.
        f64 = _float64_reference(case)
        own = [rel_err(r, a) for r, a in zip(f64, ref_orig)]
        got = [rel_err(r, b) for r, b in zip(f64, ref_fold)]
        bad = [(o, g) for o, g in zip(own, got) if g > FP32_FACTOR * o + FP32_FLOOR]
        return err, FP32_RTOL, [] if not bad else [
            f"soundness: folded outputs differ from the original by {err:.3g} (relative), above "
            f"{FP32_RTOL:g}, and from float64 by {bad[0][1]:.3g}, more than {FP32_FACTOR:g} x the "
            f"original's own {bad[0][0]:.3g} + {FP32_FLOOR:g}"]
    dtype = str(case.dtype).replace("torch.", "")
    outputs = [gate.Output(f"#{k}", dtype, a, b, exact=r) for k, (r, a, b) in enumerate(zip(f64, ref_orig, ref_fold))]
    v = gate.judge(outputs)
    bound = max((gate.FACTOR * rel_err(o.exact, o.original) + gate.FLOOR[dtype] for o in outputs), default=0.0)
    return v.folded_err or 0.0, bound, [] if v.ok else [f"soundness: folded error vs float64: {v.failure}"]


def check_onnx(case: Case) -> Outcome:
    """Soundness and completeness of the ONNX path (onnx_rewrite.fold_model) on one case."""
    import onnxruntime as ort

    from lnfold.onnx_rewrite import analyze_model, fold_model

    t0 = time.perf_counter()
    path = f"onnx[{case.exporter}/{case.opset}/{case.target}]"
    out = Outcome(path)
    if case.dtype == torch.bfloat16:
        out.skipped = "bf16: onnxruntime's CPU provider has no bf16 kernels for these ops (checked through FX)"
        return out
    try:
        proto = export(case)
    except Exception as e:  # the exporter, not lnfold
        out.skipped = f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return out
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1

    def run(p):
        sess = ort.InferenceSession(p.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds = np_inputs(case)  # exporters drop inputs the model never reads
        return sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})

    try:
        orig = run(proto)
    except Exception as e:
        out.skipped = f"onnxruntime cannot run the exported original: {str(e).splitlines()[0][:200]}"
        return out

    def fold():
        res = fold_model(proto, verify=False, target=case.target, mode=case.mode)
        return res.report, res.model

    _fold_and_judge(case, out, orig, fold, lambda: analyze_model(proto), run,
                    lambda names: _onnx_norm_modules(proto, names))
    out.seconds = time.perf_counter() - t0
    return out


def _fold_and_judge(case: Case, out: Outcome, orig: list, fold: Callable, analyze: Callable, run: Callable,
                    modules_of: Optional[Callable] = None) -> None:
    """The properties on one path: `fold()` (-> report, folded model) or, where nothing can be
    folded, `analyze()` (-> report); the report against the ground truth (completeness); the
    folded model's outputs `run(folded)` against the original's `orig` (soundness). Failures go
    into `out`. `modules_of(names)`: the module each reported norm came from, where the IR says."""
    from lnfold.passes.errors import NothingToFold

    folded = None
    try:
        report, folded = fold()
    except NothingToFold:
        try:
            report = analyze()
        except Exception as e:
            out.failures.append(f"crash: no report for an unfoldable model: {type(e).__name__}: {e}")
            return
    except Exception as e:
        out.failures.append(f"crash: the fold raised {type(e).__name__}: {str(e)[:300]}\n"
                            + "".join(traceback.format_exc(limit=-4)))
        return
    out.report = report
    names = [n.name for n in report.norms]
    modules = modules_of(names) if modules_of is not None else None
    out.verdicts, fails = map_report(case, names, [n.verdict for n in report.norms], modules, out.path)
    out.failures += fails
    if out.verdicts is not None:
        out.failures += _completeness(case, out.verdicts, [n.reason for n in report.norms], out.path)
    if folded is None:
        return
    try:
        got = run(folded)
    except Exception as e:
        out.failures.append(f"soundness: the folded model fails to run: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300]}")
        return
    f64 = _float64_reference(case) if case.dtype != torch.float32 else None
    out.err, out.bound, fails = _compare(case, orig, got, f64)
    out.failures += fails


def _completeness(case: Case, verdicts: list[str], reasons: list[str], path: str) -> list[str]:
    fails = []
    for call, want, why, got, reason in zip(case.calls, case.expected, case.why, verdicts, reasons):
        if got != want:
            fails.append(f"completeness: {path} says {got} for {call.module} ({reason or 'no reason'}); "
                         f"ground truth {want} ({why})")
    return fails


def check_fx(case: Case) -> Outcome:
    """Soundness and completeness of the torch path (fx_rewrite.fold_module) on one case."""
    from lnfold import fx_rewrite

    t0 = time.perf_counter()
    out = Outcome("fx")
    with torch.no_grad():
        orig = [t.detach().numpy() if t.dtype != torch.bfloat16 else t.float().numpy() for t in flat(case.module(*case.inputs))]

    def fold():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # real RMSNorms (an eager fold may keep the LayerNorm kernel on the centered stream,
            # which would hide a missed centering), no verification of its own (the fuzzer
            # checks), static shapes (the example inputs' sizes)
            res = fx_rewrite.fold_module(case.module, case.inputs, mode=case.mode, verify=False, norm="rms_norm",
                                         dynamic=False)
        return res.report, res.module

    def run(folded):
        with torch.no_grad():
            return [t.detach().float().numpy() for t in flat(folded(*case.inputs))]

    _fold_and_judge(case, out, orig, fold, lambda: _fx_report_only(case), run)
    out.seconds = time.perf_counter() - t0
    return out


def _fx_report_only(case: Case):
    from lnfold import fx_rewrite

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fx_rewrite.analyze_module(case.module, case.inputs, dynamic=False)


def agreement(case: Case, a: Outcome, b: Outcome) -> list[str]:
    """The two frontends give the same verdict for every LayerNorm, the same number of
    recenters and the same reasons (modulo node names)."""
    if a.verdicts is None or b.verdicts is None:
        return []
    fails = [f"agreement: {c.module}: {a.path} says {x}, {b.path} says {y}"
             for c, x, y in zip(case.calls, a.verdicts, b.verdicts) if x != y]
    if a.report is not None and b.report is not None:
        fails += report_differences(a.report, b.report, a.path, b.path)
    return fails


def normalized_reason(reason: str) -> str:
    """A reason without the names of nodes and values, which differ between IRs: "read by
    MatMul `node_linear`" and "read by aten.linear.default `linear`" both say "read by <node>"."""
    reason = re.sub(r"[\w.:()<>#-]+ `[^`]*`", "<node>", reason)
    return re.sub(r"`[^`]*`", "<value>", reason)


def report_differences(a, b, pa: str = "onnx", pb: str = "fx") -> list[str]:
    """What differs between two frontends' reports of one model (verdicts in order, recenter
    counts, reasons modulo names); [] when they agree."""
    out = []
    if [n.verdict for n in a.norms] != [n.verdict for n in b.norms]:
        out.append(f"agreement: verdicts {pa} {[n.verdict for n in a.norms]} vs {pb} {[n.verdict for n in b.norms]}")
    if a.recentered != b.recentered:
        out.append(f"agreement: {pa} recenters {a.recentered}, {pb} {b.recentered}")
    ra = sorted(normalized_reason(n.reason) for n in a.norms)
    rb = sorted(normalized_reason(n.reason) for n in b.norms)
    if ra != rb:
        out.append(f"agreement: reasons differ: {pa} {ra} vs {pb} {rb}")
    return out


def check(case: Case, paths=("onnx",)) -> list[Outcome]:
    outs = []
    if "onnx" in paths:
        outs.append(check_onnx(case))
    if "fx" in paths:
        outs.append(check_fx(case))
    if len(outs) == 2:
        outs[0].failures += agreement(case, outs[0], outs[1])
    return outs


def failures(outs: list[Outcome]) -> list[str]:
    return [f for o in outs for f in o.failures]
