"""The cluster read path: local segments from shared memory, the rest from their owners.

Any process computes placement itself (no metadata server). A read tries, in order: the local
node's mapped segment, then each owner of the segment (best first) over its transport, then
the source file; only then it fails. A node that does not answer is marked down for a while.
Bytes from the source are checked against the manifest's checksum when a whole file is read.
"""

from __future__ import annotations

import base64
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import xxhash

from . import placement
from .client import NodeClient
from .config import Settings
from .errors import DataError, KSpeedError, NodeUnreachable, NotFound
from .localdata import LocalDataset
from .manifest import Manifest
from .rtclient import open_local, read_source, read_through
from .sources import is_url
from .transport import Range, Transport, open_transport
from .units import parse_address

log = logging.getLogger(__name__)

DOWN_FOR_S = 10.0


@dataclass
class DatasetHandle:
    """What a reader needs to read one dataset: its manifest and where its segments are."""

    name: str
    uuid: str
    source: str
    members: list[str]
    replicas: int
    manifest: Manifest
    local: LocalDataset | None = None
    _owners: dict[int, list[str]] = field(default_factory=dict)

    def owners(self, seg: int) -> list[str]:
        found = self._owners.get(seg)
        if found is None:
            found = self._owners[seg] = placement.owners(
                self.name, seg, self.members, self.replicas
            )
        return found

    def local_holds(self, seg: int) -> bool:
        return self.local is not None and self.local.holds(seg)


