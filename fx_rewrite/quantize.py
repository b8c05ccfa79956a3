"""`quantize_module` (lnfold.quantize_module): the exact fold in front of torch's own quantizers,
torchao's `quantize_` where installed (`pip install 'lnfold[quantize]'`), else torch.ao's
`quantize_dynamic` (int8 only). lnfold quantizes nothing itself; the candidates of `rotate="auto"`,
the choice and the report are passes/quantize.py's, shared with `quantize_onnx`.

The quantizers swap nn.Linear modules, while the graph of `ExportedProgram.module()` calls
`aten.linear` / `aten.addmm` on constant weights: `as_linear_modules` makes each an nn.Linear holding
the same weight, an exact rewrite verified together with the fold (float64).
"""
from __future__ import annotations

import contextlib
import copy
import io
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from ..passes import LnfoldError
from ..passes.options import MASSIVE, FoldOptions, check_choice
from ..passes.pipeline import record
from ..passes.quantize import (AUTO, QuantizeResult, Quantized, auto_candidates, check_rotation_options, check_scheme,
                               choose, fold_for_quantizer, report_of, streamed_errors, trial)
from . import calibration as calibration_io
from .api import own_tensors, export, fold_module, program_view, with_massive_channels
from .apply import READOUT_BUFFERS
from .slice import module_float_parameters
from .edits import attr_of
from .verify import Verifier

BACKENDS = ("auto", "torchao", "torch.ao")
GROUP_SIZES = (32, 64, 128, 256)  # int4 weight-only: weights per group along K
_ATEN = torch.ops.aten


@dataclass
class Prepared:
    """The float module handed to the quantizer: folded (and rotated), linear layers as nn.Linear."""

    module: fx.GraphModule
    fold: Optional[object]  # FoldResult, None when nothing folded
    notes: list
    gamma_into_readers: bool
    layers: dict  # new nn.Linear submodule -> the weight it holds (its state_dict name)


def torchao_quantization():
    """torchao's quantization module, or None where it is not installed."""
    try:
        # (its import logs, on a CPU build, that its CUDA kernels did not load)
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao import quantization
        return quantization
    except Exception:  # (not installed, or built for another torch)
        return None


def check_options(weights: str, rotate: Optional[str], seed, block_size: int, backend: str) -> str:
    """Every option, checked before any work (one-line LnfoldErrors); returns the backend to use."""
    check_scheme(weights, None, rotate, seed)
    check_choice("backend", backend, BACKENDS)
    if weights == "int4" and block_size not in GROUP_SIZES:
        raise LnfoldError(f"block size {block_size!r}: one of {', '.join(map(str, GROUP_SIZES))} (int4 groups along K)")
    if weights != "int4" and block_size != 32:
        raise LnfoldError("block_size is for int4 weights")
    installed = torchao_quantization() is not None
    if backend == "auto":
        backend = "torchao" if installed else "torch.ao"
    if backend == "torchao" and not installed:
        raise LnfoldError("backend='torchao': torchao is not installed (pip install 'lnfold[quantize]')")
    if weights == "int4" and backend != "torchao":
        raise LnfoldError("int4 weight-only needs torchao (pip install 'lnfold[quantize]'); torch.ao quantizes "
                          "int8 only")
    return backend


def scheme_name(weights: str, backend: str, block_size: int) -> str:
    if weights == "int4":
        return f"int4 weight-only, groups of {block_size} (torchao IntxWeightOnlyConfig, symmetric)"
    if backend == "torchao":
        return "int8 weights, dynamic int8 activations (torchao Int8DynamicActivationInt8WeightConfig)"
    return "int8 weights, dynamic int8 activations (torch.ao quantize_dynamic, nn.Linear, qint8)"


# -- the adapter: linear layers as nn.Linear, then the quantizer ------------------------------------

def _constant(gm: fx.GraphModule, node) -> Optional[torch.Tensor]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        t = attr_of(gm, node.target)
        return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None
    return None


