"""A dataset held on this node: its manifest and its segments, mapped read-only.

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
the disk, so a lookup tries seg/, then the disk, then seg/ again.

Memory segments are mapped (views are zero-copy), and so are sealed disk-tier segments (each
file checked against its checksum the first time this process reads it; a read by segment
range checks the whole segment once). Unsealed disk-tier segments are never mapped: they
are read with pread, and checked against the manifest's checksums (xxh3_64) before their
bytes are first served in this process. A disk is what fails, and what another process may
cut short: a map of a file truncated under it kills its reader (SIGBUS) at the next touch of
a page past the new end, while a pread just comes back short. So:
- a read of a file with bytes on the disk tier reads the whole file and checks it against the
  file's checksum (xxh3_64, ~14 GB/s here) the first time this process reads it, and again
  whenever one of its disk segments changed since (every read fstats the segment's open file:
  its size, mtime and ctime, which a write, a truncation or an extension changes); a whole-file
  read (the fast path, kspeedfs://, most FUSE reads) costs only the hash, since it reads the
  whole file anyway. Other reads pread just the range asked for;
- a read by segment range (`view`, `read_into`: the node serving another node) checks the
  whole segment against its checksum instead, the first time and when it changed;
- a segment whose size is not the manifest's, a read that comes back short, or bytes that fail
  their checksum raise DamagedSegment (a DataError: readers read elsewhere, from a replica or
  the source) and are reported to `on_damage` (the node quarantines and fetches it again).
The price of the unsealed path, measured in one process on the same folders (issue 28's
note): reads of disk-tier files run at 0.4-0.6 of the maps they replace (a pread, an fstat
and, the first time, the hash, against a copy out of a mapped page); memory-tier reads are
unchanged.
"""

from __future__ import annotations

import array
import io
import json
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kspeedfs.format import sealing
from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.manifest import Manifest

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.ksm"
META_FILE = "meta.json"
SEGMENT_DIR = "seg"
OPEN_DISK_FILES = 64  # disk-tier segments a process keeps open for pread
HASH_CHUNK = 4 << 20  # a whole segment is checked in reads of this size
DAMAGED_RETRY_S = 10.0  # a damaged segment nobody was told of is read elsewhere this long
REPORT_EVERY_S = 1.0  # a damaged segment is logged and reported at most this often
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# Told the segments a process found damaged (from any thread).
DamageReport = Callable[[list[int]], None]


