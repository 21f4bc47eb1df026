"""Bytes at rest kept sound: a damaged segment costs that segment, never the dataset or a reader.

Damage is found four ways: a reader's check of disk-tier bytes before it serves them
(system/disk_copies; the reader reports it with `report_damage` and the node checks again itself),
promotion (SegmentPlaces.promote checks a segment before it joins memory), a restart with
`verify_on_start` (SegmentStore.recover keeps the dataset, and names the damaged segments in
`damaged_at_start`), and the scrubber: a task that re-reads every disk-tier segment of the
preloaded datasets, by pread, at `scrub_rate` bytes per second, and checks it against the
manifest's checksum (xxh3_64). Each damaged segment is announced to every reader on the
machine at once (system/damage.py: they drop their maps and checks of it; a completed pass is
announced too, and readers check their disk-tier bytes again), quarantined (unlinked and forgotten:
readers that have it open find it damaged too and read elsewhere) and fetched again, from the
members that may hold a replica first, else the source, and kept only when it matches the
manifest's checksum; it lands in memory when there is room, else on the disk tier. One log
line per segment; the counts are in `status` ("integrity") and in /metrics.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import trio
import xxhash

from kspeedfs.format import placement
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.scrub import DamageChecked, ReportDamage
from kspeedfs.format.contract.status import IntegrityStatus
from kspeedfs.format.errors import DataError, KSpeedError, StaleDataset
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_size
from kspeedfs.node import sourceio
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.ops import READ, OpRegistry
from kspeedfs.node.peers import PeerPool, read_segment_into
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import open_source
from kspeedfs.system import damage

log = logging.getLogger(__name__)

IDLE_S = 5.0  # the scrubber looks again this often when there is no disk-tier segment


class Scrubber:
    """Finds damaged segments (reports, promotion, start, the scrub) and makes them again."""

    def __init__(
        self,
        settings: Settings,
        store: SegmentStore,
        events: DatasetEvents,
        address: Callable[[], str],
    ):
        self.store = store
        self.address = address
        self.rate = parse_size(settings.scrub_rate)  # bytes/s the scrubber reads (0: off)
        self.readers = PeerPool(settings.token_file, settings.timeout, tls=client_context(settings))
        self.stats: dict[str, Any] = {
            "damaged": 0,  # segments found damaged (and quarantined)
            "repaired": 0,  # of those, fetched again and sound
            "repair_failed": 0,  # no replica and no source could give them
            "from_source": 0,  # repaired from the source (no replica had it)
            "reported": 0,  # segments readers reported (checked again here)
            "scrubbed_bytes": 0,
            "scrub_cpu_seconds": 0.0,  # CPU time of the scrubber's reads and hashes
            "passes": 0,  # complete passes over the disk tier
        }
        self._send, self._receive = trio.open_memory_channel[tuple[str, int, str]](math.inf)
        # Damage the node's own reads found (DatasetEvents.follow_damage, any thread).
        self._found_send, self._found_receive = trio.open_memory_channel[tuple[str, list[int]]](
            math.inf
        )
        self._token: trio.lowlevel.TrioToken | None = None
        events.follow_damage(self._found_by_node)  # (dropped until `run` starts)
        self._pending: set[tuple[str, int]] = set()

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(ReportDamage, self.op_report_damage, READ)

    def status(self) -> IntegrityStatus:
        s = self.stats
        return IntegrityStatus(
            damaged=s["damaged"],
            repaired=s["repaired"],
            repair_failed=s["repair_failed"],
            from_source=s["from_source"],
            reported=s["reported"],
            scrubbed_bytes=s["scrubbed_bytes"],
            scrub_cpu_seconds=s["scrub_cpu_seconds"],
            passes=s["passes"],
            scrub_rate=self.rate,
        )

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        for name, seg in self.store.damaged_at_start:
            self._found(name, seg, "", quarantined=True)
        self.store.damaged_at_start = []
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._repairs)
            nursery.start_soon(self._checks_of_found)
            if self.rate > 0:
                nursery.start_soon(self._scrub)
            task_status.started()

    def damaged(self, name: str, seg: int, why: str) -> None:
        """Segment `seg` of `name` is damaged (`why`): quarantine it and fetch it again. From
        the node's event loop."""
        self._found(name, seg, why, quarantined=False)

    def quarantined(self, name: str, seg: int) -> None:
        """Segment `seg` of `name` was found damaged and quarantined (promotion): fetch it
        again. From the node's event loop."""
        self._found(name, seg, "", quarantined=True)

    def _found(self, name: str, seg: int, why: str, quarantined: bool) -> None:
        if (name, seg) in self._pending:
            return
        self._pending.add((name, seg))
        self.stats["damaged"] += 1
        self._announce(name, [seg])
        self._send.send_nowait((name, seg, "" if quarantined else why))

    def _announce(self, name: str, segments: list[int], scrub_pass: bool = False) -> None:
        """News to every reader of `name` on this machine before its next read (system/
        damage.py): they drop their maps and checks of `segments` (after a pass: all checks).
        On the event loop: a few words of shared memory, before a reporter hears back."""
        record = self.store.datasets.get(name)
        if record is not None:
            damage.announce(record.path, segments, scrub_pass)

    def _found_by_node(self, name: str, segments: list[int]) -> None:
        """The node's own read of `name` found `segments` damaged: checked like a report."""
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(self._found_send.send_nowait, (name, list(segments)))
        except trio.RunFinishedError:
            pass  # the node is stopping

    async def _checks_of_found(self) -> None:
        async for name, segments in self._found_receive:
            record = self.store.datasets.get(name)
            if record is not None:
                await self._check_reported(name, segments)

    async def op_report_damage(self, request: ReportDamage) -> DamageChecked:
        """A reader found segments damaged: each checked here (a reader's word alone drops
        nothing), the damaged ones quarantined and fetched again."""
        record = self.store.datasets.get(request.name)
        if record is None or (request.uuid and request.uuid != record.uuid):
            raise StaleDataset(f"dataset {request.name!r} was unloaded or loaded again")
        found = await self._check_reported(
            request.name, request.segments[: max(1, record.segments)]
        )
        return DamageChecked(damaged=found)

    async def _check_reported(self, name: str, segments: list[int]) -> int:
        """Each segment checked here; the damaged ones quarantined and fetched again. How
        many are damaged."""
        found = 0
        for seg in sorted(set(segments)):
            self.stats["reported"] += 1
            if (name, seg) in self._pending:
                found += 1
                continue
            why = await trio.to_thread.run_sync(self.store.segments.verify_segment, name, seg)
            if why:
                self.damaged(name, seg, why)
                found += 1
        return found

    async def _repairs(self) -> None:
        async for name, seg, why in self._receive:
            try:
                if why:
                    await trio.to_thread.run_sync(self.store.segments.quarantine, name, seg, why)
                await self._fetch_again(name, seg)
            finally:
                self._pending.discard((name, seg))

    async def _fetch_again(self, name: str, seg: int) -> None:
        """Segment `seg` of `name` made again: from a member that may hold a replica, else the
        source; kept only when it matches the manifest's checksum."""
        record = self.store.datasets.get(name)
        if record is None or seg in record.held:
            return  # unloaded meanwhile, or made again already
        manifest = self.store.open(name).manifest
        length, expected = int(manifest.seg_len[seg]), int(manifest.seg_checksum[seg])
        me = self.address()
        members = [m for m in record.members if m != me]
        if members:
            where = placement.Placement(name, record.segments, record.members, record.replicas)
            for peer in [p for p in where.ranked(seg, len(record.members)) if p != me]:
                read = functools.partial(self._read_peer, peer, name, record.uuid, seg, expected)
                try:
                    await trio.to_thread.run_sync(
                        self.store.segments.add_segment, name, seg, length, read
                    )
                except (KSpeedError, OSError) as e:
                    log.info("segment %d of %s not from %s: %s", seg, name, peer, e)
                    continue
                self.stats["repaired"] += 1
                log.warning("segment %d of %s fetched again from %s", seg, name, peer)
                return
        try:
            endpoint = str(manifest.header.get("endpoint") or "")
            src = open_source(record.source, endpoint)
            data = await sourceio.run_sync(src.read_segment, manifest, manifest.layout, seg)
            if expected and xxhash.xxh3_64_intdigest(data) != expected:
                raise DataError("the source no longer matches the manifest")
            await trio.to_thread.run_sync(
                self.store.segments.add_segment,
                name,
                seg,
                length,
                functools.partial(_copy_in, data),
            )
        except (KSpeedError, OSError) as e:
            self.stats["repair_failed"] += 1
            log.error("segment %d of %s cannot be fetched again: %s", seg, name, e)
            return
        self.stats["repaired"] += 1
        self.stats["from_source"] += 1
        log.warning("segment %d of %s fetched again from the source", seg, name)

    def _read_peer(
        self, peer: str, name: str, uuid: str, seg: int, expected: int, out: memoryview
    ) -> None:
        """A whole segment from `peer` (in a worker thread), straight into `out`; DataError
        when it fails the manifest's checksum."""
        read_segment_into(self.readers, peer, name, uuid, seg, out)
        if expected and xxhash.xxh3_64_intdigest(out) != expected:
            raise DataError("its copy fails its checksum too")

    async def _scrub(self) -> None:
        """Every disk-tier segment of the preloaded datasets re-read and checked, one at a
        time, at `rate` bytes per second on average; round and round."""
        while True:
            todo = [
                (r.name, seg)
                for _, r in sorted(self.store.datasets.items())
                for seg in sorted(r.disk)
            ]
            for name, seg in todo:
                if (name, seg) in self._pending:
                    continue
                why, nbytes, cpu = await trio.to_thread.run_sync(self._check, name, seg)
                self.stats["scrubbed_bytes"] += nbytes
                self.stats["scrub_cpu_seconds"] += cpu
                if why:
                    self.damaged(name, seg, why)
                await trio.sleep(nbytes / self.rate)
            if todo:
                self.stats["passes"] += 1
                for name in sorted({name for name, _ in todo}):
                    self._announce(name, [], scrub_pass=True)
            else:
                await trio.sleep(IDLE_S)

    def _check(self, name: str, seg: int) -> tuple[str, int, float]:
        """Why disk segment `seg` of `name` is damaged ("": sound), the bytes read and the CPU
        seconds it took (in a worker thread)."""
        started = time.thread_time()
        where = self.store.segments.segment_file(name, seg)
        why = self.store.segments.verify_segment(name, seg) if where is not None else ""
        return why, where[1] if where is not None else 0, time.thread_time() - started


def _copy_in(data: bytes | bytearray, out: memoryview) -> None:
    out[:] = data
