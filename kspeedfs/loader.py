"""Copies the files of some segments of a scanned source tree into staging, checksumming them.

Runs in a worker thread of a node daemon. The kernel copies each file into its segment file
(sendfile: one copy, no page faults on the mapping), then it is hashed in place through the map. A node loads only the segments that
placement gives it; a file lying wholly in those segments gets its checksum here.
"""

from __future__ import annotations

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


def load_segments(
    source: Path,
    tree: Tree,
    offsets: list[int],
    seg_len: list[int],
    held: Collection[int],
    staging: Path,
    segment_size: int,
    progress: Progress,
) -> dict[int, int]:
    """Fill staging/seg/ with the held segments; returns {entry: checksum} for the files that
    lie wholly in held segments (the others are checksummed by whoever holds all of them)."""
    held = set(held)
    todo = files_in(tree, offsets, segment_size, held)
    progress.files_total = len(todo)
    progress.bytes_total = sum(tree.size[i] for i in todo)
    checksums: dict[int, int] = {}
    maps: dict[int, mmap.mmap] = {}
    fds: dict[int, int] = {}  # kept open: the copies are written through them
    try:
        for seg in sorted(held):
            length = seg_len[seg]
            fd = fds[seg] = os.open(
                segment_path(staging, seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644
            )
            try:
                os.posix_fallocate(fd, 0, length)  # claim tmpfs pages now: ENOSPC up front
            except OSError as e:
                raise DataError(f"cannot allocate segment {seg}: {e.strerror}") from None
            maps[seg] = mmap.mmap(fd, length)
        src = os.fsencode(source)
        for i in todo:
            if progress.cancel.is_set():
                raise KSpeedError("preload cancelled")
            size = tree.size[i]
            path = src + b"/" + tree.path(i)
            digest = _copy_file(path, size, offsets[i], segment_size, maps, fds)
            if digest is not None:
                checksums[i] = digest
            progress.files_done += 1
            progress.bytes_done += size
        for m in maps.values():
            m.flush()
    finally:
        for m in maps.values():
            m.close()
        for fd in fds.values():
            os.close(fd)
    return checksums


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


def _copy_file(
    path: bytes,
    size: int,
    offset: int,
    segment_size: int,
    maps: dict[int, mmap.mmap],
    fds: dict[int, int],
) -> int | None:
    """Copy the held pieces of one file; its checksum when every piece was held, else None."""
    hasher = xxhash.xxh3_64()
    complete = True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    try:
        pos, done = offset, 0
        while done < size:
            seg, seg_off = divmod(pos, segment_size)
            n = min(size - done, segment_size - seg_off)
            if seg not in maps:
                complete = False
            else:
                dest = memoryview(maps[seg])[seg_off : seg_off + n]
                try:
                    _fill(fd, done, fds[seg], seg_off, dest, path)
                    hasher.update(dest)
                finally:
                    dest.release()
            pos += n
            done += n
        if complete and os.pread(fd, 1, size):
            raise DataError(f"source changed while loading (longer): {os.fsdecode(path)}")
    except OSError as e:
        raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    finally:
        os.close(fd)
    return hasher.intdigest() if complete else None


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
