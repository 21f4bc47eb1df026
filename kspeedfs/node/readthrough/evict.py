"""Making room in the store's one memory budget: read-through segments leave in the order the
eviction policy gives, spilled to the disk tier first when the node has one (disktier.py).

The evictor decides which datasets a miss may take from; the policy picks the segment. A
dataset with a cap (`max_memory`) never holds more: past it, only its own segments make room.
A capped dataset's segments are its share: no other dataset's miss, and no preload, takes
them. The uncapped ones share the rest by max-min (shares.py): under every policy, a miss
takes from another dataset only while its own is under its share, and only from the one most
over its share by at least a segment; else the policy picks among the miss's own segments
(`lru`, `plan`) or keeps what is there (`stable`). So holdings settle at the shares and never
move back and forth (two datasets at equal holdings took a segment from each other on every
miss while "holds more" was the test). When the policy finds no victim, the miss is not kept
(`NotAdmitted`): the reader reads the source. The reads that
order evictions come here too (fills, mounts' `touch` reports, other nodes' reads)."""

from __future__ import annotations

import logging

import trio

from kspeedfs.format.contract.readthrough import RegisterSource, Touch, Touched
from kspeedfs.format.errors import InvalidArgument, NoSpace, NotFound
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.units import format_size
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.shares import Demand, fair_shares
from kspeedfs.node.safedir import unlink_file
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

PRELOAD = "preload"  # what evictions for a preload's room are counted as


class NotAdmitted(Exception):
    """A miss the policy does not keep: read from the source, not admitted."""


