"""The spill folder: segments evicted from memory, kept on disk within their own budget (LRU).

Layout: SPILL_DIR/NAME.UUID/NNNNNNNN, one file per segment (SPILL_DIR/tier is the store's disk
tier, which shares the budget: the spill gives way to it). The uuid in the folder name means a
dataset that was refreshed or loaded again never picks up another instance's bytes. Copies are
written under a dot-name and renamed, so a crash leaves no partial segment under a real name.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

TIER_DIR = "tier"  # the store's disk tier, under the same folder


class SpillArea:
    """Thread-safe: evictions copy segments in from worker threads."""

    def __init__(self, root: Path, budget: int, tier: Callable[[], int] = lambda: 0):
        self.root = root
        self.budget = budget
        self._tier = tier  # bytes of the budget the disk tier holds
        self.used = 0  # bytes of the files here, plus copies in progress
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()  # oldest first
        self._pending: set[tuple[str, int]] = set()
        self._count: Counter[str] = Counter()  # per dataset key
        self._bytes: Counter[str] = Counter()
        self._lock = threading.Lock()

    @staticmethod
    def key(name: str, uuid: str) -> str:
        return f"{name}.{uuid}"

    def path(self, key: str, seg: int) -> Path:
        return self.root / key / f"{seg:08d}"

    def recover(self, keep: set[str]) -> None:
        """Keep the segments of datasets that still exist (oldest first by time); drop the rest."""
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for folder in self.root.iterdir():
            if folder.name == TIER_DIR:
                continue  # the store's
            if folder.name not in keep or folder.is_symlink() or not folder.is_dir():
                log.info("removing spilled data of a dataset that is gone: %s", folder.name)
                _remove(folder)
                continue
            for f in folder.iterdir():
                if not f.name.isdigit():
                    f.unlink(missing_ok=True)  # an unfinished copy
                    continue
                st = f.stat()
                found.append((st.st_mtime, folder.name, int(f.name), st.st_size))
        for _mtime, key, seg, size in sorted(found):
            self._add(key, seg, size)
            self.used += size
        with self._lock:
            self._make_room(0)

    def room(self) -> int:
        """Its budget, less what the disk tier holds."""
        return max(0, self.budget - self._tier())

    def has(self, key: str, seg: int) -> bool:
        return (key, seg) in self._entries

    def count(self, key: str) -> int:
        return self._count[key]

    def bytes_of(self, key: str) -> int:
        return self._bytes[key]

    def _add(self, key: str, seg: int, size: int) -> None:
        self._entries[(key, seg)] = size
        self._count[key] += 1
        self._bytes[key] += size

    def _remove_entry(self, key: str, seg: int) -> int | None:
        size = self._entries.pop((key, seg), None)
        if size is not None:
            self._count[key] -= 1
            self._bytes[key] -= size
        return size

    def touch(self, key: str, seg: int) -> None:
        with self._lock:
            if (key, seg) in self._entries:
                self._entries.move_to_end((key, seg))

    def put(self, key: str, seg: int, src: Path, cap: int = 0) -> bool:
        """Copy a segment file in, dropping the least recently used ones to make room (only
        the dataset's own past its `cap` of bytes here; 0: none). False when it cannot be
        kept (bigger than the budget or the cap, disk full)."""
        size = src.stat().st_size
        with self._lock:
            if (key, seg) in self._entries or (key, seg) in self._pending:
                return True
            if size > self.room() or (cap and size > cap):
                return False
            if cap:
                self._make_room_in(key, cap - size)
            self._make_room(size)
            self.used += size
            self._pending.add((key, seg))
        dest = self.path(key, seg)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp)
            os.rename(tmp, dest)
        except OSError as e:
            log.warning("cannot spill segment %d of %s: %s", seg, key, e)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending.discard((key, seg))
                self.used -= size
            return False
        with self._lock:
            self._pending.discard((key, seg))
            self._add(key, seg, size)
        return True

    def _make_room(self, size: int) -> None:
        """Drop the oldest entries until `size` more bytes fit (called with the lock held)."""
        while self._entries and self.used + size > self.room():
            key, seg = next(iter(self._entries))
            self.used -= self._remove_entry(key, seg) or 0
            self.path(key, seg).unlink(missing_ok=True)

    def _make_room_in(self, key: str, keep: int) -> None:
        """Drop the oldest entries of `key` until it holds at most `keep` bytes (lock held)."""
        for k, seg in [e for e in self._entries if e[0] == key]:
            if self._bytes[key] <= keep:
                return
            self.used -= self._remove_entry(k, seg) or 0
            self.path(k, seg).unlink(missing_ok=True)

    def copy_out(self, key: str, seg: int, dest: Path) -> None:
        """Copy a spilled segment to dest (raises OSError when it is gone or unreadable)."""
        shutil.copyfile(self.path(key, seg), dest)
        self.touch(key, seg)

    def drop(self, key: str, seg: int) -> None:
        with self._lock:
            n = self._remove_entry(key, seg)
            if n is None:
                return
            self.used -= n
        self.path(key, seg).unlink(missing_ok=True)

    def drop_dataset(self, key: str) -> None:
        with self._lock:
            for k in [k for k in self._entries if k[0] == key]:
                self.used -= self._remove_entry(*k) or 0
            self._count.pop(key, None)
            self._bytes.pop(key, None)
        _remove(self.root / key)

    def rename_dataset(self, old: str, new: str, segs: dict[int, int]) -> None:
        """Carry spilled segments over to a refreshed instance: old seg -> new seg."""
        with self._lock:
            for old_seg, new_seg in segs.items():
                n = self._remove_entry(old, old_seg)
                if n is None:
                    continue
                dest = self.path(new, new_seg)
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(self.path(old, old_seg), dest)
                except OSError:
                    self.used -= n
                    continue
                self._add(new, new_seg, n)

    def keys(self) -> set[str]:
        with self._lock:
            return {k for k, _ in self._entries} | {k for k, _ in self._pending}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
