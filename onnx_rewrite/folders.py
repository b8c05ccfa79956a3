"""`lnfold fold` on a folder, and where an output goes when `-o` is not given.

An exporter's folder (Optimum's `encoder_model.onnx`, ... with `config.json` and the tokenizer's files)
is folded file by file into a temporary folder renamed into place once every file is written, so a
failure leaves nothing behind. A `transformers` checkpoint folder is folded by the torch frontend.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from ..passes import LnfoldError, NothingToFold
from ..passes.errors import first_line
from ..passes.outputs import (FOLDED_SUFFIX, Staging, check_output_folder, default_output_folder, flush_tree,
                              folder_files, fsync_folder, inside, pickled_checkpoint)


def default_output(src: Path) -> Path:
    """`X.onnx` -> `X.folded.onnx` beside it; a folder `DIR` -> `DIR.folded` beside it."""
    if src.is_dir():
        return default_output_folder(src)
    stem = src.name[:-len(".onnx")] if src.name.lower().endswith(".onnx") else src.name
    return src.parent / f"{stem}{FOLDED_SUFFIX}.onnx"


def onnx_files(folder: Path) -> list[Path]:
    """The ONNX files of `folder` and its subfolders, in a stable order."""
    return sorted(p for p in folder.rglob("*.onnx") if p.is_file())


def check_onnx_folder(folder: Path) -> list[Path]:
    """The ONNX files of an exporter's folder, or a one-line error saying what the folder is."""
    found = onnx_files(folder)
    if found:
        return found
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        raise LnfoldError(f"{folder}: a transformers checkpoint (config.json, safetensors) with neither "
                          "model.safetensors nor model.safetensors.index.json, and no ONNX files")
    raise LnfoldError(pickled_checkpoint(folder) or f"{folder}: is a directory with no ONNX file in it")


def is_transformers_checkpoint(folder: Path) -> bool:
    """config.json with model.safetensors or its shard index, and no ONNX file: a checkpoint."""
    return (folder / "config.json").is_file() and any(
        (folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")) and not onnx_files(folder)


def fold_checkpoint_folder(src: Path, dst: Path | None, args) -> int:
    """`lnfold fold CHECKPOINT_DIR`: the torch frontend folds it shard by shard."""
    try:
        from ..fx_rewrite.checkpoint_fold import fold_checkpoint
    except ImportError as e:
        raise LnfoldError(f"{src}: a transformers checkpoint: folding it needs torch and transformers "
                          f"(pip install 'lnfold[torch]' transformers accelerate): {first_line(e)}") from None

    from .progress import reporting

    t0 = time.perf_counter()
    with reporting(src, json=args.json) as progress:
        result = fold_checkpoint(src, dst, mode=args.mode, verify=not args.no_verify, jobs=args.jobs, progress=progress)
    if args.json:
        print(json.dumps({"output": str(result.model), **fold_summary(result, args, time.perf_counter() - t0)},
                         indent=2))
        return 0
    print(result.report.table())
    print(f"lnfold: verification: {verification_line(result, args)}")
    t = result.timings
    print(f"lnfold: wrote {result.model} (a checkpoint for the stock class; its folded LayerNorms read a zero-mean "
          f"stream, where they compute RMSNorm) in {time.perf_counter() - t0:.2f} s: analysis "
          f"{t.get('analysis', 0):.2f} s, editing {t.get('editing', 0):.2f} s"
          + (f", verification {t['verification']:.2f} s" if "verification" in t else ""))
    return 0


def fold_folder(src: Path, dst: Path | None, args, fold_file: Callable) -> int:
    """Fold every ONNX file of `src` into `dst` (default `src.folded`), copy the rest; print one
    report (a table per folded file, then what was copied), or one JSON object with `--json`."""
    files = check_onnx_folder(src)
    dst = dst if dst is not None else default_output(src)
    check_output_folder(src, dst)
    others = folder_files(src)  # (a link out, a FIFO, ...: refused before anything is written)
    t0 = time.perf_counter()
    with Staging.folder(dst) as tmp:  # (a second lnfold writing dst: refused; a killed one's leftovers: removed)
        try:
            folded, unchanged, data_files = {}, {}, set()
            for f in files:
                rel = f.relative_to(src)
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                t1 = time.perf_counter()
                try:
                    folded[rel] = (fold_file(f, tmp / rel, args), time.perf_counter() - t1)
                except NothingToFold as e:  # (a file of a folder: copied as it is, and said so)
                    unchanged[rel] = str(e)
                    shutil.copy2(f, tmp / rel)
                    for d in _data_files_of(src, f):  # (in their layout: `sub/x.data` stays in sub/)
                        (tmp / d).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src / d, tmp / d)
                data_files |= set(_data_files_of(src, f))
            if not folded:
                raise NothingToFold(f"{src}: nothing to fold in its {len(files)} ONNX file(s); first: "
                                    f"{next(iter(unchanged.values()))}")
            copied = []
            for rel in others:  # (regular files, or links to one inside: folder_files refused the rest)
                if not rel.endswith(".onnx") and rel not in data_files:
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src / rel, tmp / rel)
                    copied.append(Path(rel))
            flush_tree(tmp)  # (on disk before the rename publishes it)
            os.replace(tmp, dst)  # (an empty folder at dst is replaced; check_output_folder refused a full one)
            fsync_folder(dst.parent)
        except OSError as e:
            raise LnfoldError(f"{dst}: cannot write: {first_line(e)}") from None
    _print_report(src, dst, folded, unchanged, copied, args, time.perf_counter() - t0)
    return 0


