"""What a read-through dataset needs of the cluster (`ClusterCatalog`): the etcd catalog
(kspeedfs.node.control.catalog.EtcdCatalog), or this node alone (`LocalCatalog`)."""

from __future__ import annotations

from typing import Any, Protocol

from kspeedfs.client.catalog import CatalogEntry, ListedInstance

# An instance held elsewhere: its manifest, and the store's record of it holding no segment.
Fetched = tuple[bytes, dict[str, Any]]


class ClusterCatalog(Protocol):
    async def members_now(self) -> list[str]: ...

    async def entry_now(self, name: str) -> CatalogEntry | None: ...

    async def claim(self, record: CatalogEntry) -> None: ...

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None: ...

    async def replace(self, name: str, uuid: str, listed: ListedInstance) -> bool: ...

    async def forget(self, name: str, uuid: str) -> bool: ...

    async def fetch_manifest(self, name: str, entry: CatalogEntry) -> Fetched | None: ...

    async def announce(self, name: str, uuid: str) -> None: ...


class LocalCatalog:
    """Without etcd a read-through dataset is this node's alone: it is placed over this node,
    its name is claimed from no one, and there is no one to tell of it or to adopt it from."""

    def __init__(self, address: str):
        self.address = address

    async def members_now(self) -> list[str]:
        return [self.address]

    async def entry_now(self, name: str) -> CatalogEntry | None:
        """No other member registered it."""
        return None

    async def claim(self, record: CatalogEntry) -> None:
        """Nothing to claim: no other member shares the name."""

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None:
        """Nothing to publish to: the store's record is the only one."""

    async def replace(self, name: str, uuid: str, listed: ListedInstance) -> bool:
        """A refresh's new instance replaces the old one here only."""
        return True

    async def forget(self, name: str, uuid: str) -> bool:
        return False

    async def fetch_manifest(self, name: str, entry: CatalogEntry) -> Fetched | None:
        """No member to fetch it from (never asked: `entry_now` finds no entry)."""
        return None

    async def announce(self, name: str, uuid: str) -> None:
        """No member to tell."""
