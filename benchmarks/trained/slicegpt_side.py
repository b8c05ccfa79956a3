"""Issue 32: SliceGPT's own code side by side with `lnfold slice` on one OPT checkpoint — held-out
perplexity, parameters and CPU latency (onnxruntime and eager torch, interleaved, with an A/A pair)
at fractions 0.1 / 0.2 / 0.3. NOT exact, either of them.

    git --git-dir=<fetched microsoft/TransformerCompression> archive HEAD | tar -x -C /tmp/tc
    python -m benchmarks.trained.slicegpt_side --slicegpt-src /tmp/tc/src [--fractions 0.1 0.2 0.3] [--rounds 30]

lnfold is run twice per fraction: one basis per stream, and `per_block=True` (a basis per block
input, each residual shortcut re-expressed by a k×k MatMul, SliceGPT's scheme; each block's basis,
as SliceGPT's, from the model already sliced before it: passes/slicer.sequential).

The checkpoint is `opt_stdlib` (train.py's recipe; trained here into benchmarks/trained/opt_stdlib/
when its weights are missing, ~10 min). Both methods calibrate on the same rows: CALIBRATION_ROWS
windows of the *training* text (seeded), in batches of 16 (SliceGPT's default batch); both are
scored on the 64 committed held-out windows (files never trained on), which also measure lnfold's
error against its exact fold. Both keep the same width k = d − round(F·d) (lnfold's rule; SliceGPT's
CLI would round int((1−F)·d) down to a multiple of 8: its `ConstSlicingScheduler(k)` is given k).

SliceGPT is run from its source tree (not vendored): `rotate.rotate_and_slice` with its OPT adapter,
`layernorm_fusion.replace_layers` / `fuse_modules`, its `pca_calc` calibration, its defaults
(`final_orientation='pca'`, head not sliced). Two shims, both outside its algorithm: its package
`__init__` (which imports the HF-hub / `datasets` / wandb helpers the slicing does not use) is not
run, and its `config` module (an ml_collections ConfigDict holding the device) is given device=cpu;
its `CompressedOPTDecoderLayer.forward` was written for transformers 4.x's layer call, so
`Transformers5Layer` below repeats it for 5.x's (`cache=`, `position_ids=`, attention returning two
values, the layer returning a tensor) with the same shortcut arithmetic.
"""
from __future__ import annotations

import argparse
import copy
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import torch

import lnfold
from lnfold import zoo
from lnfold.onnx_rewrite import timing
from lnfold.onnx_rewrite.linear_layers import float_parameters as parameters
from lnfold.passes.slicing import kept_width

from . import harness, train
from .slice_metric import session

NAME = "opt_stdlib"
CALIBRATION_ROWS = 64
BATCH = 16
TIMED_ROWS = 4


def ensure_checkpoint(root: Path) -> None:
    """Train opt_stdlib into `root` when its weights are missing (they are not committed)."""
    if not (harness.folder(NAME, root) / "model.safetensors").exists():
        print(f"{NAME}: no weights in {harness.folder(NAME, root)}; training them (train.py's recipe, ~10 min)",
              flush=True)
        train.main(["--only", NAME, "--out", str(root)])


def calibration_rows(n: int = CALIBRATION_ROWS, seed: int = 3) -> np.ndarray:
    """n windows of CONTEXT bytes from the training text at seeded random offsets ([n, CONTEXT] int64)."""
    text, _, _ = train.stdlib_bytes()
    starts = np.random.default_rng(seed).integers(0, text.size - train.CONTEXT, n)
    return np.stack([text[s:s + train.CONTEXT] for s in starts]).astype(np.int64)


# ---------------------------------------------------------------- SliceGPT, from its source tree

def slicegpt_package(src: Path) -> None:
    """Make `import slicegpt...` read SliceGPT's modules from `src` (the folder holding `slicegpt/`)
    without running its package __init__, its config holding device=cpu (benchmarks/slicegpt_llm.py
    shares it)."""
    if not (src / "slicegpt" / "rotate.py").is_file():
        raise SystemExit(f"--slicegpt-src {src}: no slicegpt/rotate.py there (give TransformerCompression's src/)")
    package = types.ModuleType("slicegpt")
    package.__path__ = [str(src / "slicegpt")]
    config = types.ModuleType("slicegpt.config")
    config.config = types.SimpleNamespace(device=torch.device("cpu"))
    sys.modules.update({"slicegpt": package, "slicegpt.config": config})


def slicegpt_modules(adapter: type, layer: type) -> types.SimpleNamespace:
    """What the side-by-sides call of SliceGPT (imported after `slicegpt_package`): its rotation and
    fusion modules, its slicing scheduler, and `adapter` (one of its model adapters) building its
    compressed layers as `layer` (the adapter's layer with a transformers-5 forward)."""
    from slicegpt import layernorm_fusion, rotate
    from slicegpt.slicing_scheduler import ConstSlicingScheduler

    with_layer = type(adapter.__name__, (adapter,), {"compressed_layer_type": property(lambda self: layer),
                                                     "__module__": __name__})
    return types.SimpleNamespace(rotate=rotate, fusion=layernorm_fusion, Adapter=with_layer,
                                 ConstSlicingScheduler=ConstSlicingScheduler)


