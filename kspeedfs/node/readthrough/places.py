"""Where each segment of one read-through instance lies, in memory, on the disk tier or
spilled there, and what that takes of the node's budgets: one owner (`InstancePlaces`,
`CachedDataset.places`), the only writer of both.

Fills, evictions, spills, promotions, the disk tier's reclaim and recovery, a refresh and the
pruning of an unloaded instance tell it what happened to a segment (`cached`, `evicted`,
`claim_disk`, `placed_on_disk`, `claim_spill`, `placed_spilled`, `promoted`, ...) and ask it
where one is (`memory`, `disk`, `spilled`, `holds`); none of them keeps a set of its own. It
keeps, in the same call, the store's record of the instance (`held` and `stored`, through
`SegmentPlaces`, which counts them in the memory budget) and the instance's claims on the
disk tier's budget (a reservation of tier "disk" per segment, from before its copy is written
until it leaves the tier), so a count never sees a segment in one place and its bytes in
another.

Both kinds of disk place are files of the instance's disk-tier folder: `seg/NNNNNNNN`, which
readers read where they lie, and `spill/NNNNNNNN`, copies of segments evicted from memory that
a fill copies back (readers never look there). A spilled copy may stay while its segment is in
memory again: the next eviction of it writes nothing.
"""

from __future__ import annotations

import collections.abc

import numpy as np

from kspeedfs.format.errors import AlreadyExists, NoSpace
from kspeedfs.node.budget import Budgets
from kspeedfs.node.records import DatasetRecord
from kspeedfs.node.segments import SegmentPlaces


