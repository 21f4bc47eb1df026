"""Finding (or actively loading) the cached dataset behind a path, and reading it in each process.

`attach` runs once, where the dataset object is built: it finds the dataset whose source holds
the path, preloads it with a lease when it is not there, and returns a `CacheRef`, which is
plain picklable config. `reader(ref)` opens the manifest and mappings lazily in each process
(DataLoader workers fork or spawn) and keeps one `Reader` per dataset per process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from kspeedfs.client import admin
from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader, local_node_for
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.contract.node import List
from kspeedfs.format.contract.readthrough import Plan
from kspeedfs.format.errors import (
    AuthError,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
)
from kspeedfs.format.localdata import LocalDataset
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient
from kspeedfs.sources.scan import check_source
from kspeedfs.sources.source import name_from_source

from . import lease

log = logging.getLogger(__name__)

PLAN_CHUNK = 65536  # segment uses per `plan` request: well inside a frame


@dataclasses.dataclass(frozen=True)
class CacheRef:
    """Picklable: what any process needs to open the same dataset again."""

    settings: Settings
    name: str
    uuid: str
    source: str
    info: dict[str, Any]  # the node's listing entry (members, path, replicas, lifetime)
    local: bool | None  # None: map where possible; True: must map; False: always the network

    @property
    def key(self) -> tuple[str, str, bool | None]:
        return (self.name, self.uuid, self.local)


def client_settings(
    nodes: str | Sequence[str] | None,
    token: str | os.PathLike[str] | None,
    user: str | None = None,
    password: str | None = None,
) -> Settings:
    """Settings from the config file and environment, with the dataset's own arguments on top
    (a user and password replace the token); with `etcd` set and no node list given, the nodes
    are the live members found there."""
    cli: dict[str, Any] = {}
    if nodes is not None:
        cli["nodes"] = nodes if isinstance(nodes, str) else ",".join(str(n) for n in nodes)
    if token is not None:
        cli["token_file"] = os.fspath(token)
    if user is not None:
        if password is None:
            raise InvalidArgument(f"user {user!r} needs a password")
        cli["user"], cli["password"] = user, password
    settings = load_settings(
        cli,
        cli_origin="dataset's arguments",
        cli_names={"nodes": "nodes=", "token_file": "token=", "user": "user="},
    )
    if settings.etcd:  # control plane: the live members in etcd, unless `nodes` names them
        from kspeedfs.client.clusterstate import resolve_nodes

        resolve_nodes(settings, explicit=nodes is not None or "KSPEEDFS_NODES" in os.environ)
    return settings


def process_rank() -> int:
    """This process's rank in a distributed job (0 when there is none)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def kspeed_name(source: str) -> str:
    """KSpeed's name for a dataset: its root folder's own name (`/data/imagenet/train` ->
    `train`), as `kspeedfs preload SRC` names it when no --name is given."""
    return name_from_source(os.path.abspath(source))


def derived_name(source: str) -> str:
    """A stable dataset name for an actively loaded source: its folder name and a path hash."""
    base = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(source.rstrip("/")).lower()).strip("-._")
    digest = hashlib.sha256(source.encode(errors="surrogateescape")).hexdigest()[:10]
    return f"{base[:40] or 'dataset'}-{digest}"


def _inside(path: str, folder: str) -> str | None:
    """`path` relative to `folder` ('' for the folder itself), or None when it is outside."""
    rel = os.path.relpath(path, folder)
    if rel == ".":
        return ""
    if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
        return None
    return rel


def _relative(path: str, source: str) -> str | None:
    # Compare both as written and with symlinks resolved: jobs spell paths differently.
    for p in {os.path.abspath(path), os.path.realpath(path)}:
        for s in {os.path.abspath(source), os.path.realpath(source)}:
            rel = _inside(p, s)
            if rel is not None:
                return rel
    return None


def _match(
    datasets: list[dict[str, Any]], path: str, objname: str | None
) -> tuple[dict[str, Any], str] | None:
    """The dataset that holds `path` (the most specific source wins), and the path inside it."""
    live = [d for d in datasets if d.get("state") != "failed"]
    if objname is not None:
        for d in live:
            if d["name"] == objname:
                rel = _relative(path, str(d.get("source", "")))
                if rel is None:
                    raise InvalidArgument(
                        f"{path} is not inside dataset {objname} (loaded from {d.get('source')})"
                    )
                return d, rel
        return None
    best: tuple[dict[str, Any], str] | None = None
    for d in live:
        rel = _relative(path, str(d.get("source", "")))
        if rel is not None and (best is None or len(d["source"]) > len(best[0]["source"])):
            best = d, rel
    return best


