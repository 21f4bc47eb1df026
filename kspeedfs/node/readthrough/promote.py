"""The read-through cache's side of moving disk-tier segments to memory once memory frees up
(another dataset unloaded, a lease ended): what a dataset would have admitted had there been
room.

The node's Promoter (node/promote.py) decides for preloads and read-through instances alike
which segment moves next (dataset name then segment, while free memory and the dataset's
`max_memory` cap have room; nothing is evicted for a promotion). This supplies what differs
for a read-through instance (`Promotable`), whose places are its `InstancePlaces`
(places.py), not meta.json's: its disk segments, its cap, and the move, committed to those
places (`promoted`: counted in memory, its disk claim gone, in one call). A segment is copied into the shm folder under a temporary
name by the copy a preload's promotion makes (`SegmentPlaces.copy_from_disk`: through a
mapping, checked against the checksum of its fill), renamed into seg/, counted in memory and
entered in the eviction policy, then unlinked from disk and its disk claim released. A reader
finds the segment in one place or the other (memory, the disk, memory again), and its map of
the disk file stays valid until it drops it: once the Promoter has moved what it will of a
dataset, the dataset's epoch moves and its readers look again. A damaged copy is dropped from
disk (a later miss fills the segment again).
"""

from __future__ import annotations

import functools
import logging
import uuid

import trio

from kspeedfs.format.localdata import DamagedSegment, segment_path
from kspeedfs.node.promote import DiskSegment
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.evict import Evictor
from kspeedfs.node.safedir import seal_file, unlink_file
from kspeedfs.node.segments import SegmentPlaces
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class CachePromotions:
    """Promotable (node/promote.py): the read-through instances' disk-tier segments, for the
    node's Promoter."""

    def __init__(self, store: SegmentStore, instances: Instances, evictor: Evictor, disk: DiskTier):
        self.store = store
        self.instances = instances
        self.evictor = evictor
        self.disk = disk
        self.promoted = {"segments": 0, "bytes": 0}
        # By name, the instances moved from whose readers are yet to look again.
        self._moved: dict[str, CachedDataset] = {}

    def waiting(self) -> list[DiskSegment]:
        if not self.disk.enabled:
            return []
        out = []
        for ds in [d for d in self.instances.by_name.values() if d.on_disk]:
            seg = min(ds.on_disk)
            room = ds.max_memory - self.evictor.held(ds) if ds.max_memory else None
            out.append(DiskSegment(ds.name, ds.uuid, seg, ds.seg_len(seg), room))
        return out

    def settled(self, name: str) -> None:
        ds = self._moved.pop(name, None)
        if ds is not None:
            ds.epoch[0] += 1  # readers look again, and drop their maps of the disk files

    async def move(self, segment: DiskSegment) -> int:
        ds = self.instances.by_name.get(segment.name)
        if ds is None or ds.uuid != segment.uuid:
            return 0
        seg, length = segment.seg, segment.length
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
            await trio.to_thread.run_sync(copy)  # DamagedSegment: the Promoter calls `damaged`
            async with ds.lock:
                if not self.instances.current(ds) or seg not in ds.on_disk:
                    return 0  # unloaded, refreshed or found gone meanwhile
                final = segment_path(ds.record.path, seg)
                await trio.to_thread.run_sync(tmp.rename, final)
                await trio.to_thread.run_sync(seal_file, final)
                ds.places.promoted(seg)  # in memory, its disk claim gone
                self.store.budgets.release(reservation)
                self.evictor.admitted(ds, seg)
                await trio.to_thread.run_sync(unlink_file, disk_file)
        finally:
            self.store.budgets.release(reservation)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(tmp.unlink, True))
        self._moved[ds.name] = ds
        ds.stats["promoted"] += 1
        return length

    async def damaged(self, segment: DiskSegment, e: DamagedSegment) -> None:
        ds = self.instances.by_name.get(segment.name)
        if ds is None or ds.uuid != segment.uuid:
            return
        async with ds.lock:
            if not self.instances.current(ds) or segment.seg not in ds.on_disk:
                return  # unloaded, refreshed or found gone meanwhile
            log.warning("%s", e)
            self.disk.release(ds, segment.seg)
            await trio.to_thread.run_sync(
                unlink_file, segment_path(self.disk.folder(ds), segment.seg)
            )
