"""The read-only filesystem over the node's datasets, served by fuse_kernel.FuseSession.

Inode = (slot << 32) | (entry index + 1), where a slot is one loaded instance of a dataset, so a
dataset unloaded and loaded again never reuses the old inodes. Data is immutable: entries,
attributes and dataset folder listings are cached by the kernel for a day, and files are served
in the kernel's no-open mode with the page cache kept, so a second epoch costs no request.

Handlers run in the session's threads; the dataset list is refreshed from the node by trio
(`refresh`), which replaces the two lookup tables whole rather than mutating them, so a handler
always sees a consistent pair. A request at the root asks for a refresh and waits for it briefly
(TOP_WAIT), and not at all while the node does not answer: a frozen node slows nothing but the
lookup of names it has not told us about yet. An unloaded instance is forgotten at once (its
slot, manifest and segment maps), so its memory returns to the machine while the mount stays
up; a request on one of its inodes then gets ESTALE, never the bytes of a newer instance.
A refresh that fails in any way logs one line and is tried again: the mount serves on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.errors import DataError, KSpeedError, NodeUnreachable, NotFound
from kspeedfs.fuse.kernel import ROOT_INODE, Attr, FuseError, FuseSession, ReadResult, StatFs
from kspeedfs.net.aconnection import AsyncNodeClient

log = logging.getLogger(__name__)

ROOT = ROOT_INODE
DATA_TIMEOUT = 86400.0  # dataset contents never change
TOP_TIMEOUT = 1.0  # the top-level list changes with preload/unload
REFRESH_INTERVAL = 1.0
TOP_WAIT = 0.5  # how long a request at the root waits for the node's list
LOOKUP_WAIT = 2.0  # and a lookup of a name not known yet
BACKGROUND_REFRESH = 5.0
SLOT_SHIFT = 32
INDEX_MASK = (1 << SLOT_SHIFT) - 1
ENOATTR = errno.ENODATA
CHECKSUM_XATTR = b"user.kspeedfs.xxh3"
STATS_XATTR = b"user.kspeedfs.stats"
SOURCES_XATTR = b"user.kspeedfs.sources"


@dataclass
class MountedDataset:
    slot: int
    name: str
    uuid: str
    data: DatasetHandle


class KSpeedFS:
    def __init__(
        self, clients: list[AsyncNodeClient], reader: ClusterReader, dataset: str | None = None
    ):
        self.clients = clients  # the local node first: the dataset list comes from one of them
        self.reader = reader
        self.single = dataset  # serve this dataset at the root instead of one folder each
        self.by_slot: dict[int, MountedDataset] = {}
        self.by_name: dict[str, MountedDataset] = {}
        self.session: FuseSession | None = None
        self.trio_token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None  # where refreshes asked by handlers run
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_at_ns = time.time_ns()
        self._next_slot = 1
        self._last_refresh = -1e9
        self._node_answers = True  # at the last refresh; handlers wait for one only if so
        self._last_error = ""  # of the last failed refresh: logged once, not every second
        self._inflight: threading.Event | None = None  # set when the running refresh ends
        self._inflight_since = 0.0
        self._inflight_lock = threading.Lock()
        self._refresh_lock = trio.Lock()

    # ---- the dataset list (trio side)

    async def refresh(self, strict: bool = False) -> None:
        """Sync the dataset list with the node (callers keep to about one a second). Errors
        are logged and the known datasets kept; `strict` (the first refresh) raises them."""
        async with self._refresh_lock:  # two interleaved refreshes would each open a dataset
            self._last_refresh = time.monotonic()
            try:
                await self._refresh()
            except Exception as e:
                if strict:
                    raise
                self._node_answers = False  # handlers must not wait on a node that refuses us
                why = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
                if why != self._last_error:
                    log.error("cannot refresh the dataset list (serving what is known): %s", why)
                self._last_error = why
                return
            if self._last_error:
                log.info("the dataset list is refreshed again")
                self._last_error = ""

    async def _refresh(self) -> None:
        listing = None
        error: KSpeedError | None = None
        for client in self.clients:
            try:
                listing = await client.request("list")
                break
            except NodeUnreachable as e:
                error = e
        if listing is None:
            if self._node_answers:
                log.warning("no node answers, serving the datasets already known: %s", error)
            self._node_answers = False
            return
        self._node_answers = True
        ready = {d["name"]: d for d in listing["datasets"] if d.get("state") == "ready"}
        by_name = dict(self.by_name)
        by_slot = dict(self.by_slot)
        gone = [m for n, m in by_name.items() if n not in ready or ready[n]["uuid"] != m.uuid]
        for mounted in gone:
            del by_name[mounted.name]
            del by_slot[mounted.slot]
            self._drop(mounted)
        for name, d in ready.items():
            if name in by_name or (self.single and name != self.single):
                continue
            try:
                data = await trio.to_thread.run_sync(self.reader.open_dataset, name, d)
            except KSpeedError as e:
                log.error("cannot open dataset %s: %s", name, e)
                continue
            mounted = MountedDataset(self._next_slot, name, d["uuid"], data)
            self._next_slot += 1
            by_slot[mounted.slot] = mounted
            by_name[name] = mounted
        if by_name.keys() != self.by_name.keys() or gone:
            self.mounted_at_ns = time.time_ns()  # the root's mtime: its listing changed
        self.by_slot, self.by_name = by_slot, by_name

    def _drop(self, mounted: MountedDataset) -> None:
        log.info("dataset %s (instance %s) is gone from the node", mounted.name, mounted.uuid[:8])
        if mounted.data.local is not None:
            mounted.data.local.release()  # its memory returns to the node's machine
        if self.session is None:
            return
        if not self.single:
            self.session.invalidate_entry_async(ROOT, mounted.name.encode())
        else:
            # Served at the root: the kernel would keep its entries (a day) for the old
            # instance, e.g. after a refresh; forget them so lookups reach the new one.
            m = mounted.data.manifest
            for child in m.children(0):
                self.session.invalidate_entry_async(ROOT, m.name(child))

    def _refresh_from_thread(self, force: bool = False, wait: float = TOP_WAIT) -> None:
        """From a FUSE thread: have trio refresh the list (one refresh at a time, at most once
        a second unless forced) and wait for it up to `wait` seconds, and only while the node
        answers: a frozen node must not hold up the requests that walk through the root."""
        if self.trio_token is None or self.nursery is None:
            return
        now = time.monotonic()
        with self._inflight_lock:
            done = self._inflight
            if done is None:
                if not force and now - self._last_refresh < REFRESH_INTERVAL:
                    return
                done = self._inflight = threading.Event()
                self._inflight_since = now
                try:
                    self.trio_token.run_sync_soon(self._start_refresh, done)
                except trio.RunFinishedError:
                    self._inflight = None
                    return  # shutting down: serve what is known
            # A refresh already slower than `wait` is waited for no longer, by anyone.
            left = wait - (now - self._inflight_since)
        if self._node_answers and left > 0:
            done.wait(left)

    async def keep_refreshed(self) -> None:
        """Notice unloads even when nobody looks at the root: their memory is freed only once
        this process lets go of its maps."""
        while True:
            await trio.sleep(BACKGROUND_REFRESH)
            await self.refresh()

    def _start_refresh(self, done: threading.Event) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(self._refresh_task, done)

    async def _refresh_task(self, done: threading.Event) -> None:
        try:
            await self.refresh()
        finally:
            with self._inflight_lock:
                self._inflight = None
            done.set()

    # ---- inodes and attributes

    def _locate(self, inode: int) -> tuple[MountedDataset, int]:
        if inode == ROOT and self.single:
            mounted = self.by_name.get(self.single)
            if mounted is None:
                raise FuseError(errno.EIO)
            return mounted, 0
        mounted_or_none = self.by_slot.get(inode >> SLOT_SHIFT)
        if mounted_or_none is None:
            # An instance that was unloaded (and forgotten): its inodes mean nothing now.
            raise FuseError(errno.ESTALE)
        return mounted_or_none, (inode & INDEX_MASK) - 1

    def _inode(self, mounted: MountedDataset, idx: int) -> int:
        if idx == 0 and self.single:
            return ROOT
        return (mounted.slot << SLOT_SHIFT) | (idx + 1)

    def _attr(self, mounted: MountedDataset, idx: int) -> Attr:
        m = mounted.data.manifest
        mode = int(m.mode[idx])
        return Attr(
            ino=self._inode(mounted, idx),
            mode=mode & ~0o222 if not stat.S_ISLNK(mode) else mode,
            size=int(m.size[idx]),
            nlink=2 if stat.S_ISDIR(mode) else 1,
            uid=self.uid,
            gid=self.gid,
            mtime_ns=int(m.mtime_ns[idx]),
            blksize=128 * 1024,
            timeout=TOP_TIMEOUT if idx == 0 else DATA_TIMEOUT,
        )

    def _root_attr(self) -> Attr:
        return Attr(
            ino=ROOT,
            mode=stat.S_IFDIR | 0o555,
            nlink=2,
            uid=self.uid,
            gid=self.gid,
            mtime_ns=self.mounted_at_ns,
            timeout=TOP_TIMEOUT,
        )

    # ---- fuse_kernel.Filesystem (called in the session's threads)

    def getattr(self, ino: int) -> Attr:
        if ino == ROOT:
            self._refresh_from_thread()
            if self.session is not None:
                # A path walk revalidates the root first: let it see the dropped names gone.
                self.session.wait_invalidations()
            if not self.single:
                return self._root_attr()
        mounted, idx = self._locate(ino)
        return self._attr(mounted, idx)

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == ROOT and not self.single:
            self._refresh_from_thread()
            mounted = self.by_name.get(os.fsdecode(name))
            if mounted is None:  # loaded a moment ago? ask now rather than in a second
                self._refresh_from_thread(force=True, wait=LOOKUP_WAIT)
                mounted = self.by_name.get(os.fsdecode(name))
            if mounted is None:
                raise FuseError(errno.ENOENT)
            return self._attr(mounted, 0)
        mounted, idx = self._locate(parent)
        if name == b".":
            return self._attr(mounted, idx)
        if name == b"..":
            if idx == 0:
                return self._root_attr()
            return self._attr(mounted, int(mounted.data.manifest.parent[idx]))
        found = mounted.data.manifest.lookup(idx, name)
        if found is None:
            raise FuseError(errno.ENOENT)
        return self._attr(mounted, found)

    def opendir(self, ino: int) -> bool:
        if ino == ROOT:
            self._refresh_from_thread()
            if not self.single:
                return False  # the top-level list changes: no cached listing
        mounted, idx = self._locate(ino)
        if not mounted.data.manifest.is_dir(idx):
            raise FuseError(errno.ENOTDIR)
        return ino != ROOT  # a dataset's folders never change; the root of --dataset may

    def entries(self, ino: int, start: int) -> Iterator[tuple[bytes, Attr]]:
        if ino == ROOT and not self.single:
            by_name = self.by_name
            for name in sorted(by_name)[start:]:
                yield name.encode(), self._attr(by_name[name], 0)
            return
        mounted, idx = self._locate(ino)
        m = mounted.data.manifest
        kids = m.children(idx)
        for pos in range(start, len(kids)):
            child = int(kids[pos])
            yield m.name(child), self._attr(mounted, child)

    def read(self, ino: int, offset: int, size: int) -> ReadResult:
        mounted, idx = self._locate(ino)
        local = mounted.data.local
        if local is not None:
            try:
                return local.read(idx, offset, size)  # inline: no thread hop when local
            except DataError:
                pass  # not (all) held here: the cluster path below knows where it is
        return self._cluster_read(mounted, idx, offset, size)

    def _cluster_read(
        self, mounted: MountedDataset, idx: int, offset: int, size: int
    ) -> Callable[[], bytes]:
        def blocking_read() -> bytes:
            try:
                return self.reader.read(mounted.data, idx, offset, size)
            except KSpeedError as e:
                path = os.fsdecode(mounted.data.manifest.path(idx))
                log.error("cannot read %s/%s: %s", mounted.name, path, e)
                raise FuseError(errno.EIO) from None

        return blocking_read

    def readlink(self, ino: int) -> bytes:
        mounted, idx = self._locate(ino)
        m = mounted.data.manifest
        if not stat.S_ISLNK(int(m.mode[idx])):
            raise FuseError(errno.EINVAL)
        return m.link_target(idx)

    def statfs(self) -> StatFs:
        self._refresh_from_thread()
        datasets = list(self.by_name.values())
        total = sum(d.data.manifest.nbytes + int(d.data.manifest.seg_len.sum()) for d in datasets)
        files = sum(d.data.manifest.entries for d in datasets) + 1
        return StatFs(blocks=(total + 4095) // 4096, files=files)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == STATS_XATTR and ino == ROOT:
            counts = self.session.counts() if self.session is not None else {}
            return json.dumps(dict(counts)).encode()
        if name == SOURCES_XATTR and ino == ROOT:
            # Where cluster reads were served from (local/remote/source): failover at work.
            return json.dumps(dict(self.reader.stats)).encode()
        if name == CHECKSUM_XATTR and ino != ROOT:
            mounted, idx = self._locate(ino)
            if mounted.data.manifest.is_file(idx):
                return b"%016x" % int(mounted.data.manifest.checksum[idx])
        raise FuseError(ENOATTR)

    def listxattr(self, ino: int) -> list[bytes]:
        if ino != ROOT or self.single:
            mounted, idx = self._locate(ino)
            if mounted.data.manifest.is_file(idx):
                return [CHECKSUM_XATTR]
        return []


def require_dataset(fs: KSpeedFS, name: str) -> None:
    if name not in fs.by_name:
        raise NotFound(f"no dataset named {name!r} on the node")
