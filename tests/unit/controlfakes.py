"""In-memory stand-ins for what the control plane talks to, for unit tests on trio's MockClock:
etcd (its v3 JSON API behind etcd3gw's own client, so the real ClusterState runs over it), the
members' stores and the reads of segments from them, and a small local dataset with a real
manifest (heal's last resort, the source, is read for real).

Everything here runs on the event loop: `inline_threads` makes trio.to_thread.run_sync call its
function in place. A MockClock with autojump_threshold=0 jumps to the next deadline whenever
every task is blocked, a task waiting on a worker thread included, so with real threads virtual
time would pass at random points of an etcd call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import etcd3gw
import trio
import trio.testing
import xxhash
from etcd3gw import Etcd3Client
from etcd3gw import exceptions as etcd_errors

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import (
    DatasetEntry,
    DatasetListing,
    List,
    ManifestPiece,
    ManifestReq,
)
from kspeedfs.format.contract.pieces import from_base64, read_piece, to_base64
from kspeedfs.format.errors import NodeUnreachable, NotFound, StaleDataset
from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.node.peers import PeerPool
from kspeedfs.sources.scan import scan_tree
from kspeedfs.sources.source import LocalSource

ETCD_URL = "http://etcd.unit.test:2379"  # never dialled: MemoryEtcdClient answers in-process


async def _run_inline(fn: Callable[..., Any], *args: Any, **_options: Any) -> Any:
    await trio.lowlevel.checkpoint()
    return fn(*args)


def inline_threads(monkeypatch: Any) -> None:
    """trio.to_thread.run_sync calls its function on the event loop (see the module's doc)."""
    monkeypatch.setattr(trio.to_thread, "run_sync", _run_inline)


def run(main: Callable[[], Any]) -> Any:
    """`main` under a clock that jumps to the next deadline as soon as every task waits."""
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# etcd


@dataclasses.dataclass
class _Key:
    value: bytes
    create: int
    mod: int
    version: int
    lease: int


# A compare's target: the field of a key it reads, and the field of the compare it is held to.
_TARGETS = {
    "CREATE": ("create", "create_revision"),
    "MOD": ("mod", "mod_revision"),
    "VERSION": ("version", "version"),
}


@dataclasses.dataclass
class _Lease:
    ttl: int
    deadline: float


class MemoryEtcd:
    """The part of etcd's v3 JSON API that ClusterState uses (range, txn, deleterange, leases)
    over a dict: one revision per write, compares on create and mod revisions, and leases that
    expire on `clock` (their keys deleted) unless kept alive. `answering` False: every call
    fails as an unreachable etcd does."""

    def __init__(self, clock: Callable[[], float] = trio.current_time):
        self.clock = clock
        self.revision = 1
        self.keys: dict[bytes, _Key] = {}
        self.leases: dict[int, _Lease] = {}
        self._next_lease = 7000
        self.answering = True

    # What a test looks at.

    def value(self, key: str) -> Any:
        found = self.keys.get(key.encode())
        return None if found is None else json.loads(found.value or b"null")

    def put_raw(self, key: str, raw: bytes) -> None:
        """An unleased key holding `raw` as it is (JSON or not)."""
        self._write([{"request_put": {"key": to_base64(key.encode()), "value": to_base64(raw)}}])

    def entry(self, key: str) -> CatalogEntry:
        """The catalog entry at `key` (a datasets/ key), parsed as a node reads it."""
        return CatalogEntry.from_json(self.value(key))

    def has(self, key: str) -> bool:
        return key.encode() in self.keys

    def put(self, key: str, value: Any) -> None:
        """An unleased key, as a finished preload leaves its ready record."""
        self._write([{"request_put": {"key": to_base64(key.encode()), "value": _b64json(value)}}])

    # The API.

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self.answering:
            raise etcd_errors.ConnectionFailedError("etcd is away (the test stopped it)")
        self._expire()
        header = {"revision": str(self.revision)}
        if path == "lease/grant":
            self._next_lease += 1
            ttl = int(body["TTL"])
            self.leases[self._next_lease] = _Lease(ttl, self.clock() + ttl)
            return {"header": header, "ID": str(self._next_lease), "TTL": str(ttl)}
        if path == "lease/keepalive":
            lease = self.leases.get(int(body["ID"]))
            if lease is None:  # expired: etcd leaves TTL out
                return {"result": {"header": header, "ID": str(body["ID"])}}
            lease.deadline = self.clock() + lease.ttl
            return {"result": {"header": header, "ID": str(body["ID"]), "TTL": str(lease.ttl)}}
        if path == "kv/lease/revoke":
            self._drop_leases([int(body["ID"])])
            return {"header": {"revision": str(self.revision)}}
        if path == "kv/range":
            return self._range(body)
        if path == "kv/deleterange":
            deleted = self._write([{"request_delete_range": body}])
            return {"header": {"revision": str(self.revision)}, "deleted": str(deleted)}
        if path == "kv/txn":
            return self._txn(body)
        raise AssertionError(f"MemoryEtcd does not serve {path}")

    def _expire(self) -> None:
        now = self.clock()
        self._drop_leases([i for i, lease in self.leases.items() if lease.deadline <= now])

    def _drop_leases(self, ids: list[int]) -> None:
        for i in ids:
            self.leases.pop(i, None)
        doomed = [k for k, v in self.keys.items() if v.lease in ids]
        if doomed:
            self.revision += 1
            for k in doomed:
                del self.keys[k]

    def _selected(self, body: dict[str, Any]) -> list[bytes]:
        start = from_base64(body["key"], "a key")
        end = from_base64(body["range_end"], "a range end") if body.get("range_end") else None
        if end is None:
            return [start] if start in self.keys else []
        return sorted(k for k in self.keys if k >= start and (end == b"\0" or k < end))

    def _range(self, body: dict[str, Any]) -> dict[str, Any]:
        rows = [self._kv(k) for k in self._selected(body)]
        answer: dict[str, Any] = {"header": {"revision": str(self.revision)}}
        if rows:  # the gateway leaves empty fields out
            answer.update(kvs=rows, count=str(len(rows)))
        return answer

    def _kv(self, k: bytes) -> dict[str, Any]:
        v = self.keys[k]
        row = {
            "key": to_base64(k),
            "create_revision": str(v.create),
            "mod_revision": str(v.mod),
            "version": str(v.version),
        }
        if v.value:
            row["value"] = to_base64(v.value)
        if v.lease:
            row["lease"] = str(v.lease)
        return row

    def _holds(self, compare: dict[str, Any]) -> bool:
        found = self.keys.get(from_base64(compare["key"], "a key"))
        target = compare.get("target", "VERSION")
        have = getattr(found, _TARGETS[target][0]) if found else 0  # absent: every one is 0
        want = int(compare.get(_TARGETS[target][1], 0))
        return {
            "EQUAL": have == want,
            "NOT_EQUAL": have != want,
            "GREATER": have > want,
            "LESS": have < want,
        }[compare.get("result", "EQUAL")]

    def _txn(self, body: dict[str, Any]) -> dict[str, Any]:
        ok = all(self._holds(c) for c in body.get("compare", []))
        ops = body.get("success" if ok else "failure", [])
        for op in ops:
            if "request_range" in op:
                raise AssertionError("MemoryEtcd: no ranges inside a transaction")
        self._write(ops)
        answer: dict[str, Any] = {"header": {"revision": str(self.revision)}}
        if ok:  # the gateway leaves a false out
            answer["succeeded"] = True
        return answer

    def _write(self, ops: list[dict[str, Any]]) -> int:
        """The ops at one new revision (as etcd: none when nothing changes); the keys deleted."""
        revision = self.revision + 1
        deleted = changed = 0
        for op in ops:
            if "request_put" in op:
                put = op["request_put"]
                key = from_base64(put["key"], "a key")
                lease = int(put.get("lease", 0) or 0)
                if lease and lease not in self.leases:
                    raise etcd_errors.Etcd3Exception("etcdserver: requested lease not found")
                old = self.keys.get(key)
                self.keys[key] = _Key(
                    from_base64(put.get("value", ""), "a value"),
                    old.create if old else revision,
                    revision,
                    old.version + 1 if old else 1,
                    lease,
                )
                changed += 1
            elif "request_delete_range" in op:
                for key in self._selected(op["request_delete_range"]):
                    del self.keys[key]
                    deleted += 1
        if changed or deleted:
            self.revision = revision
        return deleted


class MemoryEtcdClient(Etcd3Client):
    """etcd3gw's client with its HTTP posts answered by a MemoryEtcd."""

    def __init__(self, etcd: MemoryEtcd, **kwargs: Any):
        super().__init__(**kwargs)
        self.etcd = etcd

    def post(self, url: str, *args: Any, json: Any = None, **kwargs: Any) -> Any:
        body = json if json is not None else _json_loads(kwargs["data"])
        return self.etcd.handle(url.partition("/v3/")[2], body)


def _json_loads(text: str) -> Any:  # `post`'s own `json` argument hides the module there
    return json.loads(text)


def _b64json(value: Any) -> str:
    return to_base64(json.dumps(value).encode())


def memory_etcd(monkeypatch: Any) -> MemoryEtcd:
    """A MemoryEtcd that every ClusterState made from now on talks to (etcd3gw's client class
    swapped for MemoryEtcdClient), with worker threads run inline."""
    inline_threads(monkeypatch)
    etcd = MemoryEtcd()
    monkeypatch.setattr(etcd3gw, "Etcd3Client", functools.partial(MemoryEtcdClient, etcd))
    return etcd


# Stores and peers


@dataclasses.dataclass
class StoredDataset:
    """What the control plane reads of a store's record."""

    name: str
    uuid: str
    path: Path
    held: list[int] = dataclasses.field(default_factory=list)


class MemoryStore:
    """The part of SegmentStore the control plane uses: published datasets, their manifests,
    and the segments held, as bytes. `root`: where adopted manifests are written (adoption
    stages and publishes one)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        self.datasets: dict[str, StoredDataset] = {}
        self.data: dict[tuple[str, int], bytes] = {}  # the segments held, by (name, seg)
        self.dropped: list[tuple[str, int]] = []  # in the order drop_segment was called

    def put(self, dataset: LocalDataset, held: list[int]) -> None:
        """Publish `dataset` holding the segments `held`."""
        self.datasets[dataset.name] = StoredDataset(
            dataset.name, dataset.uuid, dataset.manifest_path, sorted(held)
        )
        for seg in held:
            self.data[dataset.name, seg] = dataset.segments[seg]

    @property
    def segments(self) -> MemoryStore:
        """The store's placement of segments (SegmentStore.segments): this fake itself."""
        return self

    def open(self, name: str) -> SimpleNamespace:
        record = self.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        return SimpleNamespace(manifest=Manifest(record.path))

    def add_segment(
        self, name: str, seg: int, length: int, fill: Callable[[memoryview], None]
    ) -> None:
        record = self.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        buf = bytearray(length)
        fill(memoryview(buf))  # raises to have it thrown away
        self.data[name, seg] = bytes(buf)
        record.held = sorted(set(record.held) | {seg})

    def new_staging(self, name: str) -> Path:
        assert self.root is not None, "MemoryStore(root) to stage into"
        return Path(tempfile.mkdtemp(prefix=f"{name}.", dir=self.root))

    def publish(self, staging: Path, meta: dict[str, Any]) -> None:
        self.datasets[meta["name"]] = StoredDataset(
            meta["name"], meta["uuid"], staging / "manifest.ksm", list(meta["held"])
        )

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging)

    def drop_segment(self, name: str, seg: int) -> int:
        record = self.datasets.get(name)
        if record is None or seg not in record.held:
            return 0
        record.held.remove(seg)
        self.dropped.append((name, seg))
        return len(self.data.pop((name, seg)))


