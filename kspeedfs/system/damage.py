"""Damage news: an instance's table of damaged segments, written by its node, mapped by readers.

The table (DAMAGE_FILE in the dataset's folder, in shared memory) is little-endian u64 words:
[0] the generation, bumped after every change; [1] the scrubber's completed passes; [2 + k]
the generation at which segment k was last found damaged (0: never). The node writes the
segment's word first, then the generation, so a reader that sees a new generation sees what
changed. Every read of a local copy compares word 0 with the generation it last took (one
load); on a change it drops its maps and "checked" marks of the segments found damaged since,
so a byte found flipped by any process is served by none after the node heard of it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kspeedfs.format.localdata import DAMAGE_FILE, DamageReport, damage_table_size

log = logging.getLogger(__name__)

DAMAGED_RETRY_S = 10.0  # a damaged segment nobody was told of is read elsewhere this long
REPORT_EVERY_S = 1.0  # a damaged segment is logged and reported at most this often

GENERATION, PASSES, FIRST_SEGMENT = 0, 1, 2
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def create_table(dir_fd: int, segments: int, mode: int = 0o640, gid: int = -1) -> None:
    """A table for an instance of `segments` segments in dataset folder `dir_fd` (readable by
    group `gid`, when one is given), unless one of the right size is there already (kept:
    readers may have it mapped)."""
    size = damage_table_size(segments)
    try:
        if os.stat(DAMAGE_FILE, dir_fd=dir_fd, follow_symlinks=False).st_size == size:
            return
    except FileNotFoundError:
        pass
    fd = os.open(DAMAGE_FILE, os.O_RDWR | os.O_CREAT | _FLAGS, mode, dir_fd=dir_fd)
    try:
        os.ftruncate(fd, size)
        # Its pages taken now (zeros), not at the first news: what the instance holds in
        # memory stays the same from publish on, restarts and announcements included.
        os.posix_fallocate(fd, 0, size)
        os.fchmod(fd, mode)
        if gid >= 0:
            os.fchown(fd, -1, gid)
    finally:
        os.close(fd)


def announce(folder: Path, segments: Iterable[int] = (), scrub_pass: bool = False) -> int:
    """Tell every reader of the instance in `folder` that `segments` were found damaged (and,
    with `scrub_pass`, that the scrubber completed a pass: readers check their disk-tier
    bytes again). The new generation; 0 when the instance has no table."""
    try:
        fd = os.open(folder / DAMAGE_FILE, os.O_RDWR | _FLAGS)
    except OSError:
        return 0
    try:
        with mmap.mmap(fd, 0) as m:
            words = memoryview(m).cast("Q")
            try:
                generation = int(words[GENERATION]) + 1
                for seg in segments:
                    if 0 <= seg < len(words) - FIRST_SEGMENT:
                        words[FIRST_SEGMENT + seg] = generation
                if scrub_pass:
                    words[PASSES] += 1
                words[GENERATION] = generation  # last: what changed is in place before it
            finally:
                words.release()
    finally:
        os.close(fd)
    return generation


class DamageNews:
    """One instance's table, mapped read-only: `words[0]` against `seen` is the one load a
    read pays; `take` says what changed since."""

    def __init__(self, segments: int, fd: int = -1):
        """`fd`: an open descriptor of the table (kept by the caller; -1: there is none,
        nothing to hear: a read-through instance, an old node's)."""
        self.segments = segments
        self._map: mmap.mmap | None = None
        try:
            if fd >= 0 and os.fstat(fd).st_size == damage_table_size(segments):
                self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            pass
        if self._map is not None:
            self.words = memoryview(self._map).cast("Q")
        else:
            self.words = memoryview(bytearray(8 * FIRST_SEGMENT)).cast("Q")
        self.seen = int(self.words[GENERATION])
        self.passes = int(self.words[PASSES])

    @classmethod
    def open(cls, dir_fd: int, segments: int) -> DamageNews:
        """The table of the dataset folder `dir_fd`."""
        try:
            fd = os.open(DAMAGE_FILE, os.O_RDONLY | _FLAGS, dir_fd=dir_fd)
        except OSError:
            return cls(segments)
        try:
            return cls(segments, fd)
        finally:
            os.close(fd)

    @property
    def heard(self) -> bool:
        """Whether there is news (what every read asks)."""
        return bool(self.words[GENERATION] != self.seen)

    def follow(self) -> DamageNews:
        """Another follower of the same table, from now on (its own `seen`)."""
        other = DamageNews.__new__(DamageNews)
        other.segments, other._map, other.words = self.segments, self._map, self.words
        other.seen, other.passes = int(self.words[GENERATION]), int(self.words[PASSES])
        return other

    def take(self) -> tuple[list[int], bool]:
        """The segments found damaged since the last take, and whether the scrubber completed
        a pass since (then every disk-tier byte is to be checked again)."""
        generation = int(self.words[GENERATION])
        if generation == self.seen or self._map is None:
            return [], False
        table = np.frombuffer(self._map, dtype="<u8", count=self.segments, offset=8 * FIRST_SEGMENT)
        damaged = [int(k) for k in np.flatnonzero(table > self.seen)]
        passes = int(self.words[PASSES])
        passed = passes != self.passes
        self.seen, self.passes = generation, passes
        return damaged, passed


class DamageReports:
    """What one process found damaged in one instance, and telling its node (`on_damage`, from
    any thread): each segment logged and reported at most every REPORT_EVERY_S; one the node
    could not be told of is read elsewhere for DAMAGED_RETRY_S, then tried here again."""

    def __init__(self, name: str, on_damage: DamageReport | None):
        self.name = name
        self.on_damage = on_damage
        self.damaged: dict[int, float] = {}  # segment -> when it was found (node not told)
        self._reported: dict[int, float] = {}  # segment -> when it was last reported
        self._lock = threading.Lock()

    def still_damaged(self, seg: int) -> bool:
        """Whether segment `seg` is to be read elsewhere for now."""
        found = self.damaged.get(seg)
        if found is None:
            return False
        if time.monotonic() - found < DAMAGED_RETRY_S:
            return True
        self.damaged.pop(seg, None)  # tried again: the node may have fetched it again
        return False

    def report(self, segments: list[int], why: str) -> None:
        """Bytes of `segments` are not the manifest's: logged, and the node told (once a
        while)."""
        now = time.monotonic()
        with self._lock:
            new = [s for s in segments if now - self._reported.get(s, -1e9) >= REPORT_EVERY_S]
            self._reported.update((s, now) for s in new)
        if not new:
            return
        names = ", ".join(str(s) for s in segments)
        log.error("%s: segment %s %s; reading elsewhere", self.name, names, why)
        if self.on_damage is not None:
            try:
                self.on_damage(new)
                return
            except Exception as e:  # telling the node is best effort: its scrubber finds it
                log.warning("%s: could not report damaged segments: %s", self.name, e)
        # Nobody fetches it again soon: read it elsewhere for a while. (Told, the node checks
        # it, quarantines it, announces it, and the next read here opens its new copy.)
        with self._lock:
            self.damaged.update((s, now) for s in new)
