"""Where each file's bytes lie in a dataset's packed stream of segments, and which files fill a segment.

The stream is the dataset's regular files back to back; segment k is bytes
[k * segment_size, k * segment_size + seg_len[k]) of it. `plan_layout` assigns the offsets;
`Layout` answers both directions over the arrays (a manifest's mapped arrays are used as they
are: no copy per process).
"""

from __future__ import annotations

import functools
import stat
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import numpy as np
import xxhash

from kspeedfs.format.tree import Tree


def plan_layout(tree: Tree, segment_size: int) -> tuple[list[int], list[int]]:
    """Assign each regular file an offset in the dataset's byte stream.

    A file that fits in a segment never straddles two (so a small file is one range on one
    node); a larger one starts a fresh segment and spans as many as it needs. The unused tail
    of a segment is not stored. Returns (offset per entry, used length per segment).
    """
    offsets = [0] * len(tree)
    pos = 0
    for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
        if not stat.S_ISREG(mode) or size == 0:
            offsets[i] = pos
            continue
        room = segment_size - pos % segment_size
        if size > room and pos % segment_size != 0:
            pos += room
        offsets[i] = pos
        pos += size
    n_segments = (pos + segment_size - 1) // segment_size
    seg_len = [0] * n_segments
    for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
        if stat.S_ISREG(mode) and size:
            end = offsets[i] + size
            last = (end - 1) // segment_size
            seg_len[last] = max(seg_len[last], end - last * segment_size)
            for k in range(offsets[i] // segment_size, last):
                seg_len[k] = segment_size
    return offsets, seg_len


class FilePiece(NamedTuple):
    """Bytes [file_offset, file_offset + length) of entry `entry`, at seg_offset in a segment."""

    entry: int
    file_offset: int
    seg_offset: int
    length: int


class FileTable(Protocol):
    """What names a layout's files: a scanned `Tree` or a `Manifest`."""

    @property
    def size(self) -> Any: ...

    @property
    def mtime_ns(self) -> Any: ...

    @property
    def ctime_ns(self) -> Any: ...

    @property
    def ident(self) -> Any: ...

    @property
    def dev(self) -> Any: ...

    def path(self, i: int) -> bytes: ...


class Layout:
    """Offsets <-> segment ranges. starts/sizes/mode have one row per entry (only regular,
    non-empty files have bytes in the stream); seg_len one row per segment."""

    def __init__(
        self,
        starts: np.ndarray,
        sizes: np.ndarray,
        mode: np.ndarray,
        seg_len: np.ndarray,
        segment_size: int,
    ):
        self.starts = starts
        self.sizes = sizes
        self.mode = mode
        self.seg_len = seg_len
        self.segment_size = segment_size

    @classmethod
    def of_tree(
        cls, tree: Tree, offsets: list[int], seg_len: list[int], segment_size: int
    ) -> Layout:
        """The layout `plan_layout(tree, segment_size)` returned as (offsets, seg_len)."""
        return cls(
            np.array(offsets, dtype=np.int64),
            np.array(tree.size, dtype=np.int64),
            np.array(tree.mode, dtype=np.uint32),
            np.array(seg_len, dtype=np.int64),
            segment_size,
        )

    @property
    def segments(self) -> int:
        return len(self.seg_len)

    def ranges(
        self, i: int, offset: int = 0, length: int | None = None
    ) -> list[tuple[int, int, int]]:
        """(segment, offset in segment, length) pieces for bytes [offset, offset+length) of file i."""
        size = self.sizes.item(i)  # item(): a Python int without a numpy scalar
        end = size if length is None else min(size, offset + length)
        if offset >= end:
            return []
        seg_size = self.segment_size
        pos = self.starts.item(i) + offset
        seg, seg_off = divmod(pos, seg_size)
        n = end - offset
        if seg_off + n <= seg_size:  # the common case: small files never straddle segments
            return [(seg, seg_off, n)]
        stop = pos + n
        out = []
        while pos < stop:
            seg, seg_off = divmod(pos, seg_size)
            n = min(stop - pos, seg_size - seg_off)
            out.append((seg, seg_off, n))
            pos += n
        return out

    @functools.cached_property
    def _files(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entries, starts, ends) of the regular, non-empty files, in stream order.
        Built on first use: readers that only call `ranges` never pay for it."""
        entries = np.flatnonzero(
            ((self.mode & 0o170000) == stat.S_IFREG) & (self.sizes > 0)
        ).astype(np.int64)
        starts = self.starts[entries].astype(np.int64)
        return entries, starts, starts + self.sizes[entries].astype(np.int64)

    def _span(self, seg: int) -> tuple[int, int]:
        """Positions in the file arrays of the files with bytes in segment seg."""
        _entries, starts, ends = self._files
        base = seg * self.segment_size
        lo = int(np.searchsorted(ends, base, side="right"))
        hi = int(np.searchsorted(starts, base + self.segment_size, side="left"))
        return lo, max(lo, hi)

    def files_in(self, segments: Iterable[int]) -> list[int]:
        """Regular, non-empty files with at least one byte in the given segments, in order."""
        entries = self._files[0]
        picked: set[int] = set()
        for seg in segments:
            lo, hi = self._span(seg)
            picked.update(entries[lo:hi].tolist())
        return sorted(picked)

    def segment_files(self, seg: int) -> list[FilePiece]:
        """The file pieces that fill segment seg, in order."""
        entries, starts, ends = self._files
        lo, hi = self._span(seg)
        base = seg * self.segment_size
        top = base + self.segment_size
        out = []
        for entry, start, end in zip(
            entries[lo:hi].tolist(), starts[lo:hi].tolist(), ends[lo:hi].tolist(), strict=True
        ):
            a, b = max(start, base), min(end, top)
            if a < b:
                out.append(FilePiece(entry, a - start, a - base, b - a))
        return out

    def signature(self, files: FileTable, seg: int) -> bytes:
        """Identifies a segment's contents by what is in it: its files' paths, places and whole
        versions (size, mtime, ctime, ident, dev: a file rewritten with its mtime put back is
        other contents)."""
        h = xxhash.xxh3_128()
        h.update(b"%d\0" % int(self.seg_len[seg]))
        for p in self.segment_files(seg):
            i = p.entry
            size, mtime, ctime = int(files.size[i]), int(files.mtime_ns[i]), int(files.ctime_ns[i])
            ident, dev = int(files.ident[i]), int(files.dev[i])
            h.update(
                b"%d\0%d\0%d\0%d\0%d\0" % (p.file_offset, size, mtime, p.seg_offset, p.length)
                + b"%d\0%d\0%d\0" % (ctime, ident, dev)
                + files.path(i)
            )
        return h.digest()