class MemoryPeers(PeerPool):
    """The members' stores by address, reached without a network: segment reads (heal's
    copies) through `reader`, requests through `ask` (List and ManifestReq; every request
    asked is kept in `asked`). `reads` counts the segment reads served, by member."""

    def __init__(self, stores: dict[str, MemoryStore]):
        super().__init__(Path("/nonexistent/token"), 1.0)
        self.stores = stores
        self.down: set[str] = set()  # members that do not answer
        self.reads: dict[str, int] = {}
        self.asked: list[tuple[str, Request]] = []

    def _store(self, member: str) -> MemoryStore:
        if member in self.down or member not in self.stores:
            raise NodeUnreachable(f"{member} does not answer")
        return self.stores[member]

    @contextlib.contextmanager
    def reader(self, member: str) -> Iterator[Any]:
        yield _MemoryReader(self, member)

    async def ask(self, member: str, request: Request[Answer]) -> Answer:
        await trio.lowlevel.checkpoint()
        self.asked.append((member, request))
        store = self._store(member)
        if isinstance(request, ManifestReq):
            found = store.datasets.get(request.name)
            if found is None or (request.uuid and request.uuid != found.uuid):
                raise StaleDataset(f"{member} has no instance {request.uuid[:8]} of {request.name}")
            piece = read_piece(found.path, request.offset, request.length)
            return request.answer(
                ManifestPiece(name=found.name, uuid=found.uuid, piece=piece).to_wire()
            )
        if not isinstance(request, List):
            raise AssertionError(f"MemoryPeers answers list and manifest, not {request.OP}")
        listing = DatasetListing(
            node=member,
            datasets=[
                DatasetEntry(
                    name=d.name,
                    uuid=d.uuid,
                    source="",
                    lifetime="offline",
                    replicas=1,
                    files=0,
                    bytes=0,
                    stored=0,
                    created=0.0,
                    path=str(d.path.parent),
                    segments=len(d.held),
                    held=list(d.held),
                    members=[],
                    disk=[],
                    disk_stored=0,
                    max_memory=0,
                    max_disk=0,
                    files_total=0,
                    bytes_total=0,
                    files_done=0,
                    bytes_done=0,
                    leases=0,
                    decoded={},
                )
                for d in store.datasets.values()
            ],
        )
        return request.answer(listing.to_wire())


