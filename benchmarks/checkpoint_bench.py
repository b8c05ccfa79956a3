"""Issue 25: folding a sharded `transformers` checkpoint in bounded memory (benchmarks/RESULTS.md,
"Checkpoints (issue 25)").

    python -m benchmarks.checkpoint_bench [--models opt-1.3b:float32,opt-1.3b:float16,pythia-1b:float16]
                                          [--root /tmp/i25/bench] [--keep] [--jobs 2]

For each model: a random checkpoint with adversarial weights (lnfold.zoo: large stream means,
randomized γ/β) saved by `save_pretrained(max_shard_size="300MB")`; then, each in a fresh
process whose peak RSS (VmHWM) and import baseline (RSS after importing lnfold's torch
frontend, transformers and accelerate) are recorded:
  cp      `cp -r` of the folder + `sync` (the floor: reading and writing the bytes), 3 runs, median
  fold    lnfold.fold_checkpoint(verify=False, jobs=--jobs) + `sync`
  fold+v  lnfold.fold_checkpoint(verify=True, jobs=--jobs) + `sync`
  whole   from_pretrained + fold_module(verify=False) + save_pretrained (the model in memory) + `sync`
Every time ends with the bytes on disk (the fold fsyncs its output before renaming it into place).
The folders are deleted at the end (unless --keep). The numbers are printed as one JSON line per
model and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    # facebook/opt-1.3b's config.json
    "opt-1.3b": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24,
                                                     ffn_dim=8192, num_attention_heads=32, max_position_embeddings=2048,
                                                     word_embed_proj_dim=2048, do_layer_norm_before=True)),
    # EleutherAI/pythia-1b's config.json
    "pythia-1b": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=16,
                                                              num_attention_heads=8, intermediate_size=8192,
                                                              rotary_pct=0.25, max_position_embeddings=2048,
                                                              use_parallel_residual=True, tie_word_embeddings=False)),
}

PROLOGUE = """
import json, os, sys, time, psutil
import torch, transformers, accelerate, lnfold, lnfold.fx_rewrite
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
"""
EPILOGUE = """
wall = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss carries the parent's across exec on Linux)
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
print(json.dumps({"wall": wall, "base": base, "peak": peak, **extra}))
"""
FOLD = """
r = lnfold.fold_checkpoint(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "1", jobs=int(sys.argv[4]))
os.sync()
extra = {"timings": r.timings, "exact_err": r.exact_err, "original_exact_err": r.original_exact_err,
         "folded": r.report.folded, "kept": r.report.kept}
