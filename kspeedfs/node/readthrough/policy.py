"""Which read-through segment leaves memory first: one policy for the whole store.

Preloaded and leased datasets are pinned and never enter the policy; every resident
read-through segment does, by (dataset name, segment). The evictor (evict.py) tells the
policy what became resident, what was read and what left, and asks it for the next victim;
a policy decides nothing else, so another one (stable, plan-aware, capped per dataset) plugs
in here without touching fills or spills.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

Key = tuple[str, int]  # (dataset name, segment)


class EvictionPolicy(Protocol):
    def admitted(self, key: Key) -> None:
        """`key` is resident now."""

    def used(self, key: Key) -> None:
        """`key` was read."""

    def forgotten(self, key: Key) -> None:
        """`key` left without being picked (its instance was unloaded or refreshed)."""

    def victim(self) -> Key | None:
        """The next segment to evict, taken out of the policy (so no other eviction picks it
        while it spills); None when no segment is left."""


class LeastRecentlyUsed:
    """The segment read longest ago goes first; a segment joins as the newest when it
    becomes resident, and a read makes it the newest again."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def admitted(self, key: Key) -> None:
        self._order[key] = None

    def used(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forgotten(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Key | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key