def import_slicegpt(src: Path) -> types.SimpleNamespace:
    """SliceGPT's modules from `src`, its OPT adapter's layer forward repeated for transformers 5."""
    slicegpt_package(src)
    from slicegpt.adapters.opt_adapter import CompressedOPTDecoderLayer, OPTModelAdapter

    class Transformers5Layer(CompressedOPTDecoderLayer):
        """SliceGPT's CompressedOPTDecoderLayer.forward (Pre-LN branch) for transformers 5's layer call."""

        def forward(self, hidden_states, attention_mask=None, cache=None, use_cache=False, position_ids=None,
                    **kwargs):
            residual = hidden_states
            hidden_states = self.self_attn_layer_norm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, cache=cache, position_ids=position_ids,
                                              attention_mask=attention_mask, **kwargs)
            if self.attn_shortcut_Q is not None:
                hidden_states = torch.matmul(residual, self.attn_shortcut_Q) + hidden_states
            else:
                hidden_states = residual + hidden_states
            shape = list(hidden_states.shape)
            hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
            residual = hidden_states
            hidden_states = self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(hidden_states))))
            shape[-1] = self.fc2.out_features
            if self.mlp_shortcut_Q is not None:
                return torch.matmul(residual, self.mlp_shortcut_Q).view(shape) + hidden_states.view(shape)
            return (residual + hidden_states).view(shape)

    return slicegpt_modules(OPTModelAdapter, Transformers5Layer)


def slicegpt_slice(sg: types.SimpleNamespace, model, calibration: np.ndarray, keep: int, slice_head: bool):
    """SliceGPT's run_slicegpt.py steps on a copy of `model`: replace layers, fuse the LayerNorms,
    rotate_and_slice to `keep` on the calibration rows (batches of BATCH, all-ones attention masks);
    `slice_head`: its scheduler's do_slice_head (default False: the last block writes, and the head
    reads, all d features)."""
    model = copy.deepcopy(model)
    model.config.use_cache = False
    adapter = sg.Adapter(model)
    sg.fusion.replace_layers(adapter, verbose=False)
    sg.fusion.fuse_modules(adapter)
    ids = torch.from_numpy(calibration)
    loader = [{"input_ids": ids[i:i + BATCH], "attention_mask": torch.ones_like(ids[i:i + BATCH])}
              for i in range(0, len(ids), BATCH)]
    scheduler = sg.ConstSlicingScheduler(keep, do_slice_head=slice_head)
    sg.rotate.rotate_and_slice(adapter, loader, scheduler, final_orientation="pca")
    return model.eval()


# ---------------------------------------------------------------- one basis or one per norm

def centered_norm_inputs(model, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each LayerNorm's input on `rows`, centered (what the exact fold's stream carries there)."""
    seen: dict[str, list] = {}
    hooks = [m.register_forward_hook(lambda mod, a, out, name=name: seen.setdefault(name, []).append(a[0].detach()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    with torch.no_grad():
        for i in range(0, len(rows), BATCH):
            model(torch.from_numpy(rows[i:i + BATCH]))
    for h in hooks:
        h.remove()
    out = {}
    for name, parts in seen.items():
        x = torch.cat(parts).double().numpy()
        out[name] = x - x.mean(axis=-1, keepdims=True)
    return out


def energy_kept(x: np.ndarray, q: np.ndarray, k: int) -> float:
    """The share of the unit-RMS rows' energy in span(q[:, :k])."""
    x = x.reshape(-1, x.shape[-1])
    u = x / np.sqrt((x * x).mean(axis=1, keepdims=True))
    return float(((u @ q[:, :k]) ** 2).sum() / (u * u).sum())


