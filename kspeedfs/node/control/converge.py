"""Convergence: this node's datasets and stages brought to what the catalog says (instances it
no longer has dropped, orphaned stages rolled back, ready datasets listed)."""

from __future__ import annotations

import logging

import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.node.control.adopt import Adoption, Unload
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class Converger:
    """One round of convergence against a snapshot of the catalog."""

    def __init__(
        self,
        store: SegmentStore,
        state: ClusterState,
        adoption: Adoption,
        unload: Unload,
        stager: Stager | None,
    ):
        self.store = store
        self.state = state
        self.adoption = adoption
        self.unload = unload
        self.stager = stager  # its staged parts are rolled back when their claim is gone

    async def run_once(self, catalog: dict[str, CatalogEntry], address: str) -> None:
        await self._drop_unknown(catalog, address)
        await self._roll_back_orphans(catalog)
        await self._adopt_all(catalog)

    async def _dataset_now(self, name: str) -> CatalogEntry | None:
        found = await trio.to_thread.run_sync(self.state.dataset, name)
        return found[0] if found else None

    async def _drop_unknown(self, catalog: dict[str, CatalogEntry], address: str) -> None:
        """Drop the instances the catalog does not know (unloaded while this node was away,
        a preload whose coordinator died) and those of which this node was declared lost."""
        for name, record in list(self.store.datasets.items()):
            if self.adoption.busy(name):
                continue  # being listed or refreshed here: the catalog learns it next
            if keeps(catalog.get(name), address, record.uuid, record.held):
                continue
            # Read again: a preload may have claimed and published since the snapshot.
            entry = await self._dataset_now(name)
            if entry is not None and entry.uuid == record.uuid:
                if address not in entry.lost_members or not record.held:
                    continue
                why = "its copies were made again elsewhere while this node was down"
            else:
                why = "the catalog does not have this instance (unloaded, or never finished)"
            log.info("dropping %s (instance %s): %s", name, record.uuid[:8], why)
            await self.unload(name, record.uuid)

    async def _roll_back_orphans(self, catalog: dict[str, CatalogEntry]) -> None:
        """Abort the parts staged here for a preload whose claim is gone from the catalog: its
        coordinator died (the claim was on the coordinator's lease) or gave up. A claim is
        made before any member stages, so a stage with no claim has no coordinator."""
        if self.stager is None:
            return
        for name, stage in list(self.stager.stages.items()):
            entry = catalog.get(name)
            if entry is not None and entry.uuid == stage.uuid:
                continue
            entry = await self._dataset_now(name)
            if entry is not None and entry.uuid == stage.uuid:
                continue  # claimed since the snapshot
            log.warning(
                "rolling back the preload of %s (instance %s): its claim is gone from the "
                "catalog (the coordinator died)",
                name,
                stage.uuid[:8],
            )
            await self.stager.abort(name, stage.uuid)

    async def _adopt_all(self, catalog: dict[str, CatalogEntry]) -> None:
        """Every member lists every ready dataset of the catalog: one that holds no part of it
        (it was down during the preload, or joined later) takes its manifest, no segment, so
        readers that ask it find the dataset and read from its owners."""
        for name, entry in sorted(catalog.items()):
            if not entry.ready or name in self.store.datasets:
                continue
            if self.stager is not None and name in self.stager.stages:
                continue  # a preload of this name is being staged here
            if self.adoption.busy(name):
                continue
            await self.adoption.adopt_missing(name, entry)


def keeps(entry: CatalogEntry | None, address: str, uuid: str, held: list[int]) -> bool:
    """A copy the catalog knows, and not one of a member declared lost (an empty copy, the
    manifest alone, is kept: the member lists the dataset)."""
    return (
        entry is not None and entry.uuid == uuid and (address not in entry.lost_members or not held)
    )
