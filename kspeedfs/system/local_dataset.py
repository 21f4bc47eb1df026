"""A dataset held on this node, as a reading process maps it: its manifest and its segments.

Segments are never truncated by the node while mapped (unload unlinks them), so a mapping
stays valid even after the dataset is unloaded; the memory returns when the last map closes.
Against anyone else cutting one short, a node run as root seals its segments (the immutable
flag: sealing.py): a sealed segment is mapped with nothing more to check; the map of an
unsealed memory segment has its file's size checked (fstat) at each use, a wrong size being a
damaged segment (DamagedSegment: read elsewhere), never a SIGBUS, except for a view already
handed out when the file is cut (docs/tiers.md, "Sealed segments").

One object is one instance: the folder is opened once and every segment is opened relative to
that folder's descriptor. When the dataset is unloaded and loaded again under the same name,
the new instance is a new folder at the same path; an old reader's lookups still go to the old
folder, whose segments are gone, so it gets an error (and fails over), never the new bytes.

A segment on the node's disk tier lies in the folder meta.json names ("disk_dir", one per
instance), opened once beside seg/; one moved to memory is renamed into seg/ before it leaves
the disk, so a lookup tries seg/, then the disk, then seg/ again. Its reads and checks are
disk_copies.py's. Every read first asks the instance's damage news (damage.py: one load);
on news it drops its maps and checks of the damaged segments, and opens them again.

The price of the unsealed disk path, measured in one process on the same folders (issue 28's
note): reads of disk-tier files run at 0.4-0.6 of the maps they replace (a pread, an fstat
and, the first time, the hash, against a copy out of a mapped page); memory-tier reads are
unchanged.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import threading
from pathlib import Path
from typing import NoReturn

from kspeedfs.format import sealing
from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.localdata import (
    MANIFEST_FILE,
    META_FILE,
    SEGMENT_DIR,
    DamagedSegment,
    DamageReport,
)
from kspeedfs.format.manifest import Manifest
from kspeedfs.system.damage import DamageNews, DamageReports
from kspeedfs.system.disk_copies import DiskCopies

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _disk_dir(dir_fd: int) -> str:
    """The disk-tier folder meta.json names ("" when it names none, or cannot be read)."""
    try:
        fd = os.open(META_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd) as f:
            value = json.load(f).get("disk_dir", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) and os.path.isabs(value) else ""


def _segments_in(folder: int) -> set[int]:
    """The segment numbers in a folder (none when it is not open)."""
    if folder < 0:
        return set()
    try:
        return {int(n) for n in os.listdir(folder) if n.isdigit()}
    except OSError:
        return set()


class LocalDataset:
    """Zero-copy access to one published dataset folder."""

    # Whether disk-tier segments are read by pread and checked against the manifest (a
    # read-through dataset's manifest has no checksums: its fills check their own).
    checks_disk = True

    def __init__(self, path: str | os.PathLike[str], *, on_damage: DamageReport | None = None):
        """`on_damage` is told, from any thread, the segments this process found damaged (the
        node's own reads tell its scrubber; a reader tells its node)."""
        self.path = Path(path)
        self._dir_fd = self._seg_fd = self._disk_fd = -1
        try:
            self._dir_fd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            raise NotFound(f"no dataset folder {self.path}") from None
        except OSError as e:
            raise DataError(f"cannot open dataset folder {self.path}: {e.strerror}") from None
        self.manifest = Manifest(self.path / MANIFEST_FILE, dir_fd=self._dir_fd)
        try:
            self._seg_fd = os.open(SEGMENT_DIR, _DIR_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass  # no segment of it is held here
        disk_dir = _disk_dir(self._dir_fd)
        if disk_dir:
            try:
                self._disk_fd = os.open(os.path.join(disk_dir, SEGMENT_DIR), _DIR_FLAGS)
            except OSError:
                pass  # unloaded meanwhile: its segments are gone from both tiers
        # Published datasets never change, so which segments are here is known once and for all.
        disk = _segments_in(self._disk_fd)
        held = frozenset(_segments_in(self._seg_fd) | disk)
        memory_dev = os.fstat(self._dir_fd).st_dev if self._disk_fd >= 0 else None
        news = DamageNews.open(self._dir_fd, self.manifest.segments)
        self._start(held, disk, memory_dev, on_damage, news)

    def _start(
        self,
        held: frozenset[int],
        on_disk: set[int],
        memory_dev: int | None,
        on_damage: DamageReport | None,
        news: DamageNews,
    ) -> None:
        """The state of reading: `held` the segments here, `on_disk` those that lay on the disk
        tier when opened, `memory_dev` the memory folder's device (None: all in memory)."""
        self.held = held
        self._maps: dict[int, mmap.mmap] = {}
        # Mapped segments without the immutable flag (sealing.py), by their open file: each use
        # of the map checks the file's size first (a short one is damaged, never a SIGBUS).
        self._watched: dict[int, io.FileIO] = {}
        # The maps with nothing to look at before a touch (sealed; a disk-tier one's file
        # still checked once): a gather's copy out of one is a dict lookup (read_piece_into).
        # Only LocalDataset.segment adds to it (a read-through dataset's maps are not in it).
        self._plain: dict[int, mmap.mmap] = {}
        self.lock = threading.Lock()
        self.on_disk = frozenset(on_disk) if self.checks_disk else frozenset()
        self.disk = DiskCopies(self, self.on_disk, memory_dev)
        self.reports = DamageReports(self.path.name, on_damage)
        self.news = news
        self._news = news.words  # (the one load every read pays: a word of shared memory)
        # Maps let go of so far: a reader that keeps views of them (dataset_reader) lets its
        # own go when this moves, so that it never serves a map other than the one checked.
        self.dropped = 0

    def __del__(self) -> None:
        # Closed only here, never in release(): a thread may still be opening a segment
        # relative to them, and a reused descriptor number would point elsewhere.
        fds = ("_seg_fd", "_dir_fd", "_disk_fd")
        for fd in (getattr(self, name, -1) for name in fds):
            if fd >= 0:
                os.close(fd)

    def open_segment(self, seg: int) -> int:
        """A descriptor of segment `seg` of this instance (FileNotFoundError once unloaded):
        in memory, on the disk tier, in memory again (moved meanwhile)."""
        for folder in (self._seg_fd, self._disk_fd, self._seg_fd):
            if folder < 0:
                continue
            try:
                return os.open(
                    f"{seg:08d}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder
                )
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"no segment {seg} in {self.path}")

    def stat_segment(self, seg: int) -> os.stat_result:
        for folder in (self._seg_fd, self._disk_fd, self._seg_fd):
            if folder < 0:
                continue
            try:
                return os.stat(f"{seg:08d}", dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"no segment {seg} in {self.path}")

    def holds(self, seg: int) -> bool:
        return seg in self.held and not (self.reports.damaged and self.reports.still_damaged(seg))

    def holds_file(self, i: int) -> bool:
        return all(self.holds(seg) for seg, _, _ in self.manifest.ranges(i))

    @property
    def uuid(self) -> str:
        return self.manifest.uuid

    def listen(self) -> int:
        """Take the node's damage news, if any: the maps and checks of the segments found
        damaged since are dropped (the next read opens them again: the node's new copy, or
        none), and after a scrub pass every disk-tier check. The generation heard."""
        news = self.news
        if self._news[0] != news.seen:
            with self.lock:
                damaged, passed = news.take()
                for seg in damaged:
                    self._drop_map(seg)
                self.disk.forget(damaged, scrub_pass=passed)
        return news.seen

    def _drop_map(self, seg: int) -> None:
        """Forget the map of `seg` (dropped, not closed: a reader's view keeps it alive; the
        next read maps the file again, the node's new copy once it fetched one)."""
        self.dropped += 1
        self._maps.pop(seg, None)
        self._plain.pop(seg, None)
        self._watched.pop(seg, None)

    def segment(self, seg: int) -> mmap.mmap:
        """A map of segment `seg`: a memory one, or a sealed disk-tier one (DataError for an
        unsealed disk-tier one: those are read by pread, see disk_copies.py). The map of an
        unsealed segment has its file's size checked at each call (DamagedSegment when it is
        not the manifest's: cut short, a touch of the map could SIGBUS)."""
        if self._news[0] != self.news.seen:
            self.listen()
        m = self._maps.get(seg)
        if m is not None:
            if seg in self._watched:
                self._check_size(seg)
            return m
        if seg in self.on_disk and self.disk.file(seg) is not None:
            raise DataError(f"segment {seg} of {self.path.name} is on the disk tier: not mapped")
        wrong_size = False
        with self.lock:
            m = self._maps.get(seg)
            if m is None:
                if seg not in self.held:
                    raise DataError(f"segment {seg} of {self.path.name} is not held on this node")
                try:
                    fd = self.open_segment(seg)
                    try:
                        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                    except BaseException:
                        os.close(fd)
                        raise
                except (OSError, ValueError) as e:
                    raise DataError(f"cannot map segment {seg} of {self.path.name}: {e}") from None
                if len(m) != int(self.manifest.seg_len[seg]):
                    os.close(fd)
                    wrong_size = True
                else:
                    if sealing.is_sealed(fd):
                        os.close(fd)  # nobody can cut it short: the map is safe to touch
                        self._plain[seg] = m
                    else:  # (closed when the last user lets go of it)
                        self._watched[seg] = io.FileIO(fd, "rb", closefd=True)
                    self._maps[seg] = m
        if wrong_size:  # (outside the lock, which found_damaged takes)
            self.found_damaged([seg], "has the wrong size")
        return m

    def _check_size(self, seg: int) -> None:
        """An unsealed mapped segment's file is still the manifest's length (_cut_short
        when not)."""
        f = self._watched.get(seg)
        if f is None:
            return
        try:
            size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError):
            return
        if size != int(self.manifest.seg_len[seg]):
            self._cut_short(seg)

    def _cut_short(self, seg: int) -> None:
        """Mapped segment `seg`'s file is not its length: a damaged segment (DamagedSegment:
        its map is dropped, the read goes elsewhere, the node is told)."""
        self.found_damaged([seg], "has the wrong size")

    def maps_sealed(self, seg: int) -> bool:
        """Whether segment `seg` is mapped with nothing to check before each touch (sealed, or
        not mapped yet): the hot path may keep a view of it."""
        return seg not in self._watched

    def release(self) -> None:
        """Stop using this instance (it was unloaded): its maps and files are dropped, not
        closed, since a reader may still hold one; each closes when its last reference goes."""
        with self.lock:
            self.dropped += 1
            self._maps.clear()
            self._watched.clear()
            self._plain.clear()
            self.disk.files.clear()
            self.held = frozenset()

    def found_damaged(self, segments: list[int], why: str) -> NoReturn:
        """Bytes of `segments` are not the manifest's: forget their open files and maps (the
        node fetches them again), tell on_damage once, raise DamagedSegment."""
        with self.lock:
            for seg in segments:
                # A map cut short (left alone), or a sealed disk one damaged below the flag:
                # dropped, so that the next read maps the file again (the node's new copy
                # once it fetched one; a reader's view of the old map keeps it alive).
                if seg in self._watched or seg in self.disk.sealed:
                    self._drop_map(seg)
            self.disk.forget(segments)
        self.reports.report(segments, why)
        names = ", ".join(str(s) for s in segments)
        raise DamagedSegment(f"segment {names} of {self.path.name} {why}", segments)

    def mapped_view(self, seg: int, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) of mapped segment `seg`, unchecked (for reads of
        files, which check the file)."""
        m = self.segment(seg)
        if offset < 0 or length < 0 or offset + length > len(m):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")
        return memoryview(m)[offset : offset + length]

    def read_into(self, seg: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of segment `seg`, copied into `out`: from its map,
        or with preadv where the segment lies on the disk tier (checked whole, once)."""
        if self._news[0] != self.news.seen:
            self.listen()
        f = self.disk.file(seg)
        if f is None:
            out[:] = self.view(seg, offset, len(out))
            return
        self.disk.check_segment(seg, f)
        self.disk.pread_into(f, seg, offset, out)

    def view(self, seg: int, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) of segment `seg`: a view of its map, or a checked
        copy where it lies on the disk tier."""
        if self._news[0] != self.news.seen:
            self.listen()
        if seg in self.on_disk:
            disk = self.disk
            f = disk.file(seg)
            if f is not None:
                disk.check_segment(seg, f)
                out = memoryview(bytearray(length))
                disk.pread_into(f, seg, offset, out)
                return out
            if seg not in disk.seg_ok:  # mapped (sealed): checked whole, once
                disk.check_mapped(seg)
        return self.mapped_view(seg, offset, length)

    # Reads of files: one with bytes on the disk tier is checked the first time this process
    # reads it, and again once its segment changed or the node announced news (disk_copies.py).

    def read_file_into(self, i: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of file i, copied into `out` (checked as
        disk_copies.py says)."""
        pieces = self.manifest.ranges(i, offset, len(out))
        if len(pieces) == 1:
            self.read_piece_into(i, offset, pieces[0][0], pieces[0][1], out)
        else:
            if self._news[0] != self.news.seen:
                self.listen()
            self.disk.read_checked(i, offset, out)

    def read_piece_into(self, i: int, offset: int, seg: int, off: int, out: memoryview) -> None:
        """read_file_into for bytes of file i that lie in one segment: `seg` at `off`, as
        manifest.ranges gave them (the gather's pieces). The same checks, with the per-read
        work kept to a dict lookup for a sealed map (on the disk tier, once the file was
        checked in this generation), or a pread and an fstat for an unsealed disk-tier
        segment (its stamp looked at after the read, as DiskCopies.stale does)."""
        if self._news[0] != self.news.seen:
            self.listen()
        n = len(out)
        disk = self.disk
        m = self._plain.get(seg)
        if m is not None and (seg not in self.on_disk or disk.file_ok[i] == disk.generation):
            if off < 0 or off + n > len(m):
                raise DataError(f"range {off}+{n} past the end of segment {seg}")
            out[:] = memoryview(m)[off : off + n]
            return
        if seg not in self.on_disk:  # an unsealed memory map (its size checked), or not mapped yet
            out[:] = self.view(seg, off, n)
            return
        if disk.file_ok[i] == disk.generation:
            f = disk.files.get(seg)
            if f is not None:  # unsealed on the disk tier: pread, then its stamp looked at
                disk.pread_into(f, seg, off, out)
                st = os.fstat(f.fileno())
                if disk.stamps.get(seg) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                    return
                # changed since: read and checked again, below
        disk.read_checked(i, offset, out)

    def mapped_file(self, i: int, seg: int, off: int, end: int) -> memoryview | None:
        """File i, which lies whole in segment `seg` (one that lay on the disk tier) at
        [off, end): a view of its map when the segment is mapped (sealed on the disk tier, or
        moved to memory), checked against the file's checksum the first time this process
        reads it; None when it is read by pread (unsealed on the disk tier)."""
        if self._news[0] != self.news.seen:
            self.listen()
        disk = self.disk
        if disk.file(seg) is not None:
            return None
        view = memoryview(self.segment(seg))[off:end]
        generation = disk.generation
        if disk.file_ok[i] != generation:
            disk.check_file(i, view, generation)
        return view

    def file_view(self, i: int) -> memoryview:
        """The bytes of file i: a view of shared memory when it lies in one mapped segment,
        else a (checked) copy."""
        pieces = self.manifest.ranges(i)
        if not pieces:
            return memoryview(b"")
        if self.on_disk and any(seg in self.on_disk for seg, _, _ in pieces):
            if len(pieces) == 1:
                seg, off, n = pieces[0]
                view = self.mapped_file(i, seg, off, off + n)
                if view is not None:
                    return view
            return memoryview(self.read(i, 0, int(self.manifest.size[i])))
        if len(pieces) == 1:
            return self.view(*pieces[0])
        return memoryview(b"".join(self.disk.copy(*p) for p in pieces))  # a copy anyway

    def read_view(self, i: int, offset: int, length: int) -> memoryview | bytes:
        """Bytes [offset, offset+length) of file i: a view of the segment where they lie in one
        memory segment (no copy: what FUSE writes to the kernel), else a joined copy."""
        if self._news[0] != self.news.seen:
            self.listen()
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) != 1:
            return self.read(i, offset, length)
        seg, off, n = pieces[0]
        if seg not in self.on_disk:
            return memoryview(self.segment(seg))[off : off + n]
        disk = self.disk
        if disk.file_ok[i] == disk.generation and (
            seg in disk.sealed or disk.file(seg) is None
        ):  # a mapped disk one, checked already
            return self.mapped_view(seg, off, n)
        whole = self.manifest.ranges(i)
        if len(whole) == 1 and (  # a mapped disk one: checked whole, once
            self.mapped_file(i, seg, whole[0][1], whole[0][1] + whole[0][2]) is not None
        ):
            return memoryview(self.segment(seg))[off : off + n]
        return self.read(i, offset, length)

    def read(self, i: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of file i (what FUSE hands to the kernel)."""
        if self._news[0] != self.news.seen:
            self.listen()
        disk = self.disk
        if self.on_disk:
            size = int(self.manifest.size[i])
            seg, off = divmod(int(self.manifest.data[i]), self.manifest.segment_size)
            if offset == 0 and length >= size and size and off + size <= self.manifest.segment_size:
                # A whole file in one segment (most): pread's own bytes, no buffer to zero.
                f = disk.file(seg)
                if f is not None:
                    return disk.read_whole(i, f, seg, off, size)
                generation = disk.generation  # mapped (sealed): checked once
                data = self.mapped_view(seg, off, size).tobytes()
                if disk.file_ok[i] != generation:
                    disk.check_file(i, data, generation)
                return data
            n = max(0, min(length, size - offset))
            out = bytearray(n)
            self.read_file_into(i, offset, memoryview(out))
            return bytes(out)
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) == 1:
            return disk.copy(*pieces[0])
        return b"".join(disk.copy(*p) for p in pieces)
