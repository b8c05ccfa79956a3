"""`lnfold.fold_checkpoint`: stream a checkpoint's shards through the plan, verify, publish.

How each shard is edited: DESIGN §2 "Checkpoints", *Editing*. The new folder is built under a
temporary name beside the output and renamed into place once verified: a failure leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..passes import FoldResult, LnfoldError, pipeline
from ..passes.edits import NUMPY, apply_ops, centers_first_axis, chunk_axis, only_centers
from ..passes.errors import first_line
from ..passes.options import FoldOptions
from ..passes.outputs import (Staging, check_output_folder, default_output_folder, flush_tree, folder_files,
                              fsync_folder, inside)
from ..passes.shards import ShardJob, shard_work
from ..passes.weights import center
from .checkpoint import INDEX, SINGLE, Checkpoint, CheckpointPlan, is_checkpoint, plan_checkpoint, read_checkpoint, \
    skeleton, stored_names
from .checkpoint_verify import verify_checkpoint
from .edits import rounded
from .safetensors_io import DTYPES, Rows, ShardWriter, edited_pieces, nbytes, row_blocks

SLICE_BYTES = 64 << 20  # float64 working set of an edited tensor streamed by rows
HEAP_MMAP_BYTES = SLICE_BYTES // 64  # glibc: every allocation from this size up is a mapping of its own


# --- the C heap ----------------------------------------------------------------------------------------------

def _glibc(function: str, *args) -> None:
    """glibc's `function(*args)`; nothing on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover
        return
    if hasattr(libc, function):
        getattr(libc, function)(*args)


def heap_returns_memory() -> None:
    """glibc, process-wide and for good (glibc cannot restore its moving threshold): every
    allocation of HEAP_MMAP_BYTES or more is a mapping of its own, given back when freed. By
    default glibc raises that threshold up to 32 MB as mappings are freed, so the fold's 1-32 MB
    arrays stay in the threads' heaps, fragmented, under verification's float64 run (a 0.37 B
    GPT-NeoX: 525 MiB over the import baseline, 355 MiB with this; benchmarks/RESULTS.md)."""
    _glibc("mallopt", -3, HEAP_MMAP_BYTES)  # M_MMAP_THRESHOLD (which also fixes M_TRIM_THRESHOLD at 128 KB)


def release_heap() -> None:
    """Give back the memory one stage freed before the next one runs: Python's cycles, then the
    free pages of glibc's heaps (malloc_trim)."""
    gc.collect()
    _glibc("malloc_trim", 0)


# --- streaming the edits -------------------------------------------------------------------------------------

def fold_shard(ck: Checkpoint, out: Path, job: ShardJob) -> dict:
    """Write one output shard: every tensor of `job`, copied or edited in float64; returns its tensor
    names -> their sizes (for the index). Read with pread, not a memory map, whose pages count in
    the process's resident memory (two mapped 400 MB shards alone would take the memory budget)."""
    header, handles = ck.shards[job.file], {}

    def rows(name: str) -> Rows:
        file = ck.where[name]
        if file not in handles:
            handles[file] = files.enter_context(open(ck.folder / file, "rb", buffering=0))
        e = ck.shards[file].entries[name]
        return Rows(handles[file], ck.shards[file].data_start + e.begin, DTYPES[e.dtype], e.shape)

    def source(name: str) -> np.ndarray:  # another constant an op reads (small: a LayerScale vector)
        return rows(name)[:].to(torch.float64).numpy()

    entries = [ck.shards[ck.where[t.source]].entries[t.source] for t in job.tensors]
    sizes = {t.name: nbytes(e.dtype, e.shape) for t, e in zip(job.tensors, entries)}
    with contextlib.ExitStack() as files:
        raw = files.enter_context(open(ck.folder / job.file, "rb"))
        path = inside(out, job.file, str(ck.folder / INDEX))  # (read_checkpoint checked it too: in its folder)
        path.parent.mkdir(parents=True, exist_ok=True)  # (shards in a subfolder keep it)
        writer = ShardWriter(path, [(t.name, e.dtype, e.shape) for t, e in zip(job.tensors, entries)],
                             header.metadata or {"format": "pt"})
        files.callback(writer.f.close)
        for t, e in zip(job.tensors, entries):
            if not t.ops and t.source in header.entries:
                own = header.entries[t.source]
                writer.copy(t.name, raw, header.data_start + own.begin, own.end - own.begin)
            elif not t.ops:  # (a tensor of another shard: a tied table's copy)
                writer.put(t.name, edited_pieces(rows(t.source), 0, lambda b: b, SLICE_BYTES), sizes[t.name])
            else:
                writer.put(t.name, _edited(rows(t.source), DTYPES[e.dtype], t.ops, source), sizes[t.name])
        writer.close()
    return sizes


