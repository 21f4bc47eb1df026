"""Adoption: a member that holds no part of a ready dataset (it was down during the preload,
joined later, or was just placed over by a rebalance) fetches its manifest from a member that
has it (`EtcdCatalog.fetch_manifest`) and lists the instance holding no segment, so readers
that ask it find the dataset. A read-through instance is handed to the read-through cache,
which adopts it the same way."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.control import Adopt, Adopted
from kspeedfs.format.errors import NotFound
from kspeedfs.node.control.catalog import EtcdCatalog
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

# Unload this node's copy of instance (name, uuid) (node.unload.Unloader.unload_local).
Unload = Callable[[str, str], Awaitable[object]]


class Adoption:
    """Takes the catalog's ready instances onto this node, one at a time."""

    def __init__(
        self,
        store: SegmentStore,
        catalog: EtcdCatalog,
        unload: Unload,
        readthrough: ReadThroughCache | None,
    ):
        self.store = store
        self.catalog = catalog
        self.membership = catalog.membership
        self.unload = unload
        self.readthrough = readthrough  # read-through datasets: adopted by the cache
        self._lock = trio.Lock()  # one adoption at a time: the sync and an op may race

    def busy(self, name: str) -> bool:
        """Being listed or refreshed here by the read-through cache: left alone."""
        return self.readthrough is not None and name in self.readthrough.busy

    async def op_adopt(self, request: Adopt) -> Adopted:
        """Take the catalog's ready instance of a dataset now (dropping another one held)."""
        name = request.name
        entry = await self.membership.entry_now(name)
        if entry is None or not entry.ready or entry.uuid != request.uuid:
            raise NotFound(f"no ready instance {request.uuid[:8]} of {name!r} in etcd")
        # The members live now: a node asked right after it joined has not synced yet, and
        # adopts only from members it sees live.
        await self.membership.members_now()
        await self.adopt(name, entry)
        record = self.store.datasets.get(name)
        return Adopted(name=name, adopted=record is not None and record.uuid == entry.uuid)

    async def adopt(self, name: str, entry: CatalogEntry) -> None:
        """`adopt_missing` at once, after dropping an instance the catalog no longer has (a
        read-through dataset refreshed on another member)."""
        held = self.store.datasets.get(name)
        if held is not None and held.uuid != entry.uuid and not self.busy(name):
            log.info("dropping %s (instance %s): the catalog has another", name, held.uuid[:8])
            await self.unload(name, held.uuid)
        await self.adopt_missing(name, entry)

    async def adopt_missing(self, name: str, entry: CatalogEntry) -> None:
        """The instance of `entry`, holding no segment, unless this node lists `name`."""
        async with self._lock:
            if name not in self.store.datasets:
                await self._adopt_unlocked(name, entry)

    async def _adopt_unlocked(self, name: str, entry: CatalogEntry) -> None:
        if entry.lifetime == READTHROUGH and self.readthrough is not None:
            await self.readthrough.adopt(name, entry)  # its side files are the cache's
            return
        fetched = await self.catalog.fetch_manifest(name, entry)
        if fetched is not None:
            await trio.to_thread.run_sync(self._publish_empty, name, *fetched)
            log.info("%s: joined its members", name)

    def _publish_empty(self, name: str, blob: bytes, meta: dict[str, Any]) -> None:
        staging = self.store.new_staging(name)
        try:
            with open(staging / "manifest.ksm", "wb") as f:
                f.write(blob)
            self.store.publish(staging, meta)
        except BaseException:
            self.store.discard_staging(staging)
            raise
