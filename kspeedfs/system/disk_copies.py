"""The disk-tier part of a local dataset: its segments' open files, pread, and their checks.

Unsealed disk-tier segments are never mapped: they are read with pread, and checked against
the manifest's checksums (xxh3_64) before their bytes are first served in this process. A disk
is what fails, and what another process may cut short: a map of a file truncated under it kills
its reader (SIGBUS) at the next touch of a page past the new end, while a pread just comes back
short. So:
- a read of a file with bytes on the disk tier reads the whole file and checks it against the
  file's checksum (xxh3_64, ~14 GB/s here) the first time this process reads it, and again
  whenever one of its disk segments changed since (every read fstats the segment's open file:
  its size, mtime and ctime, which a write, a truncation or an extension changes); a whole-file
  read (the fast path, kspeedfs://, most FUSE reads) costs only the hash, since it reads the
  whole file anyway. Other reads pread just the range asked for;
- a read by segment range (`view`, `read_into`: the node serving another node) checks the
  whole segment against its checksum instead, the first time and when it changed;
- sealed disk-tier segments are mapped (nobody can cut them short), each file checked the first
  time this process reads it, a read by segment range checking the whole segment once;
- every check is forgotten (the generation moves on) when a disk segment's stamp changes, when
  the node announces damage (system/damage.py) and when its scrubber completes a pass (at most
  every RECHECK_EVERY_S): bytes a long-lived process reads from the disk tier are checked again
  as often as the scrubber reads them, or every RECHECK_EVERY_S where it passes faster
  (docs/tiers.md);
- a segment whose size is not the manifest's, a read that comes back short, or bytes that fail
  their checksum raise DamagedSegment (the read goes elsewhere; the node is told).
"""

from __future__ import annotations

import array
import io
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import NoReturn, Protocol

import xxhash

from kspeedfs.format import localdata, sealing
from kspeedfs.format.errors import DataError
from kspeedfs.format.manifest import Manifest

# A scrub pass makes every disk-tier file be checked again on its next read, at most this
# often: on a disk tier the scrubber passes in seconds (bench_disk_tier's 125 MiB: every 2 s),
# a re-check at each pass cut the fast path's disk-tier files/s to 0.7 of before; real disk tiers
# pass in hours. The scrubber's own pass reads the same page cache the readers map.
RECHECK_EVERY_S = 10.0


class MappedSegments(Protocol):
    """What the disk tier's reads ask of the dataset that maps the other segments."""

    path: Path
    manifest: Manifest
    held: frozenset[int]
    lock: threading.Lock

    def open_segment(self, seg: int) -> int: ...
    def segment(self, seg: int) -> mmap.mmap: ...
    def mapped_view(self, seg: int, offset: int, length: int) -> memoryview: ...
    def found_damaged(self, segments: list[int], why: str) -> NoReturn: ...


