"""A read-through dataset folder, mapped: its set of present segments changes under its readers.

A read-through dataset's segments appear (a node filled one) and disappear (it evicted one)
while readers have it open. `ReadThroughDataset` looks for a segment file again on a miss, and
drops its maps of evicted segments when the node's eviction counter (EPOCH_FILE) moves, so that
an eviction really returns the memory.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
from pathlib import Path

from kspeedfs.format import sealing
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.errors import DataError
from kspeedfs.format.localdata import EPOCH_FILE, DamageReport, read_meta
from kspeedfs.system.local_dataset import LocalDataset


def open_local(
    path: str | os.PathLike[str], *, on_damage: DamageReport | None = None
) -> LocalDataset:
    """The right view of a published dataset folder: static, or read-through (`on_damage`:
    told the segments this process finds damaged)."""
    try:
        lifetime = read_meta(Path(path)).get("lifetime")
    except (OSError, ValueError):
        lifetime = None
    view = ReadThroughDataset if lifetime == READTHROUGH else LocalDataset
    return view(path, on_damage=on_damage)


class ReadThroughDataset(LocalDataset):
    """A LocalDataset whose set of present segments changes under it."""

    checks_disk = False  # its manifest has no checksums: its fills check what they write

    def __init__(self, path: str | os.PathLike[str], *, on_damage: DamageReport | None = None):
        super().__init__(path, on_damage=on_damage)
        self._present: set[int] = set(self.held)
        self._inodes: dict[int, int] = {}
        self._epoch = _map_epoch(self.path / EPOCH_FILE)
        self._epoch_seen = self._read_epoch()
        self.touched: set[int] = set()  # segments read since the last report to the node
        self.hits = 0

    def _read_epoch(self) -> int:
        return int(struct.unpack_from("<Q", self._epoch, 0)[0]) if self._epoch is not None else 0

    def _sync(self) -> None:
        """Forget segments evicted since we last looked: our maps would pin memory the node freed."""
        epoch = self._read_epoch()
        if epoch == self._epoch_seen:
            return
        with self.lock:
            self._epoch_seen = epoch
            for seg in list(self._present):
                try:
                    ino: int | None = self.stat_segment(seg).st_ino
                except FileNotFoundError:
                    ino = None
                if ino is None or self._inodes.get(seg, ino) != ino:
                    self._present.discard(seg)
                    self._inodes.pop(seg, None)
                    self._drop_map(seg)  # a thread reading it still holds a reference
            self.held = frozenset(self._present)

    def release(self) -> None:
        with self.lock:
            self._present.clear()
            self._inodes.clear()
        super().release()

    def _appeared(self, seg: int) -> bool:
        try:
            st = self.stat_segment(seg)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not 0 <= seg < self.manifest.segments or st.st_size != int(self.manifest.seg_len[seg]):
            return False
        with self.lock:
            self._present.add(seg)
            self.held = frozenset(self._present)
        return True

    def holds(self, seg: int) -> bool:
        self._sync()
        return seg in self._present or self._appeared(seg)

    def holds_file(self, i: int) -> bool:
        return all(self.holds(seg) for seg, _, _ in self.manifest.ranges(i))

    def segment(self, seg: int) -> mmap.mmap:
        self._sync()
        m = self._maps.get(seg)
        if m is None:
            if seg not in self._present and not self._appeared(seg):
                raise DataError(f"segment {seg} of {self.path.name} is not cached on this node")
            with self.lock:
                m = self._maps.get(seg)
                if m is None:
                    m = self._map(seg)
        if seg in self._watched:  # unsealed (a node that cannot seal): its size first
            self._check_size(seg)
        self.touched.add(seg)
        return m

    def _cut_short(self, seg: int) -> None:
        """Not a damaged segment to report (its fill checked what it wrote; a node evicts
        and fills again): the map is dropped and the read goes to the node or the source."""
        with self.lock:
            self._drop_map(seg)
            self._present.discard(seg)
            self.held = frozenset(self._present)
        raise DataError(f"segment {seg} of {self.path.name} was cut short")

    def _map(self, seg: int) -> mmap.mmap:
        kept: io.FileIO | None = None
        try:
            fd = self.open_segment(seg)
            try:
                m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                ino = os.fstat(fd).st_ino
                # Sealed (the node set the immutable flag): nobody can cut it short.
                kept = None if sealing.is_sealed(fd) else io.FileIO(fd, "rb", closefd=True)
            finally:
                if kept is None:
                    os.close(fd)
        except FileNotFoundError:
            self._present.discard(seg)
            raise DataError(f"segment {seg} of {self.path.name} was just evicted") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map segment {seg} of {self.path.name}: {e}") from None
        if len(m) != int(self.manifest.seg_len[seg]):
            if kept is not None:
                kept.close()
            raise DataError(f"segment {seg} of {self.path.name} has the wrong length")
        self._maps[seg] = m
        self._inodes[seg] = ino
        if kept is not None:
            self._watched[seg] = kept
        return m

    def read(self, i: int, offset: int, length: int) -> bytes:
        data = super().read(i, offset, length)
        self.hits += 1
        return data

    def read_view(self, i: int, offset: int, length: int) -> memoryview | bytes:
        data = super().read_view(i, offset, length)
        if isinstance(data, memoryview):
            self.hits += 1  # a joined copy went through read(), which counted it
        return data

    def drain_touches(self) -> tuple[list[int], int]:
        """Segments read and reads served since the last call (for the node's LRU and stats)."""
        touched, self.touched = self.touched, set()
        hits, self.hits = self.hits, 0
        return sorted(touched), hits


def _map_epoch(path: Path) -> mmap.mmap | None:
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 8, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
