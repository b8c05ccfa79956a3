"""Issue 47: SliceGPT's own code side by side with `lnfold.slice_onnx` on a real pretrained RMSNorm LLM,
SmolLM2-135M-Instruct (a Llama: SliceGPT's Llama adapter takes it) — perplexity, parameters and
onnxruntime CPU latency (1 thread, interleaved, with an A/A pair) at F = 0.1 / 0.2 / 0.25. NOT exact,
either of them.

    git --git-dir=<fetched microsoft/TransformerCompression> archive HEAD | tar -x -C /tmp/tc
    python -m benchmarks.slicegpt_llm --slicegpt-src /tmp/tc/src [--fractions 0.1 0.2 0.25] [--rounds 10]
    python -m benchmarks.slicegpt_llm --slicegpt-src /tmp/tc/src --parts latency --rounds 10  # saved files only

The model, its ONNX export, the texts and the windows are benchmarks.realmodels_llm's (imported, not
copied): both methods calibrate on the same 8 GPL-3 windows of 256 tokens and are scored on the 8
Apache-2.0 windows; lnfold measures its own error against its exact fold on GPL-3 windows 9–10 (so
all 8 calibration windows choose its bases, as all 8 choose SliceGPT's). Both keep the same width
k = d − round(F·d) (lnfold's rule; SliceGPT's CLI would round int((1−F)·d) down to a multiple of 8:
its `ConstSlicingScheduler(k)` is given k). lnfold is run twice per fraction: one basis per stream,
and `per_block=True` (a basis per block input, each residual shortcut re-expressed by a k×k MatMul,
each block's basis from the model already sliced before it: SliceGPT's scheme).

SliceGPT is run from its source tree (not vendored) as run_slicegpt.py runs it: its Llama adapter,
`layernorm_fusion.replace_layers` / `fuse_modules`, `rotate.rotate_and_slice` with its defaults
(`final_orientation='pca'`, head not sliced, the calibration batch of 16 — here all 8 windows in one —
with all-ones attention masks), `model.config.torch_dtype = float32` as its `_from_pretrained` sets.
Shims, all outside its algorithm (as benchmarks/trained/slicegpt_side.py's for OPT): its package
`__init__` (HF-hub / datasets / wandb helpers) is not run, its `config` module (an ml_collections
ConfigDict holding the device) is given device=cpu, and its `CompressedLlamaDecoderLayer.forward`,
written for transformers 4.x's layer call (attention returning three values, the layer a tuple), is
repeated for 5.x's (`cache=`, `position_embeddings=`, attention returning two values, the layer
returning a tensor) with the same shortcut arithmetic. Its sliced model is exported to ONNX by the
same `realmodels_llm.export` as the original, so both methods are timed as onnxruntime files.

`SliceGPT fused (no slice)`: its `fuse_modules` alone (γ into the readers, and — for every model,
RMSNorm ones too — each embedding row's mean subtracted), scored in torch: what its slices start from.

lnfold refuses a slice with more parameters than the model's own; SliceGPT's slices here have 1.05–1.23×, so
the lnfold part lifts that guard to score lnfold's beside them (its note says where `lnfold slice` refuses).
A per-block lnfold slice of this model takes ~10 min (60 sequential steps, one sliced fold and capture each, on a
2-core machine): `--bases one` for a quick run.

Investigation options: `--slicegpt-variants head unit-rms both uncentered` (SliceGPT's code with lnfold's choices
put in — the head sliced, the PCA of unit-RMS rows, the embedding left uncentered — scored in torch; `--variants-only` skips the plain runs) and
`--raw-moment` (lnfold's one basis too from SliceGPT's raw second moment, as its per-block bases are; files
`…-raw.onnx`).

Every ONNX file is saved under `<cache>/smollm2/slicegpt_llm/` (the `latency` part times them again, and the
one-basis files of `realmodels_llm --parts slice` where this benchmark made none).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
import types
import warnings
from pathlib import Path

import numpy as np
import onnx

from lnfold.onnx_rewrite.linear_layers import float_parameters
from lnfold.passes import LnfoldError
from lnfold.passes.slicing import kept_width

from . import realmodels as rm
from .common import run_header
from . import realmodels_llm as llm

PARTS = ("slicegpt", "lnfold", "latency")
# lnfold's slices (`--bases`): passes/slicer.SliceScheme's (per_block, full_width_head, center_embeddings)
SCHEMES = {"one": (False, False, False), "per-block": (True, False, False), "per-block-full-head": (True, True, False),
           "per-block-full-head-centered": (True, True, True)}
# SliceGPT with lnfold's choices put in: (slice_head, unit_rms, uncentered)
VARIANTS = {"head": (True, False, False), "unit-rms": (False, True, False), "both": (True, True, False),
            "uncentered": (False, False, True)}


# ---------------------------------------------------------------- SliceGPT, from its source tree

def import_slicegpt(src: Path) -> types.SimpleNamespace:
    """SliceGPT's modules from `src` (the folder holding `slicegpt/`), without its package __init__
    (trained/slicegpt_side.slicegpt_package), its Llama adapter's layer forward repeated for transformers 5."""
    import torch

    from .trained.slicegpt_side import slicegpt_modules, slicegpt_package

    slicegpt_package(src)
    from slicegpt.adapters.llama_adapter import CompressedLlamaDecoderLayer, LlamaModelAdapter

    class Transformers5Layer(CompressedLlamaDecoderLayer):
        """SliceGPT's CompressedLlamaDecoderLayer.forward for transformers 5's layer call."""

        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, cache=cache, use_cache=use_cache,
                                              position_embeddings=position_embeddings, **kwargs)
            if self.attn_shortcut_Q is not None:
                hidden_states = torch.matmul(residual, self.attn_shortcut_Q) + hidden_states
            else:
                hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
            if self.mlp_shortcut_Q is not None:
                return torch.matmul(residual, self.mlp_shortcut_Q) + hidden_states
            return residual + hidden_states

    return slicegpt_modules(LlamaModelAdapter, Transformers5Layer)


