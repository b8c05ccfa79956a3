"""A plan made on a shallow copy of a deep model, extended by name to its full depth (issue 25).

Exporting a model to analyse it costs ~0.3 s per block on the meta device: 8 s of OPT-1.3B's
24 blocks, the largest fixed cost of folding a checkpoint (fx_rewrite/checkpoint.py). A
`transformers` model is a stack of L blocks of one class built from one config, so a copy with
SHALLOW blocks (the first, two middle ones, the last) is planned instead, and what the plan says
of its blocks is said of the full model's: block 0 of block 0, the middle block of blocks
1 … L-2, the last of block L-1. The frontend checks first that both models' blocks have the same
parameter names and shapes (and that the config has no per-block list); here, from the names
alone (IR-neutral):

- every item of the plan (an edit, a norm's verdict, a line of the report) names at most one
  block: a cross-block item would need an offset rule, and is not extended;
- the two middle blocks are planned alike: block 2's items, renamed to block 1, are block 1's,
  in order: the induction step that makes block 1 stand for every middle block;
- no stream belongs to one block alone (a per-head norm's stream: one per block, which would
  have to be replicated with its index).

Anything else: `None`, and the caller plans the whole model.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Optional

SHALLOW = 4  # blocks in the copy that is planned: first, two middle ones, last


class NotExtensible(Exception):
    """The shallow plan cannot stand for the deep one (the caller plans the whole model)."""


class LayerStack:
    """The blocks of a model: the ModuleList at `path` (e.g. `model.decoder.layers`), `depth` of
    them in the full model; names of its members, with or without leading components of `path`
    (a checkpoint may store `decoder.layers.3.…` for the model's `model.decoder.layers.3.…`)."""

    def __init__(self, path: str, depth: int, shallow: int = SHALLOW) -> None:
        self.path, self.depth, self.shallow = path, depth, shallow
        parts = path.split(".")
        spellings = sorted({".".join(parts[j:]) for j in range(len(parts))}, key=len, reverse=True)
        self._re = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, spellings)) + r")\.(\d+)(?!\w)")

    # --- names -------------------------------------------------------------------------------------------------

    def block_of(self, item: Any) -> Optional[int]:
        """The one block `item` names (None: none); NotExtensible where it names several."""
        found = {int(m[2]) for s in _strings(item) for m in self._re.finditer(s)}
        if len(found) > 1:
            raise NotExtensible(f"an item names blocks {sorted(found)}")
        return found.pop() if found else None

    def renamed(self, item: Any, block: int) -> Any:
        """`item` with its block index replaced by `block` everywhere."""
        return _map_strings(item, lambda s: self._re.sub(lambda m: f"{m[1]}.{block}", s))

    # --- sequences -----------------------------------------------------------------------------------------------

    def extend(self, items: list) -> list:
        """The full model's items from the shallow plan's, in order: block 1's run once per middle
        block, block S-1's as block L-1's. Raises NotExtensible where blocks 1 and 2 differ."""
        last = self.shallow - 1
        by_block: dict[Optional[int], list] = {}
        for it in items:
            by_block.setdefault(self.block_of(it), []).append(it)
        first_middle, second_middle = by_block.get(1, []), by_block.get(2, [])
        if [self.renamed(it, 1) for it in second_middle] != first_middle:
            raise NotExtensible("blocks 1 and 2 of the shallow copy are not planned alike")
        out, middle_done = [], False
        for it in items:
            k = self.block_of(it)
            if k is None or k == 0:
                out.append(it)
            elif k == 1 and not middle_done:
                out += [self.renamed(x, i) for i in range(1, self.depth - 1) for x in first_middle]
                middle_done = True
            elif k == last:
                out.append(self.renamed(it, self.depth - 1))
        return out

    def extend_dict(self, d: dict) -> dict:
        return dict(self.extend(list(d.items())))

    def extend_report(self, report):
        """A copy of a passes.report.Report for the full depth."""
        r = copy.deepcopy(report)
        r.norms = self.extend(r.norms)
        r.notes = self.extend(r.notes)
        for s in r.streams:
            texts = s.norms + s.centered + s.cloned + s.scaled + s.recentered + s.dropped + s.fused + [s.rotation]
            blocks = {self.block_of(t) for t in texts if t}
            if len(blocks) == 1 and None not in blocks:  # (every item in one block: a per-block stream)
                raise NotExtensible("a stream lies inside one block")
            for f in ("norms", "centered", "cloned", "scaled", "recentered", "dropped", "fused"):
                setattr(s, f, self.extend(getattr(s, f)))
        r.compression = self.extend(r.compression)
        r.near_misses = self.extend(r.near_misses)
        r.rms_norms = self.extend(r.rms_norms)
        return r


def _strings(item: Any):
    if isinstance(item, str):
        yield item
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        for f in dataclasses.fields(item):
            yield from _strings(getattr(item, f.name))
    elif isinstance(item, (list, tuple, set, frozenset)):
        for x in item:
            yield from _strings(x)
    elif isinstance(item, dict):
        for k, v in item.items():
            yield from _strings(k)
            yield from _strings(v)


def _map_strings(item: Any, f) -> Any:
    if isinstance(item, str):
        return f(item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, **{x.name: _map_strings(getattr(item, x.name), f)
                                            for x in dataclasses.fields(item) if x.init})
    if isinstance(item, (list, tuple)):
        return type(item)(_map_strings(x, f) for x in item)
    if isinstance(item, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in item.items()}
    return item
