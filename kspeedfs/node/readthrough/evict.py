"""Making room in the store's one memory budget: read-through segments leave in the order the
eviction policy gives, spilled to disk first when the node has a spill folder. The reads that
order them come here too (fills, mounts' `touch` reports, other nodes' reads)."""

from __future__ import annotations

import functools
import logging

import trio

from kspeedfs.format.contract.readthrough import Touch, Touched
from kspeedfs.format.errors import NoSpace, NotFound
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.units import format_size
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances, spilled
from kspeedfs.node.spill import SpillArea
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class Evictor:
    """Asks the policy (Instances.policy) for victims; the store calls `reclaim` when a
    preload needs memory that read-through data holds."""

    def __init__(self, store: SegmentStore, instances: Instances, spill: SpillArea | None):
        self.store = store
        self.instances = instances
        self.policy = instances.policy
        self.spill = spill
        store.add_reclaimer(self.reclaim)

    def admitted(self, ds: CachedDataset, seg: int) -> None:
        self.policy.admitted((ds.name, seg))

    def used(self, ds: CachedDataset, seg: int) -> None:
        self.policy.used((ds.name, seg))

    def note_reads(self, name: str, segments: list[int], hits: int = 1) -> None:
        """Segments a reader read (through its map, or from another node: the node sees
        neither), `hits` times in all."""
        ds = self.instances.by_name.get(name)
        if ds is None:
            return
        for seg in segments:
            self.used(ds, seg)
        ds.stats["hits"] += hits

    async def op_touch(self, request: Touch) -> Touched:
        """A mount's report of the segments its processes read through their maps."""
        try:
            self.instances.find(request.name, request.uuid)
        except NotFound:
            return Touched(False)
        self.note_reads(request.name, request.segments, request.hits)
        return Touched(True)

    async def make_room(self, length: int, reservation: str) -> None:
        """Evict until `length` more bytes fit the budget, then reserve them."""
        while self.store.budget - self.store.used() < length:
            victim = self._victim()
            if victim is None:
                raise NoSpace(
                    f"no room for a {format_size(length)} segment: the "
                    f"{format_size(self.store.budget)} budget is held by pinned datasets and "
                    "fills in progress"
                )
            await self._evict(*victim)
        self.store.reserve(reservation, length)

    def reclaim(self, nbytes: int) -> int:
        """Free at least nbytes of read-through memory for a preload (the store calls this in
        the event loop): in the policy's order, unlinked without spilling, so it is quick."""
        freed = 0
        while freed < nbytes:
            victim = self._victim()
            if victim is None:
                break
            freed += self._drop(*victim)
        if freed:
            log.info("evicted %s of read-through data to make room", format_size(freed))
        return freed

    def _victim(self) -> tuple[CachedDataset, int] | None:
        """The policy's next victim that is still a resident segment of a current instance."""
        while (key := self.policy.victim()) is not None:
            name, seg = key
            ds = self.instances.by_name.get(name)
            if ds is not None and seg in ds.resident:
                return ds, seg
        return None

    async def _evict(self, ds: CachedDataset, seg: int) -> None:
        if self.spill is not None and not spilled(self.spill, ds, seg):
            path = segment_path(ds.record.path, seg)
            if await trio.to_thread.run_sync(self.spill.put, ds.spill_key, seg, path):
                ds.stats["spilled"] += 1
        if seg in ds.resident and self.instances.current(ds):
            path = segment_path(ds.record.path, seg)
            await trio.to_thread.run_sync(functools.partial(path.unlink, missing_ok=True))
        self._drop(ds, seg)

    def _drop(self, ds: CachedDataset, seg: int) -> int:
        """Forget a resident segment (unlinking it unless the caller did)."""
        if seg not in ds.resident:
            return 0
        if self.instances.current(ds):
            # tmpfs: one unlink, no I/O; reclaim() runs inside the store's reserve, which is
            # synchronous, so a preload's reservation frees memory at once.
            segment_path(ds.record.path, seg).unlink(missing_ok=True)
        ds.resident.discard(seg)
        try:
            ds.record.held.remove(seg)
        except ValueError:
            pass
        length = ds.seg_len(seg)
        ds.record.stored -= length
        ds.epoch[0] += 1  # readers drop their maps of it: the memory really returns
        ds.stats["evictions"] += 1
        self.instances.stats["evictions"] += 1
        return length