def as_linear_modules(gm: fx.GraphModule) -> dict[str, str]:
    """Each `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` of `gm` on a constant 2-D weight (and
    1-D bias, or none) made a call of a new nn.Linear submodule holding them (addmm's W transposed):
    the same values, now where the quantizers look. Returns submodule name -> the weight's name."""
    made: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target == _ATEN.linear.default:
            x, w, b = (tuple(node.args) + (None,))[:3]
        elif node.target == _ATEN.addmm.default and len(node.args) == 3:
            b, x, w = node.args
        else:
            continue
        weight, bias = _constant(gm, w), _constant(gm, b)
        if node.target == _ATEN.addmm.default and weight is not None and weight.ndim == 2:
            weight = weight.t()
        if weight is None or weight.ndim != 2 or (b is not None and (bias is None or bias.ndim != 1)):
            continue
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                 dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        linear.requires_grad_(False)
        name = f"lnfold_linear_{len(made)}"
        gm.add_submodule(name, linear)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (x,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        made[name] = w.target
    for node in list(gm.graph.nodes):  # the weights' get_attrs nothing reads now
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    _drop_unread(gm, set(made))
    return made


def _drop_unread(gm: fx.GraphModule, keep: set) -> None:
    """Delete the tensors no get_attr reads (the weights now in nn.Linears, the originals a fold
    replaced), outside the `keep` submodules: the quantized module holds no float copy of them."""
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        if name in read or owner.split(".")[0] in keep:
            continue
        holder = gm.get_submodule(owner) if owner else gm
        holder._parameters.pop(attr, None)
        holder._buffers.pop(attr, None)


def run_quantizer(module: fx.GraphModule, layers: dict, weights: str, backend: str, block_size: int) -> list[str]:
    """The quantizer for the scheme on the `layers` of `module`, in place; returns notes (layers kept float)."""
    notes = []
    if weights == "int4":  # a group must tile K
        odd = [n for n in layers if module.get_submodule(n).in_features % block_size]
        if odd:
            notes.append(f"kept float: {len(odd)} linear layer(s) whose input width is no multiple of {block_size}")
        layers = {n: w for n, w in layers.items() if n not in odd}
    # the layers go to the quantizer in a container of their own (a graph of ExportedProgram.module()
    # refuses .eval(), which quantize_dynamic calls) and come back swapped
    holder = torch.nn.ModuleDict({n.replace(".", "_"): module.get_submodule(n) for n in layers})
    with warnings.catch_warnings():  # (torch.ao's quantized tensors warn of their deprecation on every layer)
        warnings.simplefilter("ignore")
        if backend == "torch.ao":
            holder = torch.ao.quantization.quantize_dynamic(holder, {torch.nn.Linear}, dtype=torch.qint8)
        else:
            ao = torchao_quantization()
            if weights == "int4":
                from torchao.quantization.granularity import PerGroup

                config = ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(block_size))
            else:
                config = ao.Int8DynamicActivationInt8WeightConfig()
            ao.quantize_(holder, config)
    for n in layers:
        setattr(module, n, holder[n.replace(".", "_")])
    return notes


def layer_kinds(module: torch.nn.Module, layers) -> dict:
    """Layer kind -> count over `layers` (torchao keeps nn.Linear and swaps its weight's tensor type)."""
    kinds = Counter()
    for name in layers:
        m = module.get_submodule(name)
        w = getattr(m, "weight", None)
        kind = m._get_name()  # (torch.ao's dynamic Linear calls itself DynamicQuantizedLinear)
        if isinstance(w, torch.Tensor) and type(w) not in (torch.Tensor, torch.nn.Parameter):
            kind += f"[{type(w).__name__}]"
        kinds[kind] += 1
    return dict(kinds)


def saved_bytes(module: torch.nn.Module) -> int:
    """The size of the module's state_dict as torch.save writes it, counted, not kept (0: unsaveable)."""
    class Count:
        n = 0

        def write(self, b) -> int:
            self.n += len(b)
            return len(b)

        def flush(self) -> None:
            pass

    sink = Count()
    try:
        torch.save(module.state_dict(), sink)
    except Exception:
        return 0
    return sink.n


