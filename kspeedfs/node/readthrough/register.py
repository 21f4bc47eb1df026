"""Registering a source: its read-through dataset is listed in the background and published
holding no segment. With etcd the node that lists it claims the name in the catalog and
places the segments over the live members; the others follow that listing and adopt it
(without etcd the catalog is this node's alone: `catalog.LocalCatalog`)."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.readthrough import Registered, RegisterSource
from kspeedfs.format.errors import AlreadyExists, InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.units import format_size
from kspeedfs.node import sourceio
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.readthrough.build import InstanceBuilder, catalog_fields
from kspeedfs.node.readthrough.catalog import ClusterCatalog
from kspeedfs.node.readthrough.dataset import Instances
from kspeedfs.node.store import SegmentStore
from kspeedfs.node.tasks import Tasks
from kspeedfs.sources.loader import Progress, manifest_size_estimate
from kspeedfs.sources.source import Source, is_url, open_source

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.2  # how often a member waits on a listing another member is making


class SourceRegistrar:
    """Owns the listings: `op_register_source` starts one (or follows another member's),
    `run` runs them."""

    def __init__(
        self,
        store: SegmentStore,
        instances: Instances,
        builder: InstanceBuilder,
        loads: LoadTable,
        address: str,
        check_limits: Callable[[RegisterSource], None],
        catalog: ClusterCatalog,
    ):
        self.store = store
        self.check_limits = check_limits  # refuses a cap or floor larger than the node has free
        self.instances = instances
        self.builder = builder
        self.loads = loads
        self.address = address  # this node's: it coordinates the datasets it registers
        self.catalog = catalog  # claims the name, places the segments, tells the members
        self.tasks = Tasks()
        self._adopting = trio.Lock()  # one adoption at a time: a registration and a sync race

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.tasks.run(task_status=task_status)

    async def op_register_source(self, request: RegisterSource) -> Registered:
        """Create the read-through dataset of a source (listing it in the background)."""
        name, source, endpoint = request.name, request.source, request.endpoint
        if not (is_url(source) or os.path.isabs(source)):
            raise InvalidArgument(f"source must be an absolute path or a URL: {source!r}")
        found = self._existing(name, source, endpoint)
        if found is not None:
            return found  # its caps are the ones it was created with
        caps = request.limits()
        self.check_limits(request)
        entry = await self.catalog.entry_now(name)
        if entry is not None:
            return await self._join(name, source, endpoint, entry)
        src = open_source(source, endpoint)
        # A missing bucket or wrong credentials: a one-line error now, and nothing created.
        await sourceio.run_sync(src.check)
        found = self._existing(name, source, endpoint)
        if found is not None:
            return found
        progress = self.loads.start(name, source)
        self.tasks.start_soon(self._register, name, src, progress, caps)
        return Registered(name, "scanning")

    def _existing(self, name: str, source: str, endpoint: str) -> Registered | None:
        record = self.store.datasets.get(name)
        if record is not None:
            header = self.store.open(name).manifest.header
            if record.source == source and str(header.get("endpoint") or "") == endpoint:
                return Registered(name, "ready", record.lifetime)
            raise AlreadyExists(
                f"dataset {name!r} already holds {record.source}: choose another --name"
            )
        progress = self.loads.get(name)
        if progress is not None and progress.state != "failed":
            if progress.source == source:
                return Registered(name, progress.state)
            raise AlreadyExists(f"dataset {name!r} is already loading {progress.source}")
        return None

    async def _join(self, name: str, source: str, endpoint: str, entry: CatalogEntry) -> Registered:
        """etcd: another member registered this name: take its manifest (ready) or wait for
        its listing (loading)."""
        if entry.source != source or entry.endpoint != endpoint:
            raise AlreadyExists(
                f"dataset {name!r} already holds {entry.source}: choose another --name"
            )
        if entry.ready:
            await self.adopt(name, entry)
            if name not in self.store.datasets:
                raise NotFound(f"no member of {name!r} answers with its manifest")
            return Registered(name, "ready", READTHROUGH)
        progress = self.loads.start(name, source)
        self.tasks.start_soon(self._follow, name, entry.uuid, progress)
        return Registered(name, "scanning")

    async def _follow(self, name: str, uuid: str, progress: Progress) -> None:
        """Wait for the listing another member claimed, then adopt it."""
        try:
            while True:
                await trio.sleep(FOLLOW_POLL_S)
                try:
                    entry = await self.catalog.entry_now(name)
                except KSpeedError:
                    continue  # etcd away a moment: the claim is still there or not
                if entry is None or entry.uuid != uuid:
                    raise NotFound(f"the listing of {name!r} on another member was given up")
                if entry.ready:
                    await self.adopt(name, entry)
                    if name not in self.store.datasets:
                        raise NotFound(f"no member of {name!r} answers with its manifest")
                    self.loads.finish(name)
                    return
        except BaseException as e:
            log.error("joining %s failed: %s", name, self.loads.fail(name, e))
            if not isinstance(e, Exception):
                raise

    async def _claim(self, name: str, src: Source, uid: str) -> list[str] | None:
        """Claim the name for instance `uid` and return the members to place over; None when
        another member claimed it first (this one then follows that listing)."""
        members = await self.catalog.members_now()
        record = CatalogEntry(
            name=name,
            uuid=uid,
            state="loading",
            source=src.url,
            endpoint=src.endpoint,
            lifetime=READTHROUGH,
            replicas=1,
            members=tuple(members),
            segment_size=self.builder.segment_size,
            segments=0,
            files=0,
            bytes=0,
            coordinator=self.address,
            created=time.time(),
        )
        try:
            await self.catalog.claim(record)
        except AlreadyExists:
            entry = await self.catalog.entry_now(name)
            if entry is None or entry.source != src.url:
                raise
            return None
        return members

    async def _register(
        self, name: str, src: Source, progress: Progress, caps: dict[str, int]
    ) -> None:
        staging: Path | None = None
        uid = secrets.token_hex(16)
        claimed = False
        try:
            members = await self._claim(name, src, uid)
            if members is None:
                entry = await self.catalog.entry_now(name)
                await self._follow(name, entry.uuid if entry else "", progress)
                return
            claimed = True
            self.instances.busy.add(name)
            tree = await sourceio.run_sync(src.scan)
            progress.state = "loading"
            progress.files_total, progress.bytes_total = tree.file_count, tree.data_bytes
            segments = tree.data_bytes // self.builder.segment_size + len(tree) + 1
            self.store.budgets.reserve(name, manifest_size_estimate(tree) + 8 * segments)
            built, meta, _carried = await trio.to_thread.run_sync(
                self.builder.build, name, src, tree, None, uid, members, caps
            )
            staging = built
            record = await trio.to_thread.run_sync(self.store.publish, built, meta)
            staging = None
            ds, _ = await trio.to_thread.run_sync(self.instances.open, record, False)
            self.instances.add(ds)
            # Ready for everyone; the members adopt it.
            await self.catalog.publish(name, uid, catalog_fields(meta))
            await self.catalog.announce(name, uid)
            self.loads.finish(name)
            log.info(
                "read-through dataset %s of %s: %d files, %s in %d segments",
                name,
                src.url,
                tree.file_count,
                format_size(tree.data_bytes),
                ds.manifest.segments,
            )
        except BaseException as e:
            self.store.budgets.release(name)
            with trio.CancelScope(shield=True):
                if staging is not None:
                    await trio.to_thread.run_sync(self.store.discard_staging, staging)
                if claimed:
                    await self._unclaim(name, uid)
            log.error("listing %s for %s failed: %s", src.url, name, self.loads.fail(name, e))
            if not isinstance(e, Exception):
                raise
        finally:
            self.instances.busy.discard(name)

    async def _unclaim(self, name: str, uid: str) -> None:
        """A listing that failed gives its name back (and its instance, if published)."""
        try:
            await self.catalog.forget(name, uid)
        except KSpeedError as e:
            log.warning("could not remove %s from the catalog: %s", name, e)
        try:
            await trio.to_thread.run_sync(self.store.unload, name, uid)
        except NotFound:
            pass  # never published, or unloaded meanwhile

    async def adopt(self, name: str, entry: CatalogEntry) -> None:
        """etcd: list the catalog's instance of `entry` here, holding no segment (its manifest
        from a member that holds it), unless this node lists `name`: the fills of the
        segments this node owns land here."""
        async with self._adopting:
            if name in self.store.datasets:
                return
            fetched = await self.catalog.fetch_manifest(name, entry)
            if fetched is not None:
                await self._publish_adopted(name, *fetched)
                log.info("%s: joined its members", name)

    async def _publish_adopted(self, name: str, blob: bytes, meta: dict[str, Any]) -> None:
        staging, full = await trio.to_thread.run_sync(self.builder.adopted, name, blob, meta)
        try:
            record = await trio.to_thread.run_sync(self.store.publish, staging, full)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.discard_staging, staging)
            raise
        ds, _ = await trio.to_thread.run_sync(self.instances.open, record, False)
        self.instances.add(ds)
