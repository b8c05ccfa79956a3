"""Torch quantizers on the eager RMSNorm hand-off (issue 22): the held-out metric of the trained models.

    python -m benchmarks.trained.handoff_bench [--models gpt2_stdlib vit_digits] [--limit N]

Per trained model: the original (fp32), the original through torch's own dynamic int8
quantization (`torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`:
int8 weights per tensor, activations quantized per batch at run time), the hand-off
(`lnfold.fold_to_rmsnorm`, fp32: exact, verified against float64), the hand-off quantized the
same way: γ moved into the readers (the default, unit-weight RMSNorms), γ kept in the RMSNorm,
and rotated (a randomized Hadamard, seed 0). torchao's
weight-only `quantize_` too where torchao imports. Quantization is not exact: these are
measurements of each quantized model's metric, not verified folds.

GPT-2's projections are transformers' `Conv1D` (a Linear with its weight transposed), which
quantize_dynamic does not know: both the original and the hand-off get them as `nn.Linear`
(same values) before quantization, so that the same layers are quantized in every column.
BERT is Post-LN: only its embedding LayerNorm folds, and its output is read by the residual Add
as well, so β cannot move and nothing becomes an RMSNorm (the row says so).
Prints a markdown table for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import platform
import time
from typing import Callable, Optional

import torch
from torch import nn

import lnfold

from . import harness


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """transformers' Conv1D (y = x W + b, W [in, out]) as nn.Linear (same values), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if type(child).__name__ == "Conv1D":
                w = child.weight
                lin = nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None, dtype=w.dtype)
                with torch.no_grad():
                    lin.weight.copy_(w.t())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                parent._modules[name] = lin
    return model


def dynamic_int8(module: nn.Module) -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(module), {nn.Linear}, dtype=torch.qint8)


def torchao_weight_only(kind: str) -> Optional[Callable[[nn.Module], nn.Module]]:
    """torchao's int8 / int4 weight-only `quantize_`, or None where torchao does not import."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception:
        return None

    def run(module: nn.Module) -> nn.Module:
        m = copy.deepcopy(module)
        quantize_(m, Int8WeightOnlyConfig() if kind == "int8" else Int4WeightOnlyConfig(group_size=32))  # (int4: GPU)
        return m

    return run


def handoff(name: str, **options):
    """(hand-off module, result) of the trained model, or (None, why)."""
    module = harness.logits_module(name)
    try:
        result = lnfold.fold_to_rmsnorm(module, harness.example_args(name), **options)
    except lnfold.LnfoldError as e:
        return None, str(e)
    return result.module, result


# the hand-offs quantized: γ into the readers (the default), γ kept in the RMSNorm, rotated
VARIANTS = {"hand-off": {}, "hand-off γ in norm": {"gamma_into_readers": False},
            "hand-off rotated": {"rotate": "hadamard", "seed": 0}}


def row(name: str, limit: Optional[int], quantizers: dict[str, Callable]) -> list[str]:
    metric = lambda m: harness.evaluate(name, harness.torch_runner(m), limit)  # noqa: E731
    original = conv1d_as_linear(harness.logits_module(name))
    columns = {"fp32": metric(original)}
    for q, quantize in quantizers.items():
        columns[f"original {q}"] = metric(quantize(original))
    t = time.perf_counter()
    folded, result = handoff(name)
    fold_s = time.perf_counter() - t
    if folded is None:
        cells = [f"{columns['fp32'].value:.4f}", "—"]
        for q in quantizers:
            cells += [f"{columns[f'original {q}'].value:.4f}"] + ["—"] * len(VARIANTS)
        return [f"| {name} | " + " | ".join(cells) + f" | no hand-off: {result} |"]
    conv1d_as_linear(folded)
    columns["hand-off fp32"] = metric(folded)
    cells = [f"{columns['fp32'].value:.4f}", f"{columns['hand-off fp32'].value:.4f}"]
    quantized = {}
    for variant, options in VARIANTS.items():
        m = folded if not options else conv1d_as_linear(handoff(name, **options)[0])
        for q, quantize in quantizers.items():
            quantized[(variant, q)] = metric(quantize(m))
    for q in quantizers:
        cells += [f"{columns[f'original {q}'].value:.4f}"] + [f"{quantized[(v, q)].value:.4f}" for v in VARIANTS]
    h = result.handoff
    note = (f"{len(h.rmsnorm)} RMSNorm, {len(h.kept)} kept, {len(h.new_biases)} new bias; "
            f"fold {fold_s:.1f} s; exact err {result.exact_err:.1e} (original {result.original_exact_err:.1e})")
    return [f"| {name} | " + " | ".join(cells) + f" | {note} |"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(harness.MODELS))
    ap.add_argument("--limit", type=int, default=None, help="held-out rows (default: all)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    quantizers = {"int8 dyn": dynamic_int8}
    for kind in ("int8",):  # int4 weight-only needs mslk (GPU kernels) in torchao 0.18: not on this CPU
        q = torchao_weight_only(kind)
        if q is not None:
            quantizers[f"torchao {kind} wo"] = q
    head = ["model", "fp32", "hand-off fp32"]
    for q in quantizers:
        head += [f"orig. {q}"] + [f"{v} {q}" for v in VARIANTS]
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; `python -m benchmarks.trained.handoff_bench`")
    print("| " + " | ".join(head) + " | hand-off |")
    print("|" + "---|" * (len(head) + 1))
    for name in args.models:
        for line in row(name, args.limit, quantizers):
            print(line, flush=True)


if __name__ == "__main__":
    main()