def _data_files_of(src: Path, model_file: Path) -> list[str]:
    """The external-data files that `model_file` (in folder `src`) refers to, as paths relative to
    `src` (`/`-separated, as folder_files names them), each checked to stay inside it."""
    import onnx

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception:  # not readable as ONNX: fold_file said why already, or it is no model of ours
        return []
    tensors = list(model.graph.initializer) + [s.values for s in model.graph.sparse_initializer]
    locations = {e.value for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL
                 for e in t.external_data if e.key == "location"}
    base = model_file.relative_to(src).parent.as_posix()
    locations = {loc[2:] if loc.startswith("./") else loc for loc in locations}  # (onnx reads `./x` as x)
    names = sorted(loc if base == "." else f"{base}/{loc}" for loc in locations)
    for name in names:
        inside(src, name, f"{model_file}: its external data")
    return names


def fold_summary(result, args, elapsed: float) -> dict:
    """One file's fold for `--json`: the report, the verification, timings."""
    return {"target": getattr(args, "target", None), "report": result.report.to_dict(),
            "verified": not args.no_verify, "max_rel_err": result.max_rel_err,
            "approximate": result.report.approx is not None,  # mode rms-approx: NOT equivalent (report.approximate)
            "exact_err": result.exact_err, "original_exact_err": result.original_exact_err,
            "criterion": result.criterion, "seconds": round(elapsed, 3), "timings": result.timings}


def verification_line(result, args) -> str:
    if result.report.approx is not None:  # not exact by design: what was measured instead
        a = result.report.approx
        held = "" if a.heldout is None else f", held-out {a.heldout:.3g}"
        return (f"APPROXIMATE, not equivalent: relative output error {a.total:.3g} on the calibration inputs "
                f"(budget {a.budget:g}){held}; the exact fold " + ("not verified (--no-verify)" if args.no_verify
                                                                    else "verified before the swap"))
    if args.no_verify:
        return "skipped (--no-verify)"
    how = f"; {result.verdict.summary()}" if result.verdict is not None else ""
    return f"max relative output difference {result.max_rel_err:.2e}{how}"


def _print_report(src: Path, dst: Path, folded: dict, unchanged: dict, copied: list, args, elapsed: float) -> None:
    if args.json:
        print(json.dumps({"output": str(dst), "target": args.target, "seconds": round(elapsed, 3),
                          "folded": {str(rel): fold_summary(r, args, s) for rel, (r, s) in folded.items()},
                          "unchanged": {str(rel): why for rel, why in unchanged.items()},
                          "copied": [str(rel) for rel in copied]}, indent=2))
        return
    for rel, (result, _) in folded.items():
        print(f"== {rel}")
        print(result.report.table())
        print(f"lnfold: verification: {verification_line(result, args)}\n")
    for rel, why in unchanged.items():
        print(f"== {rel}: copied unchanged, nothing to fold: {why}")
    if copied:
        print(f"copied: {', '.join(str(c) for c in copied)}")
    print(f"lnfold: wrote {dst} (target {args.target}): {len(folded)} folded, {len(unchanged)} unchanged, "
          f"{len(copied)} other file(s) copied, in {elapsed:.2f} s")
