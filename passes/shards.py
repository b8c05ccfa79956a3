"""Which tensor of a sharded checkpoint (fx_rewrite/checkpoint.py) gets which edit, without any
framework type: the output shard of each edited, kept or new tensor (`shard_work`), and the ties an
edit breaks (`untie`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping


@dataclass(frozen=True)
class TensorJob:
    """One tensor of an output shard: `name` written from checkpoint tensor `source` after `ops`
    (none: copied as it is)."""

    name: str
    source: str
    ops: tuple = ()

    def renamed(self, fn: Callable[[str], str]) -> "TensorJob":
        return TensorJob(fn(self.name), fn(self.source), ops_renamed(self.ops, fn))


def ops_renamed(ops: tuple, fn: Callable[[str], str]) -> tuple:
    """`ops` with the other constants they read (`Op.constants`) renamed by `fn`."""
    return tuple(op.renamed({c: fn(c) for c in op.constants()}) for op in ops)


@dataclass
class ShardJob:
    """One output shard: the tensors it holds, in the order of its input shard, then new ones."""

    file: str
    tensors: list[TensorJob] = field(default_factory=list)

    @property
    def edited(self) -> int:
        return sum(1 for t in self.tensors if t.ops)


def untie(groups: Iterable[list[str]], stored: Mapping[str, str], edits: Mapping[str, tuple]
          ) -> tuple[dict[str, tuple], list[TensorJob], list[list[str]]]:
    """Edits of tied tensors as checkpoint tensors.

    `groups`: the names that share one tensor in the model (a tied embedding and lm_head);
    `stored`: model name -> the checkpoint's name of its tensor (a tied name the checkpoint does not
    store maps to the one it does); `edits`: model name -> its ops. A group whose members all get
    the same ops (or none) stays tied; one edited for some members only is untied: the stored
    tensor takes the ops of the stored member, and each member that differs from it becomes a new
    tensor of its own. Returns (stored name -> ops, new tensors, the groups untied)."""
    in_place: dict[str, tuple] = {}
    new: list[TensorJob] = []
    untied: list[list[str]] = []
    grouped = set()
    for g in groups:
        grouped.update(g)
        kinds = {edits.get(n, ()) for n in g}
        if kinds == {()}:
            continue
        src = stored[g[0]]
        if len(kinds) == 1:  # every reader wants the same edit: still one tensor
            in_place[src] = kinds.pop()
            continue
        untied.append(list(g))
        own_ops = edits.get(src, ()) if src in g else ()
        if own_ops:
            in_place[src] = own_ops
        for n in g:
            if n != src and edits.get(n, ()) != own_ops:
                new.append(TensorJob(n, src, edits.get(n, ())))
    for n, ops in edits.items():
        if n not in grouped and ops:
            in_place[stored[n]] = ops
    return in_place, new, untied


def shard_work(files: Mapping[str, list[str]], in_place: Mapping[str, tuple], new: Iterable[TensorJob]
               ) -> list[ShardJob]:
    """One job per input shard (`files`: shard -> its tensor names, in file order): each keeps its
    file name and tensors, edited where `in_place` says; a new tensor goes to its source's shard."""
    home = {n: f for f, names in files.items() for n in names}
    jobs = {f: ShardJob(f, [TensorJob(n, n, tuple(in_place.get(n, ()))) for n in names]) for f, names in files.items()}
    for t in new:
        jobs[home[t.source]].tensors.append(t)
    return list(jobs.values())
