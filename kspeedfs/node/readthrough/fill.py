"""Filling the segments readers miss: once per segment however many readers wait, from its
spilled copy on the disk tier when there is one, else from the source, written under a
temporary name and renamed into the instance's seg/ folder where every local reader maps it.

A miss the eviction policy does not keep (the dataset's share or cap is full) is filled onto
the node's disk tier when it has one with room (disktier.py), the same way, into the
instance's disk folder; later epochs read it there. Only when the disk tier is full too (or
absent) is it answered "source": the reader reads those bytes from the source itself,
verified as its every source read is (the file's size and time, and its checksum for a
whole file), so the mount and the fast path get the same verified bytes with nothing written
on the node. The reader names the bytes it will read, which count as this dataset's source
bytes."""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import os
import time
import uuid
from pathlib import Path

import trio
import xxhash

from kspeedfs.format.contract.readthrough import Filled, FillSegment
from kspeedfs.format.errors import DataError, InvalidArgument, KSpeedError, NoSpace, SourceChanged
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.manifest import Manifest
from kspeedfs.node import sourceio
from kspeedfs.node.metrics import segment_seconds
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances, file_checksum
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.evict import Evictor, NotAdmitted
from kspeedfs.node.safedir import seal_file
from kspeedfs.node.store import SegmentStore
from kspeedfs.node.tasks import Tasks
from kspeedfs.sources.source import Source, open_source

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Fill:
    """One fill in progress, which every reader of its segment waits for."""

    uuid: str
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: str = ""
    admitted: bool = True  # False: neither memory nor the disk tier keeps it (the source)


