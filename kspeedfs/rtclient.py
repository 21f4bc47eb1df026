"""Readers' side of read-through datasets: a local view whose segments come and go, fill on miss.

A read-through dataset's segments appear (a node filled one) and disappear (it evicted one)
while readers have it open. `ReadThroughDataset` looks for a segment file again on a miss, and
drops its maps of evicted segments when the node's eviction counter (EPOCH_FILE) moves, so that
an eviction really returns the memory. A miss asks the dataset's node to fill the segment; when
the node is down, out of room or slow, the bytes come straight from the source (degraded).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import xxhash

from .errors import DataError, KSpeedError, NodeUnreachable
from .localdata import LocalDataset, read_meta, segment_path
from .names import validate_name
from .sources import Piece, name_from_source, normalize_source, open_source, read_file_range
from .units import format_size

if TYPE_CHECKING:
    from .aclient import AsyncNodeClient
    from .cluster import ClusterReader, DatasetHandle
    from .config import Settings
    from .fs import KSpeedFS

log = logging.getLogger(__name__)

READTHROUGH = "readthrough"  # the lifetime of a read-through dataset
SEGSUMS_FILE = "segsums"  # u64 per segment: xxh3 of its bytes once filled (0: never filled)
EPOCH_FILE = "epoch"  # u64 the node bumps on every eviction
TOUCH_INTERVAL = 1.0
DEGRADED_LOG_EVERY_S = 10.0


def open_local(path: str | os.PathLike[str]) -> LocalDataset:
    """The right view of a published dataset folder: static, or read-through."""
    try:
        lifetime = read_meta(Path(path)).get("lifetime")
    except (OSError, ValueError):
        lifetime = None
    return ReadThroughDataset(path) if lifetime == READTHROUGH else LocalDataset(path)


class ReadThroughDataset(LocalDataset):
    """A LocalDataset whose set of present segments changes under it."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        self._present: set[int] = set(self.held)
        self._inodes: dict[int, int] = {}
        self._epoch = _map_epoch(self.path / EPOCH_FILE)
        self._epoch_seen = self._read_epoch()
        self.touched: set[int] = set()  # segments read since the last report to the node
        self.hits = 0

    def _read_epoch(self) -> int:
        return int(struct.unpack_from("<Q", self._epoch, 0)[0]) if self._epoch is not None else 0

    def _sync(self) -> None:
        """Forget segments evicted since we last looked: our maps would pin memory the node freed."""
        epoch = self._read_epoch()
        if epoch == self._epoch_seen:
            return
        with self._lock:
            self._epoch_seen = epoch
            for seg in list(self._present):
                try:
                    ino: int | None = os.stat(segment_path(self.path, seg)).st_ino
                except FileNotFoundError:
                    ino = None
                if ino is None or self._inodes.get(seg, ino) != ino:
                    self._present.discard(seg)
                    self._inodes.pop(seg, None)
                    # Dropped, not closed: a thread reading it still holds a reference.
                    self._maps.pop(seg, None)
            self.held = frozenset(self._present)

    def release(self) -> None:
        with self._lock:
            self._present.clear()
            self._inodes.clear()
        super().release()

    def _appeared(self, seg: int) -> bool:
        try:
            st = os.stat(segment_path(self.path, seg))
        except FileNotFoundError:
            return False
        if not 0 <= seg < self.manifest.segments or st.st_size != int(self.manifest.seg_len[seg]):
            return False
        with self._lock:
            self._present.add(seg)
            self.held = frozenset(self._present)
        return True

    def holds(self, seg: int) -> bool:
        self._sync()
        return seg in self._present or self._appeared(seg)

    def holds_file(self, i: int) -> bool:
        return all(self.holds(seg) for seg, _, _ in self.manifest.ranges(i))

    def segment(self, seg: int) -> mmap.mmap:
        self._sync()
        m = self._maps.get(seg)
        if m is None:
            if seg not in self._present and not self._appeared(seg):
                raise DataError(f"segment {seg} of {self.path.name} is not cached on this node")
            with self._lock:
                m = self._maps.get(seg)
                if m is None:
                    m = self._map(seg)
        self.touched.add(seg)
        return m

    def _map(self, seg: int) -> mmap.mmap:
        try:
            with open(segment_path(self.path, seg), "rb") as f:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                ino = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            self._present.discard(seg)
            raise DataError(f"segment {seg} of {self.path.name} was just evicted") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map segment {seg} of {self.path.name}: {e}") from None
        if len(m) != int(self.manifest.seg_len[seg]):
            raise DataError(f"segment {seg} of {self.path.name} has the wrong length")
        self._maps[seg] = m
        self._inodes[seg] = ino
        return m

    def read(self, i: int, offset: int, length: int) -> bytes:
        data = super().read(i, offset, length)
        self.hits += 1
        return data

    def drain_touches(self) -> tuple[list[int], int]:
        """Segments read and reads served since the last call (for the node's LRU and stats)."""
        touched, self.touched = self.touched, set()
        hits, self.hits = self.hits, 0
        return sorted(touched), hits


def _map_epoch(path: Path) -> mmap.mmap | None:
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 8, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None


_last_degraded: dict[str, float] = {}


def _degraded(ds: DatasetHandle, why: str) -> None:
    now = time.monotonic()
    if now - _last_degraded.get(ds.name, -1e9) >= DEGRADED_LOG_EVERY_S:
        _last_degraded[ds.name] = now
        log.warning("%s: reading from the source (degraded): %s", ds.name, why)


