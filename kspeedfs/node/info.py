"""What a node tells about itself: `status` (budget, connections, every subsystem's figures),
`list` (every dataset it holds or is loading) and `manifest` (a dataset's manifest, in
pieces), read off the node's parts."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import (
    DatasetEntry,
    DatasetListing,
    HeldSegments,
    List,
    LoadingEntry,
    ManifestPiece,
    ManifestReq,
    NodeStatus,
    Status,
)
from kspeedfs.format.contract.pieces import read_piece
from kspeedfs.format.contract.status import DiskTierStatus, LocalSocketStatus
from kspeedfs.format.errors import NotFound
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.node.control import ClusterControl
from kspeedfs.node.decoded import DecodedVariants
from kspeedfs.node.fdserver import FdServer
from kspeedfs.node.leases import LeaseTable
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import READ, OpRegistry
from kspeedfs.node.peers import PeerPool
from kspeedfs.node.preload_queue import PreloadQueue
from kspeedfs.node.promote import PreloadPromotions
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.scrub import Scrubber
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import SegmentStore
from kspeedfs.rdma.server import RdmaService


class NodeParts(Protocol):
    """The parts of a node (node.root.Node) this reads."""

    settings: Settings
    store: SegmentStore
    loads: LoadTable
    leases: LeaseTable
    stager: Stager
    preload_queue: PreloadQueue
    preload_promotions: PreloadPromotions
    scrubber: Scrubber
    cache: ReadThroughCache
    decoded: DecodedVariants
    rdma: RdmaService
    fds: FdServer
    peers: PeerPool
    control: ClusterControl
    members: list[str]
    stats: dict[str, int]
    started: float

    @property
    def address(self) -> str: ...


class NodeInfo:
    def __init__(self, node: NodeParts):
        self.node = node

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(Status, self.op_status, READ)
        ops.add(List, self.op_list, READ)
        ops.add(ManifestReq, self.op_manifest, READ)

    async def op_status(self, request: Status) -> NodeStatus:
        n = self.node
        folders = [r.path / "seg" for r in n.store.datasets.values()]
        if n.store.disk_root is not None:  # and the disk tier's
            folders += [
                n.store.disk_root / f"{r.name}.{r.uuid}" / "seg"
                for r in n.store.datasets.values()
                if r.disk
            ]
        segments = await trio.to_thread.run_sync(_count_files, folders)
        return NodeStatus(
            node=n.address,
            pid=os.getpid(),
            shm_dir=str(n.settings.shm_dir),
            budget=n.store.budgets.memory,
            used=n.store.budgets.used(),
            disk_tier=_disk_tier(n),
            integrity=n.scrubber.status(),  # damaged segments found and repaired, scrub
            datasets=len(n.store.datasets),
            loading=sorted(name for name, p in n.loads.items() if p.state == "loading"),
            queue=n.preload_queue.status(),
            segments=segments,
            uptime=time.time() - n.started,
            stats=dict(n.stats),
            local_socket=_local_socket(n),
            transport=n.rdma.label,
            rdma=n.rdma.status(),
            leases=n.leases.total(),
            cache=n.cache.status(),
            loaded=dict(n.stager.loaded),
            decoded={r: n.decoded.local_status(r) for r in n.store.datasets},
            members=n.control.members(),
            control=n.control.status(),
            peers=n.peers.statistics(),
            held={
                r.name: HeldSegments(held=r.held, segments=r.segments)
                for r in n.store.datasets.values()
            },
        )

    async def op_list(self, request: List) -> DatasetListing:
        n = self.node
        out: list[DatasetEntry | LoadingEntry] = [
            DatasetEntry(
                **{
                    **r.to_wire(),
                    **_readthrough_disk(n.cache.disk_stored(r.name, r.uuid)),
                    "leases": n.leases.count(r.name),
                    "decoded": n.decoded.local_status(r.name),
                    **self._placement(r.name, r.uuid),
                }
            )
            for r in n.store.datasets.values()
        ]
        out.extend(LoadingEntry.from_wire(load) for load in n.loads.to_wire())
        return DatasetListing(node=n.address, datasets=sorted(out, key=lambda d: d.name))

    async def op_manifest(self, request: ManifestReq) -> ManifestPiece:
        """A piece of the manifest, for a client on a machine that holds no part of the
        dataset (a large manifest is far over one control frame)."""
        record = self.node.store.instance(request.name, request.uuid)
        path = record.path / MANIFEST_FILE
        try:
            piece = await trio.to_thread.run_sync(read_piece, path, request.offset, request.length)
        except FileNotFoundError:  # unloaded since it was looked up
            raise NotFound(
                f"dataset {record.name!r} was unloaded while its manifest was read"
            ) from None
        return ManifestPiece(record.name, record.uuid, piece)

    def _placement(self, name: str, uuid: str) -> dict[str, Any]:
        """Where an instance's segments are placed now, when the catalog says: the members of
        its last rebalance and the lost ones (a heal or a rebalance changes them after the
        load)."""
        entry = self.node.control.catalog.get(name)
        if not entry or entry.uuid != uuid:
            return {}
        return {"placed": list(entry.members), "lost": list(entry.lost_members)}

    def metrics_snapshot(self) -> dict[str, Any]:
        """Metrics: the figures a scrape reads (from the exporter's thread)."""
        n = self.node
        return {
            "stats": dict(n.stats),
            "used": n.store.budgets.used(),
            "budget": n.store.budgets.memory,
            "leases": n.leases.total(),
            "disk_tier": _disk_tier(n),
            "integrity": n.scrubber.status(),
            "datasets": {
                r.name: (r.stored, len(r.held), r.disk_stored)
                for r in list(n.store.datasets.values())
            },
            "control": n.control.status(),
            "cache": n.cache.status(),  # read-through: hits, fills, evictions by policy
            "dataset_leases": {name: n.leases.count(name) for name in list(n.store.datasets)},
        }


def _readthrough_disk(disk_stored: int | None) -> dict[str, int]:
    """A read-through dataset's disk-tier bytes, which its record does not count."""
    return {} if disk_stored is None else {"disk_stored": disk_stored}


def _disk_tier(n: NodeParts) -> DiskTierStatus | None:
    """The disk tier's figures (None: the node has none)."""
    store = n.store
    if store.disk_root is None:
        return None
    return DiskTierStatus(
        dir=str(store.disk_root),
        budget=store.budgets.disk,
        used=store.budgets.disk_used(),
        promoted=dict(n.preload_promotions.promoted),
    )


def _local_socket(n: NodeParts) -> LocalSocketStatus:
    stats = n.fds.stats
    return LocalSocketStatus(
        path=str(n.fds.path),
        attached=stats.get("attached", 0),
        refused=stats.get("refused", 0),
        connections=stats.get("connections", 0),
        busy=stats.get("busy", 0),
        idle_closed=stats.get("idle_closed", 0),
    )


def _count_files(folders: list[Path]) -> int:
    count = 0
    for folder in folders:
        try:
            count += len(os.listdir(folder))
        except FileNotFoundError:
            pass  # unloaded meanwhile
    return count