def slicegpt_prepare(sg: types.SimpleNamespace, lm, uncentered: bool = False):
    """run_slicegpt.py's steps before slicing on a copy of `lm`: replace the layers, fuse the norms
    (`uncentered`: its centering of each embedding row undone, lnfold's default on an RMSNorm model)."""
    import torch

    model = copy.deepcopy(lm)
    model.config.use_cache = False
    model.config.torch_dtype = torch.float32  # as its LlamaModelAdapter._from_pretrained sets it
    adapter = sg.Adapter(model)
    sg.fusion.replace_layers(adapter, verbose=False)
    sg.fusion.fuse_modules(adapter)
    if uncentered:  # (fuse_modules untied the head before it centered the embedding: the head is as given)
        model.model.embed_tokens.weight.data = lm.model.embed_tokens.weight.data.clone()
    return model, adapter


def slicegpt_slice(sg: types.SimpleNamespace, lm, calibration: np.ndarray, keep: int, slice_head: bool = False,
                   unit_rms: bool = False, uncentered: bool = False):
    """SliceGPT's rotate_and_slice to `keep` on the calibration rows (one batch, all-ones masks),
    its defaults: final_orientation='pca', the head not sliced. Three of lnfold's choices, to tell
    where the two differ: `slice_head` (its scheduler's do_slice_head: the last block writes, and
    the head reads, k features, as in lnfold's slice) and `unit_rms` (its `pca_calc` given each
    row divided by its RMS, the moment lnfold's bases come from, instead of the raw rows),
    `uncentered` (the embedding as given: lnfold centers it only with center_embeddings)."""
    import torch

    model, adapter = slicegpt_prepare(sg, lm, uncentered)
    ids = torch.from_numpy(calibration)
    loader = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    pca_calc = sg.rotate.pca_calc
    if unit_rms:
        sg.rotate.pca_calc = lambda xs, masks=None: pca_calc(
            [x / x.double().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30).to(x.dtype) for x in xs], masks)
    try:
        sg.rotate.rotate_and_slice(adapter, loader, sg.ConstSlicingScheduler(keep, do_slice_head=slice_head),
                                   final_orientation="pca")
    finally:
        sg.rotate.pca_calc = pca_calc
    return model.eval()


# ---------------------------------------------------------------- the parts

