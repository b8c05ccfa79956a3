"""A list nobody can change: what a final plan holds (it compares equal to a list of the same items)."""
from __future__ import annotations


def _refuse(self, *args, **kwargs):
    raise TypeError("a plan is final: make_plan decides it, nothing changes it after")


class FrozenList(list):
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce_ex__(self, protocol):  # copy and pickle build it whole, not item by item
        return (type(self), (list(self),))
