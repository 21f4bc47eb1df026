"""The node's side of the etcd control plane, one module per concern: membership (the lease
and the live members), the catalog as the node's parts write it (claims, publishes, manifests
fetched from members), adoption (listing an instance held elsewhere), convergence (dropping
what the catalog no longer has) and healing (copies made again, rebalances).

Everything that talks to etcd runs in worker threads (the event loop never waits on etcd), and
the data plane never depends on it: with etcd away, reads go on and only control ops fail.
Read-through datasets are cataloged too (their segments placed over the members, filled on
demand), but not healed: a lost owner's segments are filled again by the next one on a miss.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Protocol

import trio

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.client.clusterstate import UNAVAILABLE
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.control import Adopt, Adopted
from kspeedfs.format.contract.node import Rebalance, Rebalanced
from kspeedfs.format.contract.status import ControlStatus
from kspeedfs.format.errors import NotFound
from kspeedfs.format.manifest import plan_layout
from kspeedfs.node.control.adopt import Adoption, Unload
from kspeedfs.node.control.catalog import EtcdCatalog
from kspeedfs.node.control.converge import Converger
from kspeedfs.node.control.heal import Healer, placed
from kspeedfs.node.ops import ADMIN, OpRegistry
from kspeedfs.node.peers import Ask, PeerPool
from kspeedfs.node.preload import Plan
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import SegmentStore

__all__ = ["ClusterControl", "ControlPlane", "EtcdCatalog", "loading_record", "placed"]

log = logging.getLogger(__name__)

SYNC_INTERVAL = 0.5  # seconds between reads of the members and the catalog


class ClusterControl(Protocol):
    """What the preload coordinator, the unloader and the status ops ask of a control plane:
    the etcd one (ControlPlane) or a static node list (control.static.StaticControl)."""

    catalog: dict[str, CatalogEntry]  # as read at the last sync ({} without etcd)
    histograms: list[Any]  # the metrics it adds to /metrics

    def register_ops(self, ops: OpRegistry) -> None: ...

    async def run(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    def members(self) -> list[str]: ...

    async def members_now(self) -> list[str]: ...

    async def claim_preload(self, plan: Plan, coordinator: str) -> None: ...

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None: ...

    async def forget(self, name: str, uuid: str) -> bool: ...

    async def forget_failed(self, name: str, uuid: str) -> None: ...

    def status(self) -> ControlStatus | None: ...


class ControlPlane:
    """Registers this node in etcd, keeps its lease, and converges the node to the catalog."""

    def __init__(
        self,
        settings: Settings,
        store: SegmentStore,
        ask: Ask,
        unload: Unload,
        etcd: EtcdCatalog,
        stager: Stager | None = None,
        readthrough: ReadThroughCache | None = None,
        readers: PeerPool | None = None,
    ):
        """`etcd`: the catalog the read-through cache was built with, whose membership this
        control plane joins and keeps. `readers`: the connections heal copies are read over
        (None: the healer opens its own)."""
        self.settings = settings
        self.membership = etcd.membership
        self.state = etcd.membership.state
        self.store = store
        self.stager = stager
        self.adoption = Adoption(store, etcd, unload, readthrough)
        self.converger = Converger(store, self.state, self.adoption, unload, stager)
        self.healer = Healer(
            settings, store, self.state, ask, self.membership, self.adoption, readers
        )
        self.histograms = [self.healer.copy_seconds]
        self.catalog: dict[str, CatalogEntry] = {}  # as read at the last sync
        self.reachable = False
        self.registered = False  # etcd holds this node's registration (at the last sync)
        # Catalog records of preloads that failed here while etcd was away (name -> instance):
        # removed at the next sync that reaches etcd, so none stays "loading" for ever.
        self.unclaimed: dict[str, str] = {}

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(Adopt, self.op_adopt, ADMIN)
        ops.add(Rebalance, self.op_rebalance, ADMIN)

    async def op_rebalance(self, request: Rebalance) -> Rebalanced:
        """Place datasets over the members live now (one, or all)."""
        done = await self.rebalance(request.name or None)
        if request.name and not done:
            raise NotFound(f"no ready dataset named {request.name!r} in the catalog")
        return Rebalanced(datasets=done, members=self.members())

    async def run(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Joins the cluster, then keeps the lease and converges until cancelled; leaves on
        the way out."""
        await self.membership.join(address)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.membership.keep_alive)
                nursery.start_soon(self._sync_forever)
        finally:
            with trio.move_on_after(2) as scope:
                scope.shield = True
                await self.healer.readers.aclose()
                await self.membership.leave()

    # What the preload, the unloader and the server ask of the control plane.

    @property
    def address(self) -> str:
        return self.membership.address

    @property
    def live(self) -> list[str]:
        return self.membership.live

    def members(self) -> list[str]:
        return self.membership.members()

    async def members_now(self) -> list[str]:
        return await self.membership.members_now()

    async def claim(self, record: CatalogEntry) -> None:
        await self.membership.claim(record)

    async def claim_preload(self, plan: Plan, coordinator: str) -> None:
        """Claim a preload's name in the catalog: of two racing preloads of it, one wins."""
        await self.claim(loading_record(plan, coordinator))

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None:
        await self.membership.publish(name, uuid, listed)

    async def forget(self, name: str, uuid: str) -> bool:
        return await self.membership.forget(name, uuid)

    async def forget_failed(self, name: str, uuid: str) -> None:
        """Remove the catalog record of a preload that failed here (instance `uuid`): now,
        or, while etcd does not answer, at the next sync that reaches it (a claim left
        "loading" would hold the name, and every member's published part, for as long as
        this node's lease lives). Never raises for an etcd away."""
        try:
            await self.membership.forget(name, uuid)
            self.unclaimed.pop(name, None)
        except UNAVAILABLE as e:
            log.warning("%s: removing the claim on %s once etcd answers", e, name)
            self.unclaimed[name] = uuid

    async def _forget_unclaimed(self) -> None:
        for name, uuid in list(self.unclaimed.items()):
            await self.membership.forget(name, uuid)  # compared on the instance: a new one stays
            if self.unclaimed.get(name) == uuid:
                del self.unclaimed[name]
            log.info("removed the claim of the failed preload of %s (instance %s)", name, uuid[:8])

    async def op_adopt(self, request: Adopt) -> Adopted:
        return await self.adoption.op_adopt(request)

    async def rebalance(self, name: str | None) -> list[str]:
        """Place one dataset, or every one, over the members live now; the names placed."""
        done, self.catalog = await self.healer.rebalance(name)
        return done

    # Converging.

    async def _sync_forever(self) -> None:
        while True:
            try:
                await self.sync_once()
            except UNAVAILABLE as e:
                self.reachable = False
                self.membership.unavailable(e)
            except Exception:
                log.exception("control plane sync failed; trying again")
            await trio.sleep(SYNC_INTERVAL)

    async def sync_once(self) -> None:
        """Read the cluster at one revision; while this node's registration is the one etcd
        holds, note the members gone, then converge and heal. A node whose lease lapsed (etcd
        was away, or it was cut off) changes nothing until it has joined again: what it read
        before is an old view (its catalog writes are fenced on its registration too)."""
        snap = await trio.to_thread.run_sync(self.state.snapshot)
        self.reachable = True
        if self.unclaimed:
            await self._forget_unclaimed()
            snap = await trio.to_thread.run_sync(self.state.snapshot)
        self.membership.live = sorted(snap.members)
        self.catalog = {name: rec for name, (rec, _rev) in snap.datasets.items()}
        me = self.membership.registration
        if me is None or not snap.registered(me):
            self.registered = False
            return
        self.registered = True
        gone = {m for e in self.catalog.values() for m in e.members} - set(snap.members)
        for m in sorted(gone - {self.address}):
            if m in snap.down and not snap.stale_note(m, me):
                continue
            stale = snap.down[m].mod if m in snap.down else 0
            note = functools.partial(self.state.note_down, m, me, self.settings.heal_after, stale)
            if await trio.to_thread.run_sync(note):
                log.info(
                    "%s is gone from etcd; lost unless it joins within %.0fs",
                    m,
                    self.settings.heal_after,
                )
        await self.converger.run_once(self.catalog, self.address)
        await self.healer.heal(self.catalog, snap, me)

    def status(self) -> ControlStatus:
        return ControlStatus(
            etcd=list(self.state.endpoints),
            cluster=self.settings.cluster,
            reachable=self.reachable,
            registered=self.registered,
            live=list(self.live),
            heal=self.healer.status(),
            under_replicated=dict(self.healer.under_replicated),
        )


def loading_record(plan: Plan, coordinator: str) -> CatalogEntry:
    """The catalog record a preload claims its name with (ready once committed)."""
    _offsets, seg_len = plan_layout(plan.tree, plan.segment_size)
    return CatalogEntry(
        name=plan.name,
        uuid=plan.uuid,
        state="loading",
        source=plan.source,
        endpoint=plan.endpoint,
        lifetime=plan.lifetime,
        replicas=plan.replicas,
        members=tuple(plan.members),
        segment_size=plan.segment_size,
        segments=len(seg_len),
        files=plan.tree.file_count,
        bytes=plan.tree.data_bytes,
        coordinator=coordinator,
        created=time.time(),
    )
