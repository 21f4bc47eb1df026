"""The read-only FUSE filesystem (pyfuse3 Operations) over the node's datasets.

Inode = (slot << 32) | (entry index + 1), where a slot is one loaded instance of a dataset, so a
dataset unloaded and loaded again never reuses the old inodes. Data is immutable: entries and
attributes are cached by the kernel for a day and page cache is kept across opens, so a second
epoch costs the daemon only open and release per file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio

from .aclient import AsyncNodeClient
from .cluster import ClusterReader, DatasetHandle
from .errors import DataError, KSpeedError, NodeUnreachable, NotFound

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
DATA_TIMEOUT = 86400.0  # dataset contents never change
TOP_TIMEOUT = 1.0  # the top-level list changes with preload/unload
REFRESH_INTERVAL = 1.0
SLOT_SHIFT = 32
INDEX_MASK = (1 << SLOT_SHIFT) - 1
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT
CHECKSUM_XATTR = b"user.kspeedfs.xxh3"
STATS_XATTR = b"user.kspeedfs.stats"
SOURCES_XATTR = b"user.kspeedfs.sources"


@dataclass
class MountedDataset:
    slot: int
    name: str
    uuid: str
    data: DatasetHandle
    alive: bool = True


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class KSpeedFS(pyfuse3.Operations):
    def __init__(
        self, clients: list[AsyncNodeClient], reader: ClusterReader, dataset: str | None = None
    ):
        super().__init__()
        self.clients = clients  # the local node first: the dataset list comes from one of them
        self.reader = reader
        self.single = dataset  # serve this dataset at the root instead of one folder each
        self.by_slot: dict[int, MountedDataset] = {}
        self.by_name: dict[str, MountedDataset] = {}
        self.counts: Counter[str] = Counter()
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_at_ns = time.time_ns()
        self._next_slot = 1
        self._last_refresh = -1e9
        self._node_down_logged = False

    async def refresh(self, force: bool = False) -> None:
        """Sync the dataset list with the node (at most once a second unless forced)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_INTERVAL:
            return
        self._last_refresh = now
        listing = None
        error: KSpeedError | None = None
        for client in self.clients:
            try:
                listing = await client.request("list")
                break
            except NodeUnreachable as e:
                error = e
        if listing is None:
            if not self._node_down_logged:
                log.warning("no node answers, serving the datasets already known: %s", error)
                self._node_down_logged = True
            return
        self._node_down_logged = False
        ready = {d["name"]: d for d in listing["datasets"] if d.get("state") == "ready"}
        for name, mounted in list(self.by_name.items()):
            if name not in ready or ready[name]["uuid"] != mounted.uuid:
                self._drop(mounted)
        for name, d in ready.items():
            if name in self.by_name or (self.single and name != self.single):
                continue
            try:
                data = await trio.to_thread.run_sync(self.reader.open_dataset, name, d)
            except KSpeedError as e:
                log.error("cannot open dataset %s: %s", name, e)
                continue
            mounted = MountedDataset(self._next_slot, name, d["uuid"], data)
            self._next_slot += 1
            self.by_slot[mounted.slot] = mounted
            self.by_name[name] = mounted

    def _drop(self, mounted: MountedDataset) -> None:
        log.info("dataset %s is gone from the node", mounted.name)
        mounted.alive = False
        self.by_name.pop(mounted.name, None)
        if not self.single:
            try:
                pyfuse3.invalidate_entry_async(ROOT, mounted.name.encode(), ignore_enoent=True)
            except OSError:
                pass
        else:
            # Served at the root: the kernel would keep its entries (a day) for the old
            # instance, e.g. after a refresh; forget them so lookups reach the new one.
            m = mounted.data.manifest
            for child in m.children(0):
                try:
                    pyfuse3.invalidate_entry_async(ROOT, m.name(child), ignore_enoent=True)
                except OSError:
                    pass

    def _locate(self, inode: int) -> tuple[MountedDataset, int]:
        if inode == ROOT and self.single:
            mounted = self.by_name.get(self.single)
            if mounted is None:
                raise pyfuse3.FUSEError(errno.EIO)
            return mounted, 0
        mounted_or_none = self.by_slot.get(inode >> SLOT_SHIFT)
        if mounted_or_none is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return mounted_or_none, (inode & INDEX_MASK) - 1

    def _inode(self, mounted: MountedDataset, idx: int) -> int:
        if idx == 0 and self.single:
            return ROOT
        return (mounted.slot << SLOT_SHIFT) | (idx + 1)

    def _entry(self, mounted: MountedDataset, idx: int) -> pyfuse3.EntryAttributes:
        m = mounted.data.manifest
        a = pyfuse3.EntryAttributes()
        a.st_ino = self._inode(mounted, idx)
        a.entry_timeout = a.attr_timeout = TOP_TIMEOUT if idx == 0 else DATA_TIMEOUT
        mode = int(m.mode[idx])
        a.st_mode = mode & ~0o222 if not stat.S_ISLNK(mode) else mode
        a.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        a.st_size = int(m.size[idx])
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = int(m.mtime_ns[idx])
        a.st_blksize = 128 * 1024
        a.st_blocks = (a.st_size + 511) // 512
        return a

    def _root_entry(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ROOT
        a.entry_timeout = a.attr_timeout = TOP_TIMEOUT
        a.st_mode = stat.S_IFDIR | 0o555
        a.st_nlink = 2
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.mounted_at_ns
        a.st_blksize = 4096
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self.counts["getattr"] += 1
        if inode == ROOT:
            await self.refresh()
            if not self.single:
                return self._root_entry()
        mounted, idx = self._locate(inode)
        return self._entry(mounted, idx)

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self.counts["lookup"] += 1
        if parent_inode == ROOT and not self.single:
            await self.refresh()
            mounted = self.by_name.get(os.fsdecode(name))
            if mounted is None:
                await self.refresh(force=True)
                mounted = self.by_name.get(os.fsdecode(name))
            if mounted is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._entry(mounted, 0)
        mounted, idx = self._locate(parent_inode)
        if name == b".":
            return self._entry(mounted, idx)
        if name == b"..":
            if idx == 0:
                return self._root_entry()
            return self._entry(mounted, int(mounted.data.manifest.parent[idx]))
        found = mounted.data.manifest.lookup(idx, name)
        if found is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._entry(mounted, found)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass  # inodes are computed, not tracked

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.counts["opendir"] += 1
        if inode == ROOT and not self.single:
            await self.refresh()
            return ROOT
        mounted, idx = self._locate(inode)
        if not mounted.data.manifest.is_dir(idx):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.counts["readdir"] += 1
        if fh == ROOT and not self.single:
            names = sorted(self.by_name)
            for pos in range(start_id, len(names)):
                mounted = self.by_name[names[pos]]
                if not pyfuse3.readdir_reply(
                    token, names[pos].encode(), self._entry(mounted, 0), pos + 1
                ):
                    return
            return
        mounted, idx = self._locate(fh)
        m = mounted.data.manifest
        kids = m.children(idx)
        for pos in range(start_id, len(kids)):
            child = kids[pos]
            if not pyfuse3.readdir_reply(
                token, m.name(child), self._entry(mounted, child), pos + 1
            ):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self.counts["open"] += 1
        if flags & WRITE_FLAGS:
            raise _erofs()
        mounted, idx = self._locate(inode)
        if not mounted.data.manifest.is_file(idx):
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.counts["read"] += 1
        mounted, idx = self._locate(fh)
        if not mounted.alive:
            log.error("read of %s after it was unloaded", mounted.name)
            raise pyfuse3.FUSEError(errno.EIO)
        local = mounted.data.local
        if local is not None:
            try:
                return local.read(idx, off, size)  # in the event loop: no thread hop when local
            except DataError:
                pass  # not (all) held here: the cluster path below knows where it is
        try:
            return await trio.to_thread.run_sync(self.reader.read, mounted.data, idx, off, size)
        except KSpeedError as e:
            log.error(
                "cannot read %s/%s: %s",
                mounted.name,
                os.fsdecode(mounted.data.manifest.path(idx)),
                e,
            )
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh: int) -> None:
        self.counts["release"] += 1

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        self.counts["readlink"] += 1
        mounted, idx = self._locate(inode)
        m = mounted.data.manifest
        if not stat.S_ISLNK(int(m.mode[idx])):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return m.link_target(idx)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        self.counts["statfs"] += 1
        await self.refresh()
        s = pyfuse3.StatvfsData()
        total = sum(
            d.data.manifest.nbytes + int(d.data.manifest.seg_len.sum())
            for d in self.by_name.values()
        )
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(d.data.manifest.entries for d in self.by_name.values()) + 1
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self.counts["access"] += 1
        if mode & os.W_OK:
            raise _erofs()
        if inode != ROOT or self.single:
            self._locate(inode)
        return True

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        self.counts["getxattr"] += 1
        if name == STATS_XATTR and inode == ROOT:
            return json.dumps(dict(self.counts)).encode()
        if name == SOURCES_XATTR and inode == ROOT:
            # Where cluster reads were served from (local/remote/source): failover at work.
            return json.dumps(dict(self.reader.stats)).encode()
        if name == CHECKSUM_XATTR and inode != ROOT:
            mounted, idx = self._locate(inode)
            if mounted.data.manifest.is_file(idx):
                return b"%016x" % int(mounted.data.manifest.checksum[idx])
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        self.counts["listxattr"] += 1
        if inode != ROOT or self.single:
            mounted, idx = self._locate(inode)
            if mounted.data.manifest.is_file(idx):
                return [CHECKSUM_XATTR]
        return []

    # Everything that would change the tree is refused: the cache is read-only.
    async def setattr(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def write(self, *args: Any) -> int:
        raise _erofs()

    async def create(self, *args: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise _erofs()

    async def mknod(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def mkdir(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def symlink(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def link(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def unlink(self, *args: Any) -> None:
        raise _erofs()

    async def rmdir(self, *args: Any) -> None:
        raise _erofs()

    async def rename(self, *args: Any) -> None:
        raise _erofs()

    async def setxattr(self, *args: Any) -> None:
        raise _erofs()

    async def removexattr(self, *args: Any) -> None:
        raise _erofs()


def require_dataset(fs: KSpeedFS, name: str) -> None:
    if name not in fs.by_name:
        raise NotFound(f"no dataset named {name!r} on the node")