class Filler:
    """Owns the fills: `op_fill` starts one (or joins the one running), `run` runs them."""

    def __init__(
        self,
        store: SegmentStore,
        instances: Instances,
        evictor: Evictor,
        disk: DiskTier,
        fill_wait: float,
    ):
        self.store = store
        self.instances = instances
        self.evictor = evictor
        self.disk = disk
        self.fill_wait = fill_wait  # how long a fill op waits before it answers "filling"
        self.fills: dict[tuple[str, int], Fill] = {}
        self.tasks = Tasks()
        self.seconds = segment_seconds(
            "kspeedfs_readthrough_fill_seconds",
            "time to fill a segment, from the miss to the segment in memory or on the disk tier",
            ("source", "spill"),
        )

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.tasks.run(task_status=task_status)

    async def op_fill(self, request: FillSegment) -> Filled:
        """Make a segment resident; answers once it is, or after fill_wait with "filling"."""
        ds = self.instances.find(request.name, request.uuid)
        seg = request.segment
        if seg >= ds.manifest.segments:
            raise InvalidArgument(f"segment {seg} out of range for {ds.name}")
        self.evictor.used(ds, seg)  # before the choice: a plan's cursor moves with the misses
        # A reader finds a disk segment without asking: one that asks may find it gone.
        if seg in ds.on_disk and not await trio.to_thread.run_sync(self.disk.there, ds, seg):
            log.warning("disk-tier segment %d of %s is gone: filling it again", seg, ds.name)
            self.disk.release(ds, seg)
        if not ds.holds(seg):
            key = (ds.name, seg)
            fill = self.fills.get(key)
            if fill is None or fill.uuid != ds.uuid:
                fill = self.fills[key] = Fill(ds.uuid)
                self.tasks.start_soon(self._fill, ds, seg, fill)
            with trio.move_on_after(self.fill_wait):
                await fill.done.wait()
            if not ds.holds(seg) or not self.instances.current(ds):
                if not fill.admitted:
                    self._read_by_reader(ds, request.length)
                    return Filled("source")
                if fill.error:
                    return Filled("failed", fill.error)
                return Filled("filling")
        return Filled("cached")

    def _read_by_reader(self, ds: CachedDataset, length: int) -> None:
        """A miss not kept: the reader reads `length` bytes from the source."""
        ds.stats["bypassed"] += 1
        for counters in (ds.stats, self.instances.stats):
            counters["source_reads"] += 1
            counters["source_bytes"] += length

    async def _fill(self, ds: CachedDataset, seg: int, fill: Fill) -> None:
        key = (ds.name, seg)
        length = ds.seg_len(seg)
        reservation = f"fill:{ds.name}:{ds.uuid}:{seg}"
        tmp = self.store.staging_dir / f"fill.{ds.name}.{seg:08d}.{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        origin = "source"
        to_disk = False
        try:
            try:
                await self.evictor.make_room(ds, seg, reservation)
            except (NotAdmitted, NoSpace) as e:
                to_disk = self.disk.claim(ds, seg)
                if not to_disk and isinstance(e, NoSpace):
                    raise
                if not to_disk:
                    fill.admitted = False
                    return
                # On the same filesystem as the disk folder's seg/: renamed in, never copied.
                tmp = self.disk.folder(ds) / f".fill.{seg:08d}.{uuid.uuid4().hex[:8]}"
            checksum = 0
            if seg in ds.places.spilled:
                try:
                    checksum = await trio.to_thread.run_sync(self._from_spill, ds, seg, tmp)
                    ds.places.spill_used(seg, time.time())
                    ds.stats["fills_spill"] += 1
                    origin = "spill"
                except (OSError, DataError) as e:
                    log.warning(
                        "spilled segment %d of %s unusable (%s): reading the source",
                        seg,
                        ds.name,
                        e,
                    )
                    if seg in ds.places.spilled and self.instances.current(ds):
                        self.disk.drop_spilled(ds, seg)
                    tmp.unlink(missing_ok=True)
            if not checksum:
                source = open_source(ds.record.source, ds.endpoint)
                checksum, reads = await sourceio.run_sync(
                    _from_source, source, ds.manifest, seg, length, tmp
                )
                ds.stats["fills_source"] += 1
                for counters in (ds.stats, self.instances.stats):
                    counters["source_reads"] += reads
                    counters["source_bytes"] += length
            ds.stats["misses"] += 1
            async with ds.lock:
                if not self.instances.current(ds):
                    return  # unloaded or refreshed meanwhile
                ds.sums[seg] = checksum
                if to_disk:
                    final = segment_path(self.disk.folder(ds), seg)
                    await trio.to_thread.run_sync(os.rename, tmp, final)
                    await trio.to_thread.run_sync(seal_file, final)  # nobody cuts it short
                    ds.places.placed_on_disk(seg)
                    ds.stats["fills_disk"] += 1
                else:
                    final = segment_path(ds.record.path, seg)
                    await trio.to_thread.run_sync(os.rename, tmp, final)
                    await trio.to_thread.run_sync(seal_file, final)
                    ds.places.cached(seg)
                    self.evictor.admitted(ds, seg)
            self.seconds.labels(origin).observe(time.perf_counter() - started)
        except SourceChanged as e:
            fill.error = str(e)
            self.instances.mark_changed(ds)
            log.warning("cannot fill segment %d of %s: %s", seg, ds.name, e)
        except KSpeedError as e:
            fill.error = str(e)
            log.warning("cannot fill segment %d of %s: %s", seg, ds.name, e)
        except Exception as e:
            fill.error = f"{type(e).__name__}: {e}"
            log.exception("filling segment %d of %s failed", seg, ds.name)
        finally:
            self.evictor.release(ds, seg, reservation)
            if to_disk and seg not in ds.on_disk:
                self.disk.release(ds, seg)  # failed, or its instance went meanwhile
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(tmp.unlink, missing_ok=True))
            if self.fills.get(key) is fill:
                del self.fills[key]
            fill.done.set()

    def _from_spill(self, ds: CachedDataset, seg: int, tmp: Path) -> int:
        self.disk.copy_out(ds, seg, tmp)
        checksum = file_checksum(tmp)
        if checksum != int(ds.sums[seg]):
            raise DataError("it fails its checksum")
        return checksum


def _from_source(
    source: Source, manifest: Manifest, seg: int, length: int, tmp: Path
) -> tuple[int, int]:
    """Write one segment from the source to tmp; returns (checksum, source reads)."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        try:
            os.posix_fallocate(fd, 0, length)  # claim the pages (or blocks) now: ENOSPC up front
        except OSError as e:
            raise NoSpace(f"cannot allocate a segment in {tmp.parent}: {e.strerror}") from None
        with mmap.mmap(fd, length) as m:
            view = memoryview(m)
            try:
                reads = source.fill(manifest, manifest.layout, seg, view, fd=fd)
                checksum = xxhash.xxh3_64_intdigest(view)
            finally:
                view.release()
    finally:
        os.close(fd)
    return checksum or 1, reads  # 0 means "never filled"
