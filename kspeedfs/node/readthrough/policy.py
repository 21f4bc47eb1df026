"""Which read-through segment leaves memory, and whether a miss is kept at all: one policy for
the whole store (the setting `eviction`).

Preloaded and leased datasets are pinned and never enter the policy; every resident
read-through segment does, by (dataset name, segment). The evictor (evict.py) tells the
policy what became resident, what was read and what left, and asks it for a victim to make
room for a miss: one of the miss's own dataset where the policy allows that, else one of the
`others` the evictor names (it knows the caps and shares); None means "do not keep this
miss" (it is read from the source and not admitted).

- `lru`: the segment read longest ago, of the datasets the evictor names (those over their
  shares), else of the miss's own. With shuffled epochs this is close to the worst order: a
  sample's last use lies anywhere in the last two epochs.
- `stable`: never a segment of the miss's own dataset, so what a dataset admitted stays and a
  dataset twice the budget keeps half of itself (one source read per miss, never two).
- `plan`: where the readers sent their order (the `plan` op), the segment of the miss's own
  dataset with the fewest uses ahead gives way to a miss with enough more (PlannedUses says
  why not Belady's furthest next use). Without a plan it is `stable`. A dataset holds one
  plan per reader (a rank's share of the sampler's epoch), each with its own cursor.
"""

from __future__ import annotations

import abc
import bisect
import statistics
from collections import OrderedDict, deque
from collections.abc import Collection
from typing import Protocol

import numpy as np

Key = tuple[str, int]  # (dataset name, segment)


class EvictionPolicy(Protocol):
    name: str  # the setting's value; evictions are counted by it

    def admitted(self, key: Key) -> None:
        """`key` is resident now."""

    def used(self, key: Key) -> None:
        """`key` was asked for (a fill, a hit reported by a reader), resident or not."""

    def forgotten(self, key: Key) -> None:
        """`key` left without being picked (its instance was unloaded or refreshed)."""

    def victim(
        self, incoming: Key | None = None, others: Collection[str] | None = None
    ) -> Key | None:
        """The segment to evict so that `incoming` fits (None: room for a preload), taken out
        of the policy so that no other eviction picks it while it spills; from `others`
        (None: any dataset) or, where the policy allows, incoming's own dataset. None: no
        victim (for a miss: do not keep it)."""

    def planned(
        self,
        name: str,
        segments: np.ndarray,
        horizon: int = 0,
        margin: int = 0,
        reader: str = "",
    ) -> None:
        """`reader` of `name` (a rank's share; "": the only one) will use `segments` in this
        order, from now, in place of its older plan; `horizon`: the uses an epoch holds;
        `margin`: how many more uses a miss needs to displace a segment."""

    def dropped_plan(self, name: str) -> None:
        """`name` is gone or refreshed: none of its plans applies any more."""

    def plan_position(self, name: str) -> dict[str, tuple[int, int]] | None:
        """Per reader, (where it is, uses in all) of its plan of `name`; None: no plan."""


class _Recency(abc.ABC):
    """Resident keys, least recently used first; what every policy here keeps. Each policy
    says which of them goes (`victim`)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def admitted(self, key: Key) -> None:
        self._order[key] = None  # one that becomes resident again keeps its place

    def used(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forgotten(self, key: Key) -> None:
        self._order.pop(key, None)

    def planned(
        self,
        name: str,
        segments: np.ndarray,
        horizon: int = 0,
        margin: int = 0,
        reader: str = "",
    ) -> None:
        """Readers' order: ignored but by the plan policy."""
        return None

    def dropped_plan(self, name: str) -> None:
        return None

    def plan_position(self, name: str) -> dict[str, tuple[int, int]] | None:
        return None

    @abc.abstractmethod
    def victim(
        self, incoming: Key | None = None, others: Collection[str] | None = None
    ) -> Key | None: ...

    def _oldest(self, allowed: Collection[str] | None) -> Key | None:
        for key in self._order:
            if allowed is None or key[0] in allowed:
                del self._order[key]
                return key
        return None


