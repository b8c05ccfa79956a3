"""What `lnfold fold` costs a user next to what onnxruntime itself costs (issue 24, item 1).

For each model: `lnfold fold --json` (fold + verification, as a user runs it) against what an
onnxruntime user pays for the original file: a fresh interpreter, `import onnxruntime`, a session
and one run on saved inputs (imports included in both: a user pays them; until 2026-12-02 the
baseline also imported lnfold and onnx and made its inputs, which flattered the ratio ~2.5x), rounds
interleaved, medians reported.
The ratio fold/onnxruntime is the figure; the fold's `--json` timings say where its time went.

Models: `transformers` default configs (GPT-2 124 M, ViT-base 86 M, CLIP ViT-B/32 151 M) with
random weights made adversarial (lnfold.zoo.adversarial), exported by torch.onnx (dynamo and
TorchScript for GPT-2), cached under benchmarks/.cache. Memory: this machine's 24 GiB are shared
by several jobs, so nothing above ~350 M parameters is built here (1.5 B is not measured).

    python -m benchmarks.foldtime [--rounds 3] [--only gpt2-dynamo,...] [--label after]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, machine, now
from .models import CACHE

# The original's cost for onnxruntime as its user pays it (issue 45 item 16): a fresh interpreter,
# `import onnxruntime`, a session and one run on inputs already saved (np.load). The inputs are
# verification's own made-up ones (inputs.candidates' first assignment), made once by the parent,
# outside the timing: the baseline no longer imports lnfold or onnx, nor parses the model with onnx.
_ORT_ONCE = """
import sys
import numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
so = ort.SessionOptions(); so.log_severity_level = 3
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
s.run(None, feeds)
"""

def _build(name: str, path: Path) -> None:
    import torch
    import transformers

    from lnfold import zoo

    torch.manual_seed(0)
    if name.startswith("gpt2"):
        cfg = transformers.GPT2Config(attn_implementation="eager")
        module = zoo.Logits(zoo.adversarial(transformers.GPT2LMHeadModel(cfg)), "logits")
        args, names = (torch.randint(0, cfg.vocab_size, (2, 8)),), ["input_ids"]
    elif name == "vit-base":
        cfg = transformers.ViTConfig(attn_implementation="eager")
        module = zoo.Logits(zoo.adversarial(transformers.ViTModel(cfg, add_pooling_layer=False)), "last_hidden_state")
        args, names = (torch.randn(2, 3, 224, 224),), ["pixel_values"]
    elif name == "clip-vision":
        cfg = transformers.CLIPVisionConfig(attn_implementation="eager")
        module = zoo.Logits(zoo.adversarial(transformers.CLIPVisionModel(cfg)), "last_hidden_state")
        args, names = (torch.randn(2, 3, 224, 224),), ["pixel_values"]
    else:
        raise SystemExit(f"unknown model {name}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = zoo.export_onnx(module.eval(), args, names, opset=18, dynamo=not name.endswith("torchscript"))
    import onnx

    onnx.save(model, str(path))


MODELS = ("gpt2-dynamo", "vit-base", "clip-vision")  # TorchScript cannot export GPT2 here (aten::diff)


def model_path(name: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"foldtime-{name}.onnx"
    if not path.exists():
        _build(name, path)
    return path


def _params(path: Path) -> int:
    import numpy as np
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return sum(int(np.prod(t.dims)) for t in m.graph.initializer)


def _fold_once(path: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(path), "-o", str(out), "--json"],
                       capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"lnfold fold {path.name}: rc {p.returncode}: {p.stderr.strip()[-300:]}")
    res = json.loads(p.stdout)
    res["wall"] = wall
    return res


def _saved_inputs(path: Path) -> Path:
    """Verification's made-up inputs for `path`, saved once beside it (the baseline reads them)."""
    import numpy as np
    import onnx

    from lnfold.onnx_rewrite import inputs

    npz = path.with_suffix(".inputs.npz")
    if not npz.exists():
        np.savez(npz, **next(inputs.candidates(onnx.load(str(path), load_external_data=False)))[1])
    return npz


def _ort_once(path: Path) -> float:
    npz = _saved_inputs(path)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _ORT_ONCE, str(path), str(npz)], capture_output=True, text=True,
                       cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"onnxruntime on {path.name}: {p.stderr.strip()[-300:]}")
    return time.perf_counter() - t0


def measure(name: str, rounds: int) -> dict:
    path = model_path(name)
    out = CACHE / f"foldtime-{name}.folded.onnx"
    folds, orts = [], []
    for r in range(rounds):  # interleaved, the order flipping every round
        steps = [lambda: folds.append(_fold_once(path, out)), lambda: orts.append(_ort_once(path))]
        for step in (steps if r % 2 == 0 else steps[::-1]):
            step()
    fold_wall = statistics.median(f["wall"] for f in folds)
    ort_wall = statistics.median(orts)
    stages = {k: round(statistics.median(f["timings"].get(k, 0.0) for f in folds), 2)
              for k in folds[0]["timings"]}
    return {"model": name, "params": _params(path), "fold_s": fold_wall, "ort_s": ort_wall,
            "ratio": fold_wall / ort_wall, "stages": stages, "criterion": folds[0]["criterion"],
            "exact_err": folds[0]["exact_err"], "original_exact_err": folds[0]["original_exact_err"],
            "rounds": rounds}


def table(rows: list[dict]) -> str:
    lines = ["| model | params | lnfold fold (s) | onnxruntime session + 1 run (s) | ratio | stages (s, median) | criterion |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        stages = ", ".join(f"{k} {v}" for k, v in r["stages"].items())
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f} M | {r['fold_s']:.1f} | {r['ort_s']:.1f} | "
                     f"**{r['ratio']:.1f}×** | {stages} | {r['criterion']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.foldtime")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=",".join(MODELS))
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = []
    for name in a.only.split(","):
        rows.append(measure(name, a.rounds))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{now()}; {machine().get('cpu', '?')}, 2 shared cores, 24 GiB, no GPU; `python -m benchmarks.foldtime {' '.join(argv or sys.argv[1:])}`\n")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
