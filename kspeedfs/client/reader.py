"""The one read policy, used by the FUSE mount and the fast path alike.

Any process computes placement itself (no metadata server). A read tries, in order: the local
node's mapped segment, then each owner of the segment (best first) over its transport, one
vectored request per node, then the source file; only then it fails. Every read names the
dataset instance it opened: a node holding another instance answers StaleDataset, a local map
of an unloaded instance cannot be opened, and the source serves only while its file is still
the one the manifest lists. So a reader gets its instance's bytes, verified source bytes, or an
error, never another version's bytes.

Network weather (docs/cluster.md#failures): a node's read that has not begun to answer within
a short delay (the time about 3% of the node's answers take to begin, at least HEDGE_MIN_S) is
sent to the segments' other owners too, and the first complete answer wins (the other is read
in the background and dropped, its connection kept). A node later than HEDGE_FLOOR_S, or whose
raced answer never comes, is suspect, for every reader of the machine (client/health.py),
and probed in the background until it answers again. A suspect node is tried after the others; a down one (refused, or silent for a whole
read) not at all, until a probe finds it again. Every read has one deadline, `timeout`
seconds for all its node requests together (connecting has its own CONNECT_TIMEOUT); what is
not answered by then comes from the source, or fails with one clear error.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeGuard

import xxhash

from kspeedfs.client import latency, passed
from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.health import NodeHealth
from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Request
from kspeedfs.format.contract.node import (
    DatasetEntry,
    DatasetListing,
    List,
    ManifestPiece,
    ManifestReq,
    Ping,
)
from kspeedfs.format.contract.pieces import BlobPiece, fetch_all
from kspeedfs.format.contract.readthrough import Filled, FillSegment
from kspeedfs.format.contract.scrub import ReportDamage
from kspeedfs.format.discovery import NodeWatch
from kspeedfs.format.errors import (
    DataError,
    InvalidArgument,
    KSpeedError,
    NodeUnreachable,
    NotFound,
    StaleDataset,
)
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient
from kspeedfs.net.transport import CONNECT_TIMEOUT, HedgeableTransport, Range, Transport
from kspeedfs.sources.source import open_source
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.system.readthrough_view import ReadThroughDataset, open_local

log = logging.getLogger(__name__)

DOWN_FOR_S = 10.0  # a node that refused or stayed silent is skipped this long, or until a
# probe finds it answering again
SUSPECT_FOR_S = 10.0  # a node late to answer is tried after the others this long, or until
# a probe finds it answering
# How long a read waits for a node's first byte before it asks another owner too: the time
# that about 3% of the node's answers exceed (NodeHealth.late_after, from every reader of the
# machine), at least HEDGE_MIN_S; HEDGE_FLOOR_S while the node's latency is not known yet.
HEDGE_FLOOR_S = 0.03
HEDGE_MIN_S = 0.002
HEDGE_CEILING_S = 1.0  # and the most
# A late read that no other owner could take (all down, or none holds it) tries again this
# often while it waits: an owner may be back (a probe trusts it) before the read's deadline.
REHEDGE_EVERY_S = 0.25
HEDGE_BYTES_PER_S = 500e6  # a large read is given its transfer time at this rate on top
PROBE_EVERY_S = 0.5  # a suspect or down node is pinged this often (once per machine)
# An answer that has begun but stops arriving for this long fails (the node is cut off
# mid-answer) and its ranges go to another owner; one lost packet's retransmission (TCP's
# 200 ms at least) stays under it, two in a row (1 in 10,000 at 1% loss) do not.
RECEIVE_STALL_S = 0.5
# The losing answer of a hedged read is read and dropped in the background (its connection
# kept) when it is at most this large, and at most this many at once.
DRAIN_MAX_BYTES = 4 * 1024 * 1024
DRAIN_MAX = 8
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


class _Hedge(NamedTuple):
    """A hedge in flight: the ranges (by index in the whole request) sent to another owner."""

    node: str
    transport: HedgeableTransport
    rid: int
    picks: list[int]
    buf: bytearray


def _stall_limit(deadline: float) -> float:
    """The socket timeout while receiving: RECEIVE_STALL_S without a byte, within the read's
    deadline."""
    return min(RECEIVE_STALL_S, deadline - time.monotonic())


def _hedgeable(transport: Transport) -> TypeGuard[HedgeableTransport]:
    return hasattr(transport, "send_read") and hasattr(transport, "wait_readable")


class ClusterReader:
    """Thread-safe: FUSE worker threads and DataLoader workers (one per process) share one."""

    def __init__(
        self,
        settings: Settings,
        local_node: str | None = None,
        health: NodeHealth | None = None,
    ):
        """`health`: the table of node health shared with the machine's other readers (by
        default the user's own in /dev/shm)."""
        self.settings = settings
        self._node_watch = NodeWatch(settings.nodes, settings.dns_refresh)  # dns: followed
        self.local_node = local_node
        self.stats: Counter[str] = Counter()
        self.health = health if health is not None else NodeHealth(settings.health_table)
        self._idle: dict[str, list[Transport]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._probing: set[str] = set()
        self._draining = 0  # losing answers of hedged reads being read (ClusterReader._drain)
        # Read-through segments a remote owner said it holds: read there with no fill request.
        self._filled: dict[tuple[str, int], str] = {}

    @property
    def nodes(self) -> list[str]:
        """The nodes to ask: settings.nodes (dns: entries as looked up last, kspeedfs.format.
        discovery)."""
        return [str(a) for a in self._node_watch.current()]

    # Node health and connections.

    def is_down(self, node: str) -> bool:
        down = self.health.is_down(node)
        if down and node not in self._probing:
            self._probe(node)  # the mark may be another process's, whose prober is gone
        return down

    def is_suspect(self, node: str) -> bool:
        suspect = self.health.is_suspect(node)
        if suspect and node not in self._probing:
            self._probe(node)
        return suspect

    def mark_down(self, node: str, reason: str) -> None:
        if not self.is_down(node):
            log.warning("node %s marked down (probed every %.1fs): %s", node, PROBE_EVERY_S, reason)
        self.health.down_for(node, DOWN_FOR_S)
        # Its other kept connections are as dead as the one that failed (a restarted node
        # closed them all): the next read after the probe connects afresh.
        self._check_fork()
        with self._lock:
            stale = self._idle.pop(node, [])
        for transport in stale:
            transport.close()
        self._probe(node)

    def suspect(self, node: str, reason: str) -> None:
        if not self.is_suspect(node):
            log.info("node %s suspect (probed every %.1fs): %s", node, PROBE_EVERY_S, reason)
        self.health.suspect_for(node, SUSPECT_FOR_S)
        self._probe(node)

    def _probe(self, node: str) -> None:
        """Ping `node` in the background until it answers, then trust it again."""
        self._check_fork()
        with self._lock:
            if node in self._probing:
                return
            self._probing.add(node)
        threading.Thread(
            target=self._probe_loop, args=(node,), name=f"probe-{node}", daemon=True
        ).start()

    def _probe_loop(self, node: str) -> None:
        try:
            while self.is_suspect(node) or self.is_down(node):
                if self.health.claim_probe(node, PROBE_EVERY_S):
                    try:
                        with self._connect(node, min(self.settings.timeout, 1.0)) as c:
                            c.call(Ping())
                    except KSpeedError:
                        # Silent to a ping too: down, tried after every suspect owner.
                        self.health.down_for(node, DOWN_FOR_S)
                    else:
                        self.health.trust(node)
                        log.info("node %s answers again", node)
                        return
                time.sleep(PROBE_EVERY_S)
        finally:
            with self._lock:
                self._probing.discard(node)

    def _rank(self, node: str, placed: bool = True) -> tuple[bool, bool, bool, float]:
        """Owners are tried healthy first (in placement order), then suspect ones (the
        fastest first), then down ones; among the nodes not down, the segment's placed owners
        before the candidates where a healing cluster would re-make a lost owner's copies
        (which hold it only once that has happened)."""
        suspect = self.is_suspect(node)
        expected = self.health.expected(node) if suspect else 0.0
        return self.is_down(node), not placed, suspect, expected

    def hedge_delay(self, node: str, nbytes: int) -> float:
        """How long a read of `nbytes` from `node` is waited for before another owner is
        asked too."""
        late = self.health.late_after(node)
        wait = max(HEDGE_MIN_S, late) if late > 0 else HEDGE_FLOOR_S
        return min(HEDGE_CEILING_S, wait + nbytes / HEDGE_BYTES_PER_S)

    def _check_fork(self) -> None:
        # Connections must not be shared across fork: a child starts with none.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._idle = {}
            self._lock = threading.Lock()
            self._probing = set()  # the parent's probe threads did not come along
            self._draining = 0

    def _acquire(self, node: str) -> tuple[bool, Transport]:
        """A connection to `node`: (True, one from the pool) or (False, a new one)."""
        self._check_fork()
        with self._lock:
            pool = self._idle.get(node)
            if pool:
                return True, pool.pop()
        return False, open_transport(parse_address(node), self.settings)

    def _release(self, node: str, transport: Transport) -> None:
        with self._lock:
            self._idle.setdefault(node, []).append(transport)

    def call(
        self, node: str, request: Request, answer_within: float | None = None
    ) -> dict[str, Any]:
        """A typed request (kspeedfs.format.contract) to `node` and its answer."""
        with self._connect(node) as c:
            return c.call(request, answer_within=answer_within)

    def _connect(self, node: str, timeout: float | None = None) -> NodeClient:
        settings = self.settings
        return NodeClient(
            parse_address(node),
            settings.credential(),
            settings.timeout if timeout is None else timeout,
            client_context(settings),
            connect_timeout=CONNECT_TIMEOUT,
        )

    def live_call(
        self, request: Request, answer_within: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A typed request to the first node that answers (the local one first)."""
        return self._first_live(lambda node: self.call(node, request, answer_within))

    def _first_live(self, ask: Callable[[str], dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        order = sorted(
            self.nodes, key=lambda n: (n != self.local_node, self.is_down(n), self.is_suspect(n))
        )
        last: KSpeedError | None = None
        for node in order:
            try:
                return node, ask(node)
            except NodeUnreachable as e:
                self.mark_down(node, str(e))
                last = e
        raise last or NodeUnreachable("no nodes configured")

    # Datasets.

    def list_datasets(self) -> dict[str, DatasetEntry]:
        """Ready datasets by name, from the first node that answers."""
        _node, listing = self.live_call(List())
        return DatasetListing.from_wire(listing).ready()

    def open_dataset(self, name: str, info: DatasetEntry | None = None) -> DatasetHandle:
        if info is None:
            info = self.list_datasets().get(name)
            if info is None:
                raise NotFound(f"no dataset named {name!r} in the cache")
        local = self._open_local(info)
        manifest = local.manifest if local else self._fetch_manifest(name, info.uuid)
        # The catalog's current placement (etcd: after a heal or a rebalance) before the one the
        # instance was loaded over.
        members = list(info.placed or manifest.header.get("members") or info.members or self.nodes)
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
            listed = DatasetListing.from_wire(self.call(self.local_node, List())).ready()
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
            self.call(self.local_node, ReportDamage(name=name, uuid=uuid, segments=segments))

    def _fetch_manifest(self, name: str, uuid: str) -> Manifest:
        """The manifest of instance `uuid`, in pieces from the first node that answers (a node
        that holds another instance refuses with StaleDataset)."""
        node, reply = self.live_call(ManifestReq(name=name, uuid=uuid))

        def ask(offset: int) -> BlobPiece:
            nonlocal reply
            if offset:
                reply = self.call(node, ManifestReq(name=name, uuid=uuid, offset=offset))
            return ManifestPiece.from_wire(reply).piece

        fd, path = tempfile.mkstemp(prefix=f"kspeedfs-{name}-", suffix=".ksm")
        try:
            with os.fdopen(fd, "wb") as f:
                fetch_all(ask, f.write)
            return Manifest(path)
        finally:
            os.unlink(path)  # the mapping keeps it alive; nothing to clean up later

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
                data = local.read(i, offset, n)
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
        manifest = ds.manifest
        by_node: dict[str, list[Piece]] = {}
        from_source: list[Piece] = []
        remote_entries: set[int] = set()
        pos = 0
        for entry, offset, length in requests:
            file_off = offset
            for seg, off, n in manifest.ranges(entry, offset, length):
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
            return  # all copied here (the common case)
        failed: set[str] = set()  # nodes that could not be heard
        lacking: set[tuple[str, int]] = set()  # (node, segment) a node said it does not serve
        deadline = time.monotonic() + self.settings.timeout  # every node request together
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
                    refused = isinstance(e, DataError)  # it answered: only these segments
                    if not refused:
                        failed.add(node)
                    for p in pieces:
                        self._filled.pop((ds.uuid, p.seg), None)  # evicted there, maybe
                        if refused:
                            lacking.add((node, p.seg))
                        tried = failed | {n for n, s in lacking if s == p.seg}
                        nxt = self._next_owner(ds, p.seg, tried, p.n)
                        (retry.setdefault(nxt, []) if nxt else from_source).append(p)
            by_node = retry
        for p in from_source:
            out[p.pos : p.pos + p.n] = self._read_source(ds, p.entry, p.file_off, p.n)
        if remote_entries:
            self._verify_whole_files(ds, requests, remote_entries, out)

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
                if not self.is_down(owner):
                    return None  # it answered but cannot fill: the source, now
                tried.add(owner)
            return None
        owners = ds.owners(seg)
        placed = set(owners[: ds.replicas])
        usable = [n for n in owners if n != self.local_node and n not in failed]
        # A suspect owner after the others (it missed a hedge delay, and is being probed), a
        # down one last (a mark may be older than its return; the read's deadline holds).
        usable.sort(key=lambda n: self._rank(n, n in placed))
        return usable[0] if usable else None

    def _fill_owner(self, ds: DatasetHandle, seg: int, failed: set[str]) -> str | None:
        """Where a read-through segment is filled: the first of its owners by placement over
        the members (one node: that node) that is up and not in `failed`."""
        owners = ds.owners(seg) if ds.members else [self.local_node] if self.local_node else []
        return next((o for o in owners if o not in failed and not self.is_down(o)), None)

    def _fill(self, ds: DatasetHandle, owner: str, seg: int, nbytes: int = 0) -> bool:
        """Ask `owner` to cache a read-through segment; False: read the source now (`nbytes`
        of it, which the owner counts when it does not keep the segment)."""
        if self._filled.get((ds.uuid, seg)) == owner:
            return True
        request = FillSegment(name=ds.name, uuid=ds.uuid, segment=seg, length=nbytes)
        try:
            filled = Filled.from_wire(self.call(owner, request))
        except NodeUnreachable as e:
            self.mark_down(owner, str(e))
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
        merged: list[list[int]] = []  # [out pos, seg, off, n]
        for p in sorted(pieces, key=lambda p: p.pos):
            last = merged[-1] if merged else None
            if (
                last
                and last[1] == p.seg
                and last[2] + last[3] == p.off
                and last[0] + last[3] == p.pos
            ):
                last[3] += p.n
            else:
                merged.append([p.pos, p.seg, p.off, p.n])
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
            chunk = merged[start:end]
            ranges = [(seg, off, n) for _pos, seg, off, n in chunk]
            first = chunk[0][0]
            if chunk[-1][0] + chunk[-1][3] - first == total:
                # Back to back in `out`: received straight into it.
                self._read_hedged(ds, node, ranges, out[first : first + total], deadline)
            else:
                tmp = memoryview(bytearray(total))
                self._read_hedged(ds, node, ranges, tmp, deadline)
                at = 0
                for opos, _seg, _off, n in chunk:
                    out[opos : opos + n] = tmp[at : at + n]
                    at += n
            self._verify_whole_segments(ds, node, chunk, out)
            start = end

    def read_ranges(
        self,
        node: str,
        dataset: str,
        instance: str,
        ranges: list[Range],
        out: memoryview,
        deadline: float | None = None,
    ) -> None:
        """One vectored read from one node, within `deadline` (time.monotonic(); default
        `timeout` from now). A node that fails or stays silent is marked down at once: no
        second try on a fresh connection (a pooled one the node closed when it restarted
        fails at once, and the probe finds the node again within PROBE_EVERY_S)."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout
        pooled, transport = self._acquire(node)
        try:
            if hasattr(transport, "set_timeout"):
                transport.set_timeout(_stall_limit(deadline))
            transport.read_into(dataset, instance, ranges, out)
        except NodeUnreachable as e:
            transport.close()
            self.mark_down(node, str(e))
            raise
        except BaseException:
            transport.close()
            raise
        self._release(node, transport)
        self.health.trust(node)

    def _open(self, node: str) -> Transport:
        """A connection to `node` (pooled, else new, with CONNECT_TIMEOUT); a node that cannot
        be reached is marked down."""
        try:
            return self._acquire(node)[1]
        except NodeUnreachable as e:
            self.mark_down(node, str(e))
            raise

    def _read_hedged(
        self,
        ds: DatasetHandle,
        node: str,
        ranges: list[Range],
        out: memoryview,
        deadline: float | None,
    ) -> None:
        """The ranges from `node`; if it has not begun to answer within its hedge delay, from
        the segments' other owners too, the first complete answer winning. The loser's
        connection is closed (its answer is never read), so nothing writes into `out` after
        this returns."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout
        nbytes = sum(r[2] for r in ranges)
        started = time.monotonic()
        for attempt in (1, 2):
            try:
                pooled, primary = self._acquire(node)
            except NodeUnreachable as e:
                self.mark_down(node, str(e))
                raise
            if not _hedgeable(primary) or ds.readthrough:
                self._release(node, primary)
                self.read_ranges(node, ds.name, ds.uuid, ranges, out, deadline)
                return
            try:
                rid = primary.send_read(ds.name, ds.uuid, ranges)
                delay = self.hedge_delay(node, nbytes)
                if primary.wait_readable(min(delay, deadline - started)):
                    self.health.first_byte(node, time.monotonic() - started)
                    primary.set_timeout(_stall_limit(deadline))
                    primary.receive_read(rid, out)
                    self._release(node, primary)
                    self.health.observe(node, time.monotonic() - started)
                    self.health.trust(node)
                    return
            except NodeUnreachable as e:
                primary.close()
                if pooled and attempt == 1 and time.monotonic() - started < HEDGE_FLOOR_S:
                    continue  # a kept connection the node closed (it restarted): no wait lost
                self.mark_down(node, str(e))
                raise
            except BaseException:
                primary.close()
                raise
            break
        # Late: suspect now, for every reader of the machine; ask the other owners too.
        self.health.missed(node, delay)
        if delay >= HEDGE_FLOOR_S:
            # A few ms late is weather (a lost packet, a busy machine), not a sign of this node:
            # suspicion reorders every reader's owners, so it waits for a real delay, or for
            # the drained answer to fail (_drain_one).
            self.suspect(node, f"no answer within {delay * 1000:.1f} ms")
        hedges = self._send_hedges(ds, node, ranges)
        assert _hedgeable(primary)
        self._race(ds, node, primary, rid, hedges, ranges, out, started, deadline)

    def _send_hedges(
        self,
        ds: DatasetHandle,
        node: str,
        ranges: list[Range],
        refused: frozenset[str] = frozenset(),
    ) -> list[_Hedge]:
        """The ranges sent to their next owners (never `node`, nor a node in `refused`: it
        said it does not hold one of them), one request per owner; [] when some range has no
        other owner that is not down (then only `node` can answer it: a hedge to a down node
        would only wait on its connect)."""
        by_owner: dict[str, list[int]] = {}
        for k, (seg, _off, _n) in enumerate(ranges):
            other = self._next_owner(ds, seg, {node, *refused})
            if other is None or self.is_down(other):
                return []
            by_owner.setdefault(other, []).append(k)
        hedges: list[_Hedge] = []
        for other, picks in by_owner.items():
            try:
                transport = self._open(other)
            except KSpeedError:
                for h in hedges:
                    h.transport.close()
                return []
            if not _hedgeable(transport):
                self._release(other, transport)
                for h in hedges:
                    h.transport.close()
                return []
            part = [ranges[k] for k in picks]
            try:
                rid = transport.send_read(ds.name, ds.uuid, part)
            except KSpeedError as e:
                transport.close()
                self.mark_down(other, str(e))
                for h in hedges:
                    h.transport.close()
                return []
            hedges.append(_Hedge(other, transport, rid, picks, bytearray(sum(r[2] for r in part))))
        self.stats["hedged"] += 1
        self.stats["hedged_bytes"] += sum(len(h.buf) for h in hedges)
        return hedges

    def _race(
        self,
        ds: DatasetHandle,
        node: str,
        primary: HedgeableTransport,
        rid: int,
        hedges: list[_Hedge],
        ranges: list[Range],
        out: memoryview,
        started: float,
        deadline: float,
    ) -> None:
        """Wait for `node`'s answer and the hedges' together, until `deadline`: the first
        complete answer (the primary's, or every hedge's) fills `out`; the rest are closed."""
        waiting: dict[int, _Hedge | None] = {primary.fileno(): None}
        waiting.update({h.transport.fileno(): h for h in hedges})
        done: list[_Hedge] = []
        refused: frozenset[str] = frozenset()
        primary_failed = False
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ready = [
                    fd
                    for fd, h in waiting.items()
                    if (primary if h is None else h.transport).wait_readable(0)
                ]
                if not ready:
                    poller = select.poll()
                    for fd in waiting:
                        poller.register(fd, select.POLLIN)
                    alone = not hedges and not primary_failed
                    wait = min(left, REHEDGE_EVERY_S) if alone else left
                    ready = [fd for fd, _ev in poller.poll(wait * 1000)]
                    if not ready and alone:
                        # No other owner could be asked (down, or refused): one may be back.
                        hedges = self._send_hedges(ds, node, ranges, refused)
                        waiting.update({h2.transport.fileno(): h2 for h2 in hedges})
                        continue
                for fd in ready:
                    h = waiting.pop(fd)
                    if h is None:
                        try:
                            primary.set_timeout(_stall_limit(deadline))
                            primary.receive_read(rid, out)
                        except KSpeedError as e:
                            primary_failed = True
                            primary.close()
                            self._answer_failed(node, e)
                            if not hedges or len(done) + len(waiting) < len(hedges):
                                raise
                            continue
                        self.stats["hedge_lost"] += 1
                        self._release(node, primary)
                        self.health.observe(node, time.monotonic() - started)
                        self.health.trust(node)
                        for h2 in done:
                            self._release(h2.node, h2.transport)
                        done = []
                        for late in waiting.values():  # still to answer: their answers dropped
                            assert late is not None
                            self._drain(late.node, late.transport, late.rid, len(late.buf))
                        waiting.clear()
                        return
                    try:
                        h.transport.set_timeout(_stall_limit(deadline))
                        h.transport.receive_read(h.rid, memoryview(h.buf))
                    except KSpeedError as e:
                        h.transport.close()
                        self._answer_failed(h.node, e)
                        if primary_failed:
                            raise
                        # The hedges start again without it (a node that said it does not
                        # hold a range: a placement candidate), or, with no one else, the
                        # read waits for `node` alone.
                        for h2 in done:
                            self._release(h2.node, h2.transport)
                        done = []
                        for fd2, pending in list(waiting.items()):
                            if pending is not None:
                                del waiting[fd2]
                                pending.transport.close()
                        if isinstance(e, DataError):
                            refused = refused | {h.node}
                            hedges = self._send_hedges(ds, node, ranges, refused)
                        else:
                            hedges = []
                        waiting.update({h2.transport.fileno(): h2 for h2 in hedges})
                        continue
                    done.append(h)
                    if hedges and len(done) == len(hedges):
                        self._scatter(ranges, done, out)
                        self.stats["hedge_won"] += 1
                        # What `node` took at least: it ranks after faster suspects.
                        self.health.observe(node, time.monotonic() - started)
                        for h2 in done:
                            self._release(h2.node, h2.transport)
                        done = []
                        if not primary_failed:
                            del waiting[primary.fileno()]
                            self._drain(node, primary, rid, len(out))
                        return
            self.mark_down(node, f"no answer within the read's {self.settings.timeout:.1f}s")
            raise NodeUnreachable(f"node {node} did not answer within {self.settings.timeout}s")
        finally:
            for h in waiting.values():
                (primary if h is None else h.transport).close()
            for h in done:
                h.transport.close()

    def _answer_failed(self, node: str, e: KSpeedError) -> None:
        """A read's answer from `node` failed: down when the node could not be heard (the
        connection, a stall, a bad frame); a refusal it answered (a segment it does not hold,
        as a placement candidate of a healing cluster may not yet) says it is up."""
        if isinstance(e, DataError):
            log.info("node %s could not serve a read: %s", node, e)
        else:
            self.mark_down(node, str(e))

    def _drain(self, node: str, transport: HedgeableTransport, rid: int, nbytes: int) -> None:
        """The losing answer of a hedged read, read in the background and dropped, and its
        connection kept: closing it would cost the next read of that node a new connection
        (a handshake, and on a lossy link a lost SYN's connect limit). A large answer, or too
        many at once, is not waited for: its connection is closed."""
        with self._lock:
            busy = nbytes > DRAIN_MAX_BYTES or self._draining >= DRAIN_MAX
            if not busy:
                self._draining += 1
        if busy:
            transport.close()
            return
        threading.Thread(
            target=self._drain_one,
            args=(node, transport, rid, nbytes),
            name=f"drain-{node}",
            daemon=True,
        ).start()

    def _drain_one(self, node: str, transport: HedgeableTransport, rid: int, nbytes: int) -> None:
        try:
            transport.set_timeout(RECEIVE_STALL_S)
            transport.receive_read(rid, memoryview(bytearray(nbytes)))
        except Exception as e:  # whatever the answer was, the connection is not reused
            transport.close()
            if not isinstance(e, DataError):
                self.suspect(node, f"the answer a hedge raced never came: {e}")
        else:
            self._release(node, transport)
            self.stats["drained"] += 1
        finally:
            with self._lock:
                self._draining -= 1

    @staticmethod
    def _scatter(ranges: list[Range], done: list[_Hedge], out: memoryview) -> None:
        """The hedges' answers into `out`, each range where it lies in the whole request."""
        starts = []
        pos = 0
        for _seg, _off, n in ranges:
            starts.append(pos)
            pos += n
        for h in done:
            at = 0
            for k in h.picks:
                n = ranges[k][2]
                out[starts[k] : starts[k] + n] = h.buf[at : at + n]
                at += n

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
        with self._lock:
            for pool in self._idle.values():
                for t in pool:
                    t.close()
            self._idle = {}


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
