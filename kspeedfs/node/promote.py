"""Moving disk-tier segments to memory once it frees up (an unload, a lease's end, an eviction).

One owner, the Promoter, with its own task, decides for every dataset with segments on the
disk tier, preloaded or read-through: the store tells it when memory may have freed up
(`Budgets.when_memory_freed`, from any thread) and it looks at once; a slow poll
(POLL_INTERVAL_S) catches what nobody reports (another user of the shm filesystem freeing
room). It moves segments one at a time, in dataset name then segment order over both kinds,
while the memory budget has room for the next one and the dataset's memory cap
(`--max-memory`) too. A move that fails (the filesystem, not the budget, was short) ends the
look: the poll tries again.

Each kind supplies only what differs (`Promotable`): where its disk segments are, its cap,
and how a move is committed to its places. A preload's places are meta.json's
(`PreloadPromotions`, here: SegmentPlaces.promote, node/segments.py, copies, renames into the
shm folder and unlinks from disk: its readers see one copy or the other, never part of one);
a read-through instance's are its `InstancePlaces` (`CachePromotions`, readthrough/promote.py,
readthrough/places.py). Both
copy with the same checked copy (node/segments.py; the cache's through
SegmentPlaces.copy_from_disk). A copy that fails its check
never joins memory: a preload's segment is quarantined and fetched again, a read-through
one dropped from disk (filled again on its next miss).

A read-through instance's spilled copies (readthrough/disktier.py: segments evicted from
memory, kept in its disk folder's spill/) are not promoted: a fill copies one back on a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import trio

from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.localdata import DamagedSegment
from kspeedfs.node.budget import Budgets
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 10.0


class DiskSegment(NamedTuple):
    """The next disk-tier segment of a dataset (`uuid`: the instance, which an unload, a new
    load or a refresh replaces): its length, and the bytes its dataset's memory cap leaves room
    for (None: no cap)."""

    name: str
    uuid: str
    seg: int
    length: int
    cap_room: int | None


class Promotable(Protocol):
    """What the Promoter asks of one kind of dataset whose segments may lie on the disk tier."""

    # Segments and bytes moved to memory: the Promoter counts each move here.
    promoted: dict[str, int]

    def waiting(self) -> list[DiskSegment]:
        """Each dataset of this kind with segments on disk: its lowest one."""
        ...

    async def move(self, segment: DiskSegment) -> int:
        """Move `segment` to memory and commit it to this kind's places: the bytes moved (0:
        gone meanwhile). DamagedSegment when its copy fails the check (nothing joined memory);
        KSpeedError or OSError when the move failed."""
        ...

    async def damaged(self, segment: DiskSegment, e: DamagedSegment) -> None:
        """`segment` failed its check on the way to memory: take it out of service."""
        ...

    def settled(self, name: str) -> None:
        """The Promoter moved what it will of `name` for now (readers may look again)."""
        ...


class Promoter:
    """The one owner of promotion: which disk-tier segment, of any kind of dataset, moves to
    memory next."""

    def __init__(self, budgets: Budgets, kinds: Sequence[Promotable]):
        """`kinds`: every kind of dataset whose segments may lie on the disk tier (the
        preloads' and the read-through cache's)."""
        self.budgets = budgets
        self.kinds = list(kinds)
        self._freed = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        budgets.when_memory_freed(self.wake)  # (a no-op until `run` starts)

    def wake(self) -> None:
        """Memory may have freed up: look now. Safe from any thread, also once the node's
        event loop has ended."""
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(lambda: self._freed.set())
        except trio.RunFinishedError:
            pass

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        task_status.started()
        while True:  # a first look at once: a restarted node may have room already
            self._freed = trio.Event()  # what frees from now on wakes the next look
            if not await self.promote_what_fits():
                # A move failed (the filesystem, not the budget, was short): its reservation
                # given back wakes us, so wait for the poll instead of trying again at once.
                await trio.sleep(POLL_INTERVAL_S)
            with trio.move_on_after(POLL_INTERVAL_S):
                await self._freed.wait()

    async def promote_what_fits(self) -> bool:
        """Move segments while the next one fits; False when a move failed."""
        last: tuple[Promotable, str] | None = None
        try:
            while (nxt := self._next()) is not None:
                kind, segment = nxt
                if last is not None and last != (kind, segment.name):
                    last[0].settled(last[1])
                last = kind, segment.name
                try:
                    moved = await kind.move(segment)
                except DamagedSegment as e:
                    await kind.damaged(segment, e)
                    continue
                except (KSpeedError, OSError) as e:
                    log.info(
                        "segment %d of %s stays on disk for now: %s", segment.seg, segment.name, e
                    )
                    return False
                kind.promoted["segments"] += moved > 0
                kind.promoted["bytes"] += moved
            return True
        finally:
            if last is not None:
                last[0].settled(last[1])

    def _next(self) -> tuple[Promotable, DiskSegment] | None:
        """The next disk segment that fits in memory and its dataset's cap now, of the first
        dataset by name that has one (None: none, or no room)."""
        waiting = sorted(
            (w.name, i, w) for i, kind in enumerate(self.kinds) for w in kind.waiting()
        )
        if not waiting:
            return None
        free = self.budgets.memory_free()
        for _, i, w in waiting:
            if w.length <= free and (w.cap_room is None or w.length <= w.cap_room):
                return self.kinds[i], w
        return None


class PreloadPromotions:
    """Promotable: the preloaded datasets' disk segments, whose places meta.json records
    (`record.disk`); moved by SegmentPlaces.promote."""

    def __init__(self, store: SegmentStore, quarantined: Callable[[str, int], None] | None = None):
        self.store = store
        # Told a segment that failed its check on the way to memory, once quarantined: it is
        # fetched again (node/scrub.py).
        self.quarantined = quarantined
        self.promoted = {"segments": 0, "bytes": 0}

    def waiting(self) -> list[DiskSegment]:
        out = []
        for record in [r for r in self.store.datasets.values() if r.disk]:
            seg = record.disk[0]
            try:
                length = int(self.store.open(record.name).manifest.seg_len[seg])
                room = self.store.segments.memory_cap_room(record)
            except KSpeedError:
                continue  # unloaded meanwhile
            out.append(DiskSegment(record.name, record.uuid, seg, length, room))
        return out

    async def move(self, segment: DiskSegment) -> int:
        # Unloaded, loaded again or the segment dropped meanwhile: SegmentPlaces.promote sees.
        return await trio.to_thread.run_sync(self.store.segments.promote, segment.name, segment.seg)

    async def damaged(self, segment: DiskSegment, e: DamagedSegment) -> None:
        # Not into memory: quarantined and fetched again (from a replica or the source).
        name, seg = segment.name, segment.seg
        await trio.to_thread.run_sync(self.store.segments.quarantine, name, seg, str(e))
        if self.quarantined is not None:
            self.quarantined(name, seg)

    def settled(self, name: str) -> None:
        pass  # a preload's readers find a moved segment by themselves (memory, then disk)
