"""Fold a `transformers` checkpoint folder shard by shard, in bounded memory (issue 25).

    lnfold fold CHECKPOINT_DIR -o OUT_DIR        lnfold.fold_checkpoint(src, dst)

The plan comes from the model's structure alone: the model is built from its config.json with
no weights (`accelerate.init_empty_weights`: every parameter on the meta device), exported and
analysed by the torch frontend exactly as `fold_module` does (fx_rewrite/api.py `ExportFrontend`,
`make_plan`), and the plan's constant edits are turned into edits of the checkpoint's tensors by
name. Then each shard is streamed (fx_rewrite/safetensors_io.py): a tensor no edit touches is
copied byte for byte, an edited one is read memory-mapped (`safetensors.safe_open`), edited in
float64 by the one edit interpreter (passes/edits.py `apply_ops`), a block of rows at a time
where its ops allow (passes/shards.py), and cast back. Shards are independent and folded in
parallel processes with `jobs > 1`. The new folder is built under a temporary name beside the
output and renamed into place when every file is written and verified.

What the output is: the same architecture, loaded by `from_pretrained` in its stock class. Its
LayerNorms stay LayerNorms, but every folded one now reads a zero-mean stream, where a LayerNorm
computes what an RMSNorm does (DESIGN §1, Lemma 2): exact in the stock class, and an RMSNorm
model for whoever swaps the op. Hence the target's capabilities: β stays the norm's own (the stock
LayerNorm has its bias), no CRMS compression (the stock class cannot drop a feature), and a
stream that would need a `Recenter` op (BLOOM's embedding LayerNorm starts its stream) is kept,
with its reason: the stock class has no such op. A tied table edited for one reader only (the
embedding centered, the lm_head reading it is not a source) is untied: config.json says
`tie_word_embeddings: false` and the lm_head gets its own tensor.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..passes import FoldResult, LnfoldError, NothingToFold, make_plan, pipeline
from ..passes.analysis import Component
from ..passes.edits import NUMPY, apply_ops
from ..passes.errors import first_line
from ..passes.options import FoldOptions
from ..passes.report import Report
from ..passes.request import Capabilities, PlanRequest
from ..passes.shards import ShardJob, TensorJob, chunk_axis, shard_work, untie
from .safetensors_io import CODES, ShardWriter, edited_pieces, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SLICE_BYTES = 64 << 20  # float64 working set of an edited tensor streamed by rows
STOCK = Capabilities(name="a transformers checkpoint (the stock class's LayerNorms)", folds_beta=False,
                     compresses=False)


def is_checkpoint(folder: Path) -> bool:
    """A `transformers` checkpoint folder: config.json with model.safetensors or a shard index."""
    return (folder / "config.json").is_file() and ((folder / SINGLE).is_file() or (folder / INDEX).is_file())


@dataclass
class Checkpoint:
    """A checkpoint folder, read and checked: its config, its shards' headers, where each tensor is."""

    folder: Path
    config: object  # transformers.PretrainedConfig
    config_dict: dict
    shards: dict  # file name -> safetensors_io.Header
    where: dict[str, str]  # tensor name -> file name
    index_meta: dict = field(default_factory=dict)

    @property
    def largest_shard(self) -> int:
        return max((self.folder / f).stat().st_size for f in self.shards)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard (memory-mapped)."""
        from safetensors import safe_open

        with safe_open(str(self.folder / self.where[name]), framework="pt") as f:
            return f.get_tensor(name)


def read_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint in `folder`, or a one-line LnfoldError saying what is wrong with it (a missing
    shard, an index naming a tensor no shard has, a truncated file, an unreadable config)."""
    import transformers

    folder = Path(folder)
    try:
        config_dict = json.loads((folder / "config.json").read_text())
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # (transformers raises ValueError, OSError, KeyError for a config it cannot read)
        raise LnfoldError(f"{folder / 'config.json'}: cannot read it as a transformers config: {first_line(e)}") from None
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
            weight_map = dict(index["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise LnfoldError(f"{folder / INDEX}: not a shard index ({first_line(e)})") from None
        files = sorted(set(weight_map.values()))
        meta = index.get("metadata", {}) or {}
    else:
        weight_map, files, meta = None, [SINGLE], {}
    for f in files:
        if not (folder / f).is_file():
            raise LnfoldError(f"{folder / f}: missing: the shard index names it and the folder does not have it")
    shards = {f: read_header(folder / f) for f in files}
    where = {n: f for f, h in shards.items() for n in h.entries}
    if weight_map is not None:
        for name, f in weight_map.items():
            if where.get(name) != f:
                raise LnfoldError(f"{folder / INDEX}: names tensor {name} in {f}, which has no such tensor")
    return Checkpoint(folder, config, config_dict, shards, where, meta)


# --- the plan, from the structure alone ----------------------------------------------------------------------

class FirstOutput(torch.nn.Module):
    """model(input_ids) -> its first output (the logits, or the last hidden state): what the
    analysis exports and verification compares."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        extra = {"use_cache": False} if getattr(self.model.config, "use_cache", None) is not None else {}
        return self.model(input_ids=ids, return_dict=False, **extra)[0]


def model_class(config):
    """The class config.json names (`architectures`), else the causal-LM class of its type."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def skeleton(config, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The model built from `config` with no weights: parameters on the meta device, buffers (rotary
    tables, masks) real. Eager attention: the one every exporter and the float64 run can trace."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    cls = model_class(config)
    try:
        with init_empty_weights():
            m = cls._from_config(config, torch_dtype=dtype) if dtype is not None else cls._from_config(config)
    except Exception as e:
        raise LnfoldError(f"cannot build {cls.__name__} from config.json on the meta device: {first_line(e)}") from None
    if hasattr(m, "tie_weights"):  # (from_pretrained ties after loading; a model built empty is not tied yet)
        m.tie_weights()
    return m.eval()


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names that share one tensor (a tied embedding and lm_head)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def stored_names(model: torch.nn.Module, ck: Checkpoint) -> dict[str, str]:
    """Model parameter/buffer name -> the checkpoint's name of its tensor: the same name, or
    with/without the base model's prefix (`model.` in older files), or a tied alias's."""
    prefix = getattr(model, "base_model_prefix", "") or ""

    def find(name: str) -> Optional[str]:
        for cand in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if cand in ck.where:
                return cand
        return None

    out = {n: s for n in model.state_dict() if (s := find(n)) is not None}
    for group in tied_groups(model):
        found = next((out[n] for n in group if n in out), None)
        if found is not None:
            out.update({n: found for n in group})
    return out


@dataclass
class CheckpointPlan:
    report: Report
    in_place: dict  # checkpoint tensor name -> ops
    new: list  # TensorJob: tensors the output gains (an untied table's second half)
    untied: list  # the tied groups broken
    norms: dict  # folded norm (its module path) -> ...
    stored: dict  # model name -> checkpoint name
    edits: int = 0


def plan_checkpoint(ck: Checkpoint, mode: str = "rms") -> CheckpointPlan:
    """The fold of `ck` as edits of its tensors, from its structure alone (no weight is read)."""
    from .api import ExportFrontend

    model = skeleton(ck.config)
    stored = stored_names(model, ck)
    wrapper = FirstOutput(model)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    frontend = ExportFrontend(wrapper, (ids,), {}, FoldOptions(mode=mode))
    try:
        view = frontend.view()
    except LnfoldError as e:
        raise LnfoldError(f"cannot trace {type(model).__name__} on the meta device: {e}") from None
    except Exception as e:
        raise LnfoldError(f"cannot trace {type(model).__name__} on the meta device (torch.export): "
                          f"{type(e).__name__}: {first_line(e)}") from None
    names = {a: t.removeprefix("model.") for a, t in frontend.attrs.items()}  # (FirstOutput's own prefix)

    def refuse(c: Component) -> Optional[str]:
        if c.opaque:
            return (f"its stream starts at {c.opaque[0].what}, which would need a Recenter op; "
                    "the stock class has none to load")
        for s in c.sources:
            for r in list(s.refs) + list(s.scales):
                if names.get(r.value) not in stored:
                    return f"it edits `{r.value}`, which is not a tensor of the checkpoint"
        return None

    plan = make_plan(view, PlanRequest(mode, "off", STOCK, refuse=refuse))
    if plan.recenters or plan.new_biases or any(cc.compressed for cc in plan.compressions) or plan.deferral.deferred:
        raise LnfoldError("internal: the plan asks for ops a checkpoint cannot hold")  # pragma: no cover
    modules = {n.name: _module_path(n) for n in frontend.gm.graph.nodes}
    report = plan.report.renamed(names)
    for v in report.norms:
        v.name = modules.get(v.name) or v.name
    if not report.norms:
        raise NothingToFold(f"{ck.folder}: no LayerNorm found in {type(model).__name__}: nothing to fold")
    if plan.empty:
        kept = next((v for v in report.norms if v.verdict == "keep"), None)
        raise NothingToFold(f"{ck.folder}: no LayerNorm can be folded; first kept: {kept.name}: {kept.reason}")
    groups = tied_groups(model)
    edits = _edits_by_name(plan, names, groups, {n.name: n for n in frontend.gm.graph.nodes})
    in_place, new, untied = untie(groups, stored, edits)
    # an op's other constants (a LayerScale folded into its source) by their checkpoint names
    sources = {a: stored[n] for a, n in names.items() if n in stored}
    in_place = {k: _named_ops(ops, sources) for k, ops in in_place.items()}
    new = [TensorJob(t.name, t.source, _named_ops(t.ops, sources)) for t in new]
    folded = {modules.get(s, s): s for s in plan.swaps}
    return CheckpointPlan(report, in_place, new, untied, folded, stored, len(plan.const_edits))


def _edits_by_name(plan, names: dict, groups: list[list[str]], nodes: dict) -> dict[str, tuple]:
    """Model parameter name -> ops. torch.export names a tied tensor once; an edit of it that is
    cloned (its other readers keep the original) belongs to the tied names whose modules are its
    users (the embedding, not the lm_head)."""
    group_of = {n: g for g in groups for n in g}
    out: dict[str, tuple] = {}
    for e in plan.const_edits:
        name = names[e.value]
        members = group_of.get(name, [name])
        if not e.clone:
            out.update({m: e.ops for m in members})
            continue
        users = {_module_path(nodes[plan.origin(u)]) for u, _ in e.users if plan.origin(u) in nodes}
        mine = [m for m in members if m.rpartition(".")[0] in users]
        if not mine:
            raise LnfoldError(f"the fold edits {name} for some of its readers only ({', '.join(sorted(users))}), "
                              "and the checkpoint has no tensor of theirs alone to write it to")
        out.update({m: e.ops for m in mine})
    return out


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("model.")


def _named_ops(ops: tuple, sources: dict) -> tuple:
    """`ops` with the constants they read renamed from the graph's names to the checkpoint's."""
    from dataclasses import fields, replace

    out = []
    for op in ops:
        changes = {f.name: sources[getattr(op, f.name)] for f in fields(op)
                   if f.name in ("by", "weight", "vector") and getattr(op, f.name) in sources}
        out.append(replace(op, **changes) if changes else op)
    return tuple(out)


# --- streaming the edits -------------------------------------------------------------------------------------

def fold_shard(folder: str, out: str, job: ShardJob, where: dict, metadata: dict) -> dict:
    """Write one output shard: every tensor of `job`, copied or edited in float64. Returns its
    new tensor names with their sizes (for the index). Top level: run in worker processes."""
    from safetensors import safe_open

    folder_p, header = Path(folder), read_header(Path(folder) / job.file)
    handles: dict[str, object] = {}

    def handle(file: str):
        if file not in handles:
            handles[file] = stack.enter_context(safe_open(str(folder_p / file), framework="pt"))
        return handles[file]

    def source(name: str) -> np.ndarray:  # another constant an op reads (small: a LayerScale vector)
        return handle(where[name]).get_tensor(name).to(torch.float64).numpy()

    layout = []
    for t in job.tensors:
        e = read_header(folder_p / where[t.source]).entries[t.source] if t.source not in header.entries \
            else header.entries[t.source]
        layout.append((t.name, e.dtype, e.shape))
    sizes = {}
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(open(folder_p / job.file, "rb"))
        writer = ShardWriter(Path(out) / job.file, layout, header.metadata or {"format": "pt"})
        try:
            for t, (_, code, shape) in zip(job.tensors, layout):
                nbytes = _nbytes(code, shape)
                sizes[t.name] = nbytes
                if not t.ops and t.source in header.entries:
                    e = header.entries[t.source]
                    writer.copy(t.name, raw, header.data_start + e.begin, e.end - e.begin)
                    continue
                x = handle(where[t.source]).get_tensor(t.source)
                if not t.ops:
                    writer.put(t.name, [_bytes(x)], nbytes)
                    continue
                edit = _editor(t.ops, source, x.dtype)
                writer.put(t.name, edited_pieces(x, chunk_axis(t.ops, x.ndim), edit, SLICE_BYTES), nbytes)
        finally:
            writer.f.close()
        writer.close()
    return sizes


def _editor(ops: tuple, source: Callable, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(x: torch.Tensor) -> torch.Tensor:
        a = apply_ops(x.to(torch.float64).numpy(), ops, source, NUMPY)  # (passes/edits.py: the one interpreter)
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    return edit


def _bytes(x: torch.Tensor):
    from .safetensors_io import tensor_bytes

    return tensor_bytes(x)


def _nbytes(code: str, shape: tuple) -> int:
    from .safetensors_io import itemsize

    n = itemsize(code)
    for s in shape:
        n *= s
    return n


def write_shards(ck: Checkpoint, jobs_list: list[ShardJob], out: Path, jobs: int) -> dict[str, int]:
    """Every output shard, `jobs` at a time in worker processes; tensor name -> its size."""
    args = [(str(ck.folder), str(out), j, ck.where, ck.shards[j.file].metadata) for j in jobs_list]
    sizes: dict[str, int] = {}
    if jobs > 1 and len(args) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(jobs, len(args))) as pool:
            for s in pool.starmap(fold_shard, args):
                sizes.update(s)
    else:
        for a in args:
            sizes.update(fold_shard(*a))
    return sizes


def _write_index(ck: Checkpoint, jobs_list: list[ShardJob], sizes: dict, out: Path) -> None:
    if (ck.folder / INDEX).is_file():
        meta = dict(ck.index_meta)
        meta["total_size"] = sum(sizes.values())
        weight_map = {t.name: j.file for j in jobs_list for t in j.tensors}
        (out / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                            indent=2) + "\n")