def attach(
    path: str,
    *,
    objname: str | None,
    settings: Settings,
    local: bool | None,
    source_for_preload: str | None = None,
    meta: Sequence[str] = (),
    name_rule: Callable[[str], str] = derived_name,
) -> tuple[CacheRef, str, tuple[str, str, str] | None]:
    """Find or actively load the dataset holding `path` (an active load indexes the `meta`
    files too, and is named `objname`, else `name_rule(source)`).

    Returns the ref, `path` relative to the dataset root, and the lease key when this process
    took a lease (release it with `lease.unhold`).
    """
    cluster = ClusterReader(settings, local_node_for(settings))
    preloaded = False
    for _attempt in range(5):
        node, listing = cluster.live_request(List.OP)
        found = _match(listing["datasets"], path, objname)
        if found is None:
            if preloaded:
                raise DataError(f"dataset for {path} vanished right after loading it")
            source = source_for_preload or path
            _active_preload(settings, source, objname, meta, name_rule, listing["datasets"])
            preloaded = True
            continue
        info, rel = found
        if info.get("state") != "ready":
            _wait_ready(settings, node, info["name"])
            continue
        key = None
        if info.get("lifetime") == "leased":
            members = info.get("members") or [node]
            try:
                key = lease.hold(settings, str(members[0]), info["name"], str(info["uuid"]))
            except NotFound:
                continue  # unloaded between the listing and the lease: look again
        ref = CacheRef(
            settings=settings,
            name=info["name"],
            uuid=str(info["uuid"]),
            source=str(info["source"]),
            info=info,
            local=local,
        )
        return ref, rel, key
    raise KSpeedError(f"could not attach {path}: the cache kept changing under us")


def _active_preload(
    settings: Settings,
    source: str,
    objname: str | None,
    meta: Sequence[str],
    name_rule: Callable[[str], str],
    datasets: list[dict[str, Any]],
) -> None:
    """Preload `source` with a leased lifetime, or join its load already under way (another job
    or rank started it); waits for it (progress shown on rank 0). A name of its own choosing
    that a dataset of another source holds is refused: it would wait for that one."""
    try:
        src = os.path.abspath(check_source(source))
    except KSpeedError as e:
        raise type(e)(f"{source} is not in the cache and cannot be loaded: {e}") from None
    name = objname or name_rule(src)
    taken = [d for d in datasets if d["name"] == name and d.get("state") != "failed"]
    if objname is None and taken:
        raise InvalidArgument(
            f"dataset {name} is already loaded from {taken[0].get('source')}; pass objname= to"
            f" load {source} under another name"
        )
    try:
        label = f"kspeedfs load {name}" if process_rank() == 0 else None
        admin.ensure_loaded(settings, src, name, lifetime="leased", progress_label=label, meta=meta)
    except AuthError as e:
        raise AuthError(
            f"{source} is not in the cache and loading it needs the admin token: {e}"
        ) from None
    except (NoSpace, NotFound, InvalidArgument) as e:
        raise type(e)(f"{source} is not in the cache and cannot be loaded: {e}") from None


def _wait_ready(settings: Settings, node: str, name: str) -> None:
    """Wait for a load of `name` that `node` lists as under way."""
    client = NodeClient(
        parse_address(node), settings.credential(), settings.timeout, client_context(settings)
    )
    try:
        label = f"kspeedfs load {name}" if process_rank() == 0 else None
        admin.wait_ready(client, name, progress_label=label)
    except NotFound:
        pass  # finished (or failed) and forgotten meanwhile: the caller looks again
    finally:
        client.close()


