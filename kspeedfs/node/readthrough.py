"""Read-through datasets on a node: segments filled from the source on a miss, LRU eviction, spill.

A read-through dataset is published like a preloaded one (a manifest, from a listing of the
source; lifetime "readthrough") but holds no segment at first. A reader that misses asks the
node to `fill` the segment: the node reads it once (concurrent misses wait for the same fill)
from the spill folder or the source, writes it under a temporary name and renames it into the
dataset's seg/ folder, where every local reader maps it.

Memory is one budget for all datasets. Preloaded (offline) and leased datasets are pinned; when
the budget is reached, read-through segments are evicted least recently used first: copied to
the spill folder when there is one, then unlinked (mapped pages stay valid; readers drop their
maps when the eviction counter moves). The node also checks sources for changes: a changed
dataset is served as it was cached and shown stale until `kspeedfs refresh NAME`.

With etcd (a `ClusterCatalog`), a dataset is one cache over the cluster: the node that lists
the source claims the name in the catalog, places the segments over the live members (readers
ask each segment's owner to fill it), and every member adopts the manifest with no segment.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import os
import secrets
import time
import uuid
from collections import Counter, OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import trio
import xxhash

from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
    SourceChanged,
)
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import MANIFEST_FILE, segment_path
from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.format.names import validate_name
from kspeedfs.format.readthrough_view import EPOCH_FILE, READTHROUGH, SEGSUMS_FILE
from kspeedfs.format.tree import Tree
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.node import sourceio
from kspeedfs.node.metrics import segment_seconds
from kspeedfs.node.ops import ADMIN, JOB, OpRegistry
from kspeedfs.node.preload import tree_digest
from kspeedfs.node.spill import SpillArea
from kspeedfs.node.store import DatasetRecord
from kspeedfs.sources.loader import Progress, manifest_size_estimate
from kspeedfs.sources.source import Source, diff_counts, is_url, open_source

if TYPE_CHECKING:
    from kspeedfs.format.config import Settings
    from kspeedfs.node.loads import LoadTable
    from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

PRUNE_INTERVAL = 1.0
FOLLOW_POLL_S = 0.2  # how often a member waits on a listing another member is making


class ClusterCatalog(Protocol):
    """What a read-through dataset needs of the etcd control plane (node.controlplane)."""

    async def members_now(self) -> list[str]: ...

    async def entry_now(self, name: str) -> dict[str, Any] | None: ...

    async def claim(self, record: dict[str, Any]) -> None: ...

    async def publish(self, name: str, uuid: str, more: dict[str, Any]) -> None: ...

    async def replace(self, name: str, uuid: str, more: dict[str, Any]) -> bool: ...

    async def forget(self, name: str, uuid: str) -> bool: ...

    async def adopt(self, name: str, entry: dict[str, Any]) -> None: ...

    async def announce(self, name: str, uuid: str) -> None: ...


@dataclasses.dataclass
class CachedDataset:
    """The node's state of one read-through dataset instance."""

    record: DatasetRecord
    manifest: Manifest
    layout: Layout
    sums: np.ndarray  # writable map of SEGSUMS_FILE
    epoch: np.ndarray  # writable map of EPOCH_FILE
    base_bytes: int  # manifest and side files
    resident: set[int] = dataclasses.field(default_factory=set)
    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    lock: trio.Lock = dataclasses.field(default_factory=trio.Lock)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def uuid(self) -> str:
        return self.record.uuid

    @property
    def endpoint(self) -> str:
        return str(self.manifest.header.get("endpoint") or "")

    @property
    def spill_key(self) -> str:
        return SpillArea.key(self.name, self.uuid)

    def seg_len(self, seg: int) -> int:
        return int(self.manifest.seg_len[seg])


@dataclasses.dataclass
class Fill:
    uuid: str
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: str = ""


