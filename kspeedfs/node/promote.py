"""Moving disk-tier segments to memory once it frees up (an unload, a lease's end, an eviction).

One small owner with its own task: it looks every PROMOTE_INTERVAL_S, and moves segments one at
a time, in dataset then segment order, while the memory budget has room for the next one. A
segment moves by copy, rename into the shm folder and unlink from disk (SegmentStore.promote):
its readers see one copy or the other, never part of one.
"""

from __future__ import annotations

import logging

import trio

from kspeedfs.format.errors import KSpeedError
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

PROMOTE_INTERVAL_S = 0.5


class Promoter:
    def __init__(self, store: SegmentStore):
        self.store = store
        self.promoted = {"segments": 0, "bytes": 0}

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(PROMOTE_INTERVAL_S)
            while (nxt := self._next()) is not None:
                name, seg = nxt
                try:
                    moved = await trio.to_thread.run_sync(self.store.promote, name, seg)
                except (KSpeedError, OSError) as e:
                    log.info("segment %d of %s stays on disk for now: %s", seg, name, e)
                    break
                self.promoted["segments"] += moved > 0
                self.promoted["bytes"] += moved

    def _next(self) -> tuple[str, int] | None:
        """The next disk segment that fits in memory now (None: none, or no room)."""
        waiting = [(name, r.disk[0]) for name, r in sorted(self.store.datasets.items()) if r.disk]
        if not waiting:
            return None
        free = self.store.memory_free()
        for name, seg in waiting:
            try:
                length = int(self.store.open(name).manifest.seg_len[seg])
            except KSpeedError:
                continue  # unloaded meanwhile
            if length <= free:
                return name, seg
        return None