class InstancePlaces:
    """The places of one instance's segments. Changed on the cache's event loop only, the
    `reclaimed_*` calls under the budgets' lock (from inside a reservation); read from worker
    threads too (a refresh's build and carry)."""

    def __init__(self, record: DatasetRecord, seg_len: np.ndarray, budgets: Budgets):
        self.record = record
        self._seg_len = seg_len
        self._budgets = budgets
        self._memory: set[int] = set()
        self._disk: set[int] = set()
        self._claims: set[int] = set()  # disk-tier room held: the disk segments, fills onto it
        # spilled copies there -> when last used, least recently used first
        self._spilled: dict[int, float] = {}
        self._spill_claims: set[int] = set()  # the spilled copies, and copies being written
        # Running sums, kept by the calls that change the sets above (an instance on the tier
        # may hold thousands of segments; a spill and a miss ask these each time).
        self._disk_bytes = 0
        self._claimed_bytes = 0
        self._spilled_bytes = 0

    @property
    def memory(self) -> collections.abc.Set[int]:
        """The segments in memory (a read-only view)."""
        return self._memory

    @property
    def disk(self) -> collections.abc.Set[int]:
        """The segments on the disk tier (a read-only view)."""
        return self._disk

    def holds(self, seg: int) -> bool:
        """Whether segment `seg` is on this node, in memory or on the disk tier."""
        return seg in self._memory or seg in self._disk

    def spill_claimed(self, seg: int) -> bool:
        """Whether segment `seg` has a spilled copy, or one being written."""
        return seg in self._spill_claims

    def claimed(self, seg: int) -> bool:
        """Whether segment `seg` holds room on the disk tier (there, or being filled onto it)."""
        return seg in self._claims

    def disk_bytes(self) -> int:
        """Bytes of the segments on the disk tier."""
        return self._disk_bytes

    @property
    def spilled(self) -> collections.abc.Mapping[int, float]:
        """The spilled copies, and when each was last used (a read-only view)."""
        return self._spilled

    def claimed_bytes(self) -> int:
        """Bytes of the disk tier's budget this instance holds: its segments there, its
        spilled copies and the fills and copies onto it (what `max_disk` caps)."""
        return self._claimed_bytes

    def spilled_bytes(self) -> int:
        """Bytes of its spilled copies."""
        return self._spilled_bytes

    def oldest_spilled(self) -> tuple[float, int] | None:
        """(when last used, segment) of its least recently used spilled copy; None: none."""
        for seg, when in self._spilled.items():
            return when, seg
        return None

    def claim_name(self, seg: int) -> str:
        """The budgets' name of the disk-tier claim of segment `seg` (names have no colon)."""
        return f"rtdisk:{self.record.uuid}:{seg}"

    def spill_claim_name(self, seg: int) -> str:
        """The budgets' name of the disk-tier claim of the spilled copy of segment `seg`."""
        return f"rtspill:{self.record.uuid}:{seg}"

    # Memory.

    def found(self, segments: collections.abc.Iterable[int], base: int) -> None:
        """The instance was opened: `segments` are in memory (its folder's sound files), and
        its folder's other files take `base` bytes."""
        self._memory = set(segments)
        stored = base + sum(int(self._seg_len[k]) for k in self._memory)
        SegmentPlaces.found(self.record, sorted(self._memory), stored)

    def cached(self, seg: int) -> None:
        """Segment `seg` is in memory now (a fill renamed it into seg/)."""
        if seg not in self._memory:
            self._memory.add(seg)
            SegmentPlaces.cached(self.record, seg, int(self._seg_len[seg]))

    def evicted(self, seg: int) -> int:
        """Segment `seg` left memory; returns its bytes (0: it was not there)."""
        if seg not in self._memory:
            return 0
        self._memory.discard(seg)
        length = int(self._seg_len[seg])
        SegmentPlaces.evicted(self.record, seg, length)
        return length

    # The disk tier.

    def claim_disk(self, seg: int, what: str) -> bool:
        """Claim the disk tier's room for segment `seg` (`what` names it); False when it holds
        a claim already, or the tier (or its filesystem) has no room. A miss never takes
        another dataset's disk segments: nothing is evicted for it."""
        if seg in self._claims:
            return False
        try:
            length = int(self._seg_len[seg])
            self._budgets.reserve(self.claim_name(seg), length, what=what, tier="disk", evict=False)
        except (NoSpace, AlreadyExists):
            return False
        self._claims.add(seg)
        self._claimed_bytes += length
        return True

    def placed_on_disk(self, seg: int) -> None:
        """Segment `seg`, claimed, is in the instance's disk folder now (a fill renamed it in,
        or recovery found it sound)."""
        assert seg in self._claims, f"segment {seg} placed on disk without a claim"
        if seg not in self._disk:
            self._disk.add(seg)
            self._disk_bytes += int(self._seg_len[seg])

    def release_disk(self, seg: int) -> None:
        """Segment `seg` leaves the disk tier, or its fill onto it ended without it: its claim
        goes."""
        self._budgets.release(self.claim_name(seg))
        self._leaves_disk(seg)

    def reclaimed_from_disk(self, seg: int) -> int:
        """Segment `seg` was unlinked from the disk tier for a preload's claim, under the
        budgets' lock (its claim is dropped in place, not released); returns its bytes."""
        self._budgets.drop_claim(self.claim_name(seg))
        self._leaves_disk(seg)
        return int(self._seg_len[seg])

    def _leaves_disk(self, seg: int) -> None:
        length = int(self._seg_len[seg])
        if seg in self._claims:
            self._claims.discard(seg)
            self._claimed_bytes -= length
        if seg in self._disk:
            self._disk.discard(seg)
            self._disk_bytes -= length

    # Spilled copies, on the disk tier too.

    def claim_spill(self, seg: int, what: str) -> bool:
        """Claim the disk tier's room for a spilled copy of segment `seg`; False when it holds
        one already, or the tier has no room (nothing is evicted for it: the caller drops
        older copies first)."""
        if seg in self._spill_claims:
            return False
        try:
            length = int(self._seg_len[seg])
            name = self.spill_claim_name(seg)
            self._budgets.reserve(name, length, what=what, tier="disk", evict=False, gives_way=True)
        except (NoSpace, AlreadyExists):
            return False
        self._spill_claims.add(seg)
        self._claimed_bytes += length
        return True

    def placed_spilled(self, seg: int, when: float) -> None:
        """The copy of segment `seg`, claimed, is in the instance's spill folder now (`when`:
        its last use, the file's time when recovery found it)."""
        assert seg in self._spill_claims, f"segment {seg} spilled without a claim"
        if self._spilled.pop(seg, None) is None:
            self._spilled_bytes += int(self._seg_len[seg])
        self._spilled[seg] = when  # the most recently used: last

    def spill_used(self, seg: int, when: float) -> None:
        """A fill copied the spilled copy of segment `seg` back at `when`."""
        if self._spilled.pop(seg, None) is not None:
            self._spilled[seg] = when  # the most recently used: last

    def release_spill(self, seg: int) -> None:
        """The spilled copy of segment `seg` is gone, or its copy was never finished."""
        self._budgets.release(self.spill_claim_name(seg))
        self._unspilled(seg)

    def reclaimed_spill(self, seg: int) -> int:
        """The spilled copy of segment `seg` was unlinked for a preload's claim, under the
        budgets' lock; returns its bytes."""
        self._budgets.drop_claim(self.spill_claim_name(seg))
        self._unspilled(seg)
        return int(self._seg_len[seg])

    def _unspilled(self, seg: int) -> None:
        length = int(self._seg_len[seg])
        if seg in self._spill_claims:
            self._spill_claims.discard(seg)
            self._claimed_bytes -= length
        if self._spilled.pop(seg, None) is not None:
            self._spilled_bytes -= length

    def promoted(self, seg: int) -> None:
        """Segment `seg` moved from the disk tier to memory: counted in memory, its disk claim
        gone (the caller unlinks the disk file next)."""
        self.cached(seg)
        self.release_disk(seg)

    def forget(self) -> None:
        """The instance is gone (unloaded, refreshed: the store removed its folders): its disk
        claims go, spilled copies' too. Its memory segments left with its folder, counted with
        its record."""
        for seg in self._claims:
            self._budgets.release(self.claim_name(seg))
        for seg in self._spill_claims:
            self._budgets.release(self.spill_claim_name(seg))
        self._claims.clear()
        self._disk.clear()
        self._spill_claims.clear()
        self._spilled.clear()
        self._disk_bytes = self._claimed_bytes = self._spilled_bytes = 0