# -- the entry --------------------------------------------------------------------------------------

def quantize_module(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *, weights: str = "int8",
                    rotate: Optional[str] = None, seed: int = 0, gamma_into_readers: Optional[bool] = None,
                    gamma_in_float: bool = False, spare_channels=None, online_hadamard: bool = False,
                    fold: bool = True, block_size: int = 32,
                    backend: str = "auto", inputs=None,
                    verify: bool = True, dynamic: bool = True) -> QuantizeResult:
    """Fold `module` exactly (fold_module), then quantize its linear layers with torchao or torch.ao;
    NOT exact: the report says by how much.

    `weights`: "int8" (int8 weights, dynamic int8 activations: torchao
    Int8DynamicActivationInt8WeightConfig, or torch.ao quantize_dynamic) or "int4" (weight-only,
    groups of `block_size` along K: torchao IntxWeightOnlyConfig). `backend`: "auto" (torchao where
    installed), "torchao" or "torch.ao". `rotate`, `seed`, `gamma_into_readers` (default: with a
    rotation that rotates a stream), `gamma_in_float`, `spare_channels` and `online_hadamard` are the
    fold's options (passes/options.OPTIONS); `rotate="auto"` quantizes each candidate
    (passes/quantize.auto_candidates) and keeps the lowest error on the measurement rows.
    `fold=False`: the same export and quantizer, nothing folded (the baseline). `inputs`: an args
    tuple, or a list of them, the error is measured on; default `args`, which the report says are not
    the user's data. `verify=False` skips the float64 verification of the fold and the rewrite.

    Returns passes/quantize.QuantizeResult: `.module` the quantized module (same inputs and
    outputs), `.report` its QuantizeReport, `.fold` the exact part's FoldResult (None: nothing folded).
    """
    t0 = time.perf_counter()
    backend = check_options(weights, rotate, seed, block_size, backend)
    check_rotation_options(rotate, fold, gamma_into_readers, gamma_in_float, spare_channels, online_hadamard)
    args, kwargs = tuple(args), dict(kwargs or {})
    batches, synthetic = calibration_io.batches_of(inputs, args)
    if spare_channels == MASSIVE:  # found once, on the rows the error is measured on
        spare_channels = with_massive_channels(module, args, kwargs, FoldOptions(rotate="orthogonal",
                                               spare_channels=MASSIVE), batches, dynamic).spare_channels
    described = (f"the example args ({len(batches)} batch) — NOT your data: give inputs= for the error on real "
                 "inputs" if synthetic else f"your inputs ({len(batches)} batch(es))")
    count = len(calibration_io.outputs(module, batches[:1]))  # (the outputs' errors stream: none is held)
    names = ["output"] if count == 1 else [f"output {k}" for k in range(count)]

    def prepare(opts: dict, verified: bool = False) -> Prepared:
        return _prepare(module, args, kwargs, seed=seed, dynamic=dynamic, verify=verified, **opts)

    def quantize(prepared: Prepared, measured: bool = True) -> Quantized:
        target = prepared.module  # (quantized in place)
        prepared.notes += run_quantizer(target, prepared.layers, weights, backend, block_size)
        errors = streamed_errors(names, calibration_io.paired_runs(module, target, batches)) if measured else {}
        return Quantized(prepared, target, prepared.fold, errors, layer_kinds(target, prepared.layers),
                         saved_bytes(target))

    def chosen(prepared: Prepared) -> Quantized:
        """The candidate auto keeps, made again: verified (before it is quantized in place), not
        measured again (choose keeps its trial's errors)."""
        if verify:
            _verify(module, args, kwargs, prepared)
        return quantize(prepared, measured=False)

    trials: list[dict] = []
    if rotate == AUTO:
        q, trials = choose(prepare, quantize, candidates=auto_candidates(backend, spare_channels),
                           plain=lambda: _plain_trial(module, names, batches),
                           plain_name="plain torch.ao", unmeasured=chosen)
    else:
        q = quantize(prepare(dict(fold=fold, rotate=rotate, gamma_into_readers=gamma_into_readers,
                                  gamma_in_float=gamma_in_float, spare_channels=spare_channels,
                                  online_hadamard=online_hadamard), verify))
    prepared = q.prepared
    readouts = tuple(READOUT_BUFFERS.values())
    kept_float = {n: t.numel() for n, t in q.quantized.named_buffers() if n.startswith(readouts)}
    report = report_of(
        scheme_name(weights, backend, block_size), q, weights=weights, activations=None,
        block_size=block_size if weights == "int4" else None, per_channel=False, rotate=rotate, seed=seed,
        gamma_into_readers=prepared.gamma_into_readers, linear_layers=len(prepared.layers),
        basis_changes=kept_float, parameters=module_float_parameters(module),
        ops_before={"Linear": len(prepared.layers)},
        bytes_before=saved_bytes(module), error_inputs=described, notes=prepared.notes,
        seconds=time.perf_counter() - t0, trials=trials)
    return QuantizeResult(report, module=q.quantized, fold=q.fold)


