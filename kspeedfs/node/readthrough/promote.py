"""Moving read-through segments from the disk tier to memory once memory frees up (another
dataset unloaded, a lease ended): what a dataset would have admitted had there been room.

The store's promotion (node/promote.py) moves a preload's segments, whose places meta.json
records; a read-through instance's places are the cache's (`CachedDataset.resident`,
`on_disk`), so it moves its own: copied into the shm folder under a temporary name by the
copy a preload's promotion makes (`SegmentPlaces.copy_from_disk`: through a mapping, checked
against the checksum of its fill), renamed into seg/, counted in memory and
entered in the eviction policy, then unlinked from disk and its disk claim released. A reader
finds the segment in one place or the other (memory, the disk, memory again), and its map of
the disk file stays valid until it drops it. Only memory that is free now is taken: nothing
is evicted for a promotion, and a dataset's `max_memory` cap holds.
"""

from __future__ import annotations

import functools
import logging
import uuid

import trio

from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.localdata import DamagedSegment, segment_path
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.evict import Evictor
from kspeedfs.node.safedir import seal_file, unlink_file
from kspeedfs.node.segments import SegmentPlaces
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class DiskPromoter:
    """Owns the read-through promotions: the node's Promoter (node/promote.py) calls
    `promote_what_fits` when memory may have freed up; it moves segments one at a time, in
    dataset then segment order, while memory has room."""

    def __init__(self, store: SegmentStore, instances: Instances, evictor: Evictor, disk: DiskTier):
        self.store = store
        self.instances = instances
        self.evictor = evictor
        self.disk = disk
        self.promoted = {"segments": 0, "bytes": 0}

    async def promote_what_fits(self) -> bool:
        """Move what fits now; False when a move failed."""
        if not self.disk.enabled:
            return True
        failed = False
        for ds in [self.instances.by_name[n] for n in sorted(self.instances.by_name)]:
            if not ds.on_disk or self.store.budgets.memory_free() < ds.seg_len(min(ds.on_disk)):
                # What every fill's end wakes it for during an epoch, with memory full: no
                # sort of the disk segments for a move that cannot happen.
                continue
            moved = False
            for seg in sorted(ds.on_disk):
                length = ds.seg_len(seg)
                if self.store.budgets.memory_free() < length:
                    break
                if ds.max_memory and self.evictor.held(ds) + length > ds.max_memory:
                    break
                try:
                    moved |= await self._promote(ds, seg, length)
                except (KSpeedError, OSError) as e:
                    log.info("segment %d of %s stays on disk for now: %s", seg, ds.name, e)
                    failed = True
                    break
            if moved:
                ds.epoch[0] += 1  # readers look again, and drop their maps of the disk files
        return not failed

    async def _promote(self, ds: CachedDataset, seg: int, length: int) -> bool:
        reservation = f"fill:{ds.name}:{ds.uuid}:{seg}"  # a fill's: not counted as a load
        tmp = self.store.staging_dir / f"promote.{ds.name}.{seg:08d}.{uuid.uuid4().hex[:8]}"
        disk_file = segment_path(self.disk.folder(ds), seg)
        self.store.budgets.reserve(
            reservation, length, what=f"segment {seg} of {ds.name}", evict=False
        )
        try:
            # The copy a preload's promotion makes too (SegmentPlaces.promote), checked against the
            # checksum of its fill; the places it changes are the cache's.
            copy = functools.partial(
                SegmentPlaces.copy_from_disk,
                disk_file,
                tmp,
                seg,
                length,
                int(ds.sums[seg]),
                f"disk-tier segment {seg} of {ds.name}",
            )
            damaged: DamagedSegment | None = None
            try:
                await trio.to_thread.run_sync(copy)
            except DamagedSegment as e:
                damaged = e
            async with ds.lock:
                if not self.instances.current(ds) or seg not in ds.on_disk:
                    return False  # unloaded, refreshed or found gone meanwhile
                if damaged is not None:
                    log.warning("%s", damaged)
                    self.disk.release(ds, seg)
                    await trio.to_thread.run_sync(unlink_file, disk_file)
                    return False
                final = segment_path(ds.record.path, seg)
                await trio.to_thread.run_sync(tmp.rename, final)
                await trio.to_thread.run_sync(seal_file, final)
                ds.resident.add(seg)
                self.store.segments.cached(ds.record, seg, length)
                self.store.budgets.release(reservation)
                self.evictor.admitted(ds, seg)
                self.disk.release(ds, seg)
                await trio.to_thread.run_sync(unlink_file, disk_file)
        finally:
            self.store.budgets.release(reservation)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(tmp.unlink, True))
        self.promoted["segments"] += 1
        self.promoted["bytes"] += length
        ds.stats["promoted"] += 1
        return True
