"""Read-through datasets on a node: segments filled from the source on a miss, evicted by one
store-wide policy, spilled to disk, or kept on the node's disk tier.

A read-through dataset is published like a preloaded one (a manifest, from a listing of the
source; lifetime "readthrough") but holds no segment at first. A reader that misses asks the
node to `fill` the segment: the node reads it once (concurrent misses wait for the same fill)
from the spill folder or the source, writes it under a temporary name and renames it into the
dataset's seg/ folder, where every local reader maps it.

Memory is one budget for all datasets. Preloaded (offline) and leased datasets are pinned; a
dataset may have a cap of its own. When the budget or a cap is reached, the eviction policy
(the setting `eviction`) picks a read-through segment to evict, or keeps what is there and
fills the miss onto the node's disk tier (when it has one with room), else lets the reader
read the miss from the source. An evicted segment is copied to the spill
folder when there is one, then unlinked (mapped pages stay valid; readers drop their maps
when the eviction counter moves). The node also checks
sources for changes: a changed dataset is served as it was cached and shown stale until
`kspeedfs refresh NAME`.

The cache is built with its `ClusterCatalog`. With etcd's, a dataset is one cache over the
cluster: the node that lists the source claims the name in the catalog, places the segments
over the live members (readers ask each segment's owner to fill it), and every member adopts
the manifest with no segment (the control plane hands the cache the catalog's read-through
instances to adopt: `adopt`). Without etcd (`LocalCatalog`) a dataset is this node's alone.

One module a job: `register` (listing a source, etcd claims, adoption), `fill` (misses),
`disktier` (misses memory does not keep, on the disk tier) with `promote` (what the node's
Promoter needs to move them back to memory when it frees up),
`evict` (the budget and the caps) with `policy` (the order) and `plans` (the readers' plans
it follows), `watch` (source checks, refresh, pruning), `build` (staging an instance),
`dataset` (the instances) with `places` (where each instance's segments lie, and what they
take of the budgets: the one writer of both), `status`. `ReadThroughCache` only
composes them, registers their ops and runs their tasks.
"""

from __future__ import annotations

import logging

import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.readthrough import (
    FillSegment,
    PlanReq,
    Refresh,
    RegisterSource,
    Touch,
)
from kspeedfs.format.contract.status import CacheStatus
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.units import format_size
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import ADMIN, JOB, OpRegistry
from kspeedfs.node.readthrough.build import InstanceBuilder
from kspeedfs.node.readthrough.catalog import ClusterCatalog, LocalCatalog
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.evict import Evictor
from kspeedfs.node.readthrough.fill import Filler
from kspeedfs.node.readthrough.plans import PlanTable
from kspeedfs.node.readthrough.policy import EvictionPolicy, make_policy
from kspeedfs.node.readthrough.promote import CachePromotions
from kspeedfs.node.readthrough.register import SourceRegistrar
from kspeedfs.node.readthrough.status import cache_status
from kspeedfs.node.readthrough.watch import SourceWatch
from kspeedfs.node.store import SegmentStore

__all__ = [
    "CachedDataset",
    "ClusterCatalog",
    "EvictionPolicy",
    "LocalCatalog",
    "ReadThroughCache",
]

log = logging.getLogger(__name__)


class ReadThroughCache:
    """Owned by the node; runs in its event loop, with file work in worker threads."""

    def __init__(
        self,
        store: SegmentStore,
        settings: Settings,
        address: str,
        loads: LoadTable,
        catalog: ClusterCatalog,
        policy: EvictionPolicy | None = None,
    ):
        self.store = store
        self.settings = settings
        policy = policy or make_policy(settings.eviction)
        self.instances = Instances(store, address, policy)
        self.plans = PlanTable(self.instances, uses_plans=policy.name == "plan")
        # The spill folder's budget and the disk tier's are the store's (spill_dir, spill).
        self.disk = DiskTier(store, self.instances)
        self.evictor = Evictor(store, self.instances, self.disk)
        self.promotions = CachePromotions(store, self.instances, self.evictor, self.disk)
        builder = InstanceBuilder(store, settings.segment_size, address)
        self.filler = Filler(
            store,
            self.instances,
            self.evictor,
            self.disk,
            max(1.0, settings.timeout / 2),
        )
        self.registrar = SourceRegistrar(
            store, self.instances, builder, loads, address, self.evictor.check_limits, catalog
        )
        self.watch = SourceWatch(
            store,
            self.instances,
            builder,
            self.disk,
            settings.source_check_interval,
            catalog,
        )
        self.fill_seconds = self.filler.seconds

    @property
    def datasets(self) -> dict[str, CachedDataset]:
        return self.instances.by_name

    @property
    def busy(self) -> set[str]:
        """Names being listed or refreshed here (not converged yet)."""
        return self.instances.busy

    def disk_stored(self, name: str, uuid: str) -> int | None:
        """Bytes instance `uuid` of read-through dataset `name` holds on the disk tier (None:
        not a read-through instance here). Its record counts only memory: where fills land
        changes with every miss, and meta.json is written once."""
        ds = self.instances.by_name.get(name)
        return ds.disk_bytes if ds is not None and ds.uuid == uuid else None

    def register_ops(self, ops: OpRegistry) -> None:
        """Creating and refreshing a dataset needs an admin; filling what a reader misses (the
        node reads the source for it) and reporting what it read need the job role."""
        ops.add(RegisterSource, self.registrar.op_register_source, ADMIN)
        ops.add(Refresh, self.watch.op_refresh, ADMIN)
        ops.add(FillSegment, self.filler.op_fill, JOB)
        ops.add(Touch, self.evictor.op_touch, JOB)
        ops.add(PlanReq, self.plans.op_plan, JOB)

    def recover(self) -> None:
        """Pick up the read-through datasets the store found; their segments are what is here,
        entering the eviction policy oldest first (those on the disk tier claim its room
        again)."""
        verify = self.settings.verify_on_start
        found: list[tuple[float, str, int]] = []
        for record in list(self.store.datasets.values()):
            if record.lifetime != READTHROUGH:
                continue
            try:
                ds, mtimes = self.instances.open(record, verify)
            except (KSpeedError, OSError, ValueError) as e:
                log.error("dropping broken read-through dataset %s: %s", record.name, e)
                self.store.unload(record.name)
                continue
            self.disk.recover(ds, verify)
            self.instances.add(ds, admit=False)
            found.extend((t, record.name, seg) for seg, t in mtimes.items())
        for _t, name, seg in sorted(found):
            self.instances.policy.admitted((name, seg))
        self.disk.remove_old_spill()
        over = self.store.budgets.used() - self.store.budgets.memory
        if over > 0:
            log.warning("%s over the memory budget after restart: evicting", format_size(over))
            self.evictor.reclaim_over_budget(over)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fills and listings that ops start, pruning, periodic checks of the sources (the
        node's Promoter moves disk-tier segments to memory, asking `promotions`)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.filler.run)
            await nursery.start(self.registrar.run)
            await nursery.start(self.watch.run)
            task_status.started()

    async def adopt(self, name: str, entry: CatalogEntry) -> None:
        """etcd: list the catalog's instance of `entry` here, holding no segment (its manifest
        from a member that holds it), unless this node lists `name` already."""
        await self.registrar.adopt(name, entry)

    def note_reads(self, name: str, segments: list[int]) -> None:
        """Segments another node read from here (its reads miss this node's policy otherwise)."""
        self.evictor.note_reads(name, segments)

    def status(self) -> CacheStatus:
        return cache_status(self.store, self.instances, self.disk, self.evictor.shares())
