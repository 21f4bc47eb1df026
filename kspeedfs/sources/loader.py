"""Stages a node's segments of a preload: segment files filled from a `Source`, files and segments hashed.

Runs in worker threads of a node daemon. The source copies each file piece into its segment
file (a local folder with sendfile: one copy, no page faults on the mapping), then the piece is
hashed in place through the map while it is hot. A node loads only the segments that placement
gives it; a file lying wholly in those segments gets its checksum here.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import xxhash

from kspeedfs.format.contract.preload import LoadState
from kspeedfs.format.errors import DataError, KSpeedError
from kspeedfs.format.layout import FilePiece, FileTable, Layout
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.tree import Tree
from kspeedfs.sources.source import Source


@dataclasses.dataclass
class Progress:
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    state: LoadState = "loading"
    source: str = ""
    error: str = ""
    error_kind: str = ""  # the error's class, so a coordinator re-raises the same one
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
            "error_kind": self.error_kind,
        }


def manifest_size_estimate(tree: Tree) -> int:
    """Bytes of the manifest: 88 bytes of arrays an entry plus the names."""
    names = sum(len(n) for n in tree.names) + sum(len(t) for t in tree.link_target.values())
    return 88 * len(tree) + names + 65536


def create_segment(staging: Path, seg: int, length: int) -> int:
    """A new segment file in staging with its tmpfs pages claimed (ENOSPC up front); its fd."""
    fd = os.open(segment_path(staging, seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as e:
        os.close(fd)
        raise DataError(f"cannot allocate segment {seg}: {e.strerror}") from None
    return fd


def load_segments(
    source: Source,
    files: FileTable,
    layout: Layout,
    held: Collection[int],
    staging: Path,
    progress: Progress,
    seg_checksums: dict[int, int] | None = None,
    disk: tuple[Path, Collection[int]] | None = None,
) -> dict[int, int]:
    """Fill staging/seg/ with the held segments; returns {entry: checksum} for the files that
    lie wholly in held segments (the others are checksummed by whoever holds all of them).

    Segments are filled one at a time (only one segment's fd and mapping open per thread:
    ImageNet has thousands of segments) by `source.fill_threads` threads, each taking a
    contiguous run of segments. A file split between two runs gets no checksum here, like one
    split between nodes. When `seg_checksums` is given it receives each segment's checksum,
    computed while the bytes are hot instead of in a second pass. `disk` names another
    staging folder (the disk tier's) and the held segments that go there instead."""
    disk_staging, on_disk = (disk[0], frozenset(disk[1])) if disk else (staging, frozenset())
    held_sorted = sorted(set(held))
    todo = layout.files_in(held_sorted)
    progress.files_total = len(todo)
    progress.bytes_total = sum(int(files.size[i]) for i in todo)
    lock = threading.Lock()
    checksums: dict[int, int] = {}
    sums: dict[int, int] = {}

    def run(segs: list[int]) -> None:
        hashing = _Hashing(files, progress, lock, checksums)
        for seg in segs:
            if progress.cancel.is_set():
                raise KSpeedError("preload cancelled")
            length = int(layout.seg_len[seg])
            fd = create_segment(disk_staging if seg in on_disk else staging, seg, length)
            try:
                with mmap.mmap(fd, length) as m:
                    hashing.start_segment()
                    view = memoryview(m)
                    try:
                        source.fill(files, layout, seg, view, fd=fd, done=hashing.landed)
                    finally:
                        view.release()
                    sums[seg] = hashing.segment_checksum(m)
            finally:
                os.close(fd)

    # A run may start only where no file continues from the segment before: every file then
    # lies in one run and gets its checksum here.
    clean = {
        seg
        for seg in held_sorted
        if not (ps := layout.segment_files(seg)) or ps[0].file_offset == 0
    }
    seg_len = [int(n) for n in layout.seg_len]
    runs = _contiguous_runs(held_sorted, seg_len, source.fill_threads, clean)
    if len(runs) <= 1:
        for r in runs:
            run(r)
    else:
        _run_all(run, runs, progress.cancel)
    if seg_checksums is not None:
        seg_checksums.update(sums)
    return checksums


class _Hashing:
    """Hashes pieces of one run of segments as they land, while hot: each file whose pieces
    all come in order gets its checksum, each segment its own."""

    def __init__(
        self,
        files: FileTable,
        progress: Progress,
        lock: threading.Lock,
        checksums: dict[int, int],
    ):
        self.files, self.progress, self.lock, self.checksums = files, progress, lock, checksums
        self.hashers: dict[int, tuple[Any, int]] = {}  # entry -> (hasher, next file offset)
        self.segment: Any = None
        self.covered = 0

    def start_segment(self) -> None:
        self.segment = xxhash.xxh3_64()
        self.covered = 0

    def landed(self, p: FilePiece, data: memoryview) -> None:
        i = p.entry
        if p.file_offset == 0:
            self.hashers[i] = (xxhash.xxh3_64(), 0)
        hasher, expected = self.hashers.get(i, (None, -1))
        if hasher is not None and expected == p.file_offset:
            hasher.update(data)
            self.hashers[i] = (hasher, p.file_offset + p.length)
        else:  # a piece is missing (held elsewhere, or in another run): no checksum here
            self.hashers.pop(i, None)
        self.segment.update(data)
        self.covered += p.length
        last = p.file_offset + p.length == int(self.files.size[i])
        with self.lock:
            self.progress.bytes_done += p.length
            if last:
                self.progress.files_done += 1
                h, _ = self.hashers.pop(i, (None, 0))
                if h is not None:
                    self.checksums[i] = h.intdigest()
        if self.progress.cancel.is_set():
            raise KSpeedError("preload cancelled")

    def segment_checksum(self, m: mmap.mmap) -> int:
        if self.covered != len(m):  # pieces always tile a segment; if not, hash what is there
            return xxhash.xxh3_64_intdigest(m)
        return int(self.segment.intdigest())


def _run_all(
    run: Callable[[list[int]], None], runs: list[list[int]], stop: threading.Event
) -> None:
    """run(r) for every run in its own daemon thread; the first failure sets stop (the other
    runs end at their next piece) and is re-raised. Daemon threads: one blocked in a source
    read (a hung NFS server) never holds the node's exit."""
    errors: list[BaseException] = []

    def target(r: list[int]) -> None:
        try:
            run(r)
        except BaseException as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


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
