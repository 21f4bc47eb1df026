"""Copies the files of some segments of a scanned source tree into staging, checksumming them.

Runs in worker threads of a node daemon. The kernel copies each file into its segment file
(sendfile: one copy, no page faults on the mapping), then it is hashed in place through the
map. A node loads only the segments that placement gives it; a file lying wholly in those
segments gets its checksum here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import xxhash

from .errors import DataError, KSpeedError
from .localdata import segment_path
from .scan import Tree


@dataclasses.dataclass
class Progress:
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    state: str = "loading"
    source: str = ""
    error: str = ""
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)

    def to_wire(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "state": self.state,
            "source": self.source,
            "files_total": self.files_total,
            "bytes_total": self.bytes_total,
            "files_done": self.files_done,
            "bytes_done": self.bytes_done,
            "elapsed": elapsed,
            "error": self.error,
        }


def manifest_size_estimate(tree: Tree) -> int:
    """Bytes of the manifest: about 60 bytes an entry plus the names."""
    names = sum(len(n) for n in tree.names) + sum(len(t) for t in tree.link_target.values())
    return 64 * len(tree) + names + 65536


def files_in(tree: Tree, offsets: list[int], segment_size: int, held: Collection[int]) -> list[int]:
    """Regular, non-empty files with at least one byte in the held segments, in tree order."""
    out = []
    for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
        if stat.S_ISREG(mode) and size:
            first = offsets[i] // segment_size
            last = (offsets[i] + size - 1) // segment_size
            if any(k in held for k in range(first, last + 1)):
                out.append(i)
    return out


def create_segment(staging: Path, seg: int, length: int) -> int:
    """A new segment file in staging with its tmpfs pages claimed (ENOSPC up front); its fd."""
    fd = os.open(segment_path(staging, seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as e:
        os.close(fd)
        raise DataError(f"cannot allocate segment {seg}: {e.strerror}") from None
    return fd


LOAD_THREADS = 2  # copying is CPU-bound (tmpfs page allocation, hashing): one run per core


def load_segments(
    source: Path,
    tree: Tree,
    offsets: list[int],
    seg_len: list[int],
    held: Collection[int],
    staging: Path,
    segment_size: int,
    progress: Progress,
    seg_checksums: dict[int, int] | None = None,
) -> dict[int, int]:
    """Fill staging/seg/ with the held segments; returns {entry: checksum} for the files that
    lie wholly in held segments (the others are checksummed by whoever holds all of them).

    Segments are filled one at a time (only one segment's fd and mapping open per thread:
    ImageNet has thousands of segments) by LOAD_THREADS threads, each taking a contiguous run
    of segments. A file split between two runs gets no checksum here, like one split between
    nodes. When `seg_checksums` is given it receives each segment's checksum, computed while
    the bytes are hot instead of in a second pass."""
    held_sorted = sorted(set(held))
    todo = files_in(tree, offsets, segment_size, set(held_sorted))
    progress.files_total = len(todo)
    progress.bytes_total = sum(tree.size[i] for i in todo)
    # (file, offset in file, offset in segment, length) for every piece, per held segment.
    pieces: dict[int, list[tuple[int, int, int, int]]] = {seg: [] for seg in held_sorted}
    for i in todo:
        pos, done, size = offsets[i], 0, tree.size[i]
        while done < size:
            seg, seg_off = divmod(pos, segment_size)
            n = min(size - done, segment_size - seg_off)
            if seg in pieces:
                pieces[seg].append((i, done, seg_off, n))
            pos += n
            done += n
    src = os.fsencode(source)
    lock = threading.Lock()
    checksums: dict[int, int] = {}
    sums: dict[int, int] = {}

    def run(segs: list[int]) -> None:
        hashers: dict[int, Any] = {}  # files started in this run, by entry
        for seg in segs:
            fd = create_segment(staging, seg, seg_len[seg])
            try:
                with mmap.mmap(fd, seg_len[seg]) as m:
                    sums[seg] = _fill_segment(
                        seg, m, fd, pieces[seg], src, tree, hashers, checksums, progress, lock
                    )
            finally:
                os.close(fd)

    # A run may start only where no file continues from the segment before: every file then
    # lies in one run and gets its checksum here.
    clean = {seg for seg, ps in pieces.items() if not ps or ps[0][1] == 0}
    runs = _contiguous_runs(held_sorted, seg_len, LOAD_THREADS, clean)
    if len(runs) <= 1:
        for r in runs:
            run(r)
    else:
        with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
            for fut in [pool.submit(run, r) for r in runs]:
                fut.result()
    if seg_checksums is not None:
        seg_checksums.update(sums)
    return checksums


def _fill_segment(
    seg: int,
    m: mmap.mmap,
    seg_fd: int,
    seg_pieces: list[tuple[int, int, int, int]],
    src: bytes,
    tree: Tree,
    hashers: dict[int, Any],
    checksums: dict[int, int],
    progress: Progress,
    lock: threading.Lock,
) -> int:
    """Copy one segment's pieces in order; returns the segment's checksum."""
    seg_hasher = xxhash.xxh3_64()
    covered = 0
    for i, file_off, seg_off, n in seg_pieces:
        if progress.cancel.is_set():
            raise KSpeedError("preload cancelled")
        path = src + b"/" + tree.path(i)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
        dest = memoryview(m)[seg_off : seg_off + n]
        try:
            _fill(fd, file_off, seg_fd, seg_off, dest, path)
            if file_off == 0:
                hashers[i] = (xxhash.xxh3_64(), 0)
            hasher, expected = hashers.get(i, (None, -1))
            if hasher is not None and expected == file_off:
                hasher.update(dest)
                hashers[i] = (hasher, file_off + n)
            else:  # a piece is missing (held elsewhere, or in another run): no checksum here
                hashers.pop(i, None)
            seg_hasher.update(dest)
            last = file_off + n == tree.size[i]
            if last and os.pread(fd, 1, tree.size[i]):
                raise DataError(f"source changed while loading (longer): {os.fsdecode(path)}")
        except OSError as e:
            raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
        finally:
            dest.release()
            os.close(fd)
        covered += n
        with lock:
            progress.bytes_done += n
            if last:
                progress.files_done += 1
                h, _ = hashers.pop(i, (None, 0))
                if h is not None:
                    checksums[i] = h.intdigest()
    if covered != len(m):  # pieces always tile a segment; if not, hash what is there
        return xxhash.xxh3_64_intdigest(m)
    return seg_hasher.intdigest()


def _contiguous_runs(
    segs: list[int], seg_len: list[int], n: int, can_start: set[int]
) -> list[list[int]]:
    """Split segments into at most n contiguous runs of about equal bytes, each starting at a
    segment in `can_start`."""
    total = sum(seg_len[k] for k in segs)
    runs: list[list[int]] = [[]]
    acc = 0
    for k in segs:
        if runs[-1] and acc >= total * len(runs) / n and len(runs) < n and k in can_start:
            runs.append([])
        runs[-1].append(k)
        acc += seg_len[k]
    return [r for r in runs if r]


def read_segment(
    source: Path, tree: Tree, offsets: list[int], segment_size: int, seg: int, length: int
) -> bytearray:
    """One segment's bytes assembled from the source (for a node that cannot read it)."""
    out = bytearray(length)
    base = seg * segment_size
    src = os.fsencode(source)
    for i in files_in(tree, offsets, segment_size, {seg}):
        start, end = max(offsets[i], base), min(offsets[i] + tree.size[i], base + length)
        path = src + b"/" + tree.path(i)
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(start - offsets[i])
                view = memoryview(out)[start - base : end - base]
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise DataError(f"source changed while loading: {os.fsdecode(path)}")
                    got += n
        except OSError as e:
            raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    return out


