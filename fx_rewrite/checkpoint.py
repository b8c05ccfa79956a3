"""A `transformers` checkpoint folder, and the plan of its fold from its structure alone.

The model is built from config.json on the meta device and planned as `fold_module` does; the
plan's constant edits become edits of the checkpoint's tensors by name (DESIGN §2 "Checkpoints").
The output loads in its stock class, whose LayerNorms compute an RMSNorm on their zero-mean streams
(THEORY §1, Lemma 2). Hence `STOCK`: β stays the norm's own, no CRMS compression, and a stream
that would need a `Recenter` op (BLOOM's embedding LayerNorm) is kept, with its reason.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from ..passes import LnfoldError, NothingToFold, make_plan
from ..passes.analysis import Component
from ..passes.depth import SHALLOW, LayerStack, NotExtensible
from ..passes.errors import first_line
from ..passes.options import FoldOptions
from ..passes.outputs import inside
from ..passes.report import Report, named
from ..passes.request import Capabilities, request_from
from ..passes.shards import TensorJob, untie
from .safetensors_io import read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
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


def read_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint in `folder`, or a one-line LnfoldError saying what is wrong with it (a missing
    shard, an index naming a tensor no shard has, a truncated file, an unreadable config)."""
    import transformers

    folder = Path(folder)
    try:
        config_dict = json.loads(inside(folder, "config.json", str(folder)).read_text())
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # (transformers raises ValueError, OSError, KeyError for a config it cannot read)
        raise LnfoldError(f"{folder / 'config.json'}: cannot read it as a transformers config: "
                          f"{first_line(e)}") from None
    if (folder / INDEX).is_file():
        try:
            index = json.loads(inside(folder, INDEX, str(folder)).read_text())
            weight_map = dict(index["weight_map"])
            meta = index.get("metadata", {}) or {}
            if not isinstance(meta, dict):
                raise TypeError(f"its metadata is a {type(meta).__name__}, not an object")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LnfoldError(f"{folder / INDEX}: not a shard index ({first_line(e)})") from None
        # every path the index names, checked before any file is opened: each is read here and
        # written as `out / name` by the fold (`/x`, `../x` or a link out would write where they say)
        paths = {f: inside(folder, f, str(folder / INDEX)) for f in weight_map.values()}
    else:
        weight_map, meta = {}, {}
        paths = {SINGLE: inside(folder, SINGLE, str(folder))}
    files = sorted(paths)
    for f in files:
        if not paths[f].is_file():
            raise LnfoldError(f"{folder / f}: missing: the shard index names it and the folder does not have it")
    shards = {f: read_header(paths[f]) for f in files}
    where = {n: f for f, h in shards.items() for n in h.entries}
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

    named = [getattr(transformers, name, None) for name in getattr(config, "architectures", None) or []]
    return next((cls for cls in named if cls is not None), transformers.AutoModelForCausalLM)


def skeleton(config) -> torch.nn.Module:
    """The model built from `config` with no weights: parameters on the meta device, buffers (rotary
    tables, masks) real. Eager attention: the one every exporter and the float64 run can trace."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    cls = model_class(config)
    try:
        with init_empty_weights():
            m = cls._from_config(config)
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
    find = _finder(model, ck)
    out = {n: s for n in model.state_dict() if (s := find(n)) is not None}
    for group in tied_groups(model):
        found = next((out[n] for n in group if n in out), None)
        if found is not None:
            out.update({n: found for n in group})
    return out


def _finder(model: torch.nn.Module, ck: Checkpoint):
    """name -> the checkpoint's name of the model's tensor `name`, or None (stored_names)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    # a stored name first, then one transformers renames on loading (GPT-NeoX's embed_out is lm_head)
    known = {**{loaded_name(model, k): k for k in ck.where}, **{k: k for k in ck.where}}

    def find(name: str) -> Optional[str]:
        return next((known[c] for c in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}") if c in known), None)

    return find


def check_depth(ck: Checkpoint) -> None:
    """The files hold every block config.json claims, else a one-line LnfoldError. Checked on
    copies with SHALLOW and SHALLOW + 1 blocks before the model is built at its depth, which a
    config claiming 10,000 layers over files of 3 would take minutes to build and plan: the stack
    is the ModuleList whose length follows the depth, and its last block's tensors, by their names
    in block 0, must be stored."""
    depth = getattr(ck.config, "num_hidden_layers", None)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth <= SHALLOW:
        return
    try:
        short, longer = (skeleton(with_depth(ck.config, n)) for n in (SHALLOW, SHALLOW + 1))
    except LnfoldError:  # (the model at its depth says why, where it cannot be built)
        return
    lengths = {p: len(m) for p, m in longer.named_modules() if isinstance(m, torch.nn.ModuleList)}
    find = _finder(short, ck)
    for path, m in short.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) != SHALLOW or lengths.get(path) != SHALLOW + 1:
            continue
        stack = LayerStack(path, depth)
        first = [n for n in short.state_dict() if stack.block(n) == 0 and find(n) is not None]
        missing = next((stack.moved(n, depth - 1) for n in first if find(stack.moved(n, depth - 1)) is None), None)
        if missing is None:
            continue
        held = sorted({b for k in ck.where for b in (stack.block(loaded_name(short, k)), stack.block(k))
                       if b is not None})
        blocks = f" ({path}.{held[0]} … {held[-1]})" if held else ""
        raise LnfoldError(f"{ck.folder / 'config.json'}: claims {depth} layers (num_hidden_layers), and the "
                          f"checkpoint's tensors hold {len(held)}{blocks}: no tensor for {missing}")