"""
HELDOUT = """
# held-out inputs (not verification's): 4 x 64 ids of another seed; original and folded in their
# dtype and the original in float64, each streamed a module at a time (checkpoint_verify.Streamed)
from lnfold.fx_rewrite.checkpoint import read_checkpoint
from lnfold.fx_rewrite.checkpoint_verify import Streamed
from lnfold.passes.weights import max_rel_err
orig, folded = read_checkpoint(sys.argv[1]), read_checkpoint(sys.argv[2])
ids = torch.randint(0, orig.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
outs = {}
for key, ck, dt in (("original", orig, None), ("exact", orig, torch.float64), ("folded", folded, None)):
    m = Streamed(ck, dt)
    outs[key] = m.run(ids, [])[0].double().numpy()
    m.close()
extra = {"heldout_folded_err": max_rel_err(outs["exact"], outs["folded"]),
         "heldout_original_err": max_rel_err(outs["exact"], outs["original"]),
         "heldout_argmax_agree": float((outs["folded"].argmax(-1) == outs["original"].argmax(-1)).mean())}
# and what a user does with it: both loaded by from_pretrained in the stock class, 32 greedy tokens
gen = []
for folder in sys.argv[1:3]:
    m = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        gen.append(m.generate(ids[:2, :8], max_new_tokens=32, do_sample=False, pad_token_id=0)[:, 8:].tolist())
    del m
extra["generated_same_tokens"] = gen[0] == gen[1]
"""
WHOLE = """
from lnfold.fx_rewrite.checkpoint import FirstOutput
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").eval()
res = lnfold.fold_module(FirstOutput(m), (torch.zeros(1, 8, dtype=torch.long),), verify=False)
m.save_pretrained(sys.argv[2], max_shard_size="300MB")
os.sync()
extra = {"folded": res.report.folded}
"""


def build(name: str, dtype: str, folder: Path) -> None:
    code = f"""
import torch, transformers
from lnfold.zoo import adversarial
cfg_cls, model_cls, kw = {CONFIGS[name]!r}
cfg = getattr(transformers, cfg_cls)(**kw)
torch.manual_seed(0)
m = adversarial(getattr(transformers, model_cls)(cfg)).to(torch.{dtype})
m.save_pretrained({str(folder)!r}, max_shard_size="300MB")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def run(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", PROLOGUE + code + EPILOGUE, *map(str, args)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cp(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter() - t0
    shutil.rmtree(dst)
    return t


def measure(name: str, dtype: str, root: Path, jobs: int) -> dict:
    src = root / f"{name}-{dtype}"
    if not src.exists():
        build(name, dtype, src)
    files = list(src.glob("*.safetensors"))
    row = {"model": name, "dtype": dtype, "shards": len(files), "bytes": sum(f.stat().st_size for f in files),
           "largest_shard": max(f.stat().st_size for f in files)}
    cp(src, root / "warm")  # (the page cache holds the files for every run alike)
    row["cp"] = statistics.median(cp(src, root / "cp") for _ in range(3))
    for key, verify in (("fold", "0"), ("fold_verify", "1")):
        out = root / "out"
        row[key] = run(FOLD, src, out, verify, jobs)
        if key == "fold_verify":
            row["heldout"] = run(HELDOUT, src, out)
        shutil.rmtree(out)
    out = root / "whole"
    try:
        row["whole"] = run(WHOLE, src, out)
    except subprocess.CalledProcessError as e:
        row["whole"] = {"error": (e.stderr or "").strip().splitlines()[-1:]}
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    gb, mb = 1e9, 1 << 20
    lines = ["| model | dtype | size (shards, largest) | cp -r | fold | fold + verify (verify share) | "
             "load + fold_module + save | peak RSS − import baseline: fold / fold+verify / whole | "
             "budget 3× largest shard |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, v, w = r["fold"], r["fold_verify"], r["whole"]
        share = v["timings"].get("verification", 0) / v["wall"]
        whole_t = f"{w['wall']:.1f} s" if "wall" in w else "failed"
        whole_m = f"{(w['peak'] - w['base']) / mb:.0f}" if "peak" in w else "-"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['bytes'] / gb:.2f} GB ({r['shards']}, {r['largest_shard'] / mb:.0f} MiB) "
            f"| {r['cp']:.1f} s | {f['wall']:.1f} s ({f['wall'] / r['cp']:.1f}× cp) | {v['wall']:.1f} s ({share:.0%}) "
            f"| {whole_t} | {(f['peak'] - f['base']) / mb:.0f} / {(v['peak'] - v['base']) / mb:.0f} / {whole_m} MiB "
            f"| {3 * r['largest_shard'] / mb:.0f} MiB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="opt-1.3b:float32,opt-1.3b:float16,pythia-1b:float16")
    ap.add_argument("--root", default="/tmp/i25/bench")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--jobs", type=int, default=2, help="fold_checkpoint's shard threads")
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in a.models.split(","):
        name, dtype = spec.split(":")
        rows.append(measure(name, dtype, root, a.jobs))
        print(json.dumps(rows[-1]), flush=True)
        if not a.keep:
            shutil.rmtree(root / f"{name}-{dtype}")
    print(table(rows))


if __name__ == "__main__":
    main()