def _copy_others(ck: Checkpoint, out: Path, untied: bool) -> list[str]:
    """config, tokenizer, generation files: copied; config.json unties the embedding where the fold did."""
    weights = set(ck.shards) | {INDEX}
    copied = []
    for p in sorted(ck.folder.rglob("*")):
        rel = p.relative_to(ck.folder)
        if not p.is_file() or str(rel) in weights:
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        if str(rel) == "config.json" and untied:
            cfg = dict(ck.config_dict)
            cfg["tie_word_embeddings"] = False
            (out / rel).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copy2(p, out / rel)
        copied.append(str(rel))
    return copied


def _check_untie(ck: Checkpoint, plan: CheckpointPlan) -> None:
    """An untied group must stay untied when the stock class loads the output."""
    if not plan.untied:
        return
    cfg = copy.deepcopy(ck.config)
    cfg.tie_word_embeddings = False
    left = {frozenset(g) for g in tied_groups(skeleton(cfg))}
    for g in plan.untied:
        if frozenset(g) in left or any(set(g) & set(h) for h in left):
            raise LnfoldError(f"the fold must untie {', '.join(g)}, and {type(skeleton(cfg)).__name__} ties them "
                              "whatever config.json says")


def destination(src: Path, dst: Optional[Path]) -> Path:
    dst = Path(dst) if dst is not None else src.resolve().parent / (src.resolve().name + ".folded")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise LnfoldError(f"{dst}: the output folder would be inside the input folder; choose another path")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise LnfoldError(f"{dst}: exists; choose another output folder or remove it")
    if not dst.parent.is_dir():
        raise LnfoldError(f"{dst.parent}: output directory does not exist")
    return dst


