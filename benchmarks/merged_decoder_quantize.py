"""`lnfold quantize` on Optimum's merged decoder (issue 47): each scheme as given and `--rotate hadamard`,
the logits' relative RMS error on rows of each branch of its If, and the file size.

    python -m benchmarks.merged_decoder_quantize [--file tests/corpus/optimum_llama_decoder_model_merged.onnx]

Each cell is `lnfold quantize F -o Q --weights … [--activations int8] [--block-size 32] [--rotate hadamard]
--calibrate no_past.npz` (the CLI, in process), where no_past.npz is tests/test_llm_files.rows (16 rows of 8
token ids, an all-ones mask, an empty past, `use_cache_branch` False: the branch without past); the error
the report gives is on those rows. The written file is then run on rows of the other branch too
(tests/test_quantize_merged's: 4 rows of 5 tokens after a random past of 3, `use_cache_branch` True)
against the float file. W8A8 is refused (onnxruntime's static QDQ quantizer leaves the branches float):
its refusal is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from .common import ROOT, run_header

SCHEMES = [("int8 dynamic", ["--weights", "int8"]),
           ("W8A8 (static QDQ)", ["--weights", "int8", "--activations", "int8"]),
           ("int4 b32", ["--weights", "int4", "--block-size", "32"]),
           ("W4A8 b32", ["--weights", "int4", "--block-size", "32", "--activations", "int8"])]


def logits_rel_rms(float_file: Path, quantized: Path, feeds: dict) -> float:
    want = ort.InferenceSession(str(float_file)).run(["logits"], feeds)[0]
    got = ort.InferenceSession(str(quantized)).run(["logits"], feeds)[0]
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def main(argv=None) -> None:
    from lnfold.onnx_rewrite import cli
    from tests.test_llm_files import rows
    from tests.test_quantize_merged import _merged_llm_rows

    p = argparse.ArgumentParser()
    p.add_argument("--file", type=Path, default=ROOT / "tests/corpus/optimum_llama_decoder_model_merged.onnx")
    args = p.parse_args(argv)
    print(run_header("benchmarks.merged_decoder_quantize", argv, "onnxruntime", "onnx"))
    model = onnx.load(str(args.file))
    past = _merged_llm_rows(model, True)
    print(f"float file: {args.file.stat().st_size / 1024:.0f} KiB\n")
    print("| scheme | rotate | logits rel. RMS, no-past branch (the report's) | logits rel. RMS, past branch | "
          "size KiB |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="lnfold-merged-") as tmp:
        calib = Path(tmp) / "no_past.npz"
        np.savez(calib, **rows(model))
        for label, flags in SCHEMES:
            for rotate in ([], ["--rotate", "hadamard"]):
                out = Path(tmp) / "q.onnx"
                said, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(err):
                    code = cli.main(["quantize", str(args.file), "-o", str(out), *flags, *rotate,
                                     "--calibrate", str(calib), "--json"])
                how = "hadamard" if rotate else "as given"
                if code:
                    print(f"| {label} | {how} | refused: {err.getvalue().strip()} | | |")
                    continue
                report = json.loads(said.getvalue())
                print(f"| {label} | {how} | {report['errors']['logits']['rel_rms']:.2e} | "
                      f"{logits_rel_rms(args.file, out, past):.2e} | {out.stat().st_size / 1024:.0f} |")
                out.unlink()


if __name__ == "__main__":
    main()