def loaded_name(model: torch.nn.Module, key: str) -> str:
    """The model's name for checkpoint tensor `key`: transformers renames some on loading (its
    conversion mapping's `WeightRenaming`s, applied in order; transformers >= 5)."""
    import re

    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
    except ImportError:
        return key
    if "_lnfold_renamings" not in model.__dict__:  # (computed once per model: possibly empty)
        model.__dict__["_lnfold_renamings"] = [(re.compile(src), w.target_patterns[0])
                                               for w in get_model_conversion_mapping(model)
                                               if isinstance(w, WeightRenaming) for src in w.source_patterns]
    for pattern, target in model.__dict__["_lnfold_renamings"]:
        key = pattern.sub(target, key)
    return key


@dataclass
class CheckpointPlan:
    report: Report
    in_place: dict  # checkpoint tensor name -> ops
    new: list  # TensorJob: tensors the output gains (an untied table's second half)
    untied: list  # the tied groups broken
    norms: list  # the folded norms' module paths
    stored: dict  # model name -> checkpoint name
    traced: str = ""  # how much of the model the analysis exported ("every block", or a shallow copy's)
    aliases: dict = field(default_factory=dict)  # model name -> the stored tensor it was tied to, now written apart


def plan_checkpoint(ck: Checkpoint, mode: str = "rms") -> CheckpointPlan:
    """The fold of `ck` as edits of its tensors, from its structure alone (no weight is read).

    A deep stack of like blocks is planned on a copy with passes/depth.py's SHALLOW blocks and the
    plan extended by name to the full depth, where the blocks allow it (`repeated_blocks`);
    otherwise, or where the shallow plan cannot stand for the deep one, the whole model."""
    check_depth(ck)
    model = skeleton(ck.config)
    stored_like(model, ck)
    path = repeated_blocks(model, ck.config)
    shallow = skeleton(with_depth(ck.config, SHALLOW)) if path is not None else None
    if shallow is not None and same_blocks(model, shallow, path):
        blocks = LayerStack(path, len(model.get_submodule(path)))
        plan = _plan_of(shallow, ck, mode)
        try:
            extended = CheckpointPlan(
                blocks.extend_report(plan.report), blocks.extend_edits(plan.in_place), blocks.extend(plan.new),
                blocks.extend(plan.untied, named), blocks.extend(plan.norms, named), stored_names(model, ck),
                traced=f"{SHALLOW} of {blocks.depth} blocks ({path}.1 … {blocks.depth - 2} planned as {path}.1)")
        except NotExtensible:
            pass
        else:
            return _as_loaded(extended, ck)
    return _as_loaded(_plan_of(model, ck, mode), ck)


def stored_like(model: torch.nn.Module, ck: Checkpoint) -> None:
    """Every tensor of `model` that `ck` stores is stored in its shape, and as a float where it is
    one (a γ of shape [32, 1] or as U32 is no weight the fold can edit, nor verification compute
    with; from_pretrained refuses them too): else a one-line LnfoldError naming the tensor."""
    state = model.state_dict(keep_vars=True)
    for name, key in stored_names(model, ck).items():
        e, file = ck.shards[ck.where[key]].entries[key], ck.folder / ck.where[key]
        if tuple(e.shape) != tuple(state[name].shape):
            raise LnfoldError(f"{file}: tensor {key} has shape {list(e.shape)}; {type(model).__name__} "
                              f"(config.json) makes {name} {list(state[name].shape)}")
        if state[name].is_floating_point() and not e.dtype.startswith(("F", "BF")):
            raise LnfoldError(f"{file}: tensor {key} is stored as {e.dtype}; {type(model).__name__} "
                              f"reads it as a floating-point {name}")


