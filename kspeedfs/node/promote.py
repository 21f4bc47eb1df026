"""Moving disk-tier segments to memory once it frees up (an unload, a lease's end, an eviction).

One small owner with its own task: the store tells it when memory may have freed up
(`Budgets.on_memory_freed`, from any thread) and it looks at once; a slow poll
(POLL_INTERVAL_S) catches what nobody reports (another user of the shm filesystem freeing
room). It moves segments one at a time, in dataset then segment order, while the memory budget
has room for the next one and the dataset's memory cap (`--max-memory`) too. A segment moves by
copy, rename into the shm folder and unlink from disk (SegmentPlaces.promote, node/segments.py): its readers see
one copy or the other, never part of one. The read-through cache moves its own disk segments
(readthrough/promote.py, whose places are the cache's, not meta.json's) with the same checked
copy (SegmentPlaces.copy_from_disk): it is one of the other movers, so both wake on the same
event.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.localdata import DamagedSegment
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 10.0


class Promoter:
    def __init__(
        self,
        store: SegmentStore,
        quarantined: Callable[[str, int], None] | None = None,
        other_movers: Sequence[Callable[[], Awaitable[bool]]] = (),
    ):
        """`other_movers`: the other owners of disk-tier segments (read-through's): each
        `mover()` moves what fits in memory now and returns False when a move failed (the
        poll, not the next wake, tries again)."""
        self.store = store
        # Told a segment that failed its check on the way to memory, once quarantined: it is
        # fetched again (node/scrub.py).
        self.quarantined = quarantined
        self.promoted = {"segments": 0, "bytes": 0}
        self._freed = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._movers = [self._promote_what_fits, *other_movers]

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
        self.store.budgets.on_memory_freed.append(self.wake)
        task_status.started()
        while True:  # a first look at once: a restarted node may have room already
            self._freed = trio.Event()  # what frees from now on wakes the next look
            moved_all = [await mover() for mover in self._movers]
            if not all(moved_all):
                # A move failed (the filesystem, not the budget, was short): its reservation
                # given back wakes us, so wait for the poll instead of trying again at once.
                await trio.sleep(POLL_INTERVAL_S)
            with trio.move_on_after(POLL_INTERVAL_S):
                await self._freed.wait()

    async def _promote_what_fits(self) -> bool:
        """Move segments while the next one fits; False when a move failed."""
        while (nxt := self._next()) is not None:
            name, seg = nxt
            try:
                moved = await trio.to_thread.run_sync(self.store.segments.promote, name, seg)
            except DamagedSegment as e:
                # Not into memory: quarantined and fetched again (from a replica or the source).
                await trio.to_thread.run_sync(self.store.segments.quarantine, name, seg, str(e))
                if self.quarantined is not None:
                    self.quarantined(name, seg)
                continue
            except (KSpeedError, OSError) as e:
                log.info("segment %d of %s stays on disk for now: %s", seg, name, e)
                return False
            self.promoted["segments"] += moved > 0
            self.promoted["bytes"] += moved
        return True

    def _next(self) -> tuple[str, int] | None:
        """The next disk segment that fits in memory and its dataset's cap now (None: none,
        or no room)."""
        waiting = [r for _, r in sorted(self.store.datasets.items()) if r.disk]
        if not waiting:
            return None
        free = self.store.budgets.memory_free()
        for record in waiting:
            seg = record.disk[0]
            try:
                length = int(self.store.open(record.name).manifest.seg_len[seg])
                room = self.store.segments.memory_cap_room(record)
            except KSpeedError:
                continue  # unloaded meanwhile
            if length <= free and (room is None or length <= room):
                return record.name, seg
        return None
