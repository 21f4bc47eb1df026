"""A dataset held on this node: its manifest and its segments, mapped read-only.

Segments are never truncated while mapped (unload unlinks them), so a mapping stays valid
even after the dataset is unloaded: no SIGBUS, the memory returns when the last map closes.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from pathlib import Path
from typing import Any

from .errors import DataError
from .manifest import Manifest

MANIFEST_FILE = "manifest.ksm"
META_FILE = "meta.json"
SEGMENT_DIR = "seg"


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
        self.manifest = Manifest(self.path / MANIFEST_FILE)
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()
        # Published datasets never change, so which segments are here is known once and for all.
        try:
            self.held = frozenset(int(n) for n in os.listdir(self.path / SEGMENT_DIR))
        except (FileNotFoundError, ValueError):
            self.held = frozenset()

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
                    with open(segment_path(self.path, seg), "rb") as f:
                        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                except (OSError, ValueError) as e:
                    raise DataError(f"cannot map segment {seg} of {self.path.name}: {e}") from None
                if len(m) != int(self.manifest.seg_len[seg]):
                    raise DataError(f"segment {seg} of {self.path.name} has the wrong length")
                self._maps[seg] = m
        return m

    def release(self) -> None:
        """Stop using this instance (it was unloaded): its maps are dropped, not closed, since a
        reader may still hold one; each unmaps when its last reference goes."""
        with self._lock:
            self._maps.clear()
            self.held = frozenset()

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
        return memoryview(b"".join(self.view(*p) for p in pieces))

    def read(self, i: int, offset: int, length: int) -> bytes:
        """A copy of bytes [offset, offset+length) of file i (what FUSE hands to the kernel)."""
        pieces = self.manifest.ranges(i, offset, length)
        if len(pieces) == 1:
            seg, off, n = pieces[0]
            m = self.segment(seg)
            return m[off : off + n]
        return b"".join(self.segment(s)[o : o + n] for s, o, n in pieces)
