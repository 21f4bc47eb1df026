"""One view of node health for every reader on a machine: which nodes are suspect or down, and
how fast each answers, in a small table of shared memory.

A mount's workers and a job's DataLoader workers are separate processes; each used to find a
dead node by itself, paying its timeout once per process (16 s of stall through a 2-worker
mount in issue 29). The table is a file in /dev/shm of the user's own (`/dev/shm/kspeedfs-
health.UID`, 0600, not followed through a symlink, checked to be ours), so a miss seen by one
reader steers every other one at once. Entries are keyed by node address; a row is a few
8-byte words written without a lock (a torn read of a float costs one wrong ordering of
replicas, never a wrong byte: health only orders replicas and sets hedge delays). Times are
CLOCK_MONOTONIC, one clock for every process of the machine. Where the file cannot be used
the table is private to the process.

The file goes with its last user: each holds a shared lock on its first byte (an open file
description's lock, F_OFD_SETLK, apart from the flock that guards taking a slot) for as long
as it has the table open; one that closes it (or exits, or is collected) and gets the byte's
exclusive lock at once is the last, and unlinks the file under that lock. The kernel drops a
crashed user's lock with its files, so a user killed with -9 never holds the file up; one that
opens the file while the last user removes it waits on the lock, finds the path gone or
another file, and opens again. A file whose users all crashed stays until the next user leaves.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import math
import mmap
import os
import stat
import struct
import time
from multiprocessing import util as mp_util

import xxhash

log = logging.getLogger(__name__)

SLOTS = 256
WORDS = 8  # per slot: key, suspect_until, down_until, srtt, rttvar, probe_until, late, 1 spare
KEY, SUSPECT, DOWN, SRTT, RTTVAR, PROBE, LATE = range(7)
# LATE tracks the time to an answer's first byte that LATE_SHARE of answers exceed: a quantile
# followed by stochastic steps in log space (up by LATE_UP when an answer is later, down by
# LATE_DOWN when it is not), which settle where LATE_SHARE of the steps go up. A reader waits
# that long before it hedges, so in quiet weather about LATE_SHARE of reads are read twice,
# whatever the shape of the latency's tail (a mean and variance, as TCP's RTO, say less of it).
LATE_SHARE = 0.03
LATE_UP = 0.1
LATE_DOWN = LATE_UP * LATE_SHARE / (1 - LATE_SHARE)
MAGIC = 0x4B53484C54480001  # "KSHLTH" v1
TABLE_BYTES = (1 + SLOTS) * WORDS * 8


def default_path() -> str:
    return f"/dev/shm/kspeedfs-health.{os.getuid()}"


def _lock_first_byte(fd: int, kind: int, wait: bool) -> bool:
    """Take (or convert to) an open file description's lock of `kind` (F_RDLCK, F_WRLCK) on
    the file's first byte; False when another description holds a conflicting one and `wait`
    is False, or where the system has no such locks."""
    setlk = getattr(fcntl, "F_OFD_SETLKW" if wait else "F_OFD_SETLK", None)
    if setlk is None:
        return False
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for a description's lock).
    request = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 1, 0)
    try:
        fcntl.fcntl(fd, setlk, request)
    except OSError:
        return False
    return True


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open at `fd`."""
    try:
        st, at = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)


