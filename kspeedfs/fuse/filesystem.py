"""The read-only filesystem over the node's datasets, as one serving process sees it.

Inode = (slot << 32) | (entry index + 1): slots are numbered by the supervisor (datasets.py)
and sent to every worker, so an inode means the same in every process serving the mount.
Data is immutable: entries, attributes and dataset folder listings are cached by the kernel for
a day, and files are served in the kernel's no-open mode with the page cache kept, so a second
epoch costs no request.

The tables are replaced whole (by the worker's control thread, as the supervisor reports loads
and unloads), never mutated, so a handler always sees a consistent pair. A request at the root
asks the supervisor for a fresh list and waits for it briefly (TOP_WAIT), and not at all while
the node does not answer: a frozen node slows nothing but the lookup of names not known yet. An
unloaded instance is forgotten at once (its slot, manifest and segment maps), so its memory
returns to the machine while the mount stays up; a request on one of its inodes then gets
ESTALE, never the bytes of a newer instance. A decoded variant (`NAME@N/`, variants.py) is
such an instance too, with its own slot over its dataset's manifest, gone with the dataset.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kspeedfs.client import on_mount
from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.contract.node import DatasetEntry
from kspeedfs.format.errors import DataError, KSpeedError, NotFound
from kspeedfs.fuse.counters import SOURCE_SLOTS, SharedCounters
from kspeedfs.fuse.datasets import INDEX_MASK, SLOT_SHIFT, MountedDataset
from kspeedfs.fuse.kernel import (
    OPCODE_NAMES,
    ROOT_INODE,
    Attr,
    Buffer,
    FuseError,
    PackedListing,
    ReadResult,
    StatFs,
)
from kspeedfs.fuse.listings import pack_folder
from kspeedfs.fuse.variants import TarFiles, VariantFiles, ViewOf
from kspeedfs.system.readthrough_view import ReadThroughDataset

log = logging.getLogger(__name__)

ROOT = ROOT_INODE
# An instance's contents never change, and an unloaded instance's names are forgotten by the
# kernel (datasets.py) and its inodes answered ESTALE: its entries and attributes may be kept
# as long as it lives. (The kernel caps the time; a 32-bit count of seconds is 136 years.)
DATA_TIMEOUT = float((1 << 32) - 1)
LISTING_BYTES = 64 << 20  # per process: packed folder listings kept (most recently used)
BLKSIZE = 128 * 1024
TOP_TIMEOUT = 1.0  # the top-level list changes with preload/unload
TOP_WAIT = 0.5  # how long a request at the root waits for the node's list
LOOKUP_WAIT = 2.0  # and a lookup of a name not known yet
ENOATTR = errno.ENODATA
CHECKSUM_XATTR = b"user.kspeedfs.xxh3"
STATS_XATTR = b"user.kspeedfs.stats"
SOURCES_XATTR = b"user.kspeedfs.sources"
DATASET_XATTR = on_mount.DATASET_XATTR.encode()  # what a path on the mount is (on_mount.py)
SLOT_WAIT = 5.0  # how long a worker waits to hear of an instance another one serves already


class Supervisor(Protocol):
    """What a serving process asks of the mount's supervisor."""

    def ask_refresh(self, force: bool, wait: float) -> None:
        """Have the list refreshed (at most once a second unless forced); wait up to `wait`."""
        ...

    def wait_invalidations(self, timeout: float) -> None:
        """Wait for the kernel to have forgotten the names of datasets dropped so far."""
        ...