def _edited(x: Rows, dtype: torch.dtype, ops: tuple, source: Callable):
    """The bytes of tensor `x` (still in its file) after `ops`, a block of rows (about SLICE_BYTES
    of float64) at a time where the ops allow (`chunk_axis`, `centers_first_axis`), else whole."""
    ndim = len(x.shape)
    if not centers_first_axis(ops, ndim):
        return edited_pieces(x, chunk_axis(ops, ndim), _editor(ops, source, dtype), SLICE_BYTES)
    as_stored = dtype in (torch.float16, torch.float32, torch.float64)  # (numpy's own; bf16 through float64)

    def values(b: torch.Tensor) -> np.ndarray:
        return b.numpy() if as_stored else b.to(torch.float64).numpy()

    mean = sum(values(x[lo:hi]).sum(axis=0, dtype=np.float64, keepdims=True)
               for lo, hi in row_blocks(x.shape, SLICE_BYTES)) / x.shape[0]

    def block(b: torch.Tensor) -> torch.Tensor:
        a = center(values(b), ops[0].axis, mean=mean)
        return torch.from_numpy(a) if as_stored else rounded(a, dtype)

    return edited_pieces(x, 0, block, SLICE_BYTES)


def _editor(ops: tuple, source: Callable, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    # A centering computes its mean and difference in float64 from any float input and rounds
    # once to the input's dtype (passes/weights.py `center`): fp16/fp32 tensors go in as they
    # are, without a float64 copy of the tensor (a third less editing time); other ops get it.
    as_stored = dtype in (torch.float16, torch.float32) and only_centers(ops)

    def edit(x: torch.Tensor) -> torch.Tensor:
        if as_stored:
            return torch.from_numpy(np.ascontiguousarray(apply_ops(x.numpy(), ops, source, NUMPY)))
        a = apply_ops(x.to(torch.float64).numpy(), ops, source, NUMPY)  # (passes/edits.py: the one interpreter)
        return rounded(np.ascontiguousarray(a, dtype=np.float64), dtype)

    return edit


def write_shards(ck: Checkpoint, jobs_list: list[ShardJob], out: Path, jobs: int) -> dict[str, int]:
    """Every output shard, `jobs` at a time; tensor name -> its size. Threads, not processes: the
    work is numpy arithmetic and file copies, which run outside the GIL, and a worker process
    would first pay its own torch import (~2 s and ~300 MB each)."""
    fold = functools.partial(fold_shard, ck, out)
    if jobs > 1 and len(jobs_list) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(jobs, len(jobs_list))) as pool:
            shards = list(pool.map(fold, jobs_list))
    else:
        shards = [fold(j) for j in jobs_list]
    return {name: size for s in shards for name, size in s.items()}


def _write_index(ck: Checkpoint, jobs_list: list[ShardJob], sizes: dict, out: Path) -> None:
    if (ck.folder / INDEX).is_file():
        meta = {**ck.index_meta, "total_size": sum(sizes.values())}
        weight_map = {t.name: j.file for j in jobs_list for t in j.tensors}
        (out / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                            indent=2) + "\n")


def _copy_others(ck: Checkpoint, others: list[str], out: Path, untied: bool) -> None:
    """config, tokenizer, generation files (`others`: passes/outputs.folder_files, which refused
    what is not a plain file of the folder): copied, a symlink as its file; config.json unties the
    embedding where the fold did."""
    weights = set(ck.shards) | {INDEX}
    for rel in others:
        if rel in weights:
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel == "config.json" and untied:
            cfg = {**ck.config_dict, "tie_word_embeddings": False}
            (out / rel).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copy2(ck.folder / rel, out / rel)


def check_complete(ck: Checkpoint, out: Checkpoint, plan: CheckpointPlan) -> None:
    """The output holds every tensor of the input (name, dtype, shape) and every tensor its stock
    class loads that the input's files gave it (DESIGN §2 "Checkpoints"). Cheap: headers and a
    model on the meta device, so it runs whether or not the fold is verified."""
    def entries(c: Checkpoint) -> dict:
        return {n: (e.dtype, e.shape) for h in c.shards.values() for n, e in h.entries.items()}

    before, after = entries(ck), entries(out)
    for name, (dtype, shape) in before.items():
        if after.get(name) != (dtype, shape):
            got = "lacks it" if name not in after else f"has it as {after[name][0]} {list(after[name][1])}"
            raise LnfoldError(f"internal: input tensor {name} ({dtype} {list(shape)}): the output {got}; "
                              "nothing written")
    model = skeleton(out.config)
    found = stored_names(model, out)
    for name in model.state_dict():
        if name not in found and name in plan.stored:
            raise LnfoldError(f"internal: {type(model).__name__} loads {name} from the input (tensor "
                              f"{plan.stored[name]}) and the output does not hold it: from_pretrained would fill it "
                              "at random; nothing written")