def fold_checkpoint(src, dst=None, *, mode: str = "rms", verify: bool = True, jobs: int = 1,
                    progress: Optional[Callable[[str], None]] = None) -> FoldResult:
    """Fold the `transformers` checkpoint folder `src` into `dst` (default `src.folded`).

    The plan comes from config.json alone (meta device); each shard is streamed and edited in
    float64; with `verify` the output is checked block by block against the original in bounded
    memory (fx_rewrite/checkpoint_verify.py, the gate of passes/gate.py) before it is renamed into
    place. Returns a FoldResult with the report, `model` = the output folder, and the timings.
    Raises LnfoldError (one line) for a bad folder, NothingToFold, VerificationError."""
    opts = FoldOptions(mode=mode, verify=verify)
    if not isinstance(jobs, int) or jobs < 1:
        raise LnfoldError(f"jobs must be a positive integer, not {jobs!r}")
    src = Path(src)
    if not is_checkpoint(src):
        raise LnfoldError(f"{src}: not a transformers checkpoint folder (config.json with {SINGLE} or {INDEX})")
    dst = destination(src, dst)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pipeline.stage(progress, "reading the checkpoint's headers")
    ck = read_checkpoint(src)
    pipeline.stage(progress, "analyzing (the model built on the meta device)")
    plan = plan_checkpoint(ck, opts.mode)
    _check_untie(ck, plan)
    timings["analysis"] = time.perf_counter() - t0
    files = {f: list(h.entries) for f, h in ck.shards.items()}
    work = shard_work(files, plan.in_place, plan.new)
    tmp = Path(tempfile.mkdtemp(prefix=".lnfold-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    result = FoldResult(report=plan.report, model=dst)
    try:
        t1 = time.perf_counter()
        pipeline.stage(progress, f"editing {sum(j.edited for j in work)} tensors in {len(work)} shard(s)")
        sizes = write_shards(ck, work, tmp, jobs)
        _write_index(ck, work, sizes, tmp)
        _copy_others(ck, tmp, bool(plan.untied))
        timings["editing"] = time.perf_counter() - t1
        if opts.verify:
            from .checkpoint_verify import verify_checkpoint

            t2 = time.perf_counter()
            pipeline.stage(progress, "verifying block by block in float64")
            verdict = verify_checkpoint(ck, read_checkpoint(tmp), plan)
            pipeline.record(result, verdict)
            timings["verification"] = time.perf_counter() - t2
        os.replace(tmp, dst)
    except OSError as e:
        raise LnfoldError(f"{dst}: cannot write: {first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if plan.untied:
        result.report.notes.append("untied " + "; ".join(" / ".join(g) for g in plan.untied) +
                                   ": the embedding is centered, its other reader is not a stream source "
                                   "(config.json: tie_word_embeddings false)")
    result.timings = timings
    return result