def read_through(
    reader: ClusterReader, ds: DatasetHandle, i: int, offset: int, length: int
) -> bytes:
    """Bytes of file i from the cache, asking the dataset's node to fill missing segments;
    from the source when that cannot be done now."""
    pieces = ds.manifest.ranges(i, offset, length)
    if not pieces:
        return b""
    owner = ds.members[0] if ds.members else reader.local_node
    local = ds.local
    if owner is not None and not reader.is_down(owner):
        filled = True
        for seg in sorted({p[0] for p in pieces}):
            if local is not None and local.holds(seg):
                continue
            try:
                reply = reader.request(owner, "fill", name=ds.name, uuid=ds.uuid, segment=seg)
            except NodeUnreachable as e:
                reader.mark_down(owner, str(e))
                filled = False
                break
            except KSpeedError as e:
                _degraded(ds, str(e))
                filled = False
                break
            if reply.get("state") != "cached":
                _degraded(ds, str(reply.get("error") or f"segment {seg} is still being filled"))
                filled = False
                break
        if filled:
            try:
                if local is not None:
                    data = local.read(i, offset, length)
                    reader.stats["local"] += 1
                    return data
                out = bytearray(sum(p[2] for p in pieces))
                reader.read_ranges(owner, ds.name, pieces, memoryview(out))
                reader.stats["remote"] += 1
                return bytes(out)
            except KSpeedError as e:
                _degraded(ds, str(e))
    reader.stats["source"] += 1
    return read_source(ds, i, offset, length)


def read_source(ds: DatasetHandle, i: int, offset: int, length: int) -> bytes:
    """Bytes of file i straight from the source, refused when the file is not as listed."""
    m = ds.manifest
    size = int(m.size[i])
    n = max(0, min(length, size - offset))
    if n == 0:
        return b""
    if not ds.source:
        raise DataError(f"{ds.name}: no copy reachable and no source recorded")
    source = open_source(ds.source, str(m.header.get("endpoint") or ""))
    data = read_file_range(source, Piece(m.path(i), offset, size, int(m.mtime_ns[i])), n)
    checksum = int(m.checksum[i])
    if checksum and n == size and xxhash.xxh3_64_intdigest(data) != checksum:
        raise DataError(f"source file changed since preload: {source.display(m.path(i))}")
    return data


async def report_touches(fs: KSpeedFS, clients: Sequence[AsyncNodeClient]) -> None:
    """Tell the node which read-through segments this mount read (its LRU cannot see mmap hits)."""
    while True:
        await trio.sleep(TOUCH_INTERVAL)
        for mounted in list(fs.by_name.values()):
            local = mounted.data.local
            if not isinstance(local, ReadThroughDataset):
                continue
            segments, hits = local.drain_touches()
            if not segments and not hits:
                continue
            try:
                await clients[0].request(
                    "touch", name=mounted.name, uuid=mounted.uuid, segments=segments, hits=hits
                )
            except KSpeedError as e:
                log.debug("could not report reads of %s: %s", mounted.name, e)


def register_source(
    settings: Settings, source: str, endpoint: str = "", name: str | None = None
) -> str:
    """Make (or find) the read-through dataset of a source on the node; returns its name."""
    from .admin import connect

    source = normalize_source(source)
    name = validate_name(name) if name else validate_name(name_from_source(source))
    with connect(settings) as client:
        reply = client.request("register_source", name=name, source=source, endpoint=endpoint)
        while reply.get("state") != "ready":
            if reply.get("state") == "failed":
                raise DataError(f"listing {source} failed: {reply.get('error', '')}")
            time.sleep(0.1)
            reply = client.request("progress", name=name)
    return name


def cache_table(nodes: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs status`: every dataset's cache state on every node that is up."""
    rows: list[tuple[str, ...]] = [
        (
            "NODE",
            "DATASET",
            "LIFETIME",
            "RESIDENT",
            "IN MEMORY",
            "ON SPILL",
            "HITS",
            "MISSES",
            "EVICTIONS",
            "SOURCE READS",
            "STATE",
        ),
    ]
    for s in nodes:
        cache = s.get("cache") if s.get("up") else None
        if not cache:
            continue
        for name, d in sorted(cache["datasets"].items()):
            pinned = d["lifetime"] != READTHROUGH
            pct = 100.0 * d["in_memory"] / d["segments"] if d["segments"] else 100.0
            state = f"stale: {d['stale']} files changed" if d["stale"] else "current"
            rows.append(
                (
                    s["node"],
                    name,
                    d["lifetime"] + (" (pinned)" if pinned else ""),
                    f"{pct:.0f}%",
                    format_size(d["memory_bytes"]),
                    "-" if pinned else format_size(d["spill_bytes"]),
                    "-" if pinned else str(d["hits"]),
                    "-" if pinned else str(d["misses"]),
                    "-" if pinned else str(d["evictions"]),
                    "-" if pinned else str(d["source_reads"]),
                    state,
                )
            )
    return rows if len(rows) > 1 else []


def spill_lines(nodes: list[dict[str, Any]]) -> list[str]:
    out = []
    for s in nodes:
        spill = (s.get("cache") or {}).get("spill") if s.get("up") else None
        if spill:
            out.append(
                f"spill of {s['node']}: {format_size(spill['used'])} / "
                f"{format_size(spill['budget'])} in {spill['dir']}"
            )
    return out
