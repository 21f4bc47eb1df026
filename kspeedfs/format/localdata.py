"""A dataset held on this node: its manifest and its segments, mapped read-only.

Segments are never truncated while mapped (unload unlinks them), so a mapping stays valid
even after the dataset is unloaded: no SIGBUS, the memory returns when the last map closes.

One object is one instance: the folder is opened once and every segment is opened relative to
that folder's descriptor. When the dataset is unloaded and loaded again under the same name,
the new instance is a new folder at the same path; an old reader's lookups still go to the old
folder, whose segments are gone, so it gets an error (and fails over), never the new bytes.

A segment on the node's disk tier lies in the folder meta.json names ("disk_dir", one per
instance), opened once beside seg/; one moved to memory is renamed into seg/ before it leaves
the disk, so a lookup tries seg/, then the disk, then seg/ again.

Views are maps. A copy (`read`, `read_into`) comes from the segment's map too, while this
instance has fewer than MAPPED_SEGMENTS maps in this process: copying out of a map is the
faster here (bench_disk_tier: pread reads 0.80-0.82 of a fresh map's files/s, warm or cold page
cache). Past that, a copy of a disk-tier segment not mapped yet is read with pread from its open
file instead: every map stays until the instance is released, and a process copying from a disk
tier larger than memory would hold a map (and its page tables) of every segment it ever read,
up to the kernel's limit of maps a process (vm.max_map_count, 65530 by default).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.manifest import Manifest

MANIFEST_FILE = "manifest.ksm"
META_FILE = "meta.json"
SEGMENT_DIR = "seg"
MAPPED_SEGMENTS = 1024  # maps of an instance a process makes before copies of disk ones are preads
OPEN_DISK_FILES = 64  # disk-tier segments a process keeps open for pread
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


def segment_path(dataset_dir: Path, seg: int) -> Path:
    return dataset_dir / SEGMENT_DIR / f"{seg:08d}"


def read_meta(dataset_dir: Path) -> dict[str, Any]:
    with open(dataset_dir / META_FILE) as f:
        meta: dict[str, Any] = json.load(f)
    return meta


class LocalDataset:
    """Zero-copy access to one published dataset folder."""

    def __init__(self, path: str | os.PathLike[str]):
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
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()
        # Published datasets never change, so which segments are here is known once and for all.
        self.held = frozenset(_segments_in(self._seg_fd) | _segments_in(self._disk_fd))
        self._init_copies(os.fstat(self._dir_fd).st_dev if self._disk_fd >= 0 else None)

    def _init_copies(self, memory_dev: int | None) -> None:
        """Copies by pread: `memory_dev` is the device of the memory folder (a segment on
        another one is on the disk tier); None: every segment is in memory."""
        self._memory_dev = memory_dev
        # Per segment: its open file when it lies on the disk tier, None when in memory; the
        # most recent OPEN_DISK_FILES only, so a process reading a large disk tier does not
        # run out of descriptors (one dropped closes when its last reader lets go of it).
        self._disk_files: OrderedDict[int, io.FileIO | None] = OrderedDict()

    def __del__(self) -> None:
        # Closed only here, never in release(): a thread may still be opening a segment
        # relative to them, and a reused descriptor number would point elsewhere.
        fds = ("_seg_fd", "_dir_fd", "_disk_fd")
        for fd in (getattr(self, name, -1) for name in fds):
            if fd >= 0:
                os.close(fd)

    def _folders(self) -> list[int]:
        """Where a segment may lie: memory, the disk tier, memory again (moved meanwhile)."""
        if self._disk_fd < 0:
            return [self._seg_fd] if self._seg_fd >= 0 else []
        return [fd for fd in (self._seg_fd, self._disk_fd, self._seg_fd) if fd >= 0]

    def _open_segment(self, seg: int) -> int:
        """A descriptor of segment `seg` of this instance (FileNotFoundError once unloaded)."""
        for folder in self._folders():
            try:
                return os.open(
                    f"{seg:08d}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder
                )
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"no segment {seg} in {self.path}")

    def _stat_segment(self, seg: int) -> os.stat_result:
        for folder in self._folders():
            try:
                return os.stat(f"{seg:08d}", dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"no segment {seg} in {self.path}")

    def holds(self, seg: int) -> bool:
        return seg in self.held

    def holds_file(self, i: int) -> bool:
        return all(seg in self.held for seg, _, _ in self.manifest.ranges(i))

    @property
    def uuid(self) -> str:
        return self.manifest.uuid

    def segment(self, seg: int) -> mmap.mmap:
        m = self._maps.get(seg)
        if m is not None:
            return m
        with self._lock:
            m = self._maps.get(seg)
            if m is None:
                if seg not in self.held:
                    raise DataError(f"segment {seg} of {self.path.name} is not held on this node")
                try:
                    fd = self._open_segment(seg)
                    try:
                        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                except (OSError, ValueError) as e:
                    raise DataError(f"cannot map segment {seg} of {self.path.name}: {e}") from None
                if len(m) != int(self.manifest.seg_len[seg]):
                    raise DataError(f"segment {seg} of {self.path.name} has the wrong length")
                self._maps[seg] = m
        return m

    def release(self) -> None:
        """Stop using this instance (it was unloaded): its maps and files are dropped, not
        closed, since a reader may still hold one; each closes when its last reference goes."""
        with self._lock:
            self._maps.clear()
            self._disk_files.clear()
            self.held = frozenset()

    def _disk_file(self, seg: int) -> io.FileIO | None:
        """Segment `seg`'s open file when a copy of it is best read with pread (it lies on the
        disk tier, this process has no map of it and MAPPED_SEGMENTS of others); None: copy
        from its map."""
        if self._memory_dev is None or seg in self._maps or len(self._maps) < MAPPED_SEGMENTS:
            return None
        if seg not in self.held:
            raise DataError(f"segment {seg} of {self.path.name} is not held on this node")
        with self._lock:
            if seg in self._disk_files:
                self._disk_files.move_to_end(seg)
                return self._disk_files[seg]
            try:
                fd = self._open_segment(seg)
            except OSError as e:
                raise DataError(f"cannot open segment {seg} of {self.path.name}: {e}") from None
            opened = io.FileIO(fd, "rb", closefd=True)
            st = os.fstat(fd)
            f = None if st.st_dev == self._memory_dev else opened
            if f is None:
                opened.close()  # in memory: mapped
            elif st.st_size != int(self.manifest.seg_len[seg]):
                opened.close()
                raise DataError(f"segment {seg} of {self.path.name} has the wrong length")
            self._disk_files[seg] = f
            while len(self._disk_files) > OPEN_DISK_FILES:
                self._disk_files.popitem(last=False)  # not closed: a pread may be using it
        return f

    @property
    def has_disk_part(self) -> bool:
        """Whether segments of it may lie on the disk tier (else all are in memory)."""
        return self._memory_dev is not None

    def copies_by_pread(self, seg: int) -> bool:
        """Whether a copy of segment `seg` is read with pread rather than through a map."""
        try:
            return self._disk_file(seg) is not None
        except DataError:
            return False  # not here (any more): the read that follows says so

    def _check_range(self, seg: int, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > int(self.manifest.seg_len[seg]):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")

    def read_into(self, seg: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of segment `seg`, copied into `out`: from its map,
        or with preadv where the segment lies on the disk tier and is not mapped here."""
        f = self._disk_file(seg)
        if f is None:
            out[:] = self.view(seg, offset, len(out))
            return
        self._check_range(seg, offset, len(out))
        try:
            got = os.preadv(f.fileno(), [out], offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.path.name}: {e}") from None
        if got != len(out):  # its length was checked: it was cut short since
            raise DataError(f"segment {seg} of {self.path.name} ends early")

    def _copy(self, seg: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of segment `seg` (pread where that pays)."""
        f = self._disk_file(seg)
        if f is None:
            return self.view(seg, offset, length).tobytes()
        self._check_range(seg, offset, length)
        try:
            data = os.pread(f.fileno(), length, offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.path.name}: {e}") from None
        if len(data) != length:
            raise DataError(f"segment {seg} of {self.path.name} ends early")
        return data

    def view(self, seg: int, offset: int, length: int) -> memoryview:
        m = self.segment(seg)
        if offset < 0 or length < 0 or offset + length > len(m):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")
        return memoryview(m)[offset : offset + length]

    def file_view(self, i: int) -> memoryview:
        """The bytes of file i: a view of shared memory when it lies in one segment."""
        pieces = self.manifest.ranges(i)
        if not pieces:
            return memoryview(b"")
        if len(pieces) == 1:
            return self.view(*pieces[0])
        return memoryview(b"".join(self._copy(*p) for p in pieces))  # a copy anyway

    def read_view(self, i: int, offset: int, length: int) -> memoryview | bytes:
        """Bytes [offset, offset+length) of file i: a view of the segment where they lie in one
        (no copy: what FUSE writes to the kernel), else a joined copy."""
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) == 1:
            seg, off, n = pieces[0]
            return memoryview(self.segment(seg))[off : off + n]
        return self.read(i, offset, length)

    def read(self, i: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of file i (what FUSE hands to the kernel)."""
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) == 1:
            return self._copy(*pieces[0])
        return b"".join(self._copy(*p) for p in pieces)
