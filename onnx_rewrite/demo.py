"""`lnfold demo`: a small random GPT-2, exported, reported, folded, verified and timed."""
from __future__ import annotations

import contextlib
import io as _io
import tempfile
import time
from pathlib import Path

import numpy as np


def run_demo(layers: int = 4, hidden: int = 256, keep: str | None = None) -> int:
    from .. import zoo
    from ..passes.timing import interleaved

    from . import io
    from .api import analyze_model, fold_model
    from .verify import session

    t0 = time.perf_counter()
    print(f"lnfold demo: GPT-2 with {layers} layers, width {hidden}, random weights made adversarial "
          "(randomized γ/β, large-mean sources)")
    module, args = zoo.gpt2(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab=1000, positions=128)
    with contextlib.redirect_stdout(_io.StringIO()), contextlib.redirect_stderr(_io.StringIO()):
        model = zoo.export_onnx(module, args, ["input_ids"], opset=18)
    print(f"exported to ONNX (opset 18) in {time.perf_counter() - t0:.1f} s\n")

    print(analyze_model(model).table(), "\n")
    result = fold_model(model)  # verifies by default
    print(f"folded in {sum(v for k, v in result.timings.items() if k != 'verification'):.3f} s; "
          f"verified in onnxruntime: max relative output difference {result.max_rel_err:.2e}")

    out_dir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="lnfold-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    io.save(model, out_dir / "gpt2.onnx")
    io.save(result.model, out_dir / "gpt2.folded.onnx")

    ids = np.random.default_rng(0).integers(0, 1000, size=(1, 128)).astype(np.int64)
    a, b = session(out_dir / "gpt2.onnx"), session(out_dir / "gpt2.folded.onnx")
    name = a.get_inputs()[0].name
    stats = interleaved({"original": lambda: a.run(None, {name: ids}), "folded": lambda: b.run(None, {name: ids})},
                        rounds=30)
    o, f = stats["original"]["median"], stats["folded"]["median"]
    print(f"onnxruntime CPU, batch 1 x 128 tokens, 30 interleaved runs: original {o * 1e3:.2f} ms, "
          f"folded {f * 1e3:.2f} ms (median), folded/original = {f / o:.3f}")
    print(f"models in {out_dir}; demo took {time.perf_counter() - t0:.1f} s")
    return 0