class LeastRecentlyUsed(_Recency):
    """The segment read longest ago goes first: of the `others` the evictor names (datasets
    over their shares), else of the miss's own dataset; a segment joins as the newest when it
    becomes resident, and a read makes it the newest."""

    def victim(
        self, incoming: Key | None = None, others: Collection[str] | None = None
    ) -> Key | None:
        if others is None or incoming is None:
            return self._oldest(others)
        found = self._oldest([n for n in others if n != incoming[0]])
        return found if found is not None else self._oldest({incoming[0]})


class StableResidentSet(_Recency):
    """A dataset keeps what it admitted: a miss evicts only another dataset's segment (the
    oldest of `others`), else it is not kept."""

    name = "stable"

    def victim(
        self, incoming: Key | None = None, others: Collection[str] | None = None
    ) -> Key | None:
        if incoming is not None:
            others = [n for n in others or () if n != incoming[0]]
        return self._oldest(others)


class ReadersPlan:
    """One dataset's upcoming segment uses, and where the readers are in them.

    The node sees the readers only through their misses (hits go through maps), from several
    DataLoader workers and their prefetchers at once, and with repeated samples a segment
    has several uses near any position. So each request is matched to its segment's planned
    use nearest the cursor (within `window` either side), and the cursor moves forward to the
    median of the last `MATCHES` matches: moving to each match ahead ran away to the end of
    the plan on PrioritySampler draws (a simulation of two readers 128 uses apart: the cursor
    1,400 uses ahead on average; with the median, 16-45 behind the front reader)."""

    MATCHES = 32

    def __init__(self, segments: np.ndarray, horizon: int = 0, window: int = 0):
        self.length = len(segments)
        self.horizon = horizon or max(1, self.length // 2)  # the readers send two epochs
        self.window = window or max(256, self.length // 64)
        order = np.argsort(segments, kind="stable")
        sorted_segs = segments[order]
        cuts = np.flatnonzero(np.diff(sorted_segs)) + 1
        self._uses: dict[int, list[int]] = {
            int(group[0]): sorted(positions.tolist())
            for group, positions in zip(
                np.split(sorted_segs, cuts), np.split(order, cuts), strict=True
            )
            if len(group)
        }
        self._segments = segments
        self.cursor = 0
        self._matches: deque[int] = deque(maxlen=self.MATCHES)

    def observe(self, seg: int) -> None:
        uses = self._uses.get(seg)
        if not uses:
            return
        lo = bisect.bisect_left(uses, self.cursor - self.window)
        hi = bisect.bisect_right(uses, self.cursor + self.window)
        if lo == hi:
            return  # off the plan here
        self._matches.append(min(uses[lo:hi], key=lambda u: abs(u - self.cursor)))
        self.cursor = max(self.cursor, int(statistics.median_low(self._matches)))

    def uses_ahead(self, seg: int) -> int:
        """Planned uses of `seg` after the cursor, within the horizon (an epoch's worth)."""
        uses = self._uses.get(seg)
        if not uses:
            return 0
        first = bisect.bisect_right(uses, self.cursor)
        return bisect.bisect_right(uses, self.cursor + self.horizon) - first

    def ahead_counts(self) -> np.ndarray:
        """`uses_ahead` of every segment at once, indexed by segment (up to the largest one
        in the horizon)."""
        return np.bincount(self._segments[self.cursor + 1 : self.cursor + 1 + self.horizon])


class PlannedUses(_Recency):
    """Where the readers' order is known: of a dataset with a plan, the resident segment
    with the fewest uses in the next epoch's worth of the plan gives way to a miss with more,
    by more than `margin(name)` uses (admitting reads a whole segment from the source, not
    keeping it reads one file: the swap must pay for that); `stable` otherwise, and `others`
    first (a dataset over its share gives way before a planned one chooses).

    Not Belady's furthest next use: with several files a segment, every admission costs a
    segment, and furthest-next-use admits on almost every miss (a simulation of shuffled
    epochs over a dataset twice the budget, 4 files a segment: 0.93 of the dataset from the
    source per epoch against 0.5 kept stable; this rule, with a margin of a segment's files
    and the readers' position 32 uses off: 0.50-0.54, and 0.40-0.43 against 0.5 where samples
    repeat, as a PrioritySampler draws them).

    Each reader of a dataset (a rank's share of a distributed sampler) sends its own plan and
    keeps its own cursor: a miss, whichever rank it came from, moves the cursors of the plans
    that use its segment near where they are (ReadersPlan.observe ignores the others), and a
    segment's uses ahead are summed over the plans. At most MAX_READERS plans a dataset, of
    MAX_USES uses in all: a plan beyond them drops the ones sent longest ago."""

    name = "plan"
    MAX_READERS = 64
    MAX_USES = 1 << 26  # of a dataset's plans together (one plan longer is refused before)

    def __init__(self) -> None:
        super().__init__()
        self.plans: dict[str, OrderedDict[str, ReadersPlan]] = {}  # name -> reader -> plan
        self.margins: dict[str, int] = {}

    def used(self, key: Key) -> None:
        super().used(key)
        for plan in self.plans.get(key[0], {}).values():
            plan.observe(key[1])

    def planned(
        self,
        name: str,
        segments: np.ndarray,
        horizon: int = 0,
        margin: int = 0,
        reader: str = "",
    ) -> None:
        readers = self.plans.setdefault(name, OrderedDict())
        readers.pop(reader, None)  # a newer plan of the same reader: the newest of all
        readers[reader] = ReadersPlan(segments, horizon)
        uses = sum(plan.length for plan in readers.values())
        while len(readers) > self.MAX_READERS or (uses > self.MAX_USES and len(readers) > 1):
            uses -= readers.popitem(last=False)[1].length
        self.margins[name] = margin

    def dropped_plan(self, name: str) -> None:
        self.plans.pop(name, None)
        self.margins.pop(name, None)

    def plan_position(self, name: str) -> dict[str, tuple[int, int]] | None:
        readers = self.plans.get(name)
        if not readers:
            return None
        return {reader: (plan.cursor, plan.length) for reader, plan in readers.items()}

    def uses_ahead(self, key: Key) -> int:
        """Planned uses of `key` after each reader's cursor, within its horizon, summed."""
        return sum(plan.uses_ahead(key[1]) for plan in self.plans.get(key[0], {}).values())

    def _ahead_counts(self, name: str) -> np.ndarray:
        """`uses_ahead` of every segment of `name`, indexed by segment: once a miss, not once
        a resident segment and plan (4,096 resident, 64 plans: 85 ms a victim that way)."""
        counts = [plan.ahead_counts() for plan in self.plans[name].values()]
        total = np.zeros(max(len(c) for c in counts), dtype=np.int64)
        for c in counts:
            total[: len(c)] += c
        return total

    def victim(
        self, incoming: Key | None = None, others: Collection[str] | None = None
    ) -> Key | None:
        if incoming is None:
            return self._oldest(others)
        name, seg = incoming
        found = self._oldest([n for n in others or () if n != name])
        if found is not None or not self.plans.get(name):
            return found
        # The miss's own use is the one being read now, which the cursor (behind the readers)
        # still counts ahead: not a use to come.
        ahead = self._ahead_counts(name).tolist()
        known = len(ahead)
        fewest = max(0, (ahead[seg] if seg < known else 0) - 1) - self.margins.get(name, 0)
        victim = None
        for key in self._order:
            if key[0] == name:
                n = ahead[key[1]] if key[1] < known else 0
                if n < fewest:
                    fewest, victim = n, key
        if victim is not None:
            del self._order[victim]
        return victim


POLICIES: dict[str, type[_Recency]] = {
    p.name: p for p in (LeastRecentlyUsed, StableResidentSet, PlannedUses)
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy of the setting `eviction` (checked by setting_rules)."""
    return POLICIES[name]()