@dataclasses.dataclass
class _MemoryReader:
    peers: MemoryPeers
    member: str

    def send_read(self, name: str, uuid: str, chunk: list[tuple[int, int, int]]) -> Any:
        store = self.peers._store(self.member)
        record = store.datasets.get(name)
        if record is None or record.uuid != uuid:
            raise StaleDataset(f"{self.member} has no instance {uuid[:8]} of {name}")
        return [(store.data.get((name, seg)), pos, length) for seg, pos, length in chunk]

    def receive_read(self, sent: Any, out: memoryview) -> None:
        at = 0
        for data, pos, length in sent:
            if data is None:
                raise NotFound(f"{self.member} does not hold that segment")
            out[at : at + length] = data[pos : pos + length]
            at += length
        self.peers.reads[self.member] = self.peers.reads.get(self.member, 0) + 1


# A dataset


@dataclasses.dataclass
class LocalDataset:
    """A folder of files (the source), its manifest, and its segments' bytes."""

    name: str
    uuid: str
    source: Path
    manifest_path: Path
    segments: list[bytes]

    def entry(self, members: list[str], replicas: int, **more: Any) -> CatalogEntry:
        """`record` as a node reads it."""
        return CatalogEntry.from_json(self.record(members, replicas, **more))

    def record(self, members: list[str], replicas: int, **more: Any) -> dict[str, Any]:
        """Its ready catalog record, placed over `members` (the JSON in etcd)."""
        return {
            "name": self.name,
            "uuid": self.uuid,
            "state": "ready",
            "source": str(self.source),
            "endpoint": "",
            "lifetime": "offline",
            "replicas": replicas,
            "members": members,
            "segment_size": 4096,
            "segments": len(self.segments),
            "files": len(self.segments),
            "bytes": sum(len(s) for s in self.segments),
            "created": 0.0,
            **more,
        }


def local_dataset(root: Path, name: str, segments: int, uuid: str = "") -> LocalDataset:
    """`segments` files of 4 KiB under root/source, one segment each, and their manifest."""
    source = root / "source"
    source.mkdir(parents=True)
    for i in range(segments):
        (source / f"f{i:03d}.bin").write_bytes(bytes([i % 251]) * 4096)
    tree = scan_tree(source)
    offsets, seg_len = plan_layout(tree, 4096)
    uuid = uuid or xxhash.xxh3_64_hexdigest(name.encode())
    path = root / "manifest.ksm"
    header = {"uuid": uuid, "segment_size": 4096, "name": name}
    files = [0] * len(tree)
    # The segments' checksums are known once the segments are read through a manifest.
    write_manifest(path, tree, offsets, files, seg_len, [0] * len(seg_len), header)
    manifest = Manifest(path)
    src = LocalSource(os.fspath(source))
    data = [bytes(src.read_segment(manifest, manifest.layout, s)) for s in range(len(seg_len))]
    del manifest
    checksums = [xxhash.xxh3_64_intdigest(d) for d in data]
    write_manifest(path, tree, offsets, files, seg_len, checksums, header)
    return LocalDataset(name, uuid, source, path, data)