def slicegpt_part(sg, lm, cal, held, fractions, threads, base, out: Path, table: llm.Table, variants=(),
                  plain: bool = True) -> None:
    """SliceGPT's slices at each fraction (`plain`: as it runs, exported and scored in onnxruntime), and
    `variants` ((slice_head, unit_rms, uncentered): slicegpt_slice) scored in torch."""
    if plain:
        t0 = time.time()
        fused, _ = slicegpt_prepare(sg, lm)
        table.add("0", "SliceGPT fused (no slice)", "",
                  f"{llm.perplexity(llm.torch_logits(fused.eval(), held), held):.2f}", "", "", f"{time.time() - t0:.0f}",
                  "fuse_modules alone, torch")
        del fused
    d = lm.config.hidden_size
    for f in fractions:
        k = kept_width(d, f)
        if plain:
            t0 = time.time()
            sliced = slicegpt_slice(sg, lm, cal, k)
            torch_ppl = llm.perplexity(llm.torch_logits(sliced, held), held)
            path = out / f"slicegpt-{f:g}.onnx"
            path.unlink(missing_ok=True)
            llm.export(sliced, path)
            del sliced
            model = onnx.load(str(path))
            params = float_parameters(model)
            table.add(f"{f:g}", "SliceGPT", str(k), f"{llm.ort_perplexity(model, held, threads):.2f}",
                      f"{params:,}", f"{params / base:.3f}", f"{time.time() - t0:.0f}",
                      f"torch {torch_ppl:.2f}; head reads all {d} features (not sliced)")
        for slice_head, unit_rms, uncentered in variants:
            t0 = time.time()
            sliced = slicegpt_slice(sg, lm, cal, k, slice_head, unit_rms, uncentered)
            label = "SliceGPT" + (", head sliced" if slice_head else "") + (", unit-RMS PCA" if unit_rms else "") \
                + (", embedding not centered" if uncentered else "")
            table.add(f"{f:g}", label, str(k), f"{llm.perplexity(llm.torch_logits(sliced, held), held):.2f}", "", "",
                      f"{time.time() - t0:.0f}", "torch (not exported); lnfold's choice put into SliceGPT's code")
            del sliced


