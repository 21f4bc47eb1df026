"""Copies a scanned source tree into staging segments, checksumming as it goes.

Runs in a worker thread of the node daemon. Each file is read straight into the mapped segment
(one copy, kernel to tmpfs page), then hashed in place.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from .errors import DataError, KSpeedError
from .localdata import MANIFEST_FILE, segment_path
from .manifest import plan_layout, write_manifest
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


def stored_size_estimate(tree: Tree) -> int:
    """Memory a dataset will take: its file bytes plus the manifest (about 80 bytes an entry)."""
    names = sum(len(n) for n in tree.names) + sum(len(t) for t in tree.link_target.values())
    return tree.data_bytes + 96 * len(tree) + names + 65536


def load_tree(
    source: Path,
    tree: Tree,
    staging: Path,
    segment_size: int,
    header: dict[str, Any],
    progress: Progress,
) -> None:
    """Fill staging/seg/ and write staging/manifest.ksm; raises on any problem."""
    offsets, seg_len = plan_layout(tree, segment_size)
    checksums = [0] * len(tree)
    progress.files_total = tree.file_count
    progress.bytes_total = tree.data_bytes
    maps: list[mmap.mmap] = []
    try:
        for seg, length in enumerate(seg_len):
            fd = os.open(segment_path(staging, seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    os.posix_fallocate(fd, 0, length)  # claim tmpfs pages now: ENOSPC up front
                except OSError as e:
                    raise DataError(f"cannot allocate segment {seg}: {e.strerror}") from None
                maps.append(mmap.mmap(fd, length))
            finally:
                os.close(fd)
        src = os.fsencode(source)
        for i, mode in enumerate(tree.mode):
            if not stat.S_ISREG(mode):
                continue
            if progress.cancel.is_set():
                raise KSpeedError("preload cancelled")
            size = tree.size[i]
            path = src + b"/" + tree.path(i)
            checksums[i] = _copy_file(path, size, offsets[i], segment_size, maps)
            progress.files_done += 1
            progress.bytes_done += size
        seg_checksums = [xxhash.xxh3_64_intdigest(m) for m in maps]
        for m in maps:
            m.flush()
    finally:
        for m in maps:
            m.close()
    write_manifest(
        staging / MANIFEST_FILE, tree, offsets, checksums, seg_len, seg_checksums, header
    )


def _copy_file(
    path: bytes, size: int, offset: int, segment_size: int, maps: list[mmap.mmap]
) -> int:
    hasher = xxhash.xxh3_64()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    try:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            pos, remaining = offset, size
            while remaining:
                seg, seg_off = divmod(pos, segment_size)
                n = min(remaining, segment_size - seg_off)
                dest = memoryview(maps[seg])[seg_off : seg_off + n]
                got = 0
                while got < n:
                    r = f.readinto(dest[got:])
                    if not r:
                        raise DataError(
                            f"source changed while loading (shorter): {os.fsdecode(path)}"
                        )
                    got += r
                hasher.update(dest)
                dest.release()
                pos += n
                remaining -= n
            if f.read(1):
                raise DataError(f"source changed while loading (longer): {os.fsdecode(path)}")
    except OSError as e:
        raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
    finally:
        os.close(fd)
    return hasher.intdigest()