class KSpeedFS:
    def __init__(
        self,
        reader: ClusterReader,
        supervisor: Supervisor,
        dataset: str | None = None,
        counters: SharedCounters | None = None,
        row: int = 0,
    ):
        self.reader = reader
        self.supervisor = supervisor
        self.single = dataset  # serve this dataset at the root instead of one folder each
        self.counters = counters
        self.row = row  # this process's row of the counters (where its source counts go)
        self.by_slot: dict[int, MountedDataset] = {}
        self.by_name: dict[str, MountedDataset] = {}
        self.uid, self.gid = os.getuid(), os.getgid()
        # "source": the source's modes and owners, checked by the kernel (default_permissions)
        self.source_access = reader.settings.access == "source"
        self.mounted_at_ns = time.time_ns()
        self._tables_lock = threading.Lock()  # one writer at a time (the control thread)
        # The highest slot the supervisor has told this process about (added or dropped): an
        # inode of a higher one was handed out by a faster worker, and its "add" is on its way.
        self._slots_heard = 0
        self._slots_changed = threading.Condition(self._tables_lock)
        # Packed listings by (slot, folder, plus), least recently used first.
        self._listings: OrderedDict[tuple[int, int, bool], PackedListing] = OrderedDict()
        self._listings_bytes = 0
        self._listings_lock = threading.Lock()

    # ---- the dataset list, as the supervisor reports it (control thread)

    def add(
        self, slot: int, name: str, uuid: str, info: DatasetEntry | None, view: ViewOf | None
    ) -> None:
        """Open an instance the supervisor numbered `slot` (blocking: maps its manifest), or a
        decoded variant or tar view of one already open (`view`: its manifest, its own slot)."""
        variant = None
        try:
            if view is not None:
                data, variant = self._open_variant(name, uuid, view)
            else:
                data = self.reader.open_dataset(name, info)
        except KSpeedError as e:
            log.error("cannot open dataset %s: %s", name, e)
            self._heard(slot)
            return
        with self._tables_lock:
            by_slot, by_name = dict(self.by_slot), dict(self.by_name)
            old = by_name.get(name)
            if old is not None:
                del by_slot[old.slot]
                self._forget_listings(old.slot)
                _release(old)
            by_slot[slot] = by_name[name] = MountedDataset(
                slot, name, uuid, data, info, variant, view
            )
            self.by_slot, self.by_name = by_slot, by_name
            self._slots_heard = max(self._slots_heard, slot)
            self._slots_changed.notify_all()

    def _heard(self, slot: int) -> None:
        with self._tables_lock:
            self._slots_heard = max(self._slots_heard, slot)
            self._slots_changed.notify_all()

    def _open_variant(
        self, name: str, uuid: str, view: ViewOf
    ) -> tuple[DatasetHandle, VariantFiles | TarFiles]:
        base = self.by_name.get(view.base)
        if base is None or base.uuid != uuid or base.variant is not None:
            raise NotFound(f"no instance {uuid[:8]} of {view.base} for {name}")
        if view.size is None:
            return base.data, TarFiles(self.reader, base.data)
        return base.data, VariantFiles(self.reader, base.data, view.size)

    def drop(self, slot: int) -> None:
        with self._tables_lock:
            mounted = self.by_slot.get(slot)
            if mounted is None:
                return
            by_slot, by_name = dict(self.by_slot), dict(self.by_name)
            del by_slot[slot]
            if by_name.get(mounted.name) is mounted:
                del by_name[mounted.name]
            self.by_slot, self.by_name = by_slot, by_name
            self._slots_heard = max(self._slots_heard, slot)
            self._slots_changed.notify_all()
        self._forget_listings(slot)
        _release(mounted)

    def drain_touches(self) -> list[tuple[str, str, list[int], int]]:
        """Read-through segments read since the last call, by dataset (the node's LRU cannot
        see reads of mapped segments)."""
        out = []
        for mounted in list(self.by_name.values()):
            if isinstance(mounted.data.local, ReadThroughDataset):
                segments, hits = mounted.data.local.drain_touches()
                if segments or hits:
                    out.append((mounted.name, mounted.uuid, segments, hits))
        return out

    # ---- inodes and attributes

    def _locate(self, inode: int) -> tuple[MountedDataset, int]:
        if inode == ROOT and self.single:
            mounted = self.by_name.get(self.single)
            if mounted is None:
                # Between two instances (the new one changed again while this worker opened
                # it, so the add failed and the old one went): ask now, as a lookup at the root
                # of a multi-dataset mount does, rather than fail until the next refresh.
                self.supervisor.ask_refresh(True, LOOKUP_WAIT)
                mounted = self.by_name.get(self.single)
            if mounted is None:
                raise FuseError(errno.EIO)
            return mounted, 0
        slot = inode >> SLOT_SHIFT
        mounted_or_none = self.by_slot.get(slot)
        if mounted_or_none is None and slot > self._slots_heard:
            mounted_or_none = self._wait_for_slot(slot)
        if mounted_or_none is None:
            # An instance that was unloaded (and forgotten): its inodes mean nothing now.
            raise FuseError(errno.ESTALE)
        return mounted_or_none, (inode & INDEX_MASK) - 1

    def _wait_for_slot(self, slot: int) -> MountedDataset | None:
        """Another worker answered a lookup in an instance this one is still opening: wait for
        the supervisor's word on it (briefly) rather than call it stale."""
        with self._slots_changed:
            self._slots_changed.wait_for(lambda: slot <= self._slots_heard, SLOT_WAIT)
        return self.by_slot.get(slot)

    def _inode(self, mounted: MountedDataset, idx: int) -> int:
        if idx == 0 and self.single:
            return ROOT
        return (mounted.slot << SLOT_SHIFT) | (idx + 1)

    def _attr(self, mounted: MountedDataset, idx: int, decide: bool = True) -> Attr:
        variant = mounted.variant
        fields = variant.stat_fields(idx) if isinstance(variant, TarFiles) else None
        mode, size, uid, gid, mtime_ns = fields or mounted.data.manifest.stat_fields(idx)
        final = True
        if isinstance(variant, VariantFiles):  # `decide`: a variant's image may be decoded now
            size, final = variant.file_size(idx, decide)
        return Attr(
            ino=self._inode(mounted, idx),
            mode=shown_mode(mode, self.source_access),
            size=size,
            nlink=2 if stat.S_ISDIR(mode) else 1,
            uid=uid if self.source_access else self.uid,
            gid=gid if self.source_access else self.gid,
            mtime_ns=mtime_ns,
            blksize=BLKSIZE,
            timeout=(TOP_TIMEOUT if idx == 0 else DATA_TIMEOUT) if final else 0.0,
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
            self.supervisor.ask_refresh(False, TOP_WAIT)
            # A path walk revalidates the root first: let it see the dropped names gone.
            self.supervisor.wait_invalidations(1.0)
            if not self.single:
                return self._root_attr()
        mounted, idx = self._locate(ino)
        return self._attr(mounted, idx)

    def lookup(self, parent: int, name: bytes) -> Attr | Buffer:
        if parent == ROOT and not self.single:
            self.supervisor.ask_refresh(False, TOP_WAIT)
            mounted = self.by_name.get(os.fsdecode(name))
            if mounted is None:  # loaded a moment ago? ask now rather than in a second
                self.supervisor.ask_refresh(True, LOOKUP_WAIT)
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
            if isinstance(mounted.variant, TarFiles):
                return self._attr(mounted, mounted.variant.parent(idx))
            return self._attr(mounted, int(mounted.data.manifest.parent[idx]))
        if mounted.variant is not None:
            found = mounted.variant.lookup(idx, name)
        else:
            found = mounted.data.manifest.lookup(idx, name)
        if found is None:
            raise FuseError(errno.ENOENT)
        packed = self._listings.get((mounted.slot, idx, True))
        if packed is not None:  # the folder was listed: its entry is packed already
            return packed.entry(found - mounted.data.manifest.children(idx).start)
        return self._attr(mounted, found)

    def listing(self, ino: int, plus: bool) -> PackedListing | None:
        """A dataset folder's replies, packed at its first listing and kept (LISTING_BYTES);
        None for the root of a multi-dataset mount and for variants (their sizes change as
        images are decided): those are packed per reply from `entries`."""
        if ino == ROOT and not self.single:
            return None
        mounted, idx = self._locate(ino)
        if mounted.variant is not None:
            return None
        key = (mounted.slot, idx, plus)
        with self._listings_lock:
            packed = self._listings.get(key)
            if packed is not None:
                self._listings.move_to_end(key)
                return packed
        m = mounted.data.manifest
        if not m.is_dir(idx):
            raise FuseError(errno.ENOTDIR)
        packed = pack_folder(
            m,
            idx,
            mounted.slot << SLOT_SHIFT,
            plus,
            self.source_access,
            self.uid,
            self.gid,
            int(DATA_TIMEOUT),
            BLKSIZE,
        )
        with self._listings_lock:
            if key not in self._listings:
                self._listings[key] = packed
                self._listings_bytes += len(packed.data)
            while self._listings_bytes > LISTING_BYTES and len(self._listings) > 1:
                _, old = self._listings.popitem(last=False)
                self._listings_bytes -= len(old.data)
        return packed

    def _forget_listings(self, slot: int) -> None:
        with self._listings_lock:
            for key in [k for k in self._listings if k[0] == slot]:
                self._listings_bytes -= len(self._listings.pop(key).data)

    def opendir(self, ino: int) -> bool:
        if ino == ROOT:
            self.supervisor.ask_refresh(False, TOP_WAIT)
            if not self.single:
                return False  # the top-level list changes: no cached listing
        mounted, idx = self._locate(ino)
        if isinstance(mounted.variant, TarFiles):
            is_dir = mounted.variant.is_dir(idx)
        else:
            is_dir = mounted.data.manifest.is_dir(idx)
        if not is_dir:
            raise FuseError(errno.ENOTDIR)
        return ino != ROOT  # a dataset's folders never change; the root of --dataset may

    def entries(self, ino: int, start: int) -> Iterator[tuple[bytes, Attr]]:
        if ino == ROOT and not self.single:
            by_name = self.by_name
            for top in sorted(by_name)[start:]:
                yield top.encode(), self._attr(by_name[top], 0)
            return
        mounted, idx = self._locate(ino)
        if isinstance(mounted.variant, TarFiles):
            for name, child in mounted.variant.children(idx)[start:]:
                yield name, self._attr(mounted, child)
            return
        assert mounted.variant is None or isinstance(mounted.variant, VariantFiles)
        m = mounted.data.manifest
        kids = m.children(idx)
        named = m.name if mounted.variant is None else mounted.variant.name
        for pos in range(start, len(kids)):
            child = int(kids[pos])
            yield named(child), self._attr(mounted, child, decide=False)

    def read(self, ino: int, offset: int, size: int) -> ReadResult:
        mounted, idx = self._locate(ino)
        if mounted.variant is not None:
            shown = mounted.variant.read(idx, offset, size)
            if shown is not None:
                return shown
        local = mounted.data.local
        if local is not None:
            try:
                return local.read_view(idx, offset, size)  # inline: no thread hop, no copy
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
            finally:
                self._note_sources()

        return blocking_read

    def _note_sources(self) -> None:
        """Copy where this process's cluster reads came from into its shared row."""
        if self.counters is not None:
            row = self.counters.row(self.row)
            for kind, slot in SOURCE_SLOTS.items():
                row[slot] = self.reader.stats[kind]

    def readlink(self, ino: int) -> bytes:
        mounted, idx = self._locate(ino)
        if isinstance(mounted.variant, TarFiles):
            target = mounted.variant.readlink(idx)
            if target is not None:
                return target
        m = mounted.data.manifest
        if not stat.S_ISLNK(int(m.mode[idx])):
            raise FuseError(errno.EINVAL)
        return m.link_target(idx)

    def statfs(self) -> StatFs:
        self.supervisor.ask_refresh(False, TOP_WAIT)
        datasets = [d for d in self.by_name.values() if d.variant is None]
        total = sum(d.data.manifest.nbytes + int(d.data.manifest.seg_len.sum()) for d in datasets)
        files = sum(d.data.manifest.entries for d in datasets) + 1
        return StatFs(blocks=(total + 4095) // 4096, files=files)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == STATS_XATTR and ino == ROOT:
            return json.dumps(self._stats()).encode()
        if name == SOURCES_XATTR and ino == ROOT:
            # Where cluster reads were served from (local/remote/source): failover at work.
            if self.counters is None:
                return json.dumps(dict(self.reader.stats)).encode()
            return json.dumps(self.counters.sources()).encode()
        if name == DATASET_XATTR:  # never listed: copies of the files must not carry it
            if ino == ROOT and not self.single:
                return on_mount.describe_attr("", "", "", "", False)
            mounted, idx = self._locate(ino)
            rel = os.fsdecode(mounted.data.manifest.path(idx))
            is_variant = mounted.variant is not None
            return on_mount.describe_attr(
                mounted.name, mounted.uuid, mounted.data.source, rel, is_variant
            )
        if name == CHECKSUM_XATTR and ino != ROOT:
            mounted, idx = self._locate(ino)
            if not _shown_decoded(mounted, idx) and mounted.data.manifest.is_file(idx):
                return b"%016x" % int(mounted.data.manifest.checksum[idx])
        raise FuseError(ENOATTR)

    def listxattr(self, ino: int) -> list[bytes]:
        if ino != ROOT or self.single:
            mounted, idx = self._locate(ino)
            if not _shown_decoded(mounted, idx) and mounted.data.manifest.is_file(idx):
                return [CHECKSUM_XATTR]
        return []

    def _stats(self) -> dict[str, Any]:
        """Requests by kind over every serving process, and requests by process."""
        if self.counters is None:
            return {}
        stats: dict[str, Any] = self.counters.totals(OPCODE_NAMES)
        stats["by_worker"] = self.counters.by_row()
        stats["uring"] = self.counters.ring_requests()
        return stats


def _shown_decoded(mounted: MountedDataset, idx: int) -> bool:
    """A variant's image, a tar view's tar (a folder) or member: its bytes are not those of a
    dataset file (no checksum to give)."""
    variant = mounted.variant
    if isinstance(variant, TarFiles):
        return not variant.shows_own_bytes(idx)
    return variant is not None and variant.is_image(idx)


def shown_mode(mode: int, source_access: bool) -> int:
    """The mode the mount answers: the source's less its write bits (access "source"), or
    0444/0555 for everyone (access "open"); a symlink's as it is."""
    if stat.S_ISLNK(mode):
        return mode
    if source_access:
        return mode & ~0o222
    return stat.S_IFMT(mode) | (0o555 if stat.S_ISDIR(mode) or mode & 0o111 else 0o444)


def _release(mounted: MountedDataset) -> None:
    if mounted.variant is not None:
        mounted.variant.close()  # the dataset's own maps are its instance's to release
        return
    if mounted.data.local is not None:
        mounted.data.local.release()  # its memory returns to the node's machine