class Evictor:
    """Asks the policy (Instances.policy) for victims; the store calls `reclaim` when a
    preload needs memory that read-through data holds."""

    def __init__(self, store: SegmentStore, instances: Instances, disk: DiskTier):
        self.store = store
        self.instances = instances
        self.policy = instances.policy
        self.disk = disk
        self.filling: dict[str, int] = {}  # bytes of fills in progress, by dataset
        store.budgets.add_reclaimer(self.reclaim)

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
        # Readers count reads, not where they lay: split by the segments they name.
        on_disk = sum(seg in ds.on_disk for seg in segments)
        disk_hits = hits * on_disk // len(segments) if segments else 0
        ds.stats["disk_hits"] += disk_hits
        ds.stats["hits"] += hits - disk_hits

    async def op_touch(self, request: Touch) -> Touched:
        """A mount's report of the segments its processes read through their maps."""
        try:
            self.instances.find(request.name, request.uuid)
        except NotFound:
            return Touched(False)
        self.note_reads(request.name, request.segments, request.hits)
        return Touched(True)

    def held(self, ds: CachedDataset) -> int:
        """Bytes `ds` holds in memory and is filling: what its cap and its share count."""
        return ds.segment_bytes + self.filling.get(ds.name, 0)

    async def make_room(self, ds: CachedDataset, seg: int, reservation: str) -> None:
        """Evict until segment `seg` of `ds` fits its cap and the budget, then reserve it;
        NotAdmitted when the policy keeps what is there."""
        length = ds.seg_len(seg)
        if ds.max_memory and length > ds.max_memory:
            raise NotAdmitted(f"a segment is larger than the cap of {ds.name}")
        while True:
            over_cap = bool(ds.max_memory) and self.held(ds) + length > ds.max_memory
            if not over_cap and self.store.budgets.memory - self.store.budgets.used() >= length:
                break
            others = [] if over_cap else self._takes_from(ds, length)
            key = self.policy.victim((ds.name, seg), others)
            if key is None:
                if over_cap or self._holds_any(ds) or self._sharing(ds):
                    raise NotAdmitted(f"{ds.name} keeps what it holds")
                raise NoSpace(
                    f"no room for a {format_size(length)} segment: the "
                    f"{format_size(self.store.budgets.memory)} budget is held by pinned datasets, "
                    "capped shares and fills in progress"
                )
            victim = self._resident(key)
            if victim is not None:
                await self._evict(*victim, self.policy.name)
        self.store.budgets.reserve(reservation, length)
        self.filling[ds.name] = self.filling.get(ds.name, 0) + length

    def release(self, ds: CachedDataset, seg: int, reservation: str) -> None:
        """A fill that reserved with make_room ended (resident now, or given up)."""
        if reservation in self.store.budgets.reserved:
            self.store.budgets.release(reservation)
            left = self.filling.get(ds.name, 0) - ds.seg_len(seg)
            if left > 0:
                self.filling[ds.name] = left
            else:
                self.filling.pop(ds.name, None)

    def _holds_any(self, ds: CachedDataset) -> bool:
        return bool(ds.resident)

    def _sharing(self, ds: CachedDataset) -> list[CachedDataset]:
        """The other datasets holding memory that a miss of `ds` could take: uncapped ones (a
        cap is a share nobody else takes)."""
        return [
            other
            for other in self.instances.by_name.values()
            if other is not ds and not other.max_memory and other.resident
        ]

    def shares(self) -> dict[str, int]:
        """Each uncapped dataset's fair share of the memory they share: the budget less what
        others hold (pinned datasets, claims of other work) and the caps of capped ones."""
        datasets = self.instances.by_name.values()
        sharing = [ds for ds in datasets if not ds.max_memory]
        capped_room = sum(max(0, ds.max_memory - self.held(ds)) for ds in datasets if ds.max_memory)
        held = sum(self.held(ds) for ds in sharing)
        budgets = self.store.budgets
        pool = budgets.memory - (budgets.used() - held) - capped_room
        return fair_shares(
            pool, {ds.name: Demand(ds.size, ds.weight, ds.min_memory) for ds in sharing}
        )

    def _takes_from(self, ds: CachedDataset, length: int) -> list[str]:
        """The dataset a miss of `ds` (a segment of `length`) may take memory from: for a
        capped one, any uncapped one (its cap is reserved for it); else, while `ds` is under
        its share, the one most over its share by at least `length`."""
        if ds.max_memory:
            return [other.name for other in self._sharing(ds)]
        shares = self.shares()
        if self.held(ds) >= shares.get(ds.name, 0):
            return []
        over = {
            other.name: self.held(other) - shares.get(other.name, 0) for other in self._sharing(ds)
        }
        most = max(over, key=over.__getitem__, default=None)
        return [most] if most is not None and over[most] >= length else []

    def check_limits(self, request: RegisterSource) -> None:
        """Refuse (one line, nothing changed) a cap or a floor larger than the node has free:
        its budget less the pinned datasets, the work in progress and the other datasets'
        caps and floors (both are memory set aside for one dataset)."""
        name, max_memory, max_disk = request.name, request.max_memory, request.max_disk
        min_memory = request.min_memory
        if max_memory and min_memory > max_memory:
            raise InvalidArgument(
                f"--min-memory {format_size(min_memory)} for {name!r} is more than its "
                f"--max-memory {format_size(max_memory)}"
            )
        for flag, wanted in (("--max-memory", max_memory), ("--min-memory", min_memory)):
            if wanted and wanted > (free := self._memory_free_for(name)):
                raise NoSpace(
                    f"{flag} {format_size(wanted)} for {name!r} is more than the "
                    f"{format_size(max(free, 0))} this node has free (a budget of "
                    f"{format_size(self.store.budgets.memory)}, less pinned datasets and other "
                    "caps and floors)"
                )
        if max_disk:
            if not self.disk.enabled:
                raise InvalidArgument("--max-disk needs a node with a spill folder (--spill-dir)")
            capped = sum(d.max_disk for d in self.instances.by_name.values() if d.name != name)
            free = self.disk.spill_room() - capped
            if max_disk > free:
                raise NoSpace(
                    f"--max-disk {format_size(max_disk)} for {name!r} is more than the "
                    f"{format_size(max(free, 0))} of the spill folder not capped by others"
                )

    def _memory_free_for(self, name: str) -> int:
        """What a new cap or floor of `name` may set aside: the budget less the pinned
        datasets, the work in progress and the other datasets' caps and floors."""
        pinned = sum(
            r.stored for r in self.store.datasets.values() if r.name not in self.instances.by_name
        )
        work = sum(
            r.nbytes
            for k, r in self.store.budgets.reserved.items()
            if r.tier == "memory" and not k.startswith("fill:")
        )
        set_aside = sum(
            d.max_memory or d.min_memory for d in self.instances.by_name.values() if d.name != name
        )
        return self.store.budgets.memory - pinned - work - set_aside

    def reclaim(self, nbytes: int) -> int:
        """Free at least nbytes of read-through memory for a preload (the store calls this in
        the event loop): in the policy's order, unlinked without spilling, so it is quick.
        Capped shares and floors stay."""
        return self._reclaim(nbytes, protect_caps=True)

    def reclaim_over_budget(self, nbytes: int) -> int:
        """After a restart: what is over the budget leaves, capped or not."""
        return self._reclaim(nbytes, protect_caps=False)

    def _reclaim(self, nbytes: int, protect_caps: bool) -> int:
        freed = 0
        while freed < nbytes:
            others = [
                ds.name
                for ds in self.instances.by_name.values()
                if not (protect_caps and (ds.max_memory or self.held(ds) <= ds.min_memory))
            ]
            key = self.policy.victim(None, others)
            if key is None:
                break
            victim = self._resident(key)
            if victim is not None:
                freed += self._drop(*victim, PRELOAD)
        if freed:
            log.info("evicted %s of read-through data to make room", format_size(freed))
        return freed

    def _resident(self, key: tuple[str, int]) -> tuple[CachedDataset, int] | None:
        """The policy's victim, when it is still a resident segment of a current instance."""
        name, seg = key
        ds = self.instances.by_name.get(name)
        if ds is not None and seg in ds.resident:
            return ds, seg
        return None

    async def _evict(self, ds: CachedDataset, seg: int, why: str) -> None:
        if await self.disk.spill(ds, seg):
            ds.stats["spilled"] += 1
        if seg in ds.resident and self.instances.current(ds):
            path = segment_path(ds.record.path, seg)
            await trio.to_thread.run_sync(unlink_file, path)
        self._drop(ds, seg, why)

    def _drop(self, ds: CachedDataset, seg: int, why: str) -> int:
        """Forget a resident segment (unlinking it unless the caller did)."""
        if seg not in ds.resident:
            return 0
        if self.instances.current(ds):
            # tmpfs: one unlink, no I/O; reclaim() runs inside the store's reserve, which is
            # synchronous, so a preload's reservation frees memory at once.
            unlink_file(segment_path(ds.record.path, seg))
        length = ds.places.evicted(seg)
        ds.epoch[0] += 1  # readers drop their maps of it: the memory really returns
        ds.stats["evictions"] += 1
        self.instances.stats["evictions"] += 1
        self.instances.evictions_by[why] += 1
        self.store.budgets.memory_freed()  # promotion may move a disk segment in
        return length