class DiskCopies:
    """The disk-tier segments of one dataset (`ds`, a LocalDataset): `on_disk` the segments that lay on
    the disk tier when it was opened (one promoted since is still read as a disk one: checked,
    by pread, from memory once its disk file is gone); `memory_dev` the device of the memory
    folder (a segment on another one is on the disk tier)."""

    def __init__(self, ds: MappedSegments, on_disk: frozenset[int], memory_dev: int | None):
        # A proxy, not a reference: the dataset owns this, and a cycle would keep an unloaded
        # instance's maps (its manifest's too) until the cyclic collector ran.
        self.ds = weakref.proxy(ds)
        self.manifest = ds.manifest
        self.on_disk = on_disk
        self._memory_dev = memory_dev
        self._segment_size = ds.manifest.segment_size
        # Per segment: its open file when it lies on the disk tier, None when in memory; the
        # most recent OPEN_DISK_FILES only, so a process reading a large disk tier does not
        # run out of descriptors (one dropped closes when its last reader lets go of it).
        self.files: OrderedDict[int, io.FileIO | None] = OrderedDict()
        # Per file: the generation it was checked in, in this process (bytes of files on the
        # disk tier); a changed disk segment, damage news or a scrub pass starts a new one.
        self.file_ok = array.array("I", bytes(4 * ds.manifest.entries if on_disk else 0))
        self.generation = 1
        self.stamps: dict[int, tuple[int, int, int]] = {}  # disk segment: size, mtime, ctime
        self.seg_ok: set[int] = set()
        # Disk-tier segments found sealed: mapped (never dropped like the open files above).
        self.sealed: set[int] = set()
        self.rechecked = time.monotonic()  # when every check was last forgotten (a scrub pass)

    def forget(self, segments: list[int], scrub_pass: bool = False) -> None:
        """Drop the open files and checks of `segments`: the next read opens them again and
        checks what it reads. After a scrub pass, every check (at most every RECHECK_EVERY_S).
        Under the dataset's lock."""
        for seg in segments:
            self.files.pop(seg, None)
            self.seg_ok.discard(seg)
            self.stamps.pop(seg, None)
            self.sealed.discard(seg)
        everything = scrub_pass and time.monotonic() - self.rechecked >= RECHECK_EVERY_S
        if segments or everything:
            self.generation += 1
        if everything:
            self.seg_ok.clear()
            self.rechecked = time.monotonic()

    def file_checked(self, i: int) -> bool:
        """Whether file i (with bytes on the disk tier) was checked since its segments last
        changed, in this process."""
        return self.file_ok[i] == self.generation

    def copies_by_pread(self, seg: int) -> bool:
        """Whether segment `seg` is read with pread (it lies on the disk tier) rather than
        through a map."""
        try:
            return self.file(seg) is not None
        except DataError:
            return False  # not here (any more): the read that follows says so

    def file(self, seg: int) -> io.FileIO | None:
        """Segment `seg`'s open file when it lies on the disk tier (read with pread); None
        when it is in memory or sealed (mapped). Its size is checked when it is opened."""
        if seg not in self.on_disk or seg in self.sealed:
            return None
        if seg in self.files:
            try:
                return self.files[seg]
            except KeyError:
                pass  # let go of meanwhile
        ds = self.ds
        if seg not in ds.held:
            raise DataError(f"segment {seg} of {ds.path.name} is not held on this node")
        with ds.lock:
            if seg in self.files:
                self.files.move_to_end(seg)
                return self.files[seg]
            try:
                fd = ds.open_segment(seg)
            except OSError as e:
                raise DataError(f"cannot open segment {seg} of {ds.path.name}: {e}") from None
            opened = io.FileIO(fd, "rb", closefd=True)
            st = os.fstat(fd)
            on_disk = st.st_dev != self._memory_dev
            if on_disk and sealing.is_sealed(fd):
                # Sealed (the immutable flag: nobody can cut it short): mapped, as in memory.
                on_disk = False
                self.sealed.add(seg)
            wrong_size = st.st_size != int(self.manifest.seg_len[seg])
            if wrong_size:
                opened.close()
            else:
                f = opened if on_disk else None
                if f is None:
                    opened.close()  # moved to memory: mapped
                else:
                    self.stamps.setdefault(seg, (st.st_size, st.st_mtime_ns, st.st_ctime_ns))
                self.files[seg] = f
                while len(self.files) > localdata.OPEN_DISK_FILES:
                    self.files.popitem(last=False)  # not closed: a pread may be using it
        if wrong_size:  # (outside the lock, which found_damaged takes)
            ds.found_damaged([seg], "has the wrong size")
        return f

    def check_range(self, seg: int, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > int(self.manifest.seg_len[seg]):
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")

    def pread_into(self, f: io.FileIO, seg: int, offset: int, out: memoryview) -> None:
        """Bytes of disk segment `seg` by pread; DamagedSegment when they come back short."""
        self.check_range(seg, offset, len(out))
        try:
            got = os.preadv(f.fileno(), [out], offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.ds.path.name}: {e}") from None
        if got != len(out):  # its length was checked when opened: it was cut short since
            self.ds.found_damaged([seg], "ends early")

    def check_segment(self, seg: int, f: io.FileIO) -> None:
        """Disk segment `seg` against its checksum, once per generation (whole: a read by
        segment range has no file to check)."""
        if self.unchanged(seg, f) and seg in self.seg_ok:
            return
        expected = int(self.manifest.seg_checksum[seg])
        length = int(self.manifest.seg_len[seg])
        if os.fstat(f.fileno()).st_size != length:
            self.ds.found_damaged([seg], "has the wrong size")
        h = xxhash.xxh3_64()
        buf = memoryview(bytearray(min(localdata.HASH_CHUNK, length)))
        for pos in range(0, length, localdata.HASH_CHUNK):
            part = buf[: min(localdata.HASH_CHUNK, length - pos)]
            self.pread_into(f, seg, pos, part)
            h.update(part)
        if expected and h.intdigest() != expected:
            self.ds.found_damaged([seg], "fails its checksum")
        self.seg_ok.add(seg)

    def check_mapped(self, seg: int) -> None:
        """Mapped disk-tier segment `seg` (sealed) against its checksum, once per generation."""
        expected = int(self.manifest.seg_checksum[seg])
        if expected and xxhash.xxh3_64_intdigest(self.ds.segment(seg)) != expected:
            self.ds.found_damaged([seg], "fails its checksum")
        self.seg_ok.add(seg)

    def stale(self, i: int) -> tuple[bool, bool]:
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
                f = self.file(seg)
                if f is not None and not self.unchanged(seg, f):
                    changed = True
        if not touches:
            return False, False
        return changed or self.file_ok[i] != self.generation, changed

    def unchanged(self, seg: int, f: io.FileIO) -> bool:
        """Whether disk segment `seg` is as it was when last looked at (size, mtime and ctime:
        a write, a truncation or an extension changes them); a changed one starts a new
        generation (every file is checked again), a wrong size is damage."""
        st = os.fstat(f.fileno())
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if self.stamps.get(seg) == stamp:
            return True
        with self.ds.lock:
            if self.stamps.get(seg) != stamp:
                self.stamps[seg] = stamp
                self.generation += 1
                self.seg_ok.discard(seg)
        if st.st_size != int(self.manifest.seg_len[seg]):
            self.ds.found_damaged([seg], "has the wrong size")
        return False

    def check_file(self, i: int, data: memoryview | bytes, generation: int) -> None:
        """The whole of file i against its checksum (DamagedSegment when it fails); checked
        for `generation` (the one before `data` was read)."""
        expected = int(self.manifest.checksum[i])
        if expected and xxhash.xxh3_64_intdigest(data) != expected:
            segs = [seg for seg, _, _ in self.manifest.ranges(i) if seg in self.on_disk]
            self.ds.found_damaged(segs, f"fails the checksum of file {i}")
        self.file_ok[i] = generation

    def copy_into(self, seg: int, offset: int, out: memoryview) -> None:
        """Bytes of segment `seg` into `out`, unchecked: for reads of files, which check the
        file."""
        f = self.file(seg)
        if f is None:
            out[:] = self.ds.mapped_view(seg, offset, len(out))
        else:
            self.pread_into(f, seg, offset, out)

    def copy_file(self, i: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of file i into `out`, unchecked."""
        pos = 0
        for seg, off, n in self.manifest.ranges(i, offset, len(out)):
            self.copy_into(seg, off, out[pos : pos + n])
            pos += n

    def read_checked(self, i: int, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset+len(out)) of file i, each piece through the checks of the
        whole file."""
        generation = self.generation
        self.copy_file(i, offset, out)
        if not self.on_disk:
            return
        stale, changed = self.stale(i)
        if not stale:
            return
        size = int(self.manifest.size[i])
        whole = out if offset == 0 and len(out) == size else memoryview(bytearray(size))
        if changed or whole is not out:
            generation = self.generation  # read again, after the change was seen
            self.copy_file(i, 0, whole)
        self.check_file(i, whole, generation)
        if whole is not out:
            out[:] = whole[offset : offset + len(out)]

    def read_whole(self, i: int, f: io.FileIO, seg: int, off: int, size: int) -> bytes:
        """File i, which lies whole in disk segment `seg` at `off`, checked (as read_checked
        does, with the segment's stamp looked at after the read)."""
        generation = self.generation
        data = self.copy(seg, off, size)
        st = os.fstat(f.fileno())
        if (
            self.stamps.get(seg) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            and self.file_ok[i] == generation
        ):
            return data
        if not self.unchanged(seg, f):
            generation = self.generation  # read again, after the change was seen
            data = self.copy(seg, off, size)
        self.check_file(i, data, generation)
        return data

    def copy(self, seg: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of segment `seg` (pread on the disk tier;
        unchecked: for reads of files, which check the file)."""
        f = self.file(seg)
        if f is None:
            return self.ds.mapped_view(seg, offset, length).tobytes()
        self.check_range(seg, offset, length)
        try:
            data = os.pread(f.fileno(), length, offset)
        except OSError as e:
            raise DataError(f"cannot read segment {seg} of {self.ds.path.name}: {e}") from None
        if len(data) != length:
            self.ds.found_damaged([seg], "ends early")
        return data