def _leave(fd: int, path: str, opener: int) -> None:
    """A user's last word: the table's file unlinked when no other user holds it, then closed.
    In a forked child the descriptor (and its lock) is its opener's: only closed here."""
    last = os.getpid() == opener and _lock_first_byte(fd, fcntl.F_WRLCK, wait=False)
    if last and _same_file(fd, path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    os.close(fd)


class NodeHealth:
    """Per-node suspicion, down marks and latency (SRTT and its variance, as TCP keeps them),
    shared by every process that opens the same table."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = default_path() if path is None else os.fspath(path)
        self._fd = -1
        self._leave: mp_util.Finalize | None = None
        self._map = self._open() if self.path else None
        if self._map is None:
            self._map = mmap.mmap(-1, TABLE_BYTES)
        self._q = memoryview(self._map).cast("Q")
        self._d = memoryview(self._map).cast("d")
        if self._q[0] != MAGIC:
            self._q[0] = MAGIC
        self._slots: dict[str, int] = {}

    def _open(self) -> mmap.mmap | None:
        """The shared table, held (a shared lock) until this user leaves; None where it
        cannot be used."""
        for _ in range(3):  # the file is removed under us at most by its last user's leaving
            fd = self._open_file()
            if fd < 0:
                return None
            if not _lock_first_byte(fd, fcntl.F_RDLCK, wait=True) or _same_file(fd, self.path):
                break  # held (or no such locks here: then the file is never removed)
            os.close(fd)
        else:
            return None
        try:
            if os.fstat(fd).st_size < TABLE_BYTES:
                os.ftruncate(fd, TABLE_BYTES)
            m = mmap.mmap(fd, TABLE_BYTES)
        except OSError as e:
            log.debug("node health kept in this process: %s: %s", self.path, e)
            _leave(fd, self.path, os.getpid())
            return None
        self._fd = fd
        # At exit (in a multiprocessing child too, which ends without atexit) or when collected.
        leave = functools.partial(_leave, fd, self.path, os.getpid())
        self._leave = mp_util.Finalize(self, leave, exitpriority=0)
        return m

    def _open_file(self) -> int:
        """The table's file opened (-1 where it cannot be, or is not a private file of ours)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.debug("node health kept in this process: %s: %s", self.path, e)
            return -1
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("%s is not a private file of ours: node health kept here", self.path)
            os.close(fd)
            return -1
        return fd

    def _slot(self, node: str) -> int:
        """The word index of `node`'s row (taken on first use)."""
        found = self._slots.get(node)
        if found is not None:
            return found
        key = xxhash.xxh3_64_intdigest(node.encode()) | 1
        start = key % SLOTS
        for locked in (False, True):
            if locked and self._fd >= 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                for k in range(SLOTS):
                    base = (1 + (start + k) % SLOTS) * WORDS
                    have = self._q[base + KEY]
                    if have == key:
                        self._slots[node] = base
                        return base
                    if have == 0:
                        if not locked:
                            break  # take it under the lock
                        for w in range(1, WORDS):
                            self._d[base + w] = 0.0
                        self._q[base + KEY] = key
                        self._slots[node] = base
                        return base
            finally:
                if locked and self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        # Full (256 nodes seen since the file was made): the oldest entries would do as well;
        # share the first slot's row rather than fail.
        base = (1 + start) * WORDS
        self._slots[node] = base
        return base

    # Suspicion and down marks.

    def suspect_for(self, node: str, seconds: float) -> None:
        base = self._slot(node)
        self._d[base + SUSPECT] = max(self._d[base + SUSPECT], time.monotonic() + seconds)

    def down_for(self, node: str, seconds: float) -> None:
        base = self._slot(node)
        until = time.monotonic() + seconds
        self._d[base + DOWN] = max(self._d[base + DOWN], until)
        self._d[base + SUSPECT] = max(self._d[base + SUSPECT], until)

    def trust(self, node: str) -> None:
        """It answered: neither suspect nor down any more."""
        base = self._slot(node)
        if self._d[base + SUSPECT] or self._d[base + DOWN]:
            self._d[base + SUSPECT] = 0.0
            self._d[base + DOWN] = 0.0

    def is_suspect(self, node: str) -> bool:
        return self._d[self._slot(node) + SUSPECT] > time.monotonic()

    def is_down(self, node: str) -> bool:
        return self._d[self._slot(node) + DOWN] > time.monotonic()

    def claim_probe(self, node: str, seconds: float) -> bool:
        """Whether this process probes `node` now (one prober per machine at a time)."""
        base = self._slot(node)
        now = time.monotonic()
        if self._d[base + PROBE] > now:
            return False
        self._d[base + PROBE] = now + seconds
        return True

    # Latency.

    def observe(self, node: str, seconds: float) -> None:
        """One answer's latency, folded in as TCP folds RTT samples (RFC 6298)."""
        base = self._slot(node)
        srtt = self._d[base + SRTT]
        if srtt <= 0:
            self._d[base + SRTT] = seconds
            self._d[base + RTTVAR] = seconds / 2
            return
        var = self._d[base + RTTVAR]
        self._d[base + RTTVAR] = 0.75 * var + 0.25 * abs(srtt - seconds)
        self._d[base + SRTT] = 0.875 * srtt + 0.125 * seconds

    def first_byte(self, node: str, seconds: float) -> None:
        """How long an answer took to begin (an answer that began within the hedge delay)."""
        base = self._slot(node)
        late = self._d[base + LATE]
        if late <= 0:
            self._d[base + LATE] = 2 * seconds  # a first guess, above: it comes down
        else:
            self._d[base + LATE] = late * math.exp(LATE_UP if seconds > late else -LATE_DOWN)

    def missed(self, node: str, seconds: float) -> None:
        """An answer had not begun after `seconds` (a hedge was sent): later than that."""
        base = self._slot(node)
        late = self._d[base + LATE]
        if seconds >= late > 0:
            self._d[base + LATE] = late * math.exp(LATE_UP)

    def late_after(self, node: str) -> float:
        """The time to a first byte that about LATE_SHARE of `node`'s answers exceed (0: no
        answer seen yet)."""
        return self._d[self._slot(node) + LATE]

    def expected(self, node: str) -> float:
        """How long an answer from `node` may take before it is late: SRTT + 4 RTTVAR (0: no
        sample yet)."""
        base = self._slot(node)
        return self._d[base + SRTT] + 4 * self._d[base + RTTVAR]

    def view(self, nodes: list[str]) -> dict[str, dict[str, float | bool]]:
        """What the table says of `nodes` (for status and tests)."""
        now = time.monotonic()
        out: dict[str, dict[str, float | bool]] = {}
        for node in nodes:
            base = self._slot(node)
            out[node] = {
                "suspect": self._d[base + SUSPECT] > now,
                "down": self._d[base + DOWN] > now,
                "srtt_ms": round(self._d[base + SRTT] * 1000, 3),
                "late_ms": round(self._d[base + LATE] * 1000, 3),
            }
        return out

    def close(self) -> None:
        """Leave the table: its file is removed when this was its last user."""
        self._q.release()
        self._d.release()
        if self._map is not None:
            self._map.close()
        if self._leave is not None:
            self._leave()  # closes the descriptor
            self._leave = None
        self._fd = -1