def _prepare(module, args: tuple, kwargs: dict, *, fold: bool = True, rotate: Optional[str] = None, seed: int = 0,
             gamma_into_readers: Optional[bool] = None, gamma_in_float: bool = False, spare_channels=None,
             online_hadamard: bool = False, dynamic: bool = True, verify: bool = True) -> Prepared:
    """The exact steps: the fold (passes/quantize.fold_for_quantizer), linear layers as nn.Linear.
    `verify`: the fold through fold_module's gate, then the module handed to the quantizer against
    the original in float64 (the rewrite, and the fold again)."""
    def run(**fold_options):
        return fold_module(module, args, kwargs, seed=seed, verify=verify, dynamic=dynamic, **fold_options)

    result, moved, notes = fold_for_quantizer(run, fold=fold, rotate=rotate, gamma_into_readers=gamma_into_readers,
                                              gamma_in_float=gamma_in_float, spare_channels=spare_channels,
                                              online_hadamard=online_hadamard)
    gm = result.module if result is not None else None
    if gm is None:
        gm = program_view(export(module, args, kwargs, dynamic=dynamic))[0]
        own_tensors(gm)  # (the program's tensors are the module's)
    layers = as_linear_modules(gm)
    if not layers:
        raise LnfoldError("no linear layer to quantize (no aten.linear or aten.addmm with a constant 2-D weight)")
    prepared = Prepared(gm, result, notes, moved, layers)
    if verify:
        _verify(module, args, kwargs, prepared)
    return prepared


def _verify(module, args: tuple, kwargs: dict, prepared: Prepared) -> None:
    """The module handed to the quantizer against the original in float64 (the nn.Linear rewrite,
    and the fold under it): its verdict is the fold result's; a VerificationError where it fails."""
    verdict = Verifier(module, args, kwargs).check(prepared.module)
    if prepared.fold is not None:
        record(prepared.fold, verdict)


def _plain_trial(module, names: list, batches: list) -> dict:
    """Plain torch.ao quantize_dynamic on the module as given (its nn.Linear modules only: a
    transformers Conv1D is none), measured as the candidates are: a reference, never chosen."""
    label = "plain torch.ao: quantize_dynamic(module, {nn.Linear}, dtype=qint8)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(module), {torch.nn.Linear},
                                                           dtype=torch.qint8)
        errors = streamed_errors(names, calibration_io.paired_runs(module, quantized, batches))
    kinds = Counter(type(m).__name__ for m in quantized.modules() if "Linear" in type(m).__name__)
    return trial(label, Quantized(None, quantized, None, errors, dict(kinds), saved_bytes(quantized)),
                 rotate=None, plain=True)