def basis_sharing(model, cal: np.ndarray, held: np.ndarray, ks: list[int]) -> None:
    """Per norm, the held-out energy outside the kept k directions: with lnfold's one basis per stream
    (every norm's calibration moment pooled, passes/slicing.py) and with a basis of the norm's own
    (the per-block choice SliceGPT makes, here on the unsliced model)."""
    from lnfold.passes.slicing import principal_basis, second_moment as unit_rms_moment

    calibrating, scored = centered_norm_inputs(model, cal), centered_norm_inputs(model, held)
    own = {n: principal_basis(unit_rms_moment([x], -1)[0])[0] for n, x in calibrating.items()}
    pooled = principal_basis(sum(unit_rms_moment([x], -1)[0] for x in calibrating.values()) / len(calibrating))[0]
    print("\nHeld-out energy lost per norm input (1 - share of its unit-RMS rows' energy in the kept k directions): "
          "one pooled basis (lnfold) / the norm's own basis (per block, as SliceGPT)")
    print("| norm | " + " | ".join(f"k={k}: one / own" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for name, x in scored.items():
        cells = [f"{1 - energy_kept(x, pooled, k):.2e} / {1 - energy_kept(x, own[name], k):.2e}" for k in ks]
        print(f"| {name} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------- the table

def logits_of(module):
    return zoo.Logits(module, "logits").eval()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slicegpt-src", type=Path, required=True,
                   help="TransformerCompression's src/ folder (holding slicegpt/)")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    p.add_argument("--root", type=Path, default=harness.CHECKPOINTS,
                   help="where opt_stdlib/ is (or is trained to); default: beside this file")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    sg = import_slicegpt(args.slicegpt_src.resolve())
    root = args.root
    ensure_checkpoint(root)

    hf = harness.load_model(NAME, root=root)
    d = hf.config.hidden_size
    cal = calibration_rows()
    held = harness.heldout(NAME, root=root)["input_ids"]
    example = (torch.from_numpy(held[:2]),)
    original = logits_of(hf)
    onnx_models = {"original": zoo.export_onnx(original, example, ["input_ids"])}
    eager = {"original": original}
    params, notes = {}, {}

    for f in args.fractions:
        k = kept_width(d, f)
        tag = f"F={f:g} (k={k})"
        for slice_head, label in ((False, f"SliceGPT {tag}"), (True, f"SliceGPT {tag}, head sliced")):
            print(f"{label} ...", flush=True)
            sliced = logits_of(slicegpt_slice(sg, hf, cal, k, slice_head))
            eager[label] = sliced
            onnx_models[label] = zoo.export_onnx(sliced, example, ["input_ids"])
        batches = [(torch.from_numpy(cal[i:i + BATCH]),) for i in range(0, len(cal), BATCH)]
        for per_block, label in ((False, f"lnfold {tag}"), (True, f"lnfold {tag}, per-block")):
            print(f"{label}: slice_onnx / slice_module ...", flush=True)
            r = lnfold.slice_onnx(onnx_models["original"], {"input_ids": cal}, fraction=f,
                                  heldout={"input_ids": held}, per_block=per_block)
            onnx_models.setdefault("lnfold exact fold", r.exact.model)
            onnx_models[label] = r.model
            notes[label] = r.report.table()
            m = lnfold.slice_module(original, batches, fraction=f, heldout=[(torch.from_numpy(held),)],
                                    per_block=per_block)
            eager.setdefault("lnfold exact fold", m.exact.module)
            eager[label] = m.module

    print(f"\n{NAME} (d={d}): perplexity on the {len(held)} held-out windows; calibration {len(cal)} training windows")
    print("| variant | perplexity (onnxruntime) | perplexity (eager torch) | parameters (ONNX) |")
    print("|---|---|---|---|")
    for label, model in onnx_models.items():
        ort_ppl = harness.evaluate(NAME, harness.onnx_runner(model), root=root).value
        torch_ppl = (harness.evaluate(NAME, harness.torch_runner(eager[label]), root=root).value
                     if label in eager else None)
        params[label] = parameters(model)
        print(f"| {label} | {ort_ppl:.5f} | {'' if torch_ppl is None else f'{torch_ppl:.5f}'} | {params[label]:,} "
              f"({params[label] / params['original']:.3f}x) |")
    for label, text in notes.items():
        print(f"\n{label}:\n{text}")
    basis_sharing(hf, cal, held, [kept_width(d, f) for f in args.fractions])

    x = held[:TIMED_ROWS]
    sessions = {label: session(m) for label, m in onnx_models.items()}
    sessions["original (A/A)"] = session(onnx_models["original"])
    ort_stats = timing.interleaved({label: (lambda s=s: s.run(None, {"input_ids": x})) for label, s in sessions.items()},
                                   rounds=args.rounds)
    eager["original (A/A)"] = logits_of(harness.load_model(NAME, root=root))
    xt = torch.from_numpy(x)

    def run_eager(module):
        with torch.no_grad():
            module(xt)

    torch_stats = timing.interleaved({label: (lambda m=m: run_eager(m)) for label, m in eager.items()},
                                     rounds=args.rounds)
    print(f"\nCPU latency, {TIMED_ROWS} rows x {train.CONTEXT} tokens, 1 thread, {args.rounds} interleaved rounds "
          "(median ms, ratio to the original's median):")
    print("| variant | onnxruntime | eager torch |")
    print("|---|---|---|")
    ort_base, torch_base = ort_stats["original"]["median"], torch_stats["original"]["median"]
    for label in sessions:
        cells = []
        for stats, base in ((ort_stats, ort_base), (torch_stats, torch_base)):
            s = stats.get(label)
            cells.append("" if s is None else f"{s['median'] * 1e3:.2f} ({s['median'] / base:.3f}x)")
        print(f"| {label} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
