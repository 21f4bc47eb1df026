"""Adoption: a member that holds no part of a ready dataset (it was down during the preload,
joined later, or was just placed over by a rebalance) fetches its manifest from a member that
has it and lists the instance holding no segment, so readers that ask it find the dataset."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.contract.control import Adopt, Adopted
from kspeedfs.format.contract.node import ManifestPiece, ManifestReq
from kspeedfs.format.contract.pieces import Assembly
from kspeedfs.format.errors import DataError, KSpeedError, NotFound
from kspeedfs.format.readthrough_view import READTHROUGH
from kspeedfs.node.control.membership import Membership
from kspeedfs.node.peers import Ask
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 1 << 34  # what a preload's member takes (node.preload)

# Unload this node's copy of instance (name, uuid) (node.unload.Unloader.unload_local).
Unload = Callable[[str, str], Awaitable[object]]


class Adoption:
    """Takes the catalog's ready instances onto this node, one at a time."""

    def __init__(
        self,
        store: SegmentStore,
        ask: Ask,
        membership: Membership,
        unload: Unload,
        readthrough: ReadThroughCache | None,
    ):
        self.store = store
        self.ask = ask
        self.membership = membership
        self.unload = unload
        self.readthrough = readthrough  # read-through datasets: adopted by the cache
        self._lock = trio.Lock()  # one adoption at a time: the sync and an op may race

    def busy(self, name: str) -> bool:
        """Being listed or refreshed here by the read-through cache: left alone."""
        return self.readthrough is not None and name in self.readthrough.busy

    async def announce(self, name: str, uuid: str) -> None:
        """Ask the live members to adopt a ready instance now, not at their next sync."""
        for member in self.membership.live:
            if member == self.membership.address:
                continue
            try:
                await self.ask(member, Adopt(name=name, uuid=uuid))
            except KSpeedError as e:
                log.info("%s: %s adopts it at its next sync (%s)", name, member, e)

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
        for peer in entry.members:
            if peer == self.membership.address or peer not in self.membership.live:
                continue
            try:
                blob = await self._fetch_manifest(peer, name, entry.uuid)
            except KSpeedError as e:
                log.info("manifest of %s from %s: %s", name, peer, e)
                continue
            # The store's record of the instance (DatasetRecord's keys), holding no segment.
            meta: dict[str, Any] = {
                "name": entry.name,
                "uuid": entry.uuid,
                "source": entry.source,
                "lifetime": entry.lifetime,
                "replicas": entry.replicas,
                "files": entry.files,
                "bytes": entry.bytes,
                "segment_size": entry.segment_size,
                "created": time.time() if entry.created is None else entry.created,
                "members": list(entry.members),
                "segments": entry.segments,
                "stored": len(blob),
                "held": [],
                "endpoint": entry.endpoint,
            }
            if entry.lifetime == READTHROUGH and self.readthrough is not None:
                await self.readthrough.adopt(name, blob, meta)
            else:
                await trio.to_thread.run_sync(self._publish_empty, name, blob, meta)
            log.info("%s: joined its members (manifest from %s)", name, peer)
            return

    def _publish_empty(self, name: str, blob: bytes, meta: dict[str, Any]) -> None:
        staging = self.store.new_staging(name)
        try:
            with open(staging / "manifest.ksm", "wb") as f:
                f.write(blob)
            self.store.publish(staging, meta)
        except BaseException:
            self.store.discard_staging(staging)
            raise

    async def _fetch_manifest(self, peer: str, name: str, uuid: str) -> bytes:
        """The manifest of instance `uuid` from `peer`, in pieces (StaleDataset from a peer
        that holds another instance)."""
        whole = Assembly(MAX_MANIFEST_BYTES)
        while not whole.done:
            asked = ManifestReq(name=name, uuid=uuid, offset=whole.received)
            piece = ManifestPiece.from_wire(await self.ask(peer, asked)).piece
            if not piece.size and piece.total:
                raise DataError(f"{peer} sent an empty piece of the manifest of {name}")
            whole.add(piece)
        return bytes(whole.buf)
