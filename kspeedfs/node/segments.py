"""The placement of segments: which segments of its published datasets this node holds, and
where each lies, in the shm folder or on the disk tier. A segment is added (a heal, a
rebalance), dropped, moved from disk to memory (`promote`), checked and quarantined here; and
a record's `held`, `stored`, `disk` and `disk_stored` change only here, the read-through
cache's fills and evictions included (`cached`, `evicted`).

A segment is made beside its folder and renamed in (a reader never sees part of one), counted
in meta.json and then the record under the budgets' lock, and unlinked when it goes (a reader
that mapped it keeps valid pages).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import xxhash

from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.errors import NoSpace, NotFound
from kspeedfs.format.localdata import HASH_CHUNK, DamagedSegment, segment_path
from kspeedfs.format.units import format_size
from kspeedfs.node.budget import Budgets
from kspeedfs.node.records import DatasetRecord, rewrite_meta
from kspeedfs.node.safedir import (
    DIR_FLAGS,
    FILE_MODE,
    closing_fd,
    seal_segment,
    unlink_segment,
    unseal_segment,
)
from kspeedfs.system.local_dataset import LocalDataset

log = logging.getLogger(__name__)


class SegmentPlaces:
    """Owned by the store (`SegmentStore.segments`), over its dataset table, its budgets and
    its folders (filled in when the store recovers)."""

    def __init__(
        self,
        datasets: Mapping[str, DatasetRecord],
        budgets: Budgets,
        folders: Mapping[str, int],
        open_dataset: Callable[[str], LocalDataset],
        reopen: Callable[[str], None],
        disk_root: Path | None = None,
    ):
        self.datasets = datasets
        self.budgets = budgets
        self.disk_root = disk_root
        # "datasets" and "tier" -> open folder (the store's: open once it recovered)
        self._folders = folders
        self.open = open_dataset  # the dataset as readers map it now (the store's cache)
        self._reopen = reopen  # forget that map: the dataset's segments changed
        self._lock = budgets.lock

    def _dataset_folder(self, name: str) -> int:
        """A descriptor of the folder of published dataset `name`."""
        return os.open(name, DIR_FLAGS, dir_fd=self._folders["datasets"])

    def memory_cap_room(self, record: DatasetRecord) -> int | None:
        """Bytes of segments a preloaded dataset may still add to memory under its cap (None:
        no cap; a read-through dataset's cap is the read-through cache's to keep)."""
        if not record.max_memory or record.lifetime == READTHROUGH:
            return None
        seg_len = self.open(record.name).manifest.seg_len
        on_disk = set(record.disk)
        return record.max_memory - sum(int(seg_len[k]) for k in record.held if k not in on_disk)

    def add_segment(
        self, name: str, seg: int, length: int, fill: Callable[[memoryview], None]
    ) -> None:
        """Add a segment this node did not hold to a published dataset: `fill` writes its
        `length` bytes straight into the new file's mapping (a heal receives from a peer into
        it: no buffer between the socket and tmpfs) and raises to have it thrown away. Made
        beside the segment folder, then renamed into it, so a reader never sees part of one;
        meta.json and the record learn it; the next open() maps it. When memory has no room
        for it, it goes to the disk tier (where there is one)."""
        record = self.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        # Reserved while it arrives, so that a preload admitted meanwhile does not count on
        # the same bytes; counted in the dataset's bytes once it is in place.
        reservation = f"segment:{name}:{seg}:{uuid.uuid4().hex[:12]}"
        what = f"segment {seg} of {name}"
        try:
            room = self.memory_cap_room(record)
            if room is not None and length > room:
                raise NoSpace(f"{what} would take it past its --max-memory on this node")
            # Called in a thread: no eviction (the read-through cache is the event loop's).
            self.budgets.reserve(reservation, length, what=what, evict=False)
            place = self._add_segment
        except NoSpace:
            if self.disk_root is None or record.lifetime == READTHROUGH:
                raise
            if record.max_disk and record.disk_stored + length > record.max_disk:
                raise NoSpace(f"{what} would take it past its --max-disk on this node") from None
            self.budgets.reserve(
                reservation, length, what=what, tier="disk", evict=False, over_giving=True
            )
            place = self._add_disk_segment
        try:
            place(record, seg, length, fill, reservation)
        finally:
            self.budgets.release(reservation)

    def _add_disk_segment(
        self,
        record: DatasetRecord,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        reservation: str,
    ) -> None:
        """add_segment onto the disk tier: made in the instance's disk folder, as in memory."""
        assert self.disk_root is not None
        disk_dir = self.disk_root / f"{record.name}.{record.uuid}"
        with closing_fd(
            open_disk_instance(self._folders["tier"], disk_dir.name, create=True)
        ) as disk_fd:
            self._put_segment(disk_fd, seg, length, fill, seal=True)
        folder = self._dataset_folder(record.name)
        with closing_fd(folder), self._lock:
            held = sorted(set(record.held) | {seg})
            disk = sorted(set(record.disk) | {seg})
            stored = record.disk_stored + length
            changes = {"held": held, "disk": disk, "disk_stored": stored}
            rewrite_meta(folder, 0, **changes, disk_dir=str(disk_dir))
            record.held, record.disk, record.disk_stored = held, disk, stored
            self.budgets.drop_claim(reservation)
            self._reopen(record.name)

    def _add_segment(
        self,
        record: DatasetRecord,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        reservation: str,
    ) -> None:
        name = record.name
        folder = self._dataset_folder(name)
        try:
            self._put_segment(folder, seg, length, fill, seal=record.lifetime != READTHROUGH)
            with self._lock:
                held = sorted(set(record.held) | {seg})
                rewrite_meta(folder, length, held=held)
                record.held = held
                record.stored += length
                self.budgets.drop_claim(reservation)
                self._reopen(name)
        finally:
            os.close(folder)

    def drop_segment(self, name: str, seg: int) -> int:
        """Remove a segment this node no longer owns (its new owners hold it). Unlinked, so a
        reader that mapped it keeps valid pages; meta.json and the record forget it. Returns
        the bytes freed."""
        folder = self._dataset_folder(name)
        try:
            with self._lock:
                record = self.datasets.get(name)
                if record is None or seg not in record.held:
                    return 0
                if seg in record.disk:
                    return self._drop_disk_segment(folder, record, seg)
                seg_fd = os.open("seg", DIR_FLAGS, dir_fd=folder)
                # What it counts in the budget (a damaged one may be cut short, grown or gone).
                size = int(self.open(name).manifest.seg_len[seg])
                try:
                    unlink_segment(seg_fd, f"{seg:08d}")
                except FileNotFoundError:
                    pass  # gone already (a damaged one found missing): forgotten only
                finally:
                    os.close(seg_fd)
                held = [k for k in record.held if k != seg]
                rewrite_meta(folder, -size, held=held)
                record.held = held
                record.stored -= size
                self._reopen(name)
        finally:
            os.close(folder)
        self.budgets.memory_freed()
        return size

    def _drop_disk_segment(self, folder: int, record: DatasetRecord, seg: int) -> int:
        """drop_segment of a disk-tier segment. Called under the lock."""
        assert self.disk_root is not None
        path = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        # What it counts in the disk budget (a damaged one's file may be cut short or gone).
        size = int(self.open(record.name).manifest.seg_len[seg])
        with contextlib.suppress(FileNotFoundError):
            unlink_segment(None, str(path))
        held = [k for k in record.held if k != seg]
        disk = [k for k in record.disk if k != seg]
        rewrite_meta(folder, 0, held=held, disk=disk, disk_stored=record.disk_stored - size)
        record.held, record.disk, record.disk_stored = held, disk, record.disk_stored - size
        self._reopen(record.name)
        return size

    def segment_file(self, name: str, seg: int) -> tuple[Path, int, int] | None:
        """Where held segment `seg` of static dataset `name` lies, its length and checksum
        (None: not held here, or a read-through dataset's, whose cache checks its own)."""
        record = self.datasets.get(name)
        if record is None or seg not in record.held or record.lifetime == READTHROUGH:
            return None
        m = self.open(name).manifest
        if seg in record.disk and self.disk_root is not None:
            path = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        else:
            path = segment_path(record.path, seg)
        return path, int(m.seg_len[seg]), int(m.seg_checksum[seg])

    def verify_segment(self, name: str, seg: int) -> str:
        """Why held segment `seg` of `name` is damaged ("": sound, or not held here)."""
        where = self.segment_file(name, seg)
        if where is None:
            return ""
        try:
            return segment_fault(*where)
        except FileNotFoundError:
            return ""  # dropped or moved meanwhile: whoever did it had it sound

    def quarantine(self, name: str, seg: int, why: str) -> int:
        """Take damaged segment `seg` of `name` out of service: unlinked (a reader that has
        it open finds it damaged too, and reads elsewhere), forgotten by meta.json and the
        record, so that it can be fetched again. Returns its bytes (0: not held here)."""
        log.error("segment %d of %s %s: quarantined, to be fetched again", seg, name, why)
        return self.drop_segment(name, seg)

    def promote(self, name: str, seg: int) -> int:
        """Move disk-tier segment `seg` of `name` into memory: copied into the shm folder
        (through a mapping, as a heal is), renamed in, then counted in memory and unlinked
        from disk (a reader finds it in either place, and a map of the disk file stays
        valid). NoSpace when memory has no room for it; returns the bytes moved (0 when it
        is not on disk any more)."""
        record = self.datasets.get(name)
        if record is None or seg not in record.disk or self.disk_root is None:
            return 0
        disk_file = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        length = int(disk_file.stat().st_size)
        room = self.memory_cap_room(record)
        if room is not None and length > room:
            raise NoSpace(f"segment {seg} of {name} would take it past its --max-memory")
        reservation = f"promote:{name}:{seg}:{uuid.uuid4().hex[:12]}"
        self.budgets.reserve(reservation, length, what=f"segment {seg} of {name}", evict=False)
        try:
            expected = int(self.open(name).manifest.seg_checksum[seg])
            what = f"segment {seg} of {name}"
            fill = functools.partial(_copy_checked, disk_file, seg, expected, what)
            folder = self._dataset_folder(name)
            with closing_fd(folder):
                self._put_segment(folder, seg, length, fill, seal=True)
                with self._lock:
                    if self.datasets.get(name) is not record or seg not in record.disk:
                        # Unloaded, or the segment dropped (a rebalance), meanwhile.
                        with contextlib.suppress(FileNotFoundError):
                            unlink_segment(folder, f"seg/{seg:08d}")
                        return 0
                    disk = [k for k in record.disk if k != seg]
                    rewrite_meta(folder, length, disk=disk, disk_stored=record.disk_stored - length)
                    record.disk, record.disk_stored = disk, record.disk_stored - length
                    record.stored += length
                    self.budgets.drop_claim(reservation)
                    self._reopen(name)
                    unlink_segment(None, str(disk_file))
        finally:
            self.budgets.release(reservation)
        return length

    def _put_segment(
        self,
        folder: int,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        seal: bool,
    ) -> None:
        """Write segment `seg` into dataset folder `folder`'s seg/: made beside it, filled
        by `fill`, renamed in (a reader never sees part of one; one there already, a
        leftover, is unsealed first), then sealed when `seal` (a sealed file cannot be
        renamed: a reader that opens it in between finds it unsealed, and reads it as one)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir("seg", 0o750, dir_fd=folder)
        tmp = f".seg-{seg}.{uuid.uuid4().hex[:12]}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, FILE_MODE, dir_fd=folder)
        try:
            _fill_file(fd, length, fill)
            with closing_fd(os.open("seg", DIR_FLAGS, dir_fd=folder)) as seg_fd:
                unseal_segment(seg_fd, f"{seg:08d}")
                os.rename(tmp, f"{seg:08d}", src_dir_fd=folder, dst_dir_fd=seg_fd)
            if seal:
                seal_segment(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(fd)

    @staticmethod
    def copy_from_disk(
        disk_file: Path, dest: Path, seg: int, length: int, checksum: int, what: str
    ) -> None:
        """The copy of a read-through promotion, which the cache renames in itself: disk-tier
        segment `seg`, file `disk_file`, into new file `dest` of the shm folder, as `promote`
        copies a preload's (through a mapping, checked on the way: DamagedSegment, where
        `what` names it). Its caller removes `dest` when this fails."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with closing_fd(os.open(dest, flags, FILE_MODE)) as fd:
            _fill_file(fd, length, functools.partial(_copy_checked, disk_file, seg, checksum, what))

    # The read-through cache's segments: their places are the cache's (its fills, evictions
    # and promotions, on its event loop), not meta.json's; only the record counts them here.
    @staticmethod
    def cached(record: DatasetRecord, seg: int, length: int) -> None:
        """Read-through segment `seg` of `record` is in memory now (a fill, a promotion)."""
        record.held.append(seg)
        record.stored += length

    @staticmethod
    def evicted(record: DatasetRecord, seg: int, length: int) -> None:
        """Read-through segment `seg` of `record` left memory."""
        with contextlib.suppress(ValueError):
            record.held.remove(seg)
        record.stored -= length

    @staticmethod
    def found(record: DatasetRecord, held: list[int], stored: int) -> None:
        """A read-through instance opened: the segments found in memory, and its bytes."""
        record.held, record.stored = held, stored

    @staticmethod
    def files_counted(record: DatasetRecord, nbytes: int) -> None:
        """Files added to (or, negative, removed from) a published instance's folder."""
        record.stored += nbytes