def _as_loaded(plan: CheckpointPlan, ck: Checkpoint) -> CheckpointPlan:
    """The plan, completed so that the stock class loads every tensor of its output from the files:
    `tie_word_embeddings: false` unties every tie the class makes by it (DESIGN §2 "Checkpoints"),
    so each member a file stored only through a tie is written as a tensor of its own, from the
    stored tensor it was tied to and edited as that one is. A group the fold must untie and the
    class ties whatever config.json says is an error."""
    if not plan.untied:
        return plan
    config = copy.deepcopy(ck.config)
    config.tie_word_embeddings = False
    loaded = skeleton(config)
    left = tied_groups(loaded)
    for g in plan.untied:
        if any(set(g) & set(h) for h in left):
            raise LnfoldError(f"the fold must untie {', '.join(g)}, and {type(loaded).__name__} ties them "
                              "whatever config.json says")
    found = stored_names(loaded, ck)
    written = {t.name for t in plan.new}
    aliases = {n: plan.stored[n] for n in loaded.state_dict()
               if n not in found and n not in written and n in plan.stored}
    new = plan.new + [TensorJob(n, src, plan.in_place.get(src, ())) for n, src in aliases.items()]
    return replace(plan, new=new, aliases=aliases)


def repeated_blocks(model: torch.nn.Module, config) -> Optional[str]:
    """The path of the model's one ModuleList of `config.num_hidden_layers` blocks, where a copy of
    the model with SHALLOW of them can be planned instead: more blocks than that, and no list in
    the config as long as the stack (a per-block setting: sliding-window or MoE layer lists)."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth <= SHALLOW + 1:
        return None
    stacks = [p for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    if len(stacks) != 1 or _per_block_setting(config.to_dict(), depth):
        return None
    return stacks[0]


def _per_block_setting(d, depth: int) -> bool:
    if isinstance(d, dict):
        return any(_per_block_setting(v, depth) for v in d.values())
    return isinstance(d, (list, tuple)) and len(d) in (depth, depth + 1)


def with_depth(config, depth: int):
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth
    return config


def same_blocks(model: torch.nn.Module, shallow: torch.nn.Module, path: str) -> bool:
    """The shallow copy is the model with fewer like blocks: its first, middle and last blocks
    have the full model's modules and parameter shapes, every middle block of the full model is
    like the first middle one, and nothing outside the blocks differs."""
    full, short = model.get_submodule(path), shallow.get_submodule(path)
    sig = [_signature(b) for b in full]
    if len(short) != SHALLOW or len(set(sig[1:-1])) != 1:
        return False
    want = [sig[0], sig[1], sig[1], sig[-1]]
    if [_signature(b) for b in short] != want:
        return False
    outside = lambda m: {(n, tuple(t.shape)) for n, t in m.state_dict(keep_vars=True).items()  # noqa: E731
                         if not n.startswith(path + ".")}
    return outside(model) == outside(shallow)


def _signature(block: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(t.shape), t.dtype) for n, t in block.state_dict(keep_vars=True).items())
    return params + tuple(f"{n}:{type(m).__name__}" for n, m in block.named_modules())


def _plan_of(model: torch.nn.Module, ck: Checkpoint, mode: str) -> CheckpointPlan:
    """The plan of `model` (the checkpoint's model or a shallow copy of it), traced whole."""
    from .api import ExportFrontend

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

    plan = make_plan(view, request_from(frontend.opts, STOCK, refuse=refuse))
    if plan.recenters or plan.new_biases or any(cc.compressed for cc in plan.compressions) or plan.deferral.deferred:
        raise LnfoldError("internal: the plan asks for ops a checkpoint cannot hold")  # pragma: no cover
    modules = {n.name: _module_path(n) for n in frontend.gm.graph.nodes}
    # (the report names graph nodes by the module that made them: the export's node names,
    # `linear_9`, mean nothing to whoever reads a checkpoint's report; and constants by the
    # checkpoint's tensor: torch.export keeps one name of a tied group, maybe the head's)
    report = plan.report.renamed({**{k: v for k, v in modules.items() if v},
                                  **{a: stored.get(n, n) for a, n in names.items()}})
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
    in_place = {k: tuple(op.renamed(sources) for op in ops) for k, ops in in_place.items()}
    new = [TensorJob(t.name, t.source, tuple(op.renamed(sources) for op in t.ops)) for t in new]
    folded = [modules.get(s, s) for s in plan.swaps]
    return CheckpointPlan(report, in_place, new, untied, folded, stored, traced="every block")


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
    return list(stack.values())[-1][0].removeprefix("model.") if stack else ""