def lnfold_part(model, cal, cal_heldout, held, fractions, bases, threads, base, out: Path, table: llm.Table,
                raw_moment: bool = False) -> None:
    """`lnfold.slice_onnx`'s steps (onnx_rewrite/slice.py: its frontend, `slice_with`), the exact fold and
    its capture made once for every slice (realmodels_slice.ReusedFold), per block and/or one basis.
    lnfold refuses a slice with more parameters than the model's own (SliceGPT's at these fractions
    have 1.1-1.2x); to score it beside SliceGPT's all the same, that guard is lifted here (the
    frontend's `original` count set past any slice), and so is the plan's per-stream one (a per-block
    stream whose shortcut MatMuls hold more than its slice deletes: passes/rotate._costs_more, F = 0.1
    here); the note says where `lnfold slice` refuses.
    `raw_moment`: one basis too from the raw rows' second moment (per block it is lnfold's already,
    SliceGPT's choice; one basis pools unit-RMS rows): passes/slicing.second_moment forced in this
    process, an experiment, files `…-raw.onnx`."""
    from lnfold.onnx_rewrite import calibration as calibration_io
    from lnfold.onnx_rewrite import targets
    from lnfold.onnx_rewrite.slice import slicing_frontend
    from lnfold.passes import make_plan
    from lnfold.passes.slicer import SliceScheme, slice_with

    from lnfold.passes import rotate

    from .realmodels_slice import ReusedFold

    if raw_moment:  # SliceGPT's moment (its pca_calc's Σ xxᵀ; its 1 % damping moves no eigenvector)
        from lnfold.passes import slicing
        moment = slicing.second_moment
        slicing.second_moment = lambda batches, axis, unit_rms=True: moment(batches, axis, unit_rms=False)
    data = calibration_io.calibration_data(model, {"input_ids": cal}, {"input_ids": cal_heldout})
    frontend = ReusedFold(slicing_frontend(model, targets.resolve("ort", "cpu"), data, None))
    frontend.original = 10 ** 15  # the guard lifted (see above); `base` is the model's own count
    costs_more = rotate._costs_more  # (and the per-stream one, for slices: a rotation keeps it)
    rotate._costs_more = lambda view, rot: None if rot.width < rot.dim else costs_more(view, rot)
    for label in bases:
        for f in fractions:
            t0 = time.time()
            try:
                _, sliced, r = slice_with(frontend, f, make_plan, None, SliceScheme(*SCHEMES[label]))
            except Exception as e:  # noqa: BLE001 (the cell says what happened)
                traceback.print_exc()
                table.add(f"{f:g}", f"lnfold {label}", "", "—", "—", "—", f"{time.time() - t0:.0f}", llm.failure(e))
                continue
            widths = ", ".join(sorted({f"{s.dim}→{s.keep}" for s in r.streams if s.sliced})) or "none sliced"
            onnx.save(sliced.model, str(out / f"lnfold-{f:g}-{label}{'-raw' if raw_moment else ''}.onnx"))
            params = float_parameters(sliced.model)
            note = f"rel. error vs exact fold {r.error:.3g} ({r.error_rows}); {'; '.join(r.notes)}"
            if params > base:
                note += "; `lnfold slice` refuses this slice (more parameters than the model's own)"
            table.add(f"{f:g}", f"lnfold {label}" + (", raw-moment PCA" if raw_moment else ""), widths, f"{llm.ort_perplexity(sliced.model, held, threads):.2f}",
                      f"{params:,}", f"{params / base:.3f}", f"{time.time() - t0:.0f}", note.replace("|", "\\|"))
            del sliced


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slicegpt-src", type=Path, required=True,
                   help="TransformerCompression's src/ folder (holding slicegpt/)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.2, 0.25])
    p.add_argument("--bases", nargs="+", default=["per-block", "one"], choices=list(SCHEMES),
                   help="lnfold: a basis per block (per-block-full-head: the head segment kept d wide, as "
                        "SliceGPT's; -centered: the embedding centered too, as SliceGPT's) and/or one basis per "
                        "stream (default per-block and one)")
    p.add_argument("--slicegpt-variants", nargs="*", default=[], choices=list(VARIANTS),
                   help="SliceGPT with lnfold's choices put in, scored in torch: head (the head sliced), unit-rms "
                        "(PCA of RMS-normalized rows), both, uncentered (its embedding centering undone)")
    p.add_argument("--variants-only", action="store_true", help="slicegpt part: the variants alone")
    p.add_argument("--raw-moment", action="store_true",
                   help="lnfold part: bases from the raw rows' second moment (SliceGPT's), an experiment")
    p.add_argument("--cache", help=f"download folder (default ${rm.CACHE_ENV}, else ~/.cache/lnfold)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime/torch threads for perplexity (default 1)")
    p.add_argument("--rounds", type=int, default=10, help="latency rounds (default 10)")
    args = p.parse_args(argv)
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    sg = import_slicegpt(args.slicegpt_src.resolve()) if "slicegpt" in args.parts else None
    cache = rm.cache_dir(args.cache)
    out = cache / "smollm2" / "slicegpt_llm"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        lm, _, cal, cal_heldout, held, onnx_path = llm.materials(cache)
    except LnfoldError as e:
        print(f"benchmarks.slicegpt_llm: {e}", file=sys.stderr)
        return 2
    print(run_header("benchmarks.slicegpt_llm", argv, "torch", "onnxruntime", "transformers") + "\n", flush=True)
    model = onnx.load(str(onnx_path))
    base = float_parameters(model)
    if {"slicegpt", "lnfold"} & set(args.parts):
        table = llm.Table(f"SmolLM2-135M sliced, perplexity (onnxruntime) on the {len(held)} Apache-2.0 windows; "
                          f"calibration: the {len(cal)} GPL-3 windows",
                          ["F", "method", "width(s)", "perplexity", "parameters", "× original", "seconds", "note"])
        table.add("0", "original", str(lm.config.hidden_size), f"{llm.ort_perplexity(model, held, args.threads):.2f}",
                  f"{base:,}", "1.000", "", "")
        if "slicegpt" in args.parts:
            slicegpt_part(sg, lm, cal, held, args.fractions, args.threads, base, out, table,
                          [VARIANTS[v] for v in args.slicegpt_variants], not args.variants_only)
        del lm
        if "lnfold" in args.parts:
            lnfold_part(model, cal, cal_heldout, held, args.fractions, args.bases, args.threads, base, out, table,
                        args.raw_moment)
    if "latency" in args.parts:
        del model
        timed = {"original": onnx_path, "original (A/A)": onnx_path}
        for f in args.fractions:
            for name in (f"slicegpt-{f:g}", f"lnfold-{f:g}-one", f"lnfold-{f:g}-per-block"):
                if (out / f"{name}.onnx").is_file():
                    timed[name] = out / f"{name}.onnx"
            earlier = cache / "smollm2" / f"sliced-{f:g}-one.onnx"  # realmodels_llm's slice part: the same call
            if f"lnfold-{f:g}-one" not in timed and earlier.is_file():
                timed[f"lnfold-{f:g}-one (realmodels_llm --parts slice's file)"] = earlier
        llm.latency_part(timed, held, args.rounds)
    print(f"(benchmark wall time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