class ReadThroughCache:
    """Owned by the node; runs in its event loop, with file work in worker threads."""

    def __init__(self, store: SegmentStore, settings: Settings, address: str, loads: LoadTable):
        self.store = store
        self.settings = settings
        self.address = address  # this node's: it coordinates the datasets it registers
        self.loads = loads
        self.datasets: dict[str, CachedDataset] = {}
        self.lru: OrderedDict[tuple[str, int], None] = OrderedDict()  # oldest first
        self.fills: dict[tuple[str, int], Fill] = {}
        self.changed: dict[str, tuple[str, int]] = {}  # name -> (uuid, files changed at source)
        self.stats: Counter[str] = Counter()
        self.fill_wait = max(1.0, self.settings.timeout / 2)
        self.spill: SpillArea | None = None
        spill_dir, spill_budget = self.settings.spill_dir, parse_size(self.settings.spill)
        if spill_dir is not None:  # with its budget: load_settings checks that they go together
            self.spill = SpillArea(Path(spill_dir), spill_budget)
        self._nursery: trio.Nursery | None = None
        self.cluster: ClusterCatalog | None = None  # etcd: the catalog places the segments
        self.busy: set[str] = set()  # names being listed or refreshed here (not converged)
        self.fill_seconds = segment_seconds(
            "kspeedfs_readthrough_fill_seconds",
            "time to fill a segment, from the miss to the segment in memory",
            ("source", "spill"),
        )
        store.add_reclaimer(self.reclaim)

    def use_cluster(self, cluster: ClusterCatalog) -> None:
        """etcd: datasets registered here are placed over the live members and cataloged."""
        self.cluster = cluster

    def register_ops(self, ops: OpRegistry) -> None:
        """Creating and refreshing a dataset needs an admin; filling what a reader misses (the
        node reads the source for it) and reporting what it read need the job role."""
        ops.add("register_source", self.op_register_source, ADMIN)
        ops.add("refresh", self.op_refresh, ADMIN)
        ops.add("fill", self.op_fill, JOB)
        ops.add("touch", self.op_touch, JOB)

    # Start-up.

    def recover(self) -> None:
        """Pick up the read-through datasets the store found; their segments are what is here."""
        verify = self.settings.verify_on_start
        found: list[tuple[float, str, int]] = []
        for record in list(self.store.datasets.values()):
            if record.lifetime != READTHROUGH:
                continue
            try:
                ds, mtimes = self._open(record, verify)
            except (KSpeedError, OSError, ValueError) as e:
                log.error("dropping broken read-through dataset %s: %s", record.name, e)
                self.store.unload(record.name)
                continue
            self.datasets[record.name] = ds
            found.extend((t, record.name, seg) for seg, t in mtimes.items())
        for _t, name, seg in sorted(found):
            self.lru[(name, seg)] = None
        if self.spill is not None:
            self.spill.recover({ds.spill_key for ds in self.datasets.values()})
        over = self.store.used() - self.store.budget
        if over > 0:
            log.warning("%s over the memory budget after restart: evicting", format_size(over))
            self.reclaim(over)

    def _open(self, record: DatasetRecord, verify: bool) -> tuple[CachedDataset, dict[int, float]]:
        """State of one dataset from its folder: which segments are here (and sound)."""
        m = Manifest(record.path / MANIFEST_FILE)
        sums = np.memmap(record.path / SEGSUMS_FILE, dtype="<u8", mode="r+")
        if sums.size != m.segments:
            raise DataError(f"{SEGSUMS_FILE} has the wrong length")
        epoch = np.memmap(record.path / EPOCH_FILE, dtype="<u8", mode="r+", shape=(1,))
        base = sum(
            (record.path / f).stat().st_size for f in (MANIFEST_FILE, SEGSUMS_FILE, EPOCH_FILE)
        )
        ds = CachedDataset(record, m, m.layout, sums, epoch, base)
        mtimes: dict[int, float] = {}
        for fname in os.listdir(record.path / "seg"):
            path = record.path / "seg" / fname
            try:
                seg = int(fname)
                st = path.stat()
                ok = 0 <= seg < m.segments and st.st_size == ds.seg_len(seg) and int(sums[seg]) != 0
                if ok and verify:
                    ok = _file_checksum(path) == int(sums[seg])
            except (ValueError, OSError):
                ok = False
            if not ok:
                log.warning("dropping unsound cached segment %s of %s", fname, record.name)
                path.unlink(missing_ok=True)
                continue
            ds.resident.add(seg)
            mtimes[seg] = st.st_mtime
        record.held = sorted(ds.resident)
        record.stored = base + sum(ds.seg_len(k) for k in ds.resident)
        return ds, mtimes

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background fills, pruning of unloaded datasets, periodic checks of the sources."""
        interval = self.settings.source_check_interval
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            next_check = trio.current_time() + interval
            while True:
                await trio.sleep(min(PRUNE_INTERVAL, interval) if interval > 0 else PRUNE_INTERVAL)
                await self._prune()
                if interval > 0 and trio.current_time() >= next_check:
                    await self.check_sources()
                    next_check = trio.current_time() + interval

    async def _prune(self) -> None:
        """Forget datasets that were unloaded (their files are gone already)."""
        for name, ds in list(self.datasets.items()):
            record = self.store.datasets.get(name)
            if record is None or record.uuid != ds.uuid:
                self._forget(ds)
        for name, (uid, _n) in list(self.changed.items()):
            record = self.store.datasets.get(name)
            if record is None or record.uuid != uid:
                self.changed.pop(name, None)
        if self.spill is not None:
            live = {ds.spill_key for ds in self.datasets.values()}
            for key in self.spill.keys() - live:
                await trio.to_thread.run_sync(self.spill.drop_dataset, key)

    def _forget(self, ds: CachedDataset) -> None:
        """Drop an instance from the tables; its spilled segments go with the next prune."""
        if self.datasets.get(ds.name) is ds:
            del self.datasets[ds.name]
        for seg in ds.resident:
            self.lru.pop((ds.name, seg), None)

    def _dataset(self, msg: dict[str, Any]) -> CachedDataset:
        name = validate_name(msg.get("name", ""))
        ds = self.datasets.get(name)
        record = self.store.datasets.get(name)
        if ds is None or record is None or record.uuid != ds.uuid:
            raise NotFound(f"no read-through dataset named {name!r} on {self.address}")
        if msg.get("uuid") and msg["uuid"] != ds.uuid:
            raise NotFound(f"dataset {name!r} was refreshed or loaded again")
        return ds

    # Registering a source.

    async def op_register_source(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Create the read-through dataset of a source (listing it in the background)."""
        name = validate_name(msg.get("name", ""))
        source = str(msg.get("source") or "")
        endpoint = str(msg.get("endpoint") or "")
        if not (is_url(source) or os.path.isabs(source)):
            raise InvalidArgument(f"source must be an absolute path or a URL: {source!r}")
        found = self._existing(name, source, endpoint)
        if found is not None:
            return found
        if self.cluster is not None:
            entry = await self.cluster.entry_now(name)
            if entry is not None:
                return await self._join(name, source, endpoint, entry)
        src = open_source(source, endpoint)
        # A missing bucket or wrong credentials: a one-line error now, and nothing created.
        await sourceio.run_sync(src.check)
        found = self._existing(name, source, endpoint)
        if found is not None:
            return found
        progress = self.loads.start(name, source)
        assert self._nursery is not None
        self._nursery.start_soon(self._register, name, src, progress)
        return {"name": name, "state": "scanning"}

    def _existing(self, name: str, source: str, endpoint: str) -> dict[str, Any] | None:
        record = self.store.datasets.get(name)
        if record is not None:
            header = self.store.open(name).manifest.header
            if record.source == source and str(header.get("endpoint") or "") == endpoint:
                return {"name": name, "state": "ready", "lifetime": record.lifetime}
            raise AlreadyExists(
                f"dataset {name!r} already holds {record.source}: choose another --name"
            )
        progress = self.loads.get(name)
        if progress is not None and progress.state != "failed":
            if progress.source == source:
                return {"name": name, "state": progress.state}
            raise AlreadyExists(f"dataset {name!r} is already loading {progress.source}")
        return None

    async def _join(
        self, name: str, source: str, endpoint: str, entry: dict[str, Any]
    ) -> dict[str, Any]:
        """etcd: another member registered this name: take its manifest (ready) or wait for
        its listing (loading)."""
        assert self.cluster is not None and self._nursery is not None
        if entry.get("source") != source or str(entry.get("endpoint") or "") != endpoint:
            raise AlreadyExists(
                f"dataset {name!r} already holds {entry.get('source')}: choose another --name"
            )
        if entry.get("state") == "ready":
            await self.cluster.adopt(name, entry)
            if name not in self.store.datasets:
                raise NotFound(f"no member of {name!r} answers with its manifest")
            return {"name": name, "state": "ready", "lifetime": READTHROUGH}
        progress = self.loads.start(name, source)
        self._nursery.start_soon(self._follow, name, str(entry["uuid"]), progress)
        return {"name": name, "state": "scanning"}

    async def _follow(self, name: str, uuid: str, progress: Progress) -> None:
        """Wait for the listing another member claimed, then adopt it."""
        assert self.cluster is not None
        try:
            while True:
                await trio.sleep(FOLLOW_POLL_S)
                try:
                    entry = await self.cluster.entry_now(name)
                except KSpeedError:
                    continue  # etcd away a moment: the claim is still there or not
                if entry is None or entry.get("uuid") != uuid:
                    raise NotFound(f"the listing of {name!r} on another member was given up")
                if entry.get("state") == "ready":
                    await self.cluster.adopt(name, entry)
                    if name not in self.store.datasets:
                        raise NotFound(f"no member of {name!r} answers with its manifest")
                    self.loads.finish(name)
                    return
        except BaseException as e:
            log.error("joining %s failed: %s", name, self.loads.fail(name, e))
            if not isinstance(e, Exception):
                raise

    async def _claim(self, name: str, src: Source, uid: str) -> list[str] | None:
        """etcd: claim the name for instance `uid` and return the members to place over; None
        when another member claimed it first (this one then follows that listing)."""
        assert self.cluster is not None
        members = await self.cluster.members_now()
        record = {
            "name": name,
            "uuid": uid,
            "state": "loading",
            "source": src.url,
            "endpoint": src.endpoint,
            "lifetime": READTHROUGH,
            "replicas": 1,
            "members": members,
            "segment_size": self.settings.segment_size,
            "segments": 0,
            "files": 0,
            "bytes": 0,
            "coordinator": self.address,
            "created": time.time(),
        }
        try:
            await self.cluster.claim(record)
        except AlreadyExists:
            entry = await self.cluster.entry_now(name)
            if entry is None or entry.get("source") != src.url:
                raise
            return None
        return members

    async def _register(self, name: str, src: Source, progress: Progress) -> None:
        staging: Path | None = None
        uid = secrets.token_hex(16)
        members = [self.address]
        claimed = False
        try:
            if self.cluster is not None:
                placed = await self._claim(name, src, uid)
                if placed is None:
                    entry = await self.cluster.entry_now(name)
                    await self._follow(name, str((entry or {}).get("uuid")), progress)
                    return
                members, claimed = placed, True
                self.busy.add(name)
            tree = await sourceio.run_sync(src.scan)
            progress.state = "loading"
            progress.files_total, progress.bytes_total = tree.file_count, tree.data_bytes
            segments = tree.data_bytes // self.settings.segment_size + len(tree) + 1
            self.store.reserve(name, manifest_size_estimate(tree) + 8 * segments)
            built, meta, _carried = await trio.to_thread.run_sync(
                self._build, name, src, tree, None, uid, members
            )
            staging = built
            record = await trio.to_thread.run_sync(self.store.publish, built, meta)
            staging = None
            ds, _ = await trio.to_thread.run_sync(self._open, record, False)
            self.datasets[name] = ds
            if self.cluster is not None:  # etcd: ready for everyone; the members adopt it
                await self.cluster.publish(name, uid, _catalog_fields(meta))
                await self.cluster.announce(name, uid)
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
            self.store.release(name)
            with trio.CancelScope(shield=True):
                if staging is not None:
                    await trio.to_thread.run_sync(self.store.discard_staging, staging)
                if claimed:
                    await self._unclaim(name, uid)
            log.error("listing %s for %s failed: %s", src.url, name, self.loads.fail(name, e))
            if not isinstance(e, Exception):
                raise
        finally:
            self.busy.discard(name)

    async def _unclaim(self, name: str, uid: str) -> None:
        """etcd: a listing that failed gives its name back (and its instance, if published)."""
        assert self.cluster is not None
        try:
            await self.cluster.forget(name, uid)
        except KSpeedError as e:
            log.warning("could not remove %s from the catalog: %s", name, e)
        record = self.store.datasets.get(name)
        if record is not None and record.uuid == uid:
            await trio.to_thread.run_sync(self.store.unload, name)

    def _build(
        self,
        name: str,
        src: Source,
        tree: Tree,
        old: CachedDataset | None,
        uid: str = "",
        members: list[str] | None = None,
    ) -> tuple[Path, dict[str, Any], dict[int, int]]:
        """A staging folder for a new instance (`uid`, placed over `members`: this node alone
        by default); with `old`, its segments whose contents are unchanged are carried over
        (hard links: no copy, no memory). Returns the carried segments, old -> new."""
        segment_size = self.settings.segment_size
        offsets, seg_len = plan_layout(tree, segment_size)
        header = {
            "name": name,
            "uuid": uid or secrets.token_hex(16),
            "source": src.url,
            "endpoint": src.endpoint,
            "segment_size": segment_size,
            "created": time.time(),
            "members": members or [self.address],
            "replicas": 1,
            "readthrough": True,
            "digest": tree_digest(tree),
        }
        staging = self.store.new_staging(name)
        carried: dict[int, int] = {}
        try:
            write_manifest(
                staging / MANIFEST_FILE,
                tree,
                offsets,
                [0] * len(tree),
                seg_len,
                [0] * len(seg_len),
                header,
            )
            sums = np.zeros(len(seg_len), dtype="<u8")
            if old is not None:
                carried = self._carry(
                    old, tree, Layout.of_tree(tree, offsets, seg_len, segment_size)
                )
                for o, n in carried.items():
                    sums[n] = old.sums[o]
                    if o in old.resident:
                        try:
                            os.link(segment_path(old.record.path, o), segment_path(staging, n))
                        except OSError:  # evicted meanwhile: from the spill, else read again
                            if not self._spilled(old, o):
                                sums[n] = 0
            sums.tofile(staging / SEGSUMS_FILE)
            (staging / EPOCH_FILE).write_bytes(bytes(8))
            base = sum(
                (staging / f).stat().st_size for f in (MANIFEST_FILE, SEGSUMS_FILE, EPOCH_FILE)
            )
        except BaseException:
            self.store.discard_staging(staging)
            raise
        meta = {
            **header,
            "lifetime": READTHROUGH,
            "files": tree.file_count,
            "bytes": tree.data_bytes,
            "segments": len(seg_len),
            "held": [],
            "stored": base,
        }
        return staging, meta, carried

    def _spilled(self, ds: CachedDataset, seg: int) -> bool:
        return self.spill is not None and self.spill.has(ds.spill_key, seg)

    def _carry(self, old: CachedDataset, tree: Tree, layout: Layout) -> dict[int, int]:
        """Old segments (in memory or spilled) whose exact contents reappear in the new layout."""
        have = {
            old.layout.signature(old.manifest, k): k
            for k in range(old.manifest.segments)
            if k in old.resident or self._spilled(old, k)
        }
        out = {}
        for n in range(layout.segments):
            o = have.get(layout.signature(tree, n))
            if o is not None:
                out[o] = n
        return out

    # Fills.

    async def op_fill(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Make a segment resident; answers once it is, or after fill_wait with "filling"."""
        ds = self._dataset(msg)
        seg = int(msg["segment"])
        if not 0 <= seg < ds.manifest.segments:
            raise InvalidArgument(f"segment {seg} out of range for {ds.name}")
        if seg not in ds.resident:
            key = (ds.name, seg)
            fill = self.fills.get(key)
            if fill is None or fill.uuid != ds.uuid:
                fill = self.fills[key] = Fill(ds.uuid)
                assert self._nursery is not None
                self._nursery.start_soon(self._fill, ds, seg, fill)
            with trio.move_on_after(self.fill_wait):
                await fill.done.wait()
            if seg not in ds.resident or self.datasets.get(ds.name) is not ds:
                if fill.error:
                    return {"state": "failed", "error": fill.error}
                return {"state": "filling"}
        self._touch(ds, seg)
        return {"state": "cached"}

    async def _fill(self, ds: CachedDataset, seg: int, fill: Fill) -> None:
        key = (ds.name, seg)
        length = ds.seg_len(seg)
        reservation = f"fill:{ds.name}:{ds.uuid}:{seg}"
        tmp = self.store.staging_dir / f"fill.{ds.name}.{seg:08d}.{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        origin = "source"
        try:
            await self._make_room(length, reservation)
            checksum = 0
            if self._spilled(ds, seg):
                try:
                    checksum = await trio.to_thread.run_sync(self._from_spill, ds, seg, tmp)
                    ds.stats["fills_spill"] += 1
                    origin = "spill"
                except (OSError, DataError) as e:
                    log.warning(
                        "spilled segment %d of %s unusable (%s): reading the source",
                        seg,
                        ds.name,
                        e,
                    )
                    assert self.spill is not None
                    self.spill.drop(ds.spill_key, seg)
                    tmp.unlink(missing_ok=True)
            if not checksum:
                source = open_source(ds.record.source, ds.endpoint)
                checksum, reads = await sourceio.run_sync(
                    _from_source, source, ds.manifest, seg, length, tmp
                )
                ds.stats["fills_source"] += 1
                for counters in (ds.stats, self.stats):
                    counters["source_reads"] += reads
                    counters["source_bytes"] += length
            ds.stats["misses"] += 1
            async with ds.lock:
                if self.datasets.get(ds.name) is not ds:
                    return  # unloaded or refreshed meanwhile
                ds.sums[seg] = checksum
                await trio.to_thread.run_sync(os.rename, tmp, segment_path(ds.record.path, seg))
                ds.resident.add(seg)
                ds.record.held.append(seg)
                ds.record.stored += length
                self.lru[key] = None
            self.fill_seconds.labels(origin).observe(time.perf_counter() - started)
        except SourceChanged as e:
            fill.error = str(e)
            self._mark_changed(ds)
            log.warning("cannot fill segment %d of %s: %s", seg, ds.name, e)
        except KSpeedError as e:
            fill.error = str(e)
            log.warning("cannot fill segment %d of %s: %s", seg, ds.name, e)
        except Exception as e:
            fill.error = f"{type(e).__name__}: {e}"
            log.exception("filling segment %d of %s failed", seg, ds.name)
        finally:
            self.store.release(reservation)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(tmp.unlink, missing_ok=True))
            if self.fills.get(key) is fill:
                del self.fills[key]
            fill.done.set()

    def _from_spill(self, ds: CachedDataset, seg: int, tmp: Path) -> int:
        assert self.spill is not None
        self.spill.copy_out(ds.spill_key, seg, tmp)
        checksum = _file_checksum(tmp)
        if checksum != int(ds.sums[seg]):
            raise DataError("it fails its checksum")
        return checksum

    def _mark_changed(self, ds: CachedDataset) -> None:
        uid, n = self.changed.get(ds.name, ("", 0))
        if uid != ds.uuid or n == 0:
            self.changed[ds.name] = (ds.uuid, 1)

    # Eviction.

    async def _make_room(self, length: int, reservation: str) -> None:
        """Evict until `length` more bytes fit the budget, then reserve them."""
        while self.store.budget - self.store.used() < length:
            victim = self._pick_victim()
            if victim is None:
                raise NoSpace(
                    f"no room for a {format_size(length)} segment: the "
                    f"{format_size(self.store.budget)} budget is held by pinned datasets and "
                    "fills in progress"
                )
            await self._evict(*victim)
        self.store.reserve(reservation, length)

    def _pick_victim(self) -> tuple[CachedDataset, int] | None:
        while self.lru:
            name, seg = next(iter(self.lru))
            del self.lru[(name, seg)]  # taken: no other eviction picks it while it spills
            ds = self.datasets.get(name)
            if ds is not None and seg in ds.resident:
                return ds, seg
        return None

    async def _evict(self, ds: CachedDataset, seg: int) -> None:
        if self.spill is not None and not self._spilled(ds, seg):
            path = segment_path(ds.record.path, seg)
            if await trio.to_thread.run_sync(self.spill.put, ds.spill_key, seg, path):
                ds.stats["spilled"] += 1
        if seg in ds.resident and self.datasets.get(ds.name) is ds:
            path = segment_path(ds.record.path, seg)
            await trio.to_thread.run_sync(functools.partial(path.unlink, missing_ok=True))
        self._drop(ds, seg)

    def _drop(self, ds: CachedDataset, seg: int) -> int:
        """Forget a resident segment (unlinking it unless the caller did)."""
        if seg not in ds.resident:
            return 0
        if self.datasets.get(ds.name) is ds:
            # tmpfs: one unlink, no I/O; reclaim() runs inside the store's reserve, which is
            # synchronous, so a preload's reservation frees memory at once.
            segment_path(ds.record.path, seg).unlink(missing_ok=True)
        ds.resident.discard(seg)
        try:
            ds.record.held.remove(seg)
        except ValueError:
            pass
        length = ds.seg_len(seg)
        ds.record.stored -= length
        ds.epoch[0] += 1  # readers drop their maps of it: the memory really returns
        ds.stats["evictions"] += 1
        self.stats["evictions"] += 1
        return length

    def reclaim(self, nbytes: int) -> int:
        """Free at least nbytes of read-through memory for a preload (the store calls this in
        the event loop): least recently used first, unlinked without spilling, so it is quick."""
        freed = 0
        while freed < nbytes:
            victim = self._pick_victim()
            if victim is None:
                break
            freed += self._drop(*victim)
        if freed:
            log.info("evicted %s of read-through data to make room", format_size(freed))
        return freed

    # etcd: a dataset another member registered.

    async def adopt(self, name: str, blob: bytes, meta: dict[str, Any]) -> None:
        """Publish another member's instance here from its manifest, holding no segment: the
        fills of the segments this node owns land here."""
        staging = self.store.new_staging(name)
        try:
            segments = int(meta["segments"])

            def write() -> int:
                (staging / MANIFEST_FILE).write_bytes(blob)
                np.zeros(segments, dtype="<u8").tofile(staging / SEGSUMS_FILE)
                (staging / EPOCH_FILE).write_bytes(bytes(8))
                return sum(
                    (staging / f).stat().st_size for f in (MANIFEST_FILE, SEGSUMS_FILE, EPOCH_FILE)
                )

            base = await trio.to_thread.run_sync(write)
            full = {**meta, "lifetime": READTHROUGH, "held": [], "stored": base}
            record = await trio.to_thread.run_sync(self.store.publish, staging, full)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.discard_staging, staging)
            raise
        ds, _ = await trio.to_thread.run_sync(self._open, record, False)
        self.datasets[name] = ds

    # Reads reported by readers.

    def note_reads(self, name: str, segments: list[int]) -> None:
        """Segments another node read from here (its reads miss this node's LRU otherwise)."""
        ds = self.datasets.get(name)
        if ds is None:
            return
        for seg in segments:
            self._touch(ds, seg)
        ds.stats["hits"] += 1

    def _touch(self, ds: CachedDataset, seg: int) -> None:
        key = (ds.name, seg)
        if key in self.lru:
            self.lru.move_to_end(key)

    async def op_touch(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            ds = self._dataset(msg)
        except NotFound:
            return {"known": False}
        for seg in msg.get("segments", []):
            self._touch(ds, int(seg))
        ds.stats["hits"] += int(msg.get("hits", 0))
        return {"known": True}

    # Source changes.

    async def check_sources(self) -> None:
        """Compare each dataset this node coordinates with its source; remember what changed."""
        for record in list(self.store.datasets.values()):
            if record.members and record.members[0] != self.address:
                continue
            try:
                manifest = self.store.open(record.name).manifest
                src = open_source(record.source, str(manifest.header.get("endpoint") or ""))
                tree = await sourceio.run_sync(src.scan)
                changed = 0
                if tree_digest(tree) != manifest.header.get("digest"):
                    changed = await trio.to_thread.run_sync(diff_counts, manifest, tree)
            except KSpeedError as e:
                log.warning("cannot check the source of %s: %s", record.name, e)
                continue
            before = self.changed.get(record.name, ("", 0))
            if changed and before != (record.uuid, changed):
                log.warning(
                    "the source of %s changed: %d files; served as cached until "
                    "`kspeedfs refresh %s`",
                    record.name,
                    changed,
                    record.name,
                )
            if changed:
                self.changed[record.name] = (record.uuid, changed)
            else:
                self.changed.pop(record.name, None)

    async def op_refresh(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A new instance from a new listing; segments whose contents did not change are kept."""
        name = validate_name(msg.get("name", ""))
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if record.lifetime != READTHROUGH:
            raise InvalidArgument(
                f"{name} is a preloaded dataset: unload it and preload it again to refresh it"
            )
        ds = self._dataset({"name": name})
        src = open_source(record.source, ds.endpoint)
        tree = await sourceio.run_sync(src.scan)
        changed = await trio.to_thread.run_sync(diff_counts, ds.manifest, tree)
        if not changed and tree_digest(tree) == ds.manifest.header.get("digest"):
            self.changed.pop(name, None)
            return {"name": name, "state": "unchanged", "changed": 0}
        # etcd: the new instance is placed over the members live now; the others drop the old
        # one and adopt the new (their cached segments are filled again).
        members = await self.cluster.members_now() if self.cluster is not None else None
        async with ds.lock:
            self.busy.add(name)
            try:
                new, kept = await self._swap(ds, src, tree, members)
            finally:
                self.busy.discard(name)
        if self.cluster is not None:
            await self.cluster.announce(name, new.uuid)
        self.changed.pop(name, None)
        log.info(
            "refreshed %s: %d files changed, %d of %d segments kept",
            name,
            changed,
            kept,
            new.manifest.segments,
        )
        return {
            "name": name,
            "state": "refreshed",
            "changed": changed,
            "kept": kept,
            "segments": new.manifest.segments,
        }

    async def _swap(
        self, ds: CachedDataset, src: Source, tree: Tree, members: list[str] | None
    ) -> tuple[CachedDataset, int]:
        """Replace instance `ds` with one of `tree`, carrying its unchanged segments; returns
        the new instance and how many segments it kept."""
        name = ds.name
        staging, meta, carried = await trio.to_thread.run_sync(
            self._build, name, src, tree, ds, "", members
        )
        try:
            if self.cluster is not None and not await self.cluster.replace(
                name, ds.uuid, _catalog_fields(meta)
            ):
                raise NotFound(f"the catalog no longer has this instance of {name!r}")
            await trio.to_thread.run_sync(self.store.unload, name)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.discard_staging, staging)
            raise
        new_record = await trio.to_thread.run_sync(self.store.publish, staging, meta)
        new, _ = await trio.to_thread.run_sync(self._open, new_record, False)
        new.stats = ds.stats
        if self.spill is not None:
            await trio.to_thread.run_sync(
                self.spill.rename_dataset, ds.spill_key, new.spill_key, carried
            )
        self._forget(ds)
        self.datasets[name] = new
        for seg in sorted(new.resident):
            self.lru[(name, seg)] = None
        return new, len(carried)

    # Status.

    def status(self) -> dict[str, Any]:
        datasets: dict[str, Any] = {}
        for record in self.store.datasets.values():
            uid, changed = self.changed.get(record.name, ("", 0))
            d: dict[str, Any] = {
                "lifetime": record.lifetime,
                "segments": record.segments,
                "in_memory": len(record.held),
                "memory_bytes": record.stored,
                "stale": changed if uid == record.uuid else 0,
            }
            ds = self.datasets.get(record.name)
            if ds is not None and ds.uuid == record.uuid:
                spill = self.spill
                d.update(
                    on_spill=spill.count(ds.spill_key) if spill is not None else 0,
                    spill_bytes=spill.bytes_of(ds.spill_key) if spill is not None else 0,
                    **{
                        k: ds.stats[k]
                        for k in (
                            "hits",
                            "misses",
                            "evictions",
                            "fills_source",
                            "fills_spill",
                            "spilled",
                            "source_reads",
                            "source_bytes",
                        )
                    },
                )
            datasets[record.name] = d
        spill_info: dict[str, Any] | None = None
        if self.spill is not None:
            spill_info = {
                "dir": str(self.spill.root),
                "used": self.spill.used,
                "budget": self.spill.budget,
            }
        return {"datasets": datasets, "spill": spill_info, "stats": dict(self.stats)}


def _catalog_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """What the catalog record of a read-through instance says once it is listed."""
    fields = ("uuid", "members", "segments", "files", "bytes", "segment_size", "created")
    return {**{k: meta[k] for k in fields}, "lost": []}


def _from_source(
    source: Source, manifest: Manifest, seg: int, length: int, tmp: Path
) -> tuple[int, int]:
    """Write one segment from the source to tmp; returns (checksum, source reads)."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        try:
            os.posix_fallocate(fd, 0, length)  # claim the tmpfs pages now: ENOSPC up front
        except OSError as e:
            raise NoSpace(f"cannot allocate a segment in shared memory: {e.strerror}") from None
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


def _file_checksum(path: Path) -> int:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_intdigest(b"") or 1
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return xxhash.xxh3_64_intdigest(m) or 1
