"""The etcd catalog as this node's parts use it (readthrough.ClusterCatalog): the records
claimed, published, replaced and forgotten under its membership, an instance's manifest
fetched from a member that holds it, and the live members told to adopt a new instance.

Built before the read-through cache and the control plane, which are both given it: the cache
claims and publishes its datasets through it, the control plane adopts through it."""

from __future__ import annotations

import logging
import time
from typing import Any

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.control import Adopt
from kspeedfs.format.contract.node import ManifestReq
from kspeedfs.format.contract.pieces import Assembly
from kspeedfs.format.errors import DataError, KSpeedError
from kspeedfs.node.control.membership import Membership
from kspeedfs.node.peers import Ask
from kspeedfs.node.preload import MAX_MANIFEST_BYTES
from kspeedfs.node.readthrough.catalog import Fetched

log = logging.getLogger(__name__)


class EtcdCatalog:
    """The catalog in etcd, written under this node's membership; members asked with `ask`."""

    def __init__(self, membership: Membership, ask: Ask):
        self.membership = membership
        self.ask = ask

    @classmethod
    def of(cls, settings: Settings, ask: Ask) -> EtcdCatalog:
        """Over the etcd of `settings`, with a membership of its own (joined by the control
        plane that is given this catalog)."""
        return cls(Membership(settings, ClusterState.of(settings)), ask)

    async def members_now(self) -> list[str]:
        return await self.membership.members_now()

    async def entry_now(self, name: str) -> CatalogEntry | None:
        return await self.membership.entry_now(name)

    async def claim(self, record: CatalogEntry) -> None:
        await self.membership.claim(record)

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None:
        await self.membership.publish(name, uuid, listed)

    async def replace(self, name: str, uuid: str, listed: ListedInstance) -> bool:
        return await self.membership.replace(name, uuid, listed)

    async def forget(self, name: str, uuid: str) -> bool:
        return await self.membership.forget(name, uuid)

    async def announce(self, name: str, uuid: str) -> None:
        """Ask the live members to adopt a ready instance now, not at their next sync."""
        for member in self.membership.live:
            if member == self.membership.address:
                continue
            try:
                await self.ask(member, Adopt(name=name, uuid=uuid))
            except KSpeedError as e:
                log.info("%s: %s adopts it at its next sync (%s)", name, member, e)

    async def fetch_manifest(self, name: str, entry: CatalogEntry) -> Fetched | None:
        """The manifest of `entry`'s instance from the first live member of it that answers,
        and the store's record of the instance holding no segment (DatasetRecord's keys);
        None when none answers."""
        for peer in entry.members:
            if peer == self.membership.address or peer not in self.membership.live:
                continue
            try:
                blob = await self._fetch(peer, name, entry.uuid)
            except KSpeedError as e:
                log.info("manifest of %s from %s: %s", name, peer, e)
                continue
            log.info("%s: manifest from %s", name, peer)
            return blob, unheld_record(entry, len(blob))
        return None

    async def _fetch(self, peer: str, name: str, uuid: str) -> bytes:
        """The manifest of instance `uuid` from `peer`, in pieces (StaleDataset from a peer
        that holds another instance)."""
        whole = Assembly(MAX_MANIFEST_BYTES)
        while not whole.done:
            asked = ManifestReq(name=name, uuid=uuid, offset=whole.received)
            piece = (await self.ask(peer, asked)).piece
            if not piece.size and piece.total:
                raise DataError(f"{peer} sent an empty piece of the manifest of {name}")
            whole.add(piece)
        return bytes(whole.buf)


def unheld_record(entry: CatalogEntry, stored: int) -> dict[str, Any]:
    """The store's record (DatasetRecord's keys) of `entry`'s instance listed here holding no
    segment, its manifest `stored` bytes."""
    return {
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
        "stored": stored,
        "held": [],
        "endpoint": entry.endpoint,
    }