def open_disk_instance(tier: int, key: str, create: bool = False) -> int:
    """A descriptor of the disk tier's (`tier`) folder `key` (NAME.UUID), made when `create`;
    never through a symlink (OSError)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(key, 0o750, dir_fd=tier)
    return os.open(key, DIR_FLAGS, dir_fd=tier)


def segment_fault(path: Path, length: int, checksum: int) -> str:
    """Why the segment file at `path` is damaged: not `length` bytes long, or (when
    `checksum`) its bytes fail it; "" when sound. Read with pread (never mapped: a file cut
    short under a map would kill the node). FileNotFoundError when it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != length:
            return "has the wrong size"
        if not checksum:
            return ""
        h = xxhash.xxh3_64()
        buf = memoryview(bytearray(min(HASH_CHUNK, length)))
        for pos in range(0, length, HASH_CHUNK):
            part = buf[: min(HASH_CHUNK, length - pos)]
            if os.preadv(fd, [part], pos) != len(part):
                return "ends early"
            h.update(part)
        return "" if h.intdigest() == checksum else "fails its checksum"
    finally:
        os.close(fd)


def _copy_checked(path: Path, seg: int, checksum: int, what: str, view: memoryview) -> None:
    """Fill `view` with the disk copy at `path`, checked before it joins memory: DamagedSegment
    (naming `what`) when it is shorter or longer than `view` or fails `checksum` (0: none)."""
    with open(path, "rb") as src:
        done = 0
        while done < len(view):
            n = src.readinto(view[done:])
            if not n:
                raise DamagedSegment(f"{what} is short", [seg])
            done += n
        if src.read(1):
            raise DamagedSegment(f"{what} is too long", [seg])
    if checksum and xxhash.xxh3_64_intdigest(view) != checksum:
        raise DamagedSegment(f"{what} fails its checksum", [seg])


def _fill_file(fd: int, length: int, fill: Callable[[memoryview], None]) -> None:
    """Give the file `fd` its `length` bytes of tmpfs pages (ENOSPC now, not on a page fault)
    and have `fill` write them through a mapping populated up front."""
    if length == 0:
        fill(memoryview(b""))
        return
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as e:
        raise NoSpace(f"cannot allocate a segment of {format_size(length)}: {e.strerror}") from None
    mapped = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    try:
        with memoryview(mapped) as view:
            fill(view)
    finally:
        with contextlib.suppress(BufferError):  # a view kept by a traceback: unmapped with it
            mapped.close()
