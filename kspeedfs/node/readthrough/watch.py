"""Watching the sources and the store: a changed source is served as cached and shown stale
until a refresh makes a new instance from a new listing (keeping the segments whose contents
did not change, in memory, on the disk tier or spilled); instances the store unloaded are
forgotten."""

from __future__ import annotations

import logging
from typing import Any

import trio

from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.readthrough import Refresh, Refreshed
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.tree import Tree
from kspeedfs.node import sourceio
from kspeedfs.node.preload import tree_digest
from kspeedfs.node.readthrough.build import InstanceBuilder, catalog_fields
from kspeedfs.node.readthrough.catalog import ClusterCatalog
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources import version
from kspeedfs.sources.source import Source, diff_counts, open_source

log = logging.getLogger(__name__)

PRUNE_INTERVAL = 1.0


class SourceWatch:
    """Owns the periodic work (`run`) and the refresh op."""

    def __init__(
        self,
        store: SegmentStore,
        instances: Instances,
        builder: InstanceBuilder,
        disk: DiskTier,
        check_interval: float,
        catalog: ClusterCatalog,
    ):
        self.store = store
        self.instances = instances
        self.builder = builder
        self.disk = disk
        self.check_interval = check_interval  # seconds between checks of the sources; 0: never
        self.catalog = catalog  # a refresh's new instance replaces the old one there too

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prune unloaded instances every PRUNE_INTERVAL, check the sources every interval."""
        interval = self.check_interval
        task_status.started()
        next_check = trio.current_time() + interval
        while True:
            await trio.sleep(min(PRUNE_INTERVAL, interval) if interval > 0 else PRUNE_INTERVAL)
            await self.prune()
            if interval > 0 and trio.current_time() >= next_check:
                await self.check_sources()
                next_check = trio.current_time() + interval

    async def prune(self) -> None:
        """Forget instances that were unloaded (their files are gone already)."""
        for name, ds in list(self.instances.by_name.items()):
            record = self.store.datasets.get(name)
            if record is None or record.uuid != ds.uuid:
                self.instances.forget(ds)
        changed = self.instances.changed
        for name, (uid, _n) in list(changed.items()):
            record = self.store.datasets.get(name)
            if record is None or record.uuid != uid:
                changed.pop(name, None)

    async def check_sources(self) -> None:
        """Compare each dataset this node coordinates with its source; remember what changed."""
        changed_now = self.instances.changed
        for record in list(self.store.datasets.values()):
            if record.members and record.members[0] != self.instances.address:
                continue
            try:
                manifest = self.store.open(record.name).manifest
                src = open_source(record.source, str(manifest.header.get("endpoint") or ""))
                tree = await sourceio.run_sync(src.scan)
                changed = 0
                if not same_scan(manifest.header, tree):
                    changed = await trio.to_thread.run_sync(diff_counts, manifest, tree)
            except KSpeedError as e:
                log.warning("cannot check the source of %s: %s", record.name, e)
                continue
            before = changed_now.get(record.name, ("", 0))
            if changed and before != (record.uuid, changed):
                log.warning(
                    "the source of %s changed: %d files; served as cached until "
                    "`kspeedfs refresh %s`",
                    record.name,
                    changed,
                    record.name,
                )
            if changed:
                changed_now[record.name] = (record.uuid, changed)
            else:
                changed_now.pop(record.name, None)

    async def op_refresh(self, request: Refresh) -> Refreshed:
        """A new instance from a new listing; segments whose contents did not change are kept."""
        name = request.name
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if record.lifetime != READTHROUGH:
            raise InvalidArgument(
                f"{name} is a preloaded dataset: unload it and preload it again to refresh it"
            )
        ds = self.instances.find(name)
        src = open_source(record.source, ds.endpoint)
        tree = await sourceio.run_sync(src.scan)
        changed = await trio.to_thread.run_sync(diff_counts, ds.manifest, tree)
        if not changed and same_scan(ds.manifest.header, tree):
            self.instances.changed.pop(name, None)
            segments = ds.manifest.segments
            return Refreshed(name, "unchanged", 0, kept=segments, segments=segments)
        # The new instance is placed over the members live now; with etcd the others drop the
        # old one and adopt the new (their cached segments are filled again).
        members = await self.catalog.members_now()
        async with ds.lock:
            self.instances.busy.add(name)
            try:
                new, kept = await self._swap(ds, src, tree, members)
            finally:
                self.instances.busy.discard(name)
        await self.catalog.announce(name, new.uuid)
        self.instances.changed.pop(name, None)
        log.info(
            "refreshed %s: %d files changed, %d of %d segments kept",
            name,
            changed,
            kept,
            new.manifest.segments,
        )
        return Refreshed(name, "refreshed", changed, kept, new.manifest.segments)

    async def _swap(
        self, ds: CachedDataset, src: Source, tree: Tree, members: list[str]
    ) -> tuple[CachedDataset, int]:
        """Replace instance `ds` with one of `tree`, carrying its unchanged segments; returns
        the new instance and how many segments it kept."""
        name = ds.name
        staging, meta, carried = await trio.to_thread.run_sync(
            self.builder.build, name, src, tree, ds, "", members
        )
        disk_staging = None
        try:
            # Linked before the unload removes the old instance's disk folder.
            disk_staging = await trio.to_thread.run_sync(self.disk.carry, ds, carried)
            if not await self.catalog.replace(name, ds.uuid, catalog_fields(meta)):
                raise NotFound(f"the catalog no longer has this instance of {name!r}")
            await trio.to_thread.run_sync(self.store.unload, name, ds.uuid)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.discard_staging, staging)
                if disk_staging is not None:
                    await trio.to_thread.run_sync(self.store.discard_disk_staging, disk_staging)
            raise
        new_record = await trio.to_thread.run_sync(self.store.publish, staging, meta, disk_staging)
        new, _ = await trio.to_thread.run_sync(self.instances.open, new_record, False)
        new.stats = ds.stats
        self.instances.forget(ds)  # its disk claims go before the new instance claims its own
        await trio.to_thread.run_sync(self.disk.recover, new, False)
        self.instances.add(new)
        return new, len(carried)


def same_scan(header: dict[str, Any], tree: Tree) -> bool:
    """Whether a scan lists what the manifest of `header` was made from, by its digests (no
    walk over the files): names, sizes and mtimes, and the rest of the versions where the
    header records them (manifests made before it lack `versions`)."""
    if tree_digest(tree) != header.get("digest"):
        return False
    return "versions" not in header or version.digest(tree) == header["versions"]
