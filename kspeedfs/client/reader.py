"""The one read policy, used by the FUSE mount and the fast path alike.

Any process computes placement itself (no metadata server). A read tries, in order: the local
node's mapped segment, then each owner of the segment (best first) over its transport, one
vectored request per node, then the source file; only then it fails. Every read names the
dataset instance it opened: a node holding another instance answers StaleDataset, a local map
of an unloaded instance cannot be opened, and the source serves only while its file is still
the one the manifest lists. So a reader gets its instance's bytes, verified source bytes, or an
error, never another version's bytes.

Network weather (docs/cluster.md#failures): the nodes, their health and connections are the
pool's (client/nodepool.py: down and suspect nodes, probes); a late node's read is hedged to the
segments' next owners (client/hedged.py), which this policy names. Every read has one deadline,
`timeout` seconds for all its node requests together (connecting has its own CONNECT_TIMEOUT);
what is not answered by then comes from the source, or fails with one clear error.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from kspeedfs.client import latency, passed, read_times
from kspeedfs.client.blobs import fetch_blob
from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.health import NodeHealth
from kspeedfs.client.hedged import HedgedRead
from kspeedfs.client.nodepool import NodePool
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import (
    DatasetEntry,
    List,
    ManifestReq,
)
from kspeedfs.format.contract.readthrough import FillSegment
from kspeedfs.format.contract.scrub import ReportDamage
from kspeedfs.format.errors import (
    DataError,
    InvalidArgument,
    KSpeedError,
    NodeUnreachable,
    NotFound,
    StaleDataset,
)
from kspeedfs.format.manifest import Manifest
from kspeedfs.sources.source import open_source
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.system.readthrough_view import ReadThroughDataset, open_local

log = logging.getLogger(__name__)

# One vectored read stays well under the protocol's frame and range limits.
MAX_READ_BYTES = 64 * 1024 * 1024
MAX_READ_RANGES = 4096


class Piece(NamedTuple):
    """Part of a read that lies in one segment."""

    pos: int  # where it goes in the output buffer
    seg: int
    off: int  # offset in the segment
    n: int
    entry: int
    file_off: int  # offset in the file, for a read from the source


@dataclass
class _Misses:
    """The nodes a read could not use: silent ones, and (node, segment) a node refused."""

    failed: set[str] = field(default_factory=set)
    lacking: set[tuple[str, int]] = field(default_factory=set)

    def tried(self, seg: int) -> set[str]:
        return self.failed | {n for n, s in self.lacking if s == seg}


def _merge(pieces: list[Piece]) -> list[list[int]]:
    """One node's pieces as [out pos, seg, off, n], merged where adjacent."""
    merged: list[list[int]] = []
    for p in sorted(pieces, key=lambda p: p.pos):
        last = merged[-1] if merged else None
        if last and last[1] == p.seg and last[2] + last[3] == p.off and last[0] + last[3] == p.pos:
            last[3] += p.n
        else:
            merged.append([p.pos, p.seg, p.off, p.n])
    return merged


def _chunks(merged: list[list[int]]) -> Iterator[tuple[list[list[int]], int]]:
    """Merged pieces in requests of at most MAX_READ_RANGES ranges and MAX_READ_BYTES, each
    with its length."""
    start = 0
    while start < len(merged):
        end, total = start, 0
        while (
            end < len(merged)
            and end - start < MAX_READ_RANGES
            and (total == 0 or total + merged[end][3] <= MAX_READ_BYTES)
        ):
            total += merged[end][3]
            end += 1
        yield merged[start:end], total
        start = end