def fold_checkpoint(src, dst=None, *, mode: str = "rms", verify: bool = True, jobs: Optional[int] = None,
                    progress: Optional[Callable[[str], None]] = None) -> FoldResult:
    """Fold the `transformers` checkpoint folder `src` into `dst` (default `src.folded`).

    The plan comes from config.json alone (meta device); each shard is streamed and edited in
    float64, `jobs` shards at a time (threads; default 2 where there are 2 cores); with `verify`
    the output is checked block by block against the original in bounded memory
    (fx_rewrite/checkpoint_verify.py, the gate of passes/gate.py) before it is renamed into place.
    Returns a FoldResult with the report, `model` = the output folder, and the timings.
    Raises LnfoldError (one line) for a bad folder, NothingToFold, VerificationError.

    Memory: the peak stays within the RSS after importing torch, transformers and lnfold plus 3x
    the largest shard where that shard is ~125 MB or more (tests/test_checkpoint_memory.py). It is
    ~90 MB that torch.export's imports keep, plus the larger of editing (per thread, a few
    SLICE_BYTES float64 blocks of rows, or a tensor `chunk_axis` cannot split whole) and verification
    (one module's parameters in float64, in a pool of at most 4 x SLICE_BYTES, a linear layer by
    blocks of rows and an embedding by the rows it looks up; any other module whole): the stages do
    not stack, as `heap_returns_memory` and the trim between them keep the heap from holding on."""
    opts = FoldOptions(mode=mode, verify=verify)
    if jobs is None:  # (two: one edits while the other waits for the disk)
        jobs = min(2, os.cpu_count() or 1)
    if not isinstance(jobs, int) or jobs < 1:
        raise LnfoldError(f"jobs must be a positive integer, not {jobs!r}")
    src = Path(src)
    if not is_checkpoint(src):
        raise LnfoldError(f"{src}: not a transformers checkpoint folder (config.json with {SINGLE} or {INDEX})")
    dst = Path(dst) if dst is not None else default_output_folder(src)
    check_output_folder(src, dst)
    others = folder_files(src)  # (a link out, a FIFO, ...: refused before anything is read or written)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pipeline.stage(progress, "reading the checkpoint's headers")
    ck = read_checkpoint(src)
    pipeline.stage(progress, "analyzing (the model built on the meta device)")
    plan = plan_checkpoint(ck, opts.mode)
    timings["analysis"] = time.perf_counter() - t0
    files = {f: list(h.entries) for f, h in ck.shards.items()}
    work = shard_work(files, plan.in_place, plan.new)
    result = FoldResult(report=plan.report, model=dst)
    heap_returns_memory()
    with Staging.folder(dst) as tmp:
        try:
            t1 = time.perf_counter()
            pipeline.stage(progress, f"editing {sum(j.edited for j in work)} tensors in {len(work)} shard(s)")
            sizes = write_shards(ck, work, tmp, jobs)
            _write_index(ck, work, sizes, tmp)
            _copy_others(ck, others, tmp, bool(plan.untied))
            written = read_checkpoint(tmp)
            check_complete(ck, written, plan)
            timings["editing"] = time.perf_counter() - t1
            if opts.verify:
                t2 = time.perf_counter()
                release_heap()  # (what editing freed, before verification's float64 run)
                pipeline.stage(progress, "verifying block by block in float64")
                verdict = verify_checkpoint(ck, written, plan)
                pipeline.record(result, verdict)
                timings["verification"] = time.perf_counter() - t2
            t3 = time.perf_counter()
            flush_tree(tmp)
            os.replace(tmp, dst)
            fsync_folder(dst.parent)
            timings["flush"] = time.perf_counter() - t3
        except OSError as e:
            raise LnfoldError(f"{dst}: cannot write: {first_line(e)}") from None
    if plan.traced != "every block":
        result.report.notes.append(f"analysis: exported {plan.traced}; the plan extended by name (passes/depth.py)")
    if plan.untied:
        result.report.notes.append("untied " + "; ".join(" / ".join(g) for g in plan.untied) +
                                   ": the embedding is centered, its other reader is not a stream source "
                                   "(config.json: tie_word_embeddings false)")
    if plan.aliases:
        result.report.notes.append("written apart, as the untied config loads them: " + "; ".join(
            f"{n} (the values of {src})" for n, src in plan.aliases.items()))
    result.timings = timings
    return result