class ClusterReader:
    """Thread-safe: FUSE worker threads and DataLoader workers (one per process) share one."""

    def __init__(self, settings: Settings, local_node: str | None = None):
        self.settings = settings
        self.nodes = [str(a) for a in settings.nodes]
        self.local_node = local_node
        self.stats: Counter[str] = Counter()
        self._down_until: dict[str, float] = {}
        self._idle: dict[str, list[Transport]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    # Node health and connections.

    def is_down(self, node: str) -> bool:
        return self._down_until.get(node, 0.0) > time.monotonic()

    def mark_down(self, node: str, reason: str) -> None:
        if not self.is_down(node):
            log.warning("node %s marked down for %.0fs: %s", node, DOWN_FOR_S, reason)
        self._down_until[node] = time.monotonic() + DOWN_FOR_S

    def _check_fork(self) -> None:
        # Connections must not be shared across fork: a child starts with none.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._idle = {}
            self._lock = threading.Lock()

    def _acquire(self, node: str) -> Transport:
        self._check_fork()
        with self._lock:
            pool = self._idle.get(node)
            if pool:
                return pool.pop()
        return open_transport(parse_address(node), self.settings)

    def _release(self, node: str, transport: Transport) -> None:
        with self._lock:
            self._idle.setdefault(node, []).append(transport)

    def request(self, node: str, op: str, **args: Any) -> dict[str, Any]:
        with NodeClient(parse_address(node), self.settings.token_file, self.settings.timeout) as c:
            return c.request(op, **args)

    def live_request(self, op: str, **args: Any) -> tuple[str, dict[str, Any]]:
        """Ask the first node that answers (the local one first)."""
        order = sorted(self.nodes, key=lambda n: (n != self.local_node, self.is_down(n)))
        last: KSpeedError | None = None
        for node in order:
            try:
                return node, self.request(node, op, **args)
            except NodeUnreachable as e:
                self.mark_down(node, str(e))
                last = e
        raise last or NodeUnreachable("no nodes configured")

    # Datasets.

    def list_datasets(self) -> dict[str, dict[str, Any]]:
        """Ready datasets by name, from the first node that answers."""
        _node, listing = self.live_request("list")
        return {d["name"]: d for d in listing["datasets"] if d.get("state") == "ready"}

    def open_dataset(self, name: str, info: dict[str, Any] | None = None) -> DatasetHandle:
        if info is None:
            info = self.list_datasets().get(name)
            if info is None:
                raise NotFound(f"no dataset named {name!r} in the cache")
        local = self._open_local(info)
        manifest = local.manifest if local else self._fetch_manifest(name, info["uuid"])
        members = list(manifest.header.get("members") or info.get("members") or self.nodes)
        return DatasetHandle(
            name=name,
            uuid=info["uuid"],
            source=str(info.get("source", "")),
            members=members,
            replicas=int(manifest.header.get("replicas", info.get("replicas", 1))),
            manifest=manifest,
            local=local,
        )

    def _open_local(self, info: dict[str, Any]) -> LocalDataset | None:
        """The local node's copy, when this process can map it."""
        if self.local_node is None:
            return None
        try:
            _node, listing = self.local_node, self.request(self.local_node, "list")
        except NodeUnreachable:
            listing = {"datasets": [info]}  # the node is down; its shm folder may still be here
        for d in listing["datasets"]:
            if d["name"] == info["name"] and d.get("uuid") == info["uuid"] and d.get("path"):
                try:
                    local = open_local(d["path"])
                except KSpeedError:
                    return None
                return local if local.uuid == info["uuid"] else None
        return None

    def _fetch_manifest(self, name: str, uuid: str) -> Manifest:
        node, reply = self.live_request("manifest", name=name)
        fd, path = tempfile.mkstemp(prefix=f"kspeedfs-{name}-", suffix=".ksm")
        with os.fdopen(fd, "wb") as f:
            while True:
                if reply["uuid"] != uuid:
                    os.unlink(path)
                    raise DataError(f"dataset {name} changed while opening it")
                data = base64.b64decode(reply["data"])
                f.write(data)
                if not data or reply["offset"] + len(data) >= reply["total"]:
                    break
                reply = self.request(
                    node, "manifest", name=name, offset=reply["offset"] + len(data)
                )
        try:
            return Manifest(path)
        finally:
            os.unlink(path)  # the mapping keeps it alive; nothing to clean up later

    # Reads.

    def read(self, ds: DatasetHandle, i: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of file i, from wherever they can be had."""
        if ds.manifest.header.get("readthrough"):
            return read_through(self, ds, i, offset, length)
        pieces = ds.manifest.ranges(i, offset, length)
        if ds.local is not None and all(ds.local.holds(p[0]) for p in pieces):
            self.stats["local"] += 1
            return ds.local.read(i, offset, length)
        out = bytearray(sum(p[2] for p in pieces))
        view = memoryview(out)
        pos = 0
        try:
            for seg, off, n in pieces:
                self._read_range(ds, seg, off, view[pos : pos + n])
                pos += n
        except DataError as e:
            log.warning("%s: %s; trying the source", ds.name, e)
            return self._read_source(ds, i, offset, length)
        return bytes(out)

    def _read_range(self, ds: DatasetHandle, seg: int, off: int, out: memoryview) -> None:
        if ds.local_holds(seg):
            assert ds.local is not None
            out[:] = ds.local.view(seg, off, len(out))
            self.stats["local"] += 1
            return
        errors = []
        for node in ds.owners(seg):
            if node == self.local_node or self.is_down(node):
                continue
            try:
                self.read_ranges(node, ds.name, [(seg, off, len(out))], out)
                self.stats["remote"] += 1
                return
            except KSpeedError as e:
                errors.append(f"{node}: {e}")
        raise DataError(f"no live copy of segment {seg} ({'; '.join(errors) or 'owners down'})")

    def read_ranges(self, node: str, dataset: str, ranges: list[Range], out: memoryview) -> None:
        """One vectored read from one node; marks the node down when it does not answer."""
        transport = self._acquire(node)
        try:
            transport.read_into(dataset, ranges, out)
        except NodeUnreachable as e:
            transport.close()
            self.mark_down(node, str(e))
            raise
        except BaseException:
            transport.close()
            raise
        self._release(node, transport)

    def _read_source(self, ds: DatasetHandle, i: int, offset: int, length: int) -> bytes:
        if not ds.source:
            raise DataError(f"{ds.name}: no copy reachable and no source recorded")
        if is_url(ds.source):
            self.stats["source"] += 1
            return read_source(ds, i, offset, length)
        path = os.fsencode(ds.source) + b"/" + ds.manifest.path(i)
        size = int(ds.manifest.size[i])
        try:
            with open(path, "rb", buffering=0) as f:
                if offset == 0 and length >= size:
                    data = f.read(size + 1)
                    if len(data) != size or xxhash.xxh3_64_intdigest(data) != int(
                        ds.manifest.checksum[i]
                    ):
                        raise DataError(f"source file changed since preload: {os.fsdecode(path)}")
                    self.stats["source"] += 1
                    return data
                f.seek(offset)
                self.stats["source"] += 1
                return f.read(min(length, max(size - offset, 0)))
        except OSError as e:
            raise DataError(
                f"no copy reachable and the source cannot be read: {os.fsdecode(path)}: {e.strerror}"
            ) from None

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
