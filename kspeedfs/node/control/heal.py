"""Healing and rebalancing: the copies this node owns by placement and lacks are made again
(from the members that hold them, else the source), and the segments a rebalance moved away
are dropped once their new owners hold them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import trio
import xxhash

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import (
    ClusterState,
    Registration,
    Snapshot,
    absent,
    mod_is,
)
from kspeedfs.format import placement
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.node import DatasetEntry, List
from kspeedfs.format.contract.status import HealStatus
from kspeedfs.format.errors import DataError, KSpeedError, NoSpace
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tls import client_context
from kspeedfs.node import sourceio
from kspeedfs.node.control.adopt import Adoption
from kspeedfs.node.control.membership import Membership
from kspeedfs.node.metrics import segment_seconds
from kspeedfs.node.peers import Ask, PeerPool, read_segment_into
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import open_source

log = logging.getLogger(__name__)

# Segment copies in flight per node: receiving one while hashing and storing another overlap
# (bench_cluster.py on 2 CPUs: 2 in flight healed fastest; 1 and 4 were slower).
HEAL_PARALLEL = 2


def placed(name: str, entry: CatalogEntry) -> placement.Placement:
    """Where a catalog record's segments are: placed over its members, the lost ones' copies
    on the next members by weight."""
    return placement.Placement(
        name, entry.segments, entry.members, entry.replicas, entry.lost_members
    )


class Healer:
    """Makes the copies this node owns again, and counts how it went (`stats`)."""

    def __init__(
        self,
        settings: Settings,
        store: SegmentStore,
        state: ClusterState,
        ask: Ask,
        membership: Membership,
        adoption: Adoption,
        readers: PeerPool | None = None,
    ):
        self.settings = settings
        self.store = store
        self.state = state
        self.ask = ask
        self.membership = membership
        self.adoption = adoption
        self.stats = {
            "segments": 0,
            "bytes": 0,
            "failed": 0,
            "pending": 0,
            "seconds": 0.0,
            "dropped": 0,  # segments given up after a rebalance moved them
            "dropped_bytes": 0,
            "from_source": 0,  # copies no live member could give (read from the source)
        }
        self.under_replicated: dict[str, int] = {}
        # Heal copies read whole segments from worker threads over kept connections (None: the
        # node's own pool; unit tests pass one that reads from in-memory members).
        self.readers = (
            readers
            if readers is not None
            else PeerPool(settings.token_file, settings.timeout, tls=client_context(settings))
        )
        self.copy_seconds = segment_seconds(
            "kspeedfs_heal_copy_seconds",
            "time to copy one segment for healing or rebalance, by where it came from",
            ("peer", "source"),
        )

    @property
    def address(self) -> str:
        return self.membership.address

    def status(self) -> HealStatus:
        s = self.stats
        return HealStatus(
            segments=int(s["segments"]),
            bytes=int(s["bytes"]),
            failed=int(s["failed"]),
            pending=int(s["pending"]),
            seconds=float(s["seconds"]),
            dropped=int(s["dropped"]),
            dropped_bytes=int(s["dropped_bytes"]),
            from_source=int(s["from_source"]),
        )

    async def heal(
        self, catalog: dict[str, CatalogEntry], snap: Snapshot, me: Registration
    ) -> None:
        """Declare lost the members etcd says are gone for heal_after, then make this node's
        missing copies of every ready dataset and drop the ones it no longer owns."""
        live = set(snap.members)
        self.stats["pending"] = 0
        for name, entry in sorted(catalog.items()):
            if not entry.ready:
                continue
            lost = await self._declare_lost(name, entry, snap, me)
            if lost is None:
                continue  # unloaded or loaded again meanwhile
            entry = dataclasses.replace(entry, lost=tuple(lost))  # healed from this round
            if entry.lifetime == READTHROUGH:
                continue  # filled on demand: a lost owner's segments refill on the next one
            await self._heal_one(name, entry, live)

    async def _declare_lost(
        self, name: str, entry: CatalogEntry, snap: Snapshot, me: Registration
    ) -> list[str] | None:
        """The record's lost members, with those etcd says are gone for heal_after added
        (None: the record changed meanwhile). The change is compared, in one transaction, on
        each of them still absent with the same note and no grace, and on this node's own
        registration: a note or a view that went stale in between declares no one."""
        lost = set(entry.lost_members)
        gone = [m for m in entry.members if m not in lost and m != me.address and snap.lost(m, me)]
        if not gone:
            return sorted(lost)
        prefix = self.state.prefix
        guard = []
        for m in gone:
            guard += [
                absent(prefix + "members/" + m),
                mod_is(prefix + "down/" + m, snap.down[m].mod),
                absent(prefix + "grace/" + m),
            ]

        def lose(r: CatalogEntry) -> CatalogEntry:
            return dataclasses.replace(r, lost=tuple(sorted(set(r.lost_members) | set(gone))))

        update = functools.partial(self.state.update, guard=guard, fence=me)
        if not await trio.to_thread.run_sync(update, name, entry.uuid, lose):
            return None
        log.warning(
            "%s: %s gone for heal_after (%.0fs by etcd's clock); making its copies again on "
            "the others",
            name,
            ", ".join(gone),
            self.settings.heal_after,
        )
        return sorted(lost | set(gone))

    async def _heal_one(self, name: str, entry: CatalogEntry, live: set[str]) -> None:
        uuid = entry.uuid
        segments = entry.segments
        where = placed(name, entry)
        self.under_replicated[name] = sum(
            1 for seg in range(segments) if any(m not in live for m in where.owners(seg))
        )
        if self.address not in where.members or self.address in where.lost:
            return
        record = self.store.datasets.get(name)
        if record is None:
            await self.adoption.adopt_missing(name, entry)
            record = self.store.datasets.get(name)
            if record is None:
                return
        if record.uuid != uuid:
            return
        held = set(record.held)
        missing = [
            seg for seg in range(segments) if seg not in held and self.address in where.owners(seg)
        ]
        if missing:
            await self._copy_all(name, entry, missing)
        unowned = [seg for seg in record.held if self.address not in where.owners(seg)]
        if unowned and not missing:
            await self._drop_moved(name, uuid, unowned, where)

    async def _drop_moved(
        self, name: str, uuid: str, unowned: list[int], where: placement.Placement
    ) -> None:
        """After a rebalance: drop the segments this node no longer owns, each only once all
        of its new owners are up and hold it (so no copy is ever the last one dropped)."""
        held_by: dict[str, set[int]] = {}
        for peer in sorted({o for s in unowned for o in where.owners(s)}):
            if peer not in self.membership.live:
                continue
            try:
                listing = await self.ask(peer, List())
            except KSpeedError as e:
                log.debug("%s: cannot ask %s what it holds: %s", name, peer, e)
                continue
            for d in listing.datasets:
                if isinstance(d, DatasetEntry) and d.name == name and d.uuid == uuid:
                    held_by[peer] = set(d.held)  # published: ready
        dropped = 0
        for seg in unowned:
            owners = where.owners(seg)
            if all(seg in held_by.get(o, ()) for o in owners):
                freed = await trio.to_thread.run_sync(self.store.segments.drop_segment, name, seg)
                self.stats["dropped"] += 1
                self.stats["dropped_bytes"] += freed
                dropped += 1
        if dropped:
            log.info("%s: dropped %d segments now held by their new owners", name, dropped)

    async def _copy_all(self, name: str, entry: CatalogEntry, missing: list[int]) -> None:
        """The missing copies, HEAL_PARALLEL at a time; stats["seconds"] is the time taken."""
        started = time.monotonic()
        self.stats["pending"] += len(missing)
        manifest = self.store.open(name).manifest
        todo = iter(missing)  # shared by the workers: each takes the next segment

        async def worker() -> None:
            for seg in todo:
                try:
                    await self._copy(name, entry, manifest, seg)
                finally:
                    self.stats["pending"] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(min(HEAL_PARALLEL, len(missing))):
                nursery.start_soon(worker)
        self.stats["seconds"] += time.monotonic() - started

    async def _copy(self, name: str, entry: CatalogEntry, manifest: Manifest, seg: int) -> None:
        """One missing copy: from the members that may hold it (best ranked first), else the
        source; kept only when its checksum matches the manifest's."""
        started = time.monotonic()
        length = int(manifest.seg_len[seg])
        expected = int(manifest.seg_checksum[seg])
        ranked = placed(name, entry).ranked(seg, len(entry.members))
        origin = ""
        for peer in ranked:
            if peer == self.address or peer not in self.membership.live:
                continue
            try:
                await trio.to_thread.run_sync(
                    self.store.segments.add_segment,
                    name,
                    seg,
                    length,
                    functools.partial(self._read_peer, peer, name, entry.uuid, seg, expected),
                )
                origin = "peer"
                break
            except DataError as e:
                log.warning("segment %d of %s from %s: %s", seg, name, peer, e)
            except KSpeedError as e:
                if isinstance(e, NoSpace) or name not in self.store.datasets:
                    raise  # this node cannot take it (full, or unloaded meanwhile): no peer helps
                log.debug("segment %d of %s not from %s: %s", seg, name, peer, e)
        if not origin:
            origin = "source"
            self.stats["from_source"] += 1
            try:
                src = open_source(entry.source, entry.endpoint)
                data = await sourceio.run_sync(src.read_segment, manifest, manifest.layout, seg)
            except (KSpeedError, OSError) as e:
                self.stats["failed"] += 1
                log.error("segment %d of %s: no copy left and the source fails: %s", seg, name, e)
                return
            if xxhash.xxh3_64_intdigest(data) != expected:
                self.stats["failed"] += 1
                log.error("segment %d of %s: the source no longer matches", seg, name)
                return
            await trio.to_thread.run_sync(
                self.store.segments.add_segment,
                name,
                seg,
                length,
                functools.partial(_copy_in, data),
            )
        self.stats["segments"] += 1
        self.stats["bytes"] += length
        self.copy_seconds.labels(origin).observe(time.monotonic() - started)

    def _read_peer(
        self, peer: str, name: str, uuid: str, seg: int, expected: int, out: memoryview
    ) -> None:
        """A whole segment from `peer` (in a worker thread), received straight into `out`
        (the new segment's mapping); DataError when it fails the manifest's checksum."""
        read_segment_into(self.readers, peer, name, uuid, seg, out)
        if xxhash.xxh3_64_intdigest(out) != expected:
            raise DataError("it fails its checksum")

    async def rebalance(self, name: str | None) -> tuple[list[str], dict[str, CatalogEntry]]:
        """Place datasets over the live members as they are now: new members get their share
        (each node copies what it now owns and lacks), lost ones are no longer counted.
        Returns the datasets placed again and the catalog as read."""
        live = await self.membership.members_now()
        found = await trio.to_thread.run_sync(self.state.datasets)
        catalog = {n: r for n, (r, _rev) in found.items()}
        done = []
        for n in [name] if name else sorted(catalog):
            entry = catalog.get(n)
            if entry is None or not entry.ready:
                continue

            def replace(r: CatalogEntry) -> CatalogEntry:
                return dataclasses.replace(r, members=tuple(live), lost=())

            update = functools.partial(self.state.update, fence=self.membership.fence())
            if await trio.to_thread.run_sync(update, n, entry.uuid, replace):
                done.append(n)
        return done, catalog


def _copy_in(data: bytes | bytearray, out: memoryview) -> None:
    out[:] = data
