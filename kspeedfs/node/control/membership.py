"""This node's membership of the cluster: its lease in etcd, kept alive, and the members live."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import trio

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.client.clusterstate import UNAVAILABLE, ClusterState, Registration
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import Fenced, KSpeedError, NodeUnreachable

log = logging.getLogger(__name__)


class Membership:
    """The node's membership lease and what it claims under it: the catalog records of the
    preloads it coordinates (gone with the lease when the node dies)."""

    def __init__(self, settings: Settings, state: ClusterState):
        self.settings = settings
        self.state = state
        self.address = ""
        # The registration etcd holds for this node, as far as it knows: its lease, and the
        # fencing token every catalog write of this node is compared on.
        self.registration: Registration | None = None
        self.live: list[str] = []  # as read at the last sync
        self.warned = False  # etcd's absence was said: said again only after a success

    async def join(self, address: str) -> None:
        """Register at start; with etcd away the node serves anyway and joins later."""
        self.address = address
        try:
            await self._register()
        except UNAVAILABLE as e:
            log.warning("%s; serving anyway, joining when it answers", e)
            self.warned = True

    @property
    def lease_id(self) -> int:
        return self.registration.lease if self.registration else 0

    async def leave(self) -> None:
        """Leaving on purpose: everyone sees it at once, not after the TTL."""
        if self.lease_id:
            try:
                await trio.to_thread.run_sync(self.state.revoke, self.lease_id)
            except KSpeedError:
                pass

    async def _register(self) -> None:
        self.registration = await trio.to_thread.run_sync(
            self.state.register, self.address, self.settings.member_ttl, os.getpid()
        )
        log.info(
            "joined cluster %r in etcd as %s (revision %d)",
            self.settings.cluster,
            self.address,
            self.registration.revision,
        )

    async def keep_alive(self) -> None:
        while True:
            await trio.sleep(max(0.5, self.settings.member_ttl / 3))
            try:
                if not self.lease_id:  # not joined yet: etcd did not answer at start
                    await self._register()
                elif not await trio.to_thread.run_sync(self.state.keep_alive, self.lease_id):
                    log.warning("membership lease lost; joining again")
                    await self._register()
                self.warned = False
            except UNAVAILABLE as e:
                self.unavailable(e)

    def unavailable(self, e: Exception) -> None:
        if not self.warned:
            log.warning("%s; data keeps being served", e)
            self.warned = True

    def members(self) -> list[str]:
        """The live members to place new data over (this node always among them)."""
        return sorted(set(self.live) | {self.address})

    async def members_now(self) -> list[str]:
        """`members` read from etcd now, not at the last sync (a node that joined a moment
        ago counts); the last sync's view when etcd does not answer."""
        try:
            self.live = sorted(await trio.to_thread.run_sync(self.state.live_members))
        except UNAVAILABLE as e:
            log.warning("%s; placing over the members seen last", e)
        return self.members()

    # The catalog's records, claimed under the lease.

    def fence(self) -> Registration:
        """The registration this node's catalog writes are compared on (Fenced when it has
        none: it has not joined)."""
        if self.registration is None:
            raise Fenced(f"{self.address} has not joined the cluster in etcd yet")
        return self.registration

    async def claim(self, record: CatalogEntry) -> None:
        if not self.lease_id:
            await self._register()
        await trio.to_thread.run_sync(self.state.claim, record, self.fence())

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None:
        """The preload committed everywhere: the record becomes ready and outlives its
        coordinator (a read-through one names the instance `listed`)."""

        def ready(r: CatalogEntry) -> CatalogEntry:
            return r.listed(listed) if listed else dataclasses.replace(r, state="ready")

        update = functools.partial(self.state.update, fence=self.fence())
        if not await trio.to_thread.run_sync(update, name, uuid, ready):
            raise NodeUnreachable(f"etcd: the claim on {name} is gone (lease lost?)")

    async def forget(self, name: str, uuid: str) -> bool:
        return await trio.to_thread.run_sync(self.state.remove, name, uuid)

    async def replace(self, name: str, uuid: str, listed: ListedInstance) -> bool:
        """Change the ready record of instance `uuid` (a refresh: `listed` names the new one)."""

        def change(r: CatalogEntry) -> CatalogEntry:
            return r.listed(listed)

        update = functools.partial(self.state.update, fence=self.fence())
        return await trio.to_thread.run_sync(update, name, uuid, change)

    async def entry_now(self, name: str) -> CatalogEntry | None:
        """The catalog record of `name` read from etcd now."""
        found = await trio.to_thread.run_sync(self.state.dataset, name)
        return found[0] if found else None
