"""The composition root of a node: builds its parts, lets each register its own ops, and runs
each owner's tasks in the nursery the owner opens (`nursery.start(owner.run)`).

NodeServer (node.server) serves the ops and the reads of a Node; it tells the Node its port
once it listens, and the control plane then joins.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import trio

from kspeedfs.format import auth, users
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_size
from kspeedfs.node.control import ClusterControl, ControlPlane, EtcdCatalog
from kspeedfs.node.control.static import StaticControl
from kspeedfs.node.coordinator import PreloadCoordinator
from kspeedfs.node.decoded import DecodedVariants
from kspeedfs.node.discovery import placement_list
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.fdserver import FdServer
from kspeedfs.node.info import NodeInfo
from kspeedfs.node.jobs import DatasetCounters, JobTable
from kspeedfs.node.leases import LeaseOwner, LeaseTable
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.metaindexes import AddedIndexes
from kspeedfs.node.metrics import JobCollector, serve_metrics
from kspeedfs.node.ops import OpRegistry
from kspeedfs.node.peers import PeerPool
from kspeedfs.node.preload_queue import PreloadQueue
from kspeedfs.node.promote import PreloadPromotions, Promoter
from kspeedfs.node.readthrough import LocalCatalog, ReadThroughCache
from kspeedfs.node.scrub import Scrubber
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import TIER_DIR, SegmentStore
from kspeedfs.node.unload import Unloader
from kspeedfs.rdma.server import RdmaService

# Makes the node's RDMA service over its store, following its dataset events:
# RdmaService.start unless given (a test's is over a stand-in device).
RdmaFactory = Callable[[SegmentStore, DatasetEvents], RdmaService]


def cluster_members(settings: Settings) -> list[str]:
    """The node list this node places data over; just itself when it is not in the list."""
    return placement_list([str(a) for a in settings.nodes], str(settings.listen))


class Node:
    def __init__(self, settings: Settings, rdma: RdmaFactory | None = None):
        self.settings = settings
        # First: a token file that is refused (open to others, not UTF-8) starts nothing.
        self.token = auth.ensure_token(settings.token_file)
        self.port = settings.listen.port  # the one bound, once NodeServer listens
        self.started = time.time()
        self.stats = {"connections": 0, "reads": 0, "read_bytes": 0, "refused": 0}
        self.members = cluster_members(settings)
        self.ops = OpRegistry()
        # Built first: the store tells it, and each follower of the datasets (added indexes,
        # decoded variants, RDMA, the scrubber) is given it when built and subscribes then.
        events = DatasetEvents()
        self.store = SegmentStore(
            settings.shm_dir,
            settings.memory_budget(),
            settings.group,
            disk_root=settings.spill_dir / TIER_DIR if settings.spill_dir is not None else None,
            disk_budget=parse_size(settings.spill),
            events=events,
        )
        self.loads = LoadTable()
        self.leases = LeaseTable(settings.lease_ttl)
        self.peers = PeerPool(settings.token_file, settings.timeout, tls=client_context(settings))
        self.rdma = (rdma or functools.partial(RdmaService.start, settings))(self.store, events)
        self.users = users.UsersFile(settings.users_path())
        self.fds = FdServer(
            self.store, settings.socket_path(), settings.access, settings.timeout, self.users
        )
        self.stager = Stager(self.store, self.address)
        # The catalog read-through datasets are claimed in and placed by: etcd's (over the
        # membership the control plane joins), or this node alone.
        etcd = EtcdCatalog.of(settings, self.ask) if settings.etcd else None
        catalog = etcd or LocalCatalog(self.address)
        self.cache = ReadThroughCache(self.store, settings, self.address, self.loads, catalog)
        self.decoded = DecodedVariants(
            self.store, events, self.address, self.ask, settings.decode_workers
        )
        self.meta_indexes = AddedIndexes(self.store, events, self.address, self.ask)
        # Unloading forgets a dataset in the same catalog, so it is built before the control
        # plane, which unloads what the catalog no longer places here.
        self.unloader = Unloader(
            self.store, self.loads, self.leases, lambda: self.address, self.ask, catalog
        )
        # The control plane: etcd's (membership, catalog, healing; it hands the cache the
        # read-through datasets to adopt), or the static node list.
        self.control: ClusterControl = (
            ControlPlane(
                settings,
                self.store,
                self.ask,
                self.unloader.unload_local,
                etcd,
                stager=self.stager,
                readthrough=self.cache,
            )
            if etcd is not None
            else StaticControl(settings, self.members)
        )
        self.lease_owner = LeaseOwner(
            self.leases, self.store, lambda: self.address, self.unloader.unload
        )
        self.preload_queue = PreloadQueue(self.store.budgets)
        self.coordinator = PreloadCoordinator(
            settings,
            self.store,
            self.loads,
            self.stager,
            self.control,
            self.ask,
            self.decoded.after_preload,
            self.preload_queue,
        )
        self.scrubber = Scrubber(settings, self.store, events, lambda: self.address)
        self.preload_promotions = PreloadPromotions(self.store, self.scrubber.quarantined)
        self.promoter = Promoter(
            self.store.budgets, [self.preload_promotions, self.cache.promotions]
        )
        self.info = NodeInfo(self)
        self.jobs = JobTable(time.monotonic, counters_of(self.store, self.cache))
        owners = (
            self.info,
            self.jobs,
            self.coordinator,
            self.lease_owner,
            self.unloader,
            self.scrubber,
            self.control,
            self.stager,
            self.decoded,
            self.meta_indexes,
            self.rdma,
            self.cache,
        )
        for owner in owners:
            owner.register_ops(self.ops)

    @property
    def address(self) -> str:
        return f"{self.settings.listen.host}:{self.port}"

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The parts' tasks, until cancelled: each owner's in the nursery it opens."""
        await trio.to_thread.run_sync(self.store.recover, self.settings.verify_on_start)
        await trio.to_thread.run_sync(self.cache.recover)
        self.fds.start(self.token)
        try:
            async with trio.open_nursery() as nursery:
                owners = (
                    self.stager,
                    self.lease_owner,
                    self.cache,
                    self.coordinator,
                    self.promoter,
                    self.scrubber,
                    self.rdma,
                )
                for owner in owners:
                    await nursery.start(owner.run)
                task_status.started()
        finally:
            self.fds.close()
            await self.peers.aclose()

    async def join(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Once the port is known: the control plane joins the cluster, the metrics serve."""
        if self.settings.metrics_listen:  # Prometheus /metrics, its own thread
            histograms = [
                self.cache.fill_seconds,
                *self.control.histograms,
                JobCollector(self.jobs.answer),
            ]
            serve_metrics(self.settings.metrics_listen, self.info.metrics_snapshot, histograms)
        await self.control.run(self.address, task_status=task_status)

    def cancel_loads(self) -> None:
        self.loads.cancel_all()

    async def ask(self, member: str, request: Request[Answer]) -> Answer:
        """A typed request on a member: directly when it is this node (answered as a remote
        member would answer it), else over a kept connection."""
        if member == self.address:
            return await self.ops.call(request)
        return await self.peers.ask(member, request)


def counters_of(
    store: SegmentStore, cache: ReadThroughCache
) -> Callable[[str], DatasetCounters | None]:
    """What the job table reads of a dataset: a read-through one's hits, misses and source
    bytes and its segments in memory; a preload's memory (its reads are not counted here)."""

    def counters(name: str) -> DatasetCounters | None:
        ds = cache.datasets.get(name)
        if ds is not None:
            return DatasetCounters(
                hits=ds.stats["hits"],
                misses=ds.stats["misses"],
                source_bytes=ds.stats["source_bytes"],
                resident_bytes=ds.segment_bytes,
            )
        record = store.datasets.get(name)
        return DatasetCounters(resident_bytes=record.stored) if record is not None else None

    return counters
