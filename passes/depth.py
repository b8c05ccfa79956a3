"""A plan made on a shallow copy of a deep model, extended by name to its full depth (DESIGN §2,
"Checkpoints", *Depth*): block 0's items stay, block 1's stand for blocks 1 … L-2, the last for L-1,
each item renamed through its own `renamed(fn)`. Where the shallow plan cannot stand for the deep
one: `NotExtensible`, and the caller plans the whole model.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from .report import Rename, named, requoted
from .shards import ops_renamed

SHALLOW = 4  # blocks in the copy that is planned: first, two middle ones, last

# how an item of a plan hands its names to a renaming `fn`: (item, fn) -> the item renamed
Renamer = Callable[[Any, Rename], Any]


def rename_record(item: Any, fn: Rename) -> Any:  # (the report's records, shards.TensorJob)
    return item.renamed(fn)


class NotExtensible(Exception):
    """The shallow plan cannot stand for the deep one (the caller plans the whole model)."""


class LayerStack:
    """The blocks of a model: the ModuleList at `path` (e.g. `model.decoder.layers`), `depth` of
    them in the full model; names of its members, with or without leading components of `path`
    (a checkpoint may store `decoder.layers.3.…` for the model's `model.decoder.layers.3.…`)."""

    def __init__(self, path: str, depth: int) -> None:
        self.depth = depth
        parts = path.split(".")
        self._spellings = [parts[j:] for j in range(len(parts))]  # longest first

    def _index(self, name: str) -> Optional[tuple[list[str], int]]:
        """(the name's components, where its block index is), or None for a name outside the stack."""
        parts = name.split(".")
        return next(((parts, len(sp)) for sp in self._spellings
                     if parts[:len(sp)] == sp and len(parts) > len(sp) and parts[len(sp)].isdecimal()), None)

    def block(self, name: str) -> Optional[int]:
        found = self._index(name)
        return None if found is None else int(found[0][found[1]])

    def moved(self, name: str, block: int) -> str:
        """`name` in block `block` (a name outside the stack: as it is)."""
        parts, k = self._index(name) or (None, None)
        return name if parts is None else ".".join(parts[:k] + [str(block)] + parts[k + 1:])

    def block_of(self, item: Any, renamed: Renamer) -> Optional[int]:
        """The one block `item` names (None: none); NotExtensible where it names several."""
        found: set[int] = set()
        renamed(item, lambda n: found.add(self.block(n)) or n)
        found.discard(None)
        if len(found) > 1:
            raise NotExtensible(f"an item names blocks {sorted(found)}")
        return found.pop() if found else None

    def extend(self, items: list, renamed: Renamer = rename_record) -> list:
        """The full model's items from the shallow plan's, in order: block 1's run once per middle
        block, block S-1's as block L-1's. Raises NotExtensible where blocks 1 and 2 differ."""
        last = SHALLOW - 1
        to = lambda it, block: renamed(it, lambda n: self.moved(n, block))  # noqa: E731
        blocks = [self.block_of(it, renamed) for it in items]
        first_middle = [it for it, k in zip(items, blocks) if k == 1]
        if [to(it, 1) for it, k in zip(items, blocks) if k == 2] != first_middle:
            raise NotExtensible("blocks 1 and 2 of the shallow copy are not planned alike")
        out, middle_done = [], False
        for it, k in zip(items, blocks):
            if k is None or k == 0:
                out.append(it)
            elif k == 1 and not middle_done:
                out += [to(x, i) for i in range(1, self.depth - 1) for x in first_middle]
                middle_done = True
            elif k == last:
                out.append(to(it, self.depth - 1))
        return out

    def extend_edits(self, edits: dict) -> dict:
        """Tensor name -> ops."""
        return dict(self.extend(list(edits.items()), lambda e, fn: (fn(e[0]), ops_renamed(e[1], fn))))

    def extend_report(self, report):
        """A copy of a passes.report.Report for the full depth."""
        r = copy.deepcopy(report)
        r.norms, r.notes = self.extend(r.norms), self.extend(r.notes, requoted)
        for s in r.streams:
            fields = [(f, named) for f in s.NAMES] + [(f, requoted) for f in s.SENTENCES]
            listed = [(getattr(s, f), how) for f, how in fields]
            blocks = {self.block_of(t, how) for v, how in listed for t in (v if isinstance(v, list) else [v]) if t}
            if len(blocks) == 1 and None not in blocks:  # (every item in one block: a per-block stream)
                raise NotExtensible("a stream lies inside one block")
            for f, how in fields:
                if isinstance(getattr(s, f), list):  # (its rotation, one sentence, stays the shallow plan's)
                    setattr(s, f, self.extend(getattr(s, f), how))
        r.compression, r.near_misses, r.rms_norms = map(self.extend, (r.compression, r.near_misses, r.rms_norms))
        return r