def segment_checksums(staging: Path, held: Collection[int]) -> dict[int, int]:
    out = {}
    for seg in held:
        with open(segment_path(staging, seg), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                out[seg] = xxhash.xxh3_64_intdigest(b"")
                continue
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                out[seg] = xxhash.xxh3_64_intdigest(m)
    return out


def checksum_source_file(source: Path, relpath: bytes, size: int) -> int:
    """Checksum of a whole source file (for files no single node holds entirely)."""
    path = os.fsencode(source) + b"/" + relpath
    hasher = xxhash.xxh3_64()
    try:
        with open(path, "rb", buffering=0) as f:
            total = 0
            while chunk := f.read(8 << 20):
                hasher.update(chunk)
                total += len(chunk)
    except OSError as e:
        raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    if total != size:
        raise DataError(f"source changed while loading: {os.fsdecode(path)}")
    return hasher.intdigest()


# sendfile errors that mean "this source cannot be spliced": read into the mapping instead.
_NO_SENDFILE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def _fill(
    src_fd: int, src_off: int, dest_fd: int, dest_off: int, dest: memoryview, path: bytes
) -> None:
    """Copy len(dest) bytes from src_fd at src_off into the segment at dest_off (= dest)."""
    n, got = len(dest), 0
    try:
        os.lseek(dest_fd, dest_off, os.SEEK_SET)
        while got < n:
            r = os.sendfile(dest_fd, src_fd, src_off + got, n - got)
            if not r:
                raise DataError(f"source changed while loading (shorter): {os.fsdecode(path)}")
            got += r
        return
    except OSError as e:
        if e.errno not in _NO_SENDFILE:
            raise
    while got < n:
        r = os.preadv(src_fd, [dest[got:]], src_off + got)
        if not r:
            raise DataError(f"source changed while loading (shorter): {os.fsdecode(path)}")
        got += r