class Reader:
    """One process's access to one dataset: zero-copy views of local segments, network for the rest.

    Thread-safe for reads; the cluster reader pools one connection per thread in use.
    """

    def __init__(self, ref: CacheRef):
        self.ref = ref
        local_node = None if ref.local is False else local_node_for(ref.settings)
        self.cluster = ClusterReader(ref.settings, local_node)
        self.handle: DatasetHandle = self.cluster.open_dataset(ref.name, ref.info)
        if self.handle.uuid != ref.uuid:
            raise DataError(f"dataset {ref.name} was reloaded since this job attached to it")
        if ref.local is True and self.handle.local is None:
            raise InvalidArgument(
                f"dataset {ref.name} cannot be mapped by this process (local=True)"
            )
        self.manifest: Manifest = self.handle.manifest
        self.local = self.handle.local
        self.local_node = local_node
        # The hot path (cached segment views) only for a static dataset held whole here: the
        # segments of a read-through one come and go, and a cached view would pin them.
        self.all_local = (
            type(self.local) is LocalDataset and len(self.local.held) == self.manifest.segments
        )
        self._scratch = threading.local()
        self._seg_views: dict[int, memoryview] = {}
        self._data = self.manifest.data
        self._size = self.manifest.size
        self._seg_size = self.manifest.segment_size

    def local_view(self, entry: int) -> memoryview:
        """`view` of a file when the whole dataset is local: the per-sample hot path."""
        start = int(self._data[entry])
        seg, off = divmod(start, self._seg_size)
        end = off + int(self._size[entry])
        if end > self._seg_size:
            return self.view(entry)  # spans segments: joined
        mv = self._seg_views.get(seg)
        if mv is None:
            assert self.local is not None
            try:
                mv = self._seg_views[seg] = memoryview(self.local.segment(seg))
            except DataError:
                return self._copied(entry)  # unloaded before we mapped it: the read policy
        return mv[off:end]

    def is_local(self, entry: int) -> bool:
        return self.all_local or (self.local is not None and self.local.holds_file(entry))

    def view(self, entry: int) -> memoryview:
        """File `entry`'s bytes: a view of shared memory when local, else a fresh buffer."""
        if self.all_local:
            return self.local_view(entry)
        if self.is_local(entry):
            assert self.local is not None
            try:
                return self.local.file_view(entry)
            except DataError:
                pass  # unloaded before we mapped it: the read policy finds another copy
        return self._copied(entry)

    def _copied(self, entry: int) -> memoryview:
        out = bytearray(int(self.manifest.size[entry]))
        self.gather([(entry, 0, len(out))], memoryview(out))
        return memoryview(out)

    def scratch_view(self, entry: int) -> memoryview:
        """Like `view`, but remote bytes land in a reusable per-thread buffer (valid until the
        next call: for decoding right away)."""
        if self.all_local:
            return self.local_view(entry)
        if self.is_local(entry):
            assert self.local is not None
            try:
                return self.local.file_view(entry)
            except DataError:
                pass
        n = int(self.manifest.size[entry])
        buf: bytearray | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = bytearray(max(n, 1 << 20))
        out = memoryview(buf)[:n]
        self.gather([(entry, 0, n)], out)
        return out

    def fetch(self, entries: Sequence[int]) -> dict[int, memoryview]:
        """Whole files, one vectored read per node; each entry's bytes are its own memory."""
        entries = list(dict.fromkeys(entries))
        sizes = [int(self.manifest.size[e]) for e in entries]
        buf = memoryview(bytearray(sum(sizes)))
        self.gather([(e, 0, n) for e, n in zip(entries, sizes, strict=True)], buf)
        out, pos = {}, 0
        for e, n in zip(entries, sizes, strict=True):
            out[e] = buf[pos : pos + n]
            pos += n
        return out

    def announce_plan(self, epochs: Sequence[np.ndarray]) -> None:
        """Tell the nodes that fill this read-through dataset the order its files will be
        read in, an array of manifest entries per epoch (this one and the next), as segment
        uses, in chunks; the same plan from another reader of the sampler has the same name
        and is taken once."""
        runs = [self._segment_uses(entries) for entries in epochs]
        segments = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
        if len(segments) == 0:
            return
        name = xxhash.xxh3_64_hexdigest(segments.tobytes())
        h = self.handle
        nodes = h.members if h.members else [self.local_node] if self.local_node else []
        for node in nodes:
            for start in range(0, len(segments), PLAN_CHUNK):
                request = Plan(
                    name=h.name,
                    uuid=h.uuid,
                    plan=name,
                    segments=segments[start : start + PLAN_CHUNK].tolist(),
                    total=len(segments),
                    start=start,
                    horizon=len(runs[0]),
                )
                if not self.cluster.call(node, request).get("used", False):
                    break  # this node's policy does not use plans

    def _segment_uses(self, entries: np.ndarray) -> np.ndarray:
        """The segments files `entries` start in, a run of files in one segment once."""
        starts = self.manifest.data[entries].astype(np.int64) // self._seg_size
        keep = np.ones(len(starts), dtype=bool)
        keep[1:] = starts[1:] != starts[:-1]
        return starts[keep]

    def gather(self, requests: Sequence[tuple[int, int, int]], out: memoryview) -> None:
        """Fill `out` with bytes [offset, offset+length) of each (entry, offset, length), back to
        back, by the cluster's one read policy (local map, owners, verified source)."""
        self.cluster.gather(self.handle, requests, out)


_readers: dict[tuple[str, str, bool | None], Reader] = {}
_readers_pid = os.getpid()
_readers_lock = threading.Lock()
# Bumped in a forked child: objects that cache a reader check it instead of calling getpid.
generation = 0


def _after_fork() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_after_fork)


def reader(ref: CacheRef) -> Reader:
    """This process's reader for `ref` (mappings survive fork; the cluster reader reconnects)."""
    global _readers_pid
    r = _readers.get(ref.key)
    if r is not None and _readers_pid == os.getpid():
        return r
    with _readers_lock:
        if _readers_pid != os.getpid():
            _readers_pid = os.getpid()
            for old in _readers.values():
                old._scratch = threading.local()
        r = _readers.get(ref.key)
        if r is None:
            r = _readers[ref.key] = Reader(ref)
    return r