class ClusterReader:
    """Thread-safe: FUSE worker threads and DataLoader workers (one per process) share one."""

    def __init__(
        self,
        settings: Settings,
        local_node: str | None = None,
        health: NodeHealth | None = None,
        pool: NodePool | None = None,
    ):
        """`health`: the table of node health shared with the machine's other readers (by
        default the user's own in /dev/shm); `pool`: the nodes' connections (by default a
        NodePool of `settings`)."""
        self.settings = settings
        self.local_node = local_node
        self.stats: Counter[str] = Counter()
        self.pool = pool if pool is not None else NodePool(settings, local_node, health)
        self.hedged = HedgedRead(self.pool, self._next_owner, self.stats)
        # Read-through segments a remote owner said it holds: read there with no fill request.
        self._filled: dict[tuple[str, int], str] = {}

    # Datasets.

    def list_datasets(self) -> dict[str, DatasetEntry]:
        """Ready datasets by name, from the first node that answers."""
        _node, listing = self.pool.live_call(List())
        return listing.ready()

    def open_dataset(self, name: str, info: DatasetEntry | None = None) -> DatasetHandle:
        if info is None:
            info = self.list_datasets().get(name)
            if info is None:
                raise NotFound(f"no dataset named {name!r} in the cache")
        local = self._open_local(info)
        manifest = local.manifest if local else self._fetch_manifest(name, info.uuid)
        # The catalog's current placement (etcd: after a heal or a rebalance) before the one the
        # instance was loaded over.
        members = list(
            info.placed or manifest.header.get("members") or info.members or self.pool.nodes
        )
        return DatasetHandle(
            name=name,
            uuid=info.uuid,
            source=info.source,
            members=members,
            replicas=int(manifest.header.get("replicas", info.replicas)),
            manifest=manifest,
            local=local,
            heals=info.placed is not None,
            lost=list(info.lost or []),
        )

    def _open_local(self, info: DatasetEntry) -> LocalDataset | None:
        """The local node's copy, when this process can map it."""
        if self.local_node is None:
            return None
        try:
            listed = self.pool.call(self.local_node, List()).ready()
        except NodeUnreachable:
            listed = {info.name: info}  # the node is down; its shm folder may still be here
        d = listed.get(info.name)
        if d is None or d.uuid != info.uuid or not d.path:
            return None
        try:
            report = functools.partial(self._report_damage, info.name, info.uuid)
            local = open_local(d.path, on_damage=report)
        except KSpeedError as e:
            # Not in the segments' group: the node passes the descriptors instead.
            try:
                local = passed.attach(self.settings, d.path, info.name, info.uuid, report)
            except KSpeedError as why:
                log.info("%s: no local map (%s; %s)", info.name, e, why)
                return None
        if local.uuid != info.uuid:
            return None
        return local

    def _report_damage(self, name: str, uuid: str, segments: list[int]) -> None:
        """Tell this machine's node that segments of its copy are damaged (a reader found
        them not the manifest's): it checks them, quarantines them and fetches them again."""
        if self.local_node is not None:
            self.pool.call(self.local_node, ReportDamage(name=name, uuid=uuid, segments=segments))

    def _fetch_manifest(self, name: str, uuid: str) -> Manifest:
        """The manifest of instance `uuid`, in pieces from the first node that answers (a node
        that holds another instance refuses with StaleDataset)."""
        return fetch_blob(
            self.pool,
            lambda offset: ManifestReq(name=name, uuid=uuid, offset=offset),
            f"kspeedfs-{name}-",
            ".ksm",
            Manifest,
        )

    # Reads: the one read policy.

    def read(self, ds: DatasetHandle, i: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of file i (clipped at its end), from wherever they can
        be had; never fewer bytes than that, never bytes of another instance or version."""
        n = max(0, min(length, int(ds.manifest.size[i]) - offset))
        if n == 0:
            return b""
        local = ds.local
        if local is not None and not ds.readthrough and local.holds_file(i):
            try:
                started = read_times.start()
                data = local.read(i, offset, n)
                read_times.done(started, "local")
                self.stats["local"] += 1
                self.stats["local_bytes"] += n
                return data
            except DataError as e:
                _note_unmappable(ds, e)
        out = bytearray(n)
        self.gather(ds, [(i, offset, n)], memoryview(out))
        return bytes(out)

    def gather(
        self, ds: DatasetHandle, requests: Sequence[tuple[int, int, int]], out: memoryview
    ) -> None:
        """Fill `out` with bytes [offset, offset+length) of each (entry, offset, length), back to
        back. The policy, in order: the local map; the segment's owners (best first), one
        vectored request per node; the source file, if it still matches the manifest; else
        StaleDataset or DataError. A whole file that came from another node is checked against
        the manifest's checksum."""
        started = read_times.start()
        by_node: dict[str, list[Piece]] = {}
        from_source: list[Piece] = []
        remote_entries: set[int] = set()
        pos = 0
        for entry, offset, length in requests:
            file_off = offset
            for seg, off, n in ds.manifest.ranges(entry, offset, length):
                piece = Piece(pos, seg, off, n, entry, file_off)
                pos += n
                file_off += n
                if self._copy_local(ds, piece, out):
                    continue
                node = self._next_owner(ds, seg, set(), n)
                if node is None:
                    from_source.append(piece)
                else:
                    by_node.setdefault(node, []).append(piece)
                    remote_entries.add(entry)
        if pos != len(out):
            raise InvalidArgument(f"a buffer of {len(out)} bytes for {pos} bytes of reads")
        if not by_node and not from_source:
            read_times.done(started, "local")
            return  # all copied here (the common case)
        if by_node:
            from_source += self._read_owners(ds, by_node, out)
        for p in from_source:
            out[p.pos : p.pos + p.n] = self._read_source(ds, p.entry, p.file_off, p.n)
        if remote_entries:
            self._verify_whole_files(ds, requests, remote_entries, out)
        read_times.done(started, "source" if from_source else "remote")

    def _read_owners(
        self, ds: DatasetHandle, by_node: dict[str, list[Piece]], out: memoryview
    ) -> list[Piece]:
        """Each node's pieces into `out`; a piece a node failed goes to its next owner, within
        one deadline for every node request together. What is left is for the source."""
        from_source: list[Piece] = []
        misses = _Misses()
        deadline = time.monotonic() + self.settings.timeout
        while by_node:
            retry: dict[str, list[Piece]] = {}
            for node, pieces in by_node.items():
                if time.monotonic() >= deadline:
                    self.stats["past_deadline"] += 1
                    from_source += pieces  # or one clear error, when there is no source
                    continue
                try:
                    started = time.perf_counter()
                    self._read_node(ds, node, pieces, out, deadline)
                    latency.observe(self.stats, latency.REMOTE_READ, time.perf_counter() - started)
                    self.stats["remote"] += 1
                    self.stats["remote_bytes"] += sum(p.n for p in pieces)
                except KSpeedError as e:
                    log.warning("%s: read from %s failed (%s); trying elsewhere", ds.name, node, e)
                    for nxt, p in self._reroute(ds, node, pieces, e, misses):
                        (retry.setdefault(nxt, []) if nxt else from_source).append(p)
            by_node = retry
        return from_source

    def _reroute(
        self, ds: DatasetHandle, node: str, pieces: list[Piece], e: KSpeedError, misses: _Misses
    ) -> Iterator[tuple[str | None, Piece]]:
        """The pieces `node` failed, each with its next owner (None: the source)."""
        refused = isinstance(e, DataError)  # it answered: only these segments
        if not refused:
            misses.failed.add(node)
        for p in pieces:
            self._filled.pop((ds.uuid, p.seg), None)  # evicted there, maybe
            if refused:
                misses.lacking.add((node, p.seg))
            yield self._next_owner(ds, p.seg, misses.tried(p.seg), p.n), p

    def _copy_local(self, ds: DatasetHandle, p: Piece, out: memoryview) -> bool:
        """Piece `p` copied out of this node's copy (a read-through segment filled here first
        when this node fills it); False: it is not here."""
        local = ds.local
        if local is None:
            return False
        held = local.holds(p.seg)
        if not held and not (
            ds.readthrough
            and self.local_node is not None
            and self._fill_owner(ds, p.seg, set()) == self.local_node
            and self._fill(ds, self.local_node, p.seg, p.n)
            and local.holds(p.seg)
        ):
            return False
        try:
            # pread on the disk tier, checked against the file's checksum (localdata)
            local.read_piece_into(p.entry, p.file_off, p.seg, p.off, out[p.pos : p.pos + p.n])
        except DataError as e:
            _note_unmappable(ds, e)
            return False
        if held:
            count_hit(local)  # (a segment filled for this read is the node's miss)
        self.stats["local"] += 1
        self.stats["local_bytes"] += p.n
        return True

    def _next_owner(
        self, ds: DatasetHandle, seg: int, failed: set[str], nbytes: int = 0
    ) -> str | None:
        """The best owner of a segment that is up and not tried yet (never this node: its copy
        is the local map)."""
        if ds.readthrough:
            # Filled on demand by the segment's owner (a down one's successor in rendezvous
            # order, where the catalog places it once that one is lost).
            tried = set(failed)
            while (owner := self._fill_owner(ds, seg, tried)) not in (None, self.local_node):
                assert owner is not None
                if self._fill(ds, owner, seg, nbytes):
                    return owner
                if not self.pool.is_down(owner):
                    return None  # it answered but cannot fill: the source, now
                tried.add(owner)
            return None
        owners = ds.owners(seg)
        placed = set(owners[: ds.replicas])
        usable = [n for n in owners if n != self.local_node and n not in failed]
        # A suspect owner after the others (it missed a hedge delay, and is being probed), a
        # down one last (a mark may be older than its return; the read's deadline holds).
        usable.sort(key=lambda n: self.pool.rank(n, n in placed))
        return usable[0] if usable else None

    def _fill_owner(self, ds: DatasetHandle, seg: int, failed: set[str]) -> str | None:
        """Where a read-through segment is filled: the first of its owners by placement over
        the members (one node: that node) that is up and not in `failed`."""
        owners = ds.owners(seg) if ds.members else [self.local_node] if self.local_node else []
        return next((o for o in owners if o not in failed and not self.pool.is_down(o)), None)

    def _fill(self, ds: DatasetHandle, owner: str, seg: int, nbytes: int = 0) -> bool:
        """Ask `owner` to cache a read-through segment; False: read the source now (`nbytes`
        of it, which the owner counts when it does not keep the segment)."""
        if self._filled.get((ds.uuid, seg)) == owner:
            return True
        request = FillSegment(name=ds.name, uuid=ds.uuid, segment=seg, length=nbytes)
        try:
            filled = self.pool.call(owner, request)
        except NodeUnreachable as e:
            self.pool.mark_down(owner, str(e))
            return False
        except KSpeedError as e:
            _degraded(ds, str(e))
            return False
        if filled.state == "source":
            self.stats["not_kept"] += 1  # the owner's policy keeps what it has: not degraded
            return False
        if filled.state != "cached":
            _degraded(ds, filled.error or f"segment {seg} is still being filled")
            return False
        if owner != self.local_node:  # a local one is seen in the map (and may leave it)
            self._filled[(ds.uuid, seg)] = owner
        return True

    def _read_node(
        self,
        ds: DatasetHandle,
        node: str,
        pieces: list[Piece],
        out: memoryview,
        deadline: float | None = None,
    ) -> None:
        """The pieces from one node: merged where adjacent, in requests of bounded size."""
        for chunk, total in _chunks(_merge(pieces)):
            ranges = [(seg, off, n) for _pos, seg, off, n in chunk]
            first = chunk[0][0]
            if chunk[-1][0] + chunk[-1][3] - first == total:
                # Back to back in `out`: received straight into it.
                self.hedged.read(ds, node, ranges, out[first : first + total], deadline)
            else:
                tmp = memoryview(bytearray(total))
                self.hedged.read(ds, node, ranges, tmp, deadline)
                at = 0
                for opos, _seg, _off, n in chunk:
                    out[opos : opos + n] = tmp[at : at + n]
                    at += n
            self._verify_whole_segments(ds, node, chunk, out)

    def _verify_whole_segments(
        self, ds: DatasetHandle, node: str, chunk: list[list[int]], out: memoryview
    ) -> None:
        """A whole segment from another node must hash to the manifest's segment checksum; a
        bad one is that node's failure (the caller reads it elsewhere)."""
        m = ds.manifest
        for pos, seg, off, n in chunk:
            expected = int(m.seg_checksum[seg])
            whole = off == 0 and n == int(m.seg_len[seg])
            if whole and expected and xxhash.xxh3_64_intdigest(out[pos : pos + n]) != expected:
                raise DataError(f"segment {seg} of {ds.name} from {node} fails its checksum")

    def _verify_whole_files(
        self,
        ds: DatasetHandle,
        requests: Sequence[tuple[int, int, int]],
        remote: set[int],
        out: memoryview,
    ) -> None:
        pos = 0
        for entry, offset, length in requests:
            size = int(ds.manifest.size[entry])
            checksum = int(ds.manifest.checksum[entry])
            if entry in remote and offset == 0 and length == size and checksum:
                got = out[pos : pos + size]
                if xxhash.xxh3_64_intdigest(got) != checksum:
                    log.error(
                        "%s: bytes of %s from another node fail their checksum",
                        ds.name,
                        os.fsdecode(ds.manifest.path(entry)),
                    )
                    got[:] = self._read_source(ds, entry, 0, size)
            pos += length

    def _read_source(self, ds: DatasetHandle, i: int, offset: int, length: int) -> bytes:
        """Bytes of file i from the source, only while the file is still the one the manifest
        lists (size and time; the checksum too for a whole file); else StaleDataset."""
        m = ds.manifest
        if not ds.source:
            raise StaleDataset(f"{ds.name}: no copy reachable and no source recorded")
        source = open_source(ds.source, str(m.header.get("endpoint") or ""))
        try:
            data = source.read_verified(m, i, offset, length, int(m.checksum[i]))
        except StaleDataset as e:
            raise StaleDataset(f"{ds.name}: no cached copy left, and {e}") from None
        self.stats["source"] += 1
        self.stats["source_bytes"] += len(data)
        return data

    def close(self) -> None:
        self.pool.close()


def local_node_for(settings: Settings) -> str | None:
    """This machine's node: the one we listen as, when it is in the node list."""
    me = str(settings.listen)
    return (
        me
        if me in [str(a) for a in settings.nodes]
        else (str(settings.nodes[0]) if len(settings.nodes) == 1 else None)
    )


def count_hit(local: LocalDataset | None) -> None:
    """A read served from this node's map of a read-through dataset: a hit the node learns of
    from the reader's next report (`touch`), since it cannot see reads of its memory."""
    if isinstance(local, ReadThroughDataset):
        local.hits += 1


DEGRADED_LOG_EVERY_S = 10.0
_last_logged: dict[tuple[str, str], float] = {}


def _log_every(ds: DatasetHandle, kind: str, message: str, *args: object) -> None:
    """A warning at most every DEGRADED_LOG_EVERY_S per dataset and kind: reads repeat."""
    now = time.monotonic()
    if now - _last_logged.get((ds.name, kind), -1e9) >= DEGRADED_LOG_EVERY_S:
        _last_logged[(ds.name, kind)] = now
        log.warning(message, *args)


def _degraded(ds: DatasetHandle, why: str) -> None:
    _log_every(ds, "degraded", "%s: reading from the source (degraded): %s", ds.name, why)


def _note_unmappable(ds: DatasetHandle, e: DataError) -> None:
    _log_every(ds, "unmappable", "%s: local copy gone (%s); reading elsewhere", ds.name, e)