class DamagedSegment(DataError):
    """Bytes of a disk-tier segment that are not the manifest's (flipped, cut short, grown):
    the read goes elsewhere, and the node is told (`segments`)."""

    def __init__(self, message: str, segments: list[int]):
        super().__init__(message)
        self.segments = segments


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
        self._maps: dict[int, mmap.mmap] = {}
        # Mapped segments without the immutable flag (sealing.py), by their open file: each use
        # of the map checks the file's size first (a short one is damaged, never a SIGBUS).
        self._watched: dict[int, io.FileIO] = {}
        # The maps with nothing to look at before a touch (sealed; a disk-tier one's file
        # still checked once): a gather's copy out of one is a dict lookup (read_piece_into).
        # Only LocalDataset.segment adds to it (a read-through dataset's maps are not in it).
        self._plain: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()
        # Published datasets never change, so which segments are here is known once and for all.
        disk = _segments_in(self._disk_fd)
        self.held = frozenset(_segments_in(self._seg_fd) | disk)
        memory_dev = os.fstat(self._dir_fd).st_dev if self._disk_fd >= 0 else None
        self._init_copies(memory_dev, disk, on_damage)

    def _init_copies(
        self, memory_dev: int | None, on_disk: set[int], on_damage: DamageReport | None
    ) -> None:
        """Reads of the disk tier: `memory_dev` is the device of the memory folder (a segment
        on another one is on the disk tier; None: every segment is in memory), `on_disk` the
        segments that lay on the disk tier when opened (one promoted since is still read as a
        disk one: checked, by pread, from memory once its disk file is gone)."""
        self._memory_dev = memory_dev
        self._segment_size = self.manifest.segment_size
        # Per segment: its open file when it lies on the disk tier, None when in memory; the
        # most recent OPEN_DISK_FILES only, so a process reading a large disk tier does not
        # run out of descriptors (one dropped closes when its last reader lets go of it).
        self._disk_files: OrderedDict[int, io.FileIO | None] = OrderedDict()
        self.on_disk = frozenset(on_disk) if self.checks_disk else frozenset()
        # Per file, per segment: checked in this process (bytes of files on the disk tier).
        # (as the generation it was checked in: a disk segment that changes starts a new one)
        self._file_ok = array.array("I", bytes(4 * self.manifest.entries if self.on_disk else 0))
        self._generation = 1
        self._stamps: dict[int, tuple[int, int, int]] = {}  # disk segment: size, mtime, ctime
        self._seg_ok: set[int] = set()
        # Disk-tier segments found sealed: mapped (never dropped like the open files above).
        self._sealed_disk: set[int] = set()
        self.on_damage = on_damage
        # Segments found damaged in this process that the node could not be told of, and when:
        # read elsewhere for DAMAGED_RETRY_S, then tried here again.
        self.damaged: dict[int, float] = {}
        self._reported: dict[int, float] = {}  # segment -> when it was last reported

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
        return seg in self.held and not (self.damaged and self._still_damaged(seg))

    def holds_file(self, i: int) -> bool:
        return all(self.holds(seg) for seg, _, _ in self.manifest.ranges(i))

    def _still_damaged(self, seg: int) -> bool:
        found = self.damaged.get(seg)
        if found is None:
            return False
        if time.monotonic() - found < DAMAGED_RETRY_S:
            return True
        self.damaged.pop(seg, None)  # tried again: the node may have fetched it again
        return False

    @property
    def uuid(self) -> str:
        return self.manifest.uuid

    def segment(self, seg: int) -> mmap.mmap:
        """A map of segment `seg`: a memory one, or a sealed disk-tier one (DataError for an
        unsealed disk-tier one: those are read by pread, see the module's docstring). The map
        of an unsealed segment has its file's size checked at each call (DamagedSegment when
        it is not the manifest's: cut short, a touch of the map could SIGBUS)."""
        m = self._maps.get(seg)
        if m is not None:
            if seg in self._watched:
                self._check_size(seg)
            return m
        if seg in self.on_disk and self._disk_file(seg) is not None:
            raise DataError(f"segment {seg} of {self.path.name} is on the disk tier: not mapped")
        wrong_size = False
        with self._lock:
            m = self._maps.get(seg)
            if m is None:
                if seg not in self.held:
                    raise DataError(f"segment {seg} of {self.path.name} is not held on this node")
                try:
                    fd = self._open_segment(seg)
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
        if wrong_size:  # (outside the lock, which _found_damaged takes)
            self._found_damaged([seg], "has the wrong size")
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
        self._found_damaged([seg], "has the wrong size")

    def file_checked(self, i: int) -> bool:
        """Whether file i (with bytes on the disk tier) was checked since its segments last
        changed, in this process."""
        return self._file_ok[i] == self._generation

    def maps_sealed(self, seg: int) -> bool:
        """Whether segment `seg` is mapped with nothing to check before each touch (sealed, or
        not mapped yet): the hot path may keep a view of it."""
        return seg not in self._watched

    def release(self) -> None:
        """Stop using this instance (it was unloaded): its maps and files are dropped, not
        closed, since a reader may still hold one; each closes when its last reference goes."""
        with self._lock:
            self._maps.clear()
            self._watched.clear()
            self._plain.clear()
            self._disk_files.clear()
            self.held = frozenset()

    def _disk_file(self, seg: int) -> io.FileIO | None:
        """Segment `seg`'s open file when it lies on the disk tier (read with pread); None
        when it is in memory or sealed (mapped). Its size is checked when it is opened."""
        if seg not in self.on_disk or seg in self._sealed_disk:
            return None
        if seg in self._disk_files:
            try:
                return self._disk_files[seg]
            except KeyError:
                pass  # let go of meanwhile
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
            on_disk = st.st_dev != self._memory_dev
            if on_disk and sealing.is_sealed(fd):
                # Sealed (the immutable flag: nobody can cut it short): mapped, as in memory.
                on_disk = False
                self._sealed_disk.add(seg)
            wrong_size = st.st_size != int(self.manifest.seg_len[seg])
            if wrong_size:
                opened.close()
            else:
                f = opened if on_disk else None
                if f is None:
                    opened.close()  # moved to memory: mapped
                else:
                    self._stamps.setdefault(seg, (st.st_size, st.st_mtime_ns, st.st_ctime_ns))
                self._disk_files[seg] = f
                while len(self._disk_files) > OPEN_DISK_FILES:
                    self._disk_files.popitem(last=False)  # not closed: a pread may be using it
        if wrong_size:  # (outside the lock, which _found_damaged takes)
            self._found_damaged([seg], "has the wrong size")
        return f

    def _found_damaged(self, segments: list[int], why: str) -> None:
        """Bytes of `segments` are not the manifest's: forget their open files and maps (the
        node fetches them again), tell on_damage once, raise DamagedSegment."""
        with self._lock:
            for seg in segments:
                self._disk_files.pop(seg, None)
                self._seg_ok.discard(seg)
                # A map cut short (left alone), or a sealed disk one damaged below the flag:
                # dropped, so that the next read maps the file again (the node's new copy
                # once it fetched one; a reader's view of the old map keeps it alive).
                if self._watched.pop(seg, None) is not None or seg in self._sealed_disk:
                    self._maps.pop(seg, None)
                    self._plain.pop(seg, None)
                    self._sealed_disk.discard(seg)
            now = time.monotonic()
            new = [s for s in segments if now - self._reported.get(s, -1e9) >= REPORT_EVERY_S]
            self._reported.update((s, now) for s in new)
        names = ", ".join(str(s) for s in segments)
        if new:
            log.error("%s: segment %s %s; reading elsewhere", self.path.name, names, why)
            told = False
            if self.on_damage is not None:
                try:
                    self.on_damage(new)
                    told = True
                except Exception as e:  # telling the node is best effort: its scrubber finds it
                    log.warning("%s: could not report damaged segments: %s", self.path.name, e)
            if not told:
                # Nobody fetches it again soon: read it elsewhere for a while. (Told, the node
                # checks it, quarantines it, and the next read here opens its new copy.)
                with self._lock:
                    self.damaged.update((s, now) for s in new)
        raise DamagedSegment(f"segment {names} of {self.path.name} {why}", segments)

    def _pread_into(self, f: io.FileIO, seg: int, offset: int, out: memoryview) -> None:
        """Bytes of disk segment `seg` by pread; DamagedSegment when they come back short."""
        self._check_range(seg, offset, len(out))
        try:
            got = os.preadv(f.fileno(), [out], offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.path.name}: {e}") from None
        if got != len(out):  # its length was checked when opened: it was cut short since
            self._found_damaged([seg], "ends early")

    def _check_segment(self, seg: int, f: io.FileIO) -> None:
        """Disk segment `seg` against its checksum, once per process (whole: a read by
        segment range has no file to check)."""
        if self._unchanged(seg, f) and seg in self._seg_ok:
            return
        expected = int(self.manifest.seg_checksum[seg])
        length = int(self.manifest.seg_len[seg])
        if os.fstat(f.fileno()).st_size != length:
            self._found_damaged([seg], "has the wrong size")
        h = xxhash.xxh3_64()
        buf = memoryview(bytearray(min(HASH_CHUNK, length)))
        for pos in range(0, length, HASH_CHUNK):
            part = buf[: min(HASH_CHUNK, length - pos)]
            self._pread_into(f, seg, pos, part)
            h.update(part)
        if expected and h.intdigest() != expected:
            self._found_damaged([seg], "fails its checksum")
        self._seg_ok.add(seg)

    def _mapped_view(self, seg: int, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) of mapped segment `seg`, unchecked (for reads of
        files, which check the file)."""
        m = self.segment(seg)
        if offset < 0 or length < 0 or offset + length > len(m):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")
        return memoryview(m)[offset : offset + length]

    def _check_mapped(self, seg: int) -> None:
        """Mapped disk-tier segment `seg` (sealed) against its checksum, once per process."""
        expected = int(self.manifest.seg_checksum[seg])
        if expected and xxhash.xxh3_64_intdigest(self.segment(seg)) != expected:
            self._found_damaged([seg], "fails its checksum")
        self._seg_ok.add(seg)

    @property
    def has_disk_part(self) -> bool:
        """Whether segments of it may lie on the disk tier (else all are in memory)."""
        return bool(self.on_disk)

    def copies_by_pread(self, seg: int) -> bool:
        """Whether segment `seg` is read with pread (it lies on the disk tier) rather than
        through a map."""
        try:
            return self._disk_file(seg) is not None
        except DataError:
            return False  # not here (any more): the read that follows says so

    def _check_range(self, seg: int, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > int(self.manifest.seg_len[seg]):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")

    def read_into(self, seg: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of segment `seg`, copied into `out`: from its map,
        or with preadv where the segment lies on the disk tier (checked whole, once)."""
        f = self._disk_file(seg)
        if f is None:
            out[:] = self.view(seg, offset, len(out))
            return
        self._check_segment(seg, f)
        self._pread_into(f, seg, offset, out)

    def _copy_into(self, seg: int, offset: int, out: memoryview) -> None:
        """read_into, unchecked: for reads of files, which check the file."""
        f = self._disk_file(seg)
        if f is None:
            out[:] = self._mapped_view(seg, offset, len(out))
        else:
            self._pread_into(f, seg, offset, out)

    def view(self, seg: int, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) of segment `seg`: a view of its map, or a checked
        copy where it lies on the disk tier."""
        if seg in self.on_disk:
            f = self._disk_file(seg)
            if f is not None:
                self._check_segment(seg, f)
                out = memoryview(bytearray(length))
                self._pread_into(f, seg, offset, out)
                return out
            if seg not in self._seg_ok:  # mapped (sealed): checked whole, once
                self._check_mapped(seg)
        m = self.segment(seg)
        if offset < 0 or length < 0 or offset + length > len(m):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")
        return memoryview(m)[offset : offset + length]

    # Reads of files: one with bytes on the disk tier is checked the first time this process
    # reads it, and again once its segment changed (see the module's docstring).

    def _stale(self, i: int) -> tuple[bool, bool]:
        """After a read of file i: whether the bytes read must be checked (it has bytes on the
        disk tier, and this process has not checked it since its disk segments last changed),
        and whether one of them changed since it was last looked at (then they are read
        again: what was read may predate the change). Looked at after the read: a write, a
        truncation or an extension changes a file's times before its bytes, so bytes read
        before the segment's stamp is seen unchanged are the bytes that were checked."""
        start, size = int(self.manifest.data[i]), int(self.manifest.size[i])
        first, last = start // self._segment_size, (start + max(size, 1) - 1) // self._segment_size
        touches = changed = False
        for seg in range(first, last + 1):
            if seg in self.on_disk:
                touches = True
                f = self._disk_file(seg)
                if f is not None and not self._unchanged(seg, f):
                    changed = True
        if not touches:
            return False, False
        return changed or self._file_ok[i] != self._generation, changed

    def _unchanged(self, seg: int, f: io.FileIO) -> bool:
        """Whether disk segment `seg` is as it was when last looked at (size, mtime and ctime:
        a write, a truncation or an extension changes them); a changed one starts a new
        generation (every file is checked again), a wrong size is damage."""
        st = os.fstat(f.fileno())
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if self._stamps.get(seg) == stamp:
            return True
        with self._lock:
            if self._stamps.get(seg) != stamp:
                self._stamps[seg] = stamp
                self._generation += 1
                self._seg_ok.discard(seg)
        if st.st_size != int(self.manifest.seg_len[seg]):
            self._found_damaged([seg], "has the wrong size")
        return False

    def _check_file(self, i: int, data: memoryview | bytes, generation: int) -> None:
        """The whole of file i against its checksum (DamagedSegment when it fails); checked
        for `generation` (the one before `data` was read)."""
        expected = int(self.manifest.checksum[i])
        if expected and xxhash.xxh3_64_intdigest(data) != expected:
            segs = [seg for seg, _, _ in self.manifest.ranges(i) if seg in self.on_disk]
            self._found_damaged(segs, f"fails the checksum of file {i}")
        self._file_ok[i] = generation

    def _copy_file(self, i: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of file i into `out`, unchecked."""
        pos = 0
        for seg, off, n in self.manifest.ranges(i, offset, len(out)):
            self._copy_into(seg, off, out[pos : pos + n])
            pos += n

    def read_file_into(self, i: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of file i, copied into `out` (checked as the
        module's docstring says)."""
        pieces = self.manifest.ranges(i, offset, len(out))
        if len(pieces) == 1:
            self.read_piece_into(i, offset, pieces[0][0], pieces[0][1], out)
        else:
            self._read_checked(i, offset, out)

    def _read_checked(self, i: int, offset: int, out: memoryview) -> None:
        """read_file_into, each piece through the checks of the whole file."""
        generation = self._generation
        self._copy_file(i, offset, out)
        if not self.on_disk:
            return
        stale, changed = self._stale(i)
        if not stale:
            return
        size = int(self.manifest.size[i])
        whole = out if offset == 0 and len(out) == size else memoryview(bytearray(size))
        if changed or whole is not out:
            generation = self._generation  # read again, after the change was seen
            self._copy_file(i, 0, whole)
        self._check_file(i, whole, generation)
        if whole is not out:
            out[:] = whole[offset : offset + len(out)]

    def read_piece_into(self, i: int, offset: int, seg: int, off: int, out: memoryview) -> None:
        """read_file_into for bytes of file i that lie in one segment: `seg` at `off`, as
        manifest.ranges gave them (the gather's pieces). The same checks, with the per-read
        work kept to a dict lookup for a sealed map (on the disk tier, once the file was
        checked in this generation), or a pread and an fstat for an unsealed disk-tier
        segment (its stamp looked at after the read, as _stale does)."""
        n = len(out)
        m = self._plain.get(seg)
        if m is not None and (seg not in self.on_disk or self._file_ok[i] == self._generation):
            if off < 0 or off + n > len(m):
                raise DataError(f"range {off}+{n} past the end of segment {seg}")
            out[:] = memoryview(m)[off : off + n]
            return
        if seg not in self.on_disk:  # an unsealed memory map (its size checked), or not mapped yet
            out[:] = self.view(seg, off, n)
            return
        if self._file_ok[i] == self._generation:
            f = self._disk_files.get(seg)
            if f is not None:  # unsealed on the disk tier: pread, then its stamp looked at
                self._pread_into(f, seg, off, out)
                st = os.fstat(f.fileno())
                if self._stamps.get(seg) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                    return
                # changed since: read and checked again, below
        self._read_checked(i, offset, out)

    def _read_whole(self, i: int, f: io.FileIO, seg: int, off: int, size: int) -> bytes:
        """File i, which lies whole in disk segment `seg` at `off`, checked (as read_file_into
        does, with the segment's stamp looked at after the read)."""
        generation = self._generation
        data = self._copy(seg, off, size)
        st = os.fstat(f.fileno())
        if (
            self._stamps.get(seg) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            and self._file_ok[i] == generation
        ):
            return data
        if not self._unchanged(seg, f):
            generation = self._generation  # read again, after the change was seen
            data = self._copy(seg, off, size)
        self._check_file(i, data, generation)
        return data

    def _copy(self, seg: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of segment `seg` (pread on the disk tier;
        unchecked: for reads of files, which check the file)."""
        f = self._disk_file(seg)
        if f is None:
            return self._mapped_view(seg, offset, length).tobytes()
        self._check_range(seg, offset, length)
        try:
            data = os.pread(f.fileno(), length, offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.path.name}: {e}") from None
        if len(data) != length:
            self._found_damaged([seg], "ends early")
        return data

    def mapped_file(self, i: int, seg: int, off: int, end: int) -> memoryview | None:
        """File i, which lies whole in segment `seg` (one that lay on the disk tier) at
        [off, end): a view of its map when the segment is mapped (sealed on the disk tier, or
        moved to memory), checked against the file's checksum the first time this process
        reads it; None when it is read by pread (unsealed on the disk tier)."""
        if self._disk_file(seg) is not None:
            return None
        view = memoryview(self.segment(seg))[off:end]
        generation = self._generation
        if self._file_ok[i] != generation:
            self._check_file(i, view, generation)
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
        return memoryview(b"".join(self._copy(*p) for p in pieces))  # a copy anyway

    def read_view(self, i: int, offset: int, length: int) -> memoryview | bytes:
        """Bytes [offset, offset+length) of file i: a view of the segment where they lie in one
        memory segment (no copy: what FUSE writes to the kernel), else a joined copy."""
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) != 1:
            return self.read(i, offset, length)
        seg, off, n = pieces[0]
        if seg not in self.on_disk:
            return memoryview(self.segment(seg))[off : off + n]
        if self._file_ok[i] == self._generation and (
            seg in self._sealed_disk or self._disk_file(seg) is None
        ):  # a mapped disk one, checked already
            return self._mapped_view(seg, off, n)
        whole = self.manifest.ranges(i)
        if len(whole) == 1 and (  # a mapped disk one: checked whole, once
            self.mapped_file(i, seg, whole[0][1], whole[0][1] + whole[0][2]) is not None
        ):
            return memoryview(self.segment(seg))[off : off + n]
        return self.read(i, offset, length)

    def read(self, i: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of file i (what FUSE hands to the kernel)."""
        if self.on_disk:
            size = int(self.manifest.size[i])
            seg, off = divmod(int(self.manifest.data[i]), self._segment_size)
            if offset == 0 and length >= size and size and off + size <= self._segment_size:
                # A whole file in one segment (most): pread's own bytes, no buffer to zero.
                f = self._disk_file(seg)
                if f is not None:
                    return self._read_whole(i, f, seg, off, size)
                generation = self._generation  # mapped (sealed): checked once
                data = self._mapped_view(seg, off, size).tobytes()
                if self._file_ok[i] != generation:
                    self._check_file(i, data, generation)
                return data
            n = max(0, min(length, size - offset))
            out = bytearray(n)
            self.read_file_into(i, offset, memoryview(out))
            return bytes(out)
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) == 1:
            return self._copy(*pieces[0])
        return b"".join(self._copy(*p) for p in pieces)
