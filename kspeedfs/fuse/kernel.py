"""The FUSE kernel protocol spoken over /dev/fuse: mount, request loop, replies, notifications.

Why not pyfuse3: its read() handler is given the file handle but not the inode, so a
filesystem on it must answer OPEN (and then RELEASE) for every file it serves. The kernel's
no-open mode (ENOSYS to the first OPEN: no OPEN, RELEASE or FLUSH ever again, page cache kept)
needs the inode in READ, which the wire protocol carries. Measured on a 2-core machine
(bench/bench_fuse.py), the pyfuse3 + trio mount read 581 files/s on a first pass (4 requests
a file: ~400 us each) and 1197 on a second; this loop serves 1100-2400 and 9000-14600 files/s,
since for immutable data the kernel then serves a second pass with no request at all.

A RequestLoop serves one fd: its threads block in read(2) and answer inline; work that may
block (a read from another node) returns a callable, run in a pool that replies when done
(FUSE replies may come in any order), unless the kernel interrupts it first. Handlers raise
FuseError for an errno; anything else is logged and answered with EIO, never taking the mount
down. One mount may be served by several processes, each with a clone of the mount's fd
(FUSE_DEV_IOC_CLONE): threads of one process share a GIL (each extra one cost 11-15 us of CPU
per request), processes do not.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import select
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kspeedfs.fuse import uring
from kspeedfs.fuse.burstpoll import BurstPoll
from kspeedfs.fuse.counters import RING_SLOT, SLOTS, SharedCounters
from kspeedfs.system.memory import map_pages
from kspeedfs.system.mountinfo import mount_at

log = logging.getLogger(__name__)

ROOT_INODE = 1
KERNEL_VERSION = 7
OUR_MINOR = 31  # the struct layouts below are those of protocol 7.31
MAX_WRITE = 128 * 1024
MAX_PAGES = 256  # reads of up to 1 MiB in one request
READ_BUFFER = MAX_WRITE + 64 * 1024  # must hold the largest request the kernel may send
# Idle threads cost nothing (blocked in read); more than the cores so that a request waiting on
# the node (a refresh of the dataset list) never holds up the reads of local data.
THREADS = 4
POOL_THREADS = 8  # per process: reads from other nodes wait here, off the serving thread
MAX_PENDING = 256  # reads waiting on other nodes, per process; more are answered EAGAIN

# opcodes (include/uapi/linux/fuse.h)
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE = 8, 9, 10, 11, 12, 13, 14, 15, 16
STATFS, RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR = 17, 18, 20, 21, 22, 23
REMOVEXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 24, 25, 26, 27, 28, 29
ACCESS, CREATE, INTERRUPT, DESTROY, IOCTL, BATCH_FORGET = 34, 35, 36, 38, 39, 42
FALLOCATE, READDIRPLUS, RENAME2, COPY_FILE_RANGE, TMPFILE = 43, 44, 45, 47, 51
OPCODE_NAMES = {
    LOOKUP: "lookup", GETATTR: "getattr", READLINK: "readlink", OPEN: "open", READ: "read",
    STATFS: "statfs", RELEASE: "release", GETXATTR: "getxattr", LISTXATTR: "listxattr",
    FLUSH: "flush", INIT: "init", OPENDIR: "opendir", READDIR: "readdir",
    RELEASEDIR: "releasedir", ACCESS: "access", READDIRPLUS: "readdirplus", IOCTL: "ioctl",
    FORGET: "forget", BATCH_FORGET: "forget", INTERRUPT: "interrupt", DESTROY: "destroy",
}  # fmt: skip
COUNTED = (*OPCODE_NAMES.values(), "other")
WRITE_OPCODES = frozenset(
    {SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE, SETXATTR, REMOVEXATTR}
    | {CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE, TMPFILE}
)
NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# INIT flags we ask for, where the kernel offers them. Not ASYNC_READ: with it, read-ahead
# READs are background requests the kernel never interrupts, and a reader waiting on one (a
# read from a frozen node) could then be killed with SIGKILL only, not SIGINT.
ASYNC_READ = 1 << 0
DO_READDIRPLUS = 1 << 13
PARALLEL_DIROPS = 1 << 18
FLAG_MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
INIT_EXT = 1 << 30  # flags2 follows flags (then FUSE_OVER_IO_URING may be claimed)
WANTED_FLAGS = DO_READDIRPLUS | PARALLEL_DIROPS | FLAG_MAX_PAGES | CACHE_SYMLINKS

FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_RESEND = 7  # kernel 6.9+
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)

IN_HEADER = struct.Struct("<IIQQIIIHH")
READER = struct.Struct("<I")  # the requesting thread: the header's pid, after len ... gid
READER_OFFSET = 32
OUT_HEADER = struct.Struct("<IiQ")
# fuse_attr: ino, size, blocks, atime, mtime, ctime, their nanoseconds, mode, nlink, uid, gid,
# rdev, blksize, flags. The times are u64 in fuse_kernel.h but the kernel stores them into
# time64_t (fs/fuse/inode.c, fuse_change_attributes_common) and libfuse fills them from a
# signed time_t: signed on the wire, so a file dated before 1970 keeps its date.
_ATTR = "QQQqqqIIIIIIIIII"
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)
ATTR_OUT = struct.Struct("<QII" + _ATTR)
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
OPEN_OUT = struct.Struct("<QIi")
READ_IN = struct.Struct("<QQI")
GETXATTR_IN = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
DIRENT = struct.Struct("<QQII")
INVAL_ENTRY = struct.Struct("<QII")
INVAL_INODE = struct.Struct("<Qqq")  # fuse_notify_inval_inode_out: ino, off, len
INTERRUPT_IN = struct.Struct("<Q")
ENOTTY_REPLY = struct.pack("<Ii", OUT_HEADER.size, -errno.ENOTTY)  # then the request's unique
FLAGS2 = struct.Struct("<I")  # fuse_init_in.flags2, after the first 16 bytes (INIT_EXT)


class FuseError(Exception):
    """An errno for the kernel; the only exception a handler raises on purpose."""

    def __init__(self, errno_: int):
        super().__init__(errno_)
        self.errno = errno_


@dataclass(slots=True)
class Attr:
    ino: int
    mode: int
    size: int = 0
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    blksize: int = 4096
    timeout: float = 1.0  # seconds the kernel may keep the entry and the attributes

    def pack_entry(self) -> bytes:
        sec, nsec = _split(self.timeout)
        return ENTRY_OUT.pack(self.ino, 0, sec, sec, nsec, nsec, *self._fields())

    def pack_attr(self) -> bytes:
        sec, nsec = _split(self.timeout)
        return ATTR_OUT.pack(sec, nsec, 0, *self._fields())

    def _fields(self) -> tuple[int, ...]:
        t, tn = divmod(self.mtime_ns, 1_000_000_000)
        blocks = (self.size + 511) // 512
        return (self.ino, self.size, blocks, t, t, t, tn, tn, tn, self.mode, self.nlink) + (
            self.uid,
            self.gid,
            0,
            self.blksize,
            0,
        )


def _split(seconds: float) -> tuple[int, int]:
    sec = int(seconds)
    return sec, int((seconds - sec) * 1e9)


@dataclass(slots=True)
class StatFs:
    blocks: int
    files: int
    bsize: int = 4096
    namelen: int = 255


Buffer = bytes | bytearray | memoryview
ReadResult = Buffer | Callable[[], Buffer]
# How a request is answered: (unique, errno or 0, reply body). Over /dev/fuse a write to the
# fd; over io_uring a commit through the ring entry that holds the request.
Answer = Callable[[int, int, Buffer], None]


class PackedListing:
    """A folder's READDIR or READDIRPLUS reply stream for all its entries, packed once: entry
    `i` (offset `i + 1`) is `data[starts[i]:starts[i + 1]]`, and a reply is a slice of it."""

    __slots__ = ("data", "starts", "entry_size", "_ends")

    def __init__(self, data: bytes, starts: Any, entry_size: int):
        self.data = data
        self.starts = starts  # numpy int64, one more than the entries
        self.entry_size = entry_size  # READDIRPLUS: the fuse_entry_out heading each record
        self._ends = memoryview(starts.astype("<i8").tobytes()).cast("q")

    def __len__(self) -> int:
        return len(self._ends) - 1

    def reply(self, offset: int, size: int) -> memoryview:
        """The entries from position `offset` on that fit in `size` bytes (none: the end)."""
        ends = self._ends
        if offset >= len(ends) - 1:
            return memoryview(b"")
        start = ends[offset]
        last = bisect.bisect_right(ends, start + size, offset) - 1
        return memoryview(self.data)[start : ends[last]]

    def entry(self, pos: int) -> memoryview:
        """The fuse_entry_out of entry `pos` (READDIRPLUS listings): a LOOKUP's reply."""
        start = self._ends[pos]
        return memoryview(self.data)[start : start + self.entry_size]


class Filesystem(Protocol):
    """What the session asks of a read-only filesystem. Inodes are the filesystem's own."""

    def lookup(self, parent: int, name: bytes) -> Attr | Buffer:
        """The entry's attributes, or its packed fuse_entry_out."""
        ...

    def getattr(self, ino: int) -> Attr: ...
    def readlink(self, ino: int) -> bytes: ...
    def opendir(self, ino: int) -> bool:
        """Checks `ino` is a folder; True if the kernel may cache its listing."""
        ...

    def entries(self, ino: int, start: int) -> Iterator[tuple[bytes, Attr]]:
        """The folder's entries from position `start` on (no . and ..)."""
        ...

    def listing(self, ino: int, plus: bool) -> PackedListing | None:
        """The folder's replies packed whole, or None: the session packs `entries` per reply.
        (Optional: a filesystem without it is asked for `entries`.)"""
        ...

    def read(self, ino: int, offset: int, size: int) -> ReadResult:
        """The bytes, or a callable that blocks to get them (run in the session's pool)."""
        ...

    def statfs(self) -> StatFs: ...
    def getxattr(self, ino: int, name: bytes) -> bytes: ...
    def listxattr(self, ino: int) -> list[bytes]: ...


class RequestLoop:
    """Serves one /dev/fuse fd (the mount's own, or a clone) with `len(rows)` threads, each
    counting its requests in its own row of shared counters.

    Every request gets exactly one reply: inline, from the pool for a blocking read, EINTR when
    the kernel interrupts a pending read (the reader got a signal), EIO when a read passes
    `deadline` seconds, EAGAIN when MAX_PENDING reads already wait; a reply the kernel refuses
    is logged and replaced by an error reply. An INTERRUPT for a request this loop does not hold
    goes to `on_stray_interrupt` (with cloned fds it may belong to another process).

    With `use_uring` (setting fuse_uring) the loop claims FUSE over io_uring at INIT where the
    kernel offers it and a ring can be made here, and serves requests from a ring per CPU
    (uring.py) besides its /dev/fuse threads, which keep INIT, FORGET and INTERRUPT. One
    dispatch (`_dispatch`) answers both: what differs is the `Answer` a request carries, and a
    read the pool answers later commits through the ring entry that holds its request."""

    def __init__(
        self,
        fs: Filesystem,
        fd: int,
        rows: list[memoryview],
        on_stray_interrupt: Callable[[int], None] | None = None,
        deadline: float | None = None,
        poll_window: float = 0.0,
        done: threading.Event | None = None,
        use_uring: bool = False,
    ):
        self.fs = fs
        self.fd = fd
        self.rows = rows
        self.on_stray_interrupt = on_stray_interrupt
        self.deadline = deadline
        self.poll_window = poll_window  # seconds thread 0 polls for the next request of a burst
        affinity = os.sched_getaffinity(0)
        self._pool = ThreadPoolExecutor(
            max_workers=POOL_THREADS,
            thread_name_prefix="fuse-pool",
            # a pool thread started by a ring thread would inherit its pin to one CPU
            initializer=lambda: os.sched_setaffinity(0, affinity),
        )
        # unique -> when it went to the pool, and how it is to be answered
        self._pending: dict[int, tuple[float, Answer]] = {}
        self._interrupted: dict[int, None] = {}  # interrupts that came before their request
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._last_overload_log = 0.0
        self.done = done or threading.Event()  # set when it stops serving (its session's)
        self.detached = False  # the kernel said ENODEV: unmounted
        self._listing: Callable[[int, bool], PackedListing | None] | None = getattr(
            fs, "listing", None
        )
        # io_uring: claimed at INIT only if a ring can be made here (else it could hang the
        # mount: the kernel serves nothing until every CPU's queue has an entry)
        self.uring_unusable = uring.ring_unusable() if use_uring else "fuse_uring is off"
        self._rings: list[uring.QueueRing] = []
        self._ring_row: memoryview | None = None

    def start(self) -> None:
        for i, row in enumerate(self.rows):
            polls = self.poll_window if i == 0 else 0.0
            t = threading.Thread(
                target=self._serve, args=(row, polls), name=f"fuse-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        if self.deadline is not None:
            threading.Thread(target=self._expire_late, name="fuse-deadline", daemon=True).start()
        if self.uring_unusable is None:
            self._start_rings(self.rows[0])

    def _start_rings(self, row: memoryview) -> None:
        """A ring per possible CPU, each registering its entries as soon as the kernel has
        processed the INIT reply (whichever process answered it); if the connection does not
        use io_uring (not offered at INIT), they end and the /dev/fuse threads serve alone."""
        self._ring_row = row
        size = uring.payload_size(MAX_WRITE, MAX_PAGES)
        for qid in range(uring.possible_cpus()):
            ring = uring.QueueRing(
                self.fd,
                qid,
                uring.DEPTH,
                size,
                self._ring_request,
                self._ring_ended,
                self.interrupt,
            )
            self._rings.append(ring)
        for ring in self._rings:
            ring.thread.start()

    def _ring_ended(self, ring: uring.QueueRing, why: str | None) -> None:
        if why is not None and ring.qid == 0:
            log.debug("FUSE rings stop: %s", why)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` for the serving threads; True if they all ended."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return all(not t.is_alive() for t in self._threads)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.done.set()

    def interrupt(self, unique: int) -> bool:
        """The kernel asks to abort request `unique`: if it is a read still pending here, the
        reader gets EINTR now (its process can then die or handle its signal)."""
        with self._lock:
            held = self._pending.pop(unique, None)
            if held is None:
                self._interrupted[unique] = None
                while len(self._interrupted) > MAX_PENDING:
                    del self._interrupted[next(iter(self._interrupted))]
        if held is not None:
            held[1](unique, errno.EINTR, b"")
        return held is not None

    def pending(self) -> int:
        return len(self._pending)

    # ---- the request loop

    def _serve(self, row: memoryview, poll_window: float = 0.0) -> None:
        buf = bytearray(READ_BUFFER)
        view = memoryview(buf)
        burst = BurstPoll(self.fd, poll_window) if poll_window > 0 else None
        try:
            while True:
                if burst is not None:
                    burst.wait()
                try:
                    n = os.readv(self.fd, [buf])
                except OSError as e:
                    if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # interrupted, or a request the kernel took back
                    if e.errno == errno.ENODEV:
                        self.detached = True
                        return  # unmounted
                    log.error("FUSE request loop ends: %s", e)
                    return
                if n == 0:
                    return
                if burst is not None:
                    burst.arrived(READER.unpack_from(buf, READER_OFFSET)[0])
                if buf[4] == IOCTL and n >= IN_HEADER.size and not any(buf[5:8]):
                    # Python's open() asks isatty() of every file (TCGETS): answered here,
                    # before the header is unpacked (see _dispatch).
                    row[IOCTL] += 1
                    self._write(0, [ENOTTY_REPLY, view[8:16]])
                else:
                    try:
                        self._handle(view[:n], row)
                    except Exception:  # a bug here must not end the loop; the log says what
                        log.exception("FUSE request failed")
                if burst is not None:
                    burst.answered()
        finally:
            self.done.set()

    def _handle(self, req: memoryview, row: memoryview) -> None:
        _length, opcode, unique, ino, _uid, _gid, _pid, _ext, _ = IN_HEADER.unpack_from(req)
        self._dispatch(opcode, unique, ino, req[IN_HEADER.size :], row, self._answer)

    def _ring_request(self, entry: uring.RingEntry) -> None:
        """A request in a ring entry (its ring's thread, on the reader's CPU)."""
        row = self._ring_row
        assert row is not None
        _length, opcode, unique, ino, _uid, _gid, _pid, _ext, _ = IN_HEADER.unpack_from(
            entry.header
        )
        row[RING_SLOT] += 1
        try:
            self._dispatch(opcode, unique, ino, entry.body(opcode), row, entry.commit)
        except Exception:  # as in _serve; the entry must still be answered
            log.exception("FUSE request failed")
            entry.commit(unique, errno.EIO, b"")

    def _dispatch(
        self, opcode: int, unique: int, ino: int, body: memoryview, row: memoryview, answer: Answer
    ) -> None:
        """Answer one request, from either transport: inline through `answer`, or later from
        the pool for a read that may block."""
        row[opcode if opcode < SLOTS else 0] += 1
        if opcode == IOCTL:
            # Python's open() asks isatty() of every file it opens (TCGETS): one request a
            # file that the kernel forwards every time (fs/fuse/ioctl.c: no flag in INIT or
            # OPEN stops it, no answer is remembered, ENOSYS is turned into ENOTTY and asked
            # again). Answered first, with no handler and no exception; _serve answers it
            # before even unpacking the header, with a reply it keeps packed.
            answer(unique, errno.ENOTTY, b"")
            return
        if opcode in NO_REPLY:
            if opcode == INTERRUPT:
                (target,) = INTERRUPT_IN.unpack_from(body)
                if not self.interrupt(target) and self.on_stray_interrupt is not None:
                    self.on_stray_interrupt(target)
            return
        try:
            if opcode in WRITE_OPCODES:
                raise FuseError(errno.EROFS)
            handler = _HANDLERS.get(opcode)
            if handler is None:
                raise FuseError(errno.ENOSYS)
            reply = handler(self, ino, body)
        except FuseError as e:
            answer(unique, e.errno, b"")
            return
        except Exception:
            log.exception("FUSE %s of inode %d failed", OPCODE_NAMES.get(opcode, opcode), ino)
            answer(unique, errno.EIO, b"")
            return
        if callable(reply):
            self._submit(unique, reply, answer)
        else:
            answer(unique, 0, reply)

    def _submit(self, unique: int, work: Callable[[], Buffer], answer: Answer) -> None:
        with self._lock:
            interrupted = self._interrupted.pop(unique, 0) is None
            overloaded = not interrupted and len(self._pending) >= MAX_PENDING
            if not interrupted and not overloaded:
                self._pending[unique] = (time.monotonic(), answer)
        if interrupted:
            answer(unique, errno.EINTR, b"")
            return
        if overloaded:
            now = time.monotonic()
            if now - self._last_overload_log > 10:
                self._last_overload_log = now
                log.warning("%d reads already wait on other nodes: EAGAIN", MAX_PENDING)
            answer(unique, errno.EAGAIN, b"")
            return
        try:
            self._pool.submit(self._reply_later, unique, work)
        except RuntimeError:  # the pool is shut down: we are stopping
            if self._pending.pop(unique, None) is not None:
                answer(unique, errno.EIO, b"")

    def _reply_later(self, unique: int, work: Callable[[], Buffer]) -> None:
        if unique not in self._pending:
            return  # interrupted or past its deadline before it ran: answered already
        data: Buffer | None = None
        error = 0
        try:
            data = work()
        except FuseError as e:
            error = e.errno
        except Exception:
            log.exception("FUSE read failed")
            error = errno.EIO
        with self._lock:
            held = self._pending.pop(unique, None)
        if held is None:
            return  # answered meanwhile (EINTR or the deadline)
        held[1](unique, error, b"" if data is None else data)

    def _expire_late(self) -> None:
        assert self.deadline is not None
        while not self.done.wait(min(1.0, self.deadline / 4)):
            limit = time.monotonic() - self.deadline
            with self._lock:
                late = [(u, held) for u, held in self._pending.items() if held[0] < limit]
                for u, _held in late:
                    del self._pending[u]
            for u, (_since, answer) in late:
                log.error("a read waited more than %.0fs for other nodes: EIO", self.deadline)
                answer(u, errno.EIO, b"")

    def _answer(self, unique: int, error: int, data: Buffer) -> None:
        """Reply over /dev/fuse."""
        if error:
            self._reply_error(unique, error)
        else:
            self._reply(unique, data)

    def _reply(self, unique: int, data: Buffer) -> None:
        if isinstance(data, memoryview):  # a mapped segment: see map_pages
            map_pages(data)
        header = OUT_HEADER.pack(OUT_HEADER.size + len(data), 0, unique)
        if not self._write(unique, [header, data]):
            self._reply_error(unique, errno.EIO)  # the request must still get an answer

    def _reply_error(self, unique: int, errno_: int) -> None:
        self._write(unique, [OUT_HEADER.pack(OUT_HEADER.size, -errno_, unique)])

    def _write(self, unique: int, parts: list[Buffer]) -> bool:
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            # ENOENT: the request was interrupted (or resent) and is gone; ENODEV: unmounted.
            if e.errno in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                return True
            log.error("the kernel refused the reply to request %d: %s", unique, e)
            return False
        return True

    # ---- one function per opcode: (loop, inode, request body) -> reply

    def _init(self, ino: int, body: memoryview) -> bytes:
        major, minor, max_readahead, flags = INIT_IN.unpack_from(body)
        if major != KERNEL_VERSION:
            raise FuseError(errno.EPROTO)
        got = flags & WANTED_FLAGS
        if self.uring_unusable is None:
            flags2 = FLAGS2.unpack_from(body, INIT_IN.size)[0] if flags & INIT_EXT else 0
            if flags2 << 32 & uring.FUSE_OVER_IO_URING:
                got |= INIT_EXT | uring.FUSE_OVER_IO_URING
                log.info("FUSE over io_uring: serving from a ring per CPU")
            else:
                log.warning(
                    "fuse_uring: serving through /dev/fuse: the kernel did not offer io_uring "
                    "(%s was N when mounted)", uring.ENABLE_URING,
                )  # fmt: skip
        return INIT_OUT.pack(
            KERNEL_VERSION, min(minor, OUR_MINOR), max_readahead, got & 0xFFFFFFFF,
            16, 12, MAX_WRITE, 1, MAX_PAGES, 0, got >> 32, 0, 0,
        )  # fmt: skip

    def _lookup(self, ino: int, body: memoryview) -> Buffer:
        found = self.fs.lookup(ino, bytes(body[:-1]))
        return found.pack_entry() if isinstance(found, Attr) else found

    def _getattr(self, ino: int, body: memoryview) -> bytes:
        return self.fs.getattr(ino).pack_attr()

    def _readlink(self, ino: int, body: memoryview) -> bytes:
        return self.fs.readlink(ino)

    def _open(self, ino: int, body: memoryview) -> bytes:
        # ENOSYS switches the kernel to no-open mode for files: from then on it opens without
        # asking, never sends RELEASE, and keeps the page cache (the data is immutable).
        raise FuseError(errno.ENOSYS)

    def _opendir(self, ino: int, body: memoryview) -> bytes:
        cache = self.fs.opendir(ino)
        return OPEN_OUT.pack(ino, (FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR) if cache else 0, 0)

    def _release(self, ino: int, body: memoryview) -> bytes:
        return b""

    def _read(self, ino: int, body: memoryview) -> ReadResult:
        _fh, offset, size = READ_IN.unpack_from(body)
        return self.fs.read(ino, offset, size)

    def _readdir(self, ino: int, body: memoryview, plus: bool = False) -> Buffer:
        _fh, offset, size = READ_IN.unpack_from(body)
        packed = self._listing(ino, plus) if self._listing is not None else None
        if packed is not None:
            return packed.reply(offset, size)
        return pack_entries(self.fs.entries(ino, offset), offset, size, plus)

    def _readdirplus(self, ino: int, body: memoryview) -> Buffer:
        return self._readdir(ino, body, plus=True)

    def _statfs(self, ino: int, body: memoryview) -> bytes:
        s = self.fs.statfs()
        return STATFS_OUT.pack(s.blocks, 0, 0, s.files, 0, s.bsize, s.namelen, s.bsize, 0)

    def _getxattr(self, ino: int, body: memoryview) -> bytes:
        size, _ = GETXATTR_IN.unpack_from(body)
        value = self.fs.getxattr(ino, bytes(body[GETXATTR_IN.size : -1]))
        return _sized(value, size)

    def _listxattr(self, ino: int, body: memoryview) -> bytes:
        size, _ = GETXATTR_IN.unpack_from(body)
        return _sized(b"".join(name + b"\0" for name in self.fs.listxattr(ino)), size)

    def _access(self, ino: int, body: memoryview) -> bytes:
        raise FuseError(errno.ENOSYS)  # permissions are the kernel's (default_permissions)

    def _flush(self, ino: int, body: memoryview) -> bytes:
        raise FuseError(errno.ENOSYS)  # nothing to flush: the kernel stops sending it

    def _destroy(self, ino: int, body: memoryview) -> bytes:
        return b""


_HANDLERS: dict[int, Callable[[RequestLoop, int, memoryview], ReadResult]] = {
    INIT: RequestLoop._init, LOOKUP: RequestLoop._lookup, GETATTR: RequestLoop._getattr,
    READLINK: RequestLoop._readlink, OPEN: RequestLoop._open, OPENDIR: RequestLoop._opendir,
    RELEASE: RequestLoop._release, RELEASEDIR: RequestLoop._release, READ: RequestLoop._read,
    READDIR: RequestLoop._readdir, READDIRPLUS: RequestLoop._readdirplus,
    STATFS: RequestLoop._statfs, GETXATTR: RequestLoop._getxattr,
    LISTXATTR: RequestLoop._listxattr, ACCESS: RequestLoop._access, FLUSH: RequestLoop._flush,
    DESTROY: RequestLoop._destroy,
}  # fmt: skip


class FuseSession:
    """One mount: the /dev/fuse fd, notifications to the kernel, and (in-process serving, as
    the toy tests and `--workers 0` do) a RequestLoop of `threads` threads on that fd. The
    multi-process mount serves from clones of the fd instead (`clone_fd`); its serving
    processes count their requests in `counters` (in-process serving makes its own)."""

    def __init__(
        self,
        fs: Filesystem | None,
        mountpoint: str,
        options: Iterable[str],
        threads: int = THREADS,
        counters: SharedCounters | None = None,
    ):
        self.fs = fs
        self.mountpoint = mountpoint
        self.options = sorted(set(options))
        self.threads = threads
        self.fd = -1
        self.loop: RequestLoop | None = None
        self.counters = counters
        self._keep: socket.socket | None = None  # auto_unmount: fusermount3 watches this end
        self._fusermount: subprocess.Popen[str] | None = None
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuse-notify")
        self._last_invalidation: Future[None] | None = None
        self.done = threading.Event()
        self.detached = False  # the kernel said ENODEV, or we unmounted: never unmount again
        self.device: str | None = None  # our superblock's "major:minor", from mountinfo

    # ---- lifecycle

    def mount(self) -> None:
        """Mount through fusermount3 (works as root and not), which passes back the fd."""
        tool = fusermount()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        args = [tool, "-o", ",".join(self.options), "--", self.mountpoint]
        proc = subprocess.Popen(
            args, env=env, pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, text=True
        )
        theirs.close()
        try:
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        except OSError:
            fds = []
        auto_unmount = "auto_unmount" in self.options
        self._fusermount = proc  # with auto_unmount it stays, watching our end of the socket
        if not fds or not auto_unmount:
            _, err = proc.communicate()
            if not fds:
                ours.close()
                message = err.strip().splitlines()[-1] if err.strip() else "fusermount3 failed"
                raise OSError(errno.EIO, f"mount failed: {message}")
        self.fd = fds[0]
        os.set_inheritable(self.fd, False)
        # Just mounted over a free folder (the caller checked): the topmost mount there is ours.
        entry = mount_at(self.mountpoint)
        self.device = entry.device if entry is not None else None
        if auto_unmount:
            self._keep = ours  # closed when this process exits: then fusermount3 unmounts
        else:
            ours.close()

    def start(self) -> None:
        """Serve in this process, with `threads` threads."""
        assert self.fs is not None
        self.counters = SharedCounters.create(self.threads)
        rows = [self.counters.row(i) for i in range(self.threads)]
        self.loop = RequestLoop(self.fs, self.fd, rows, done=self.done)
        self.loop.start()

    def connected(self) -> bool:
        """Whether the kernel still serves this mount: it ends the connection once our
        superblock is gone (unmounted; a lazily detached mount lives while files are open),
        and from then on poll reports POLLERR on the fd."""
        events = select.poll()
        events.register(self.fd, select.POLLIN)
        return not any(
            ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in events.poll(0)
        )

    def mounted_here(self) -> bool:
        """Whether the mount at our mountpoint now is this session's own."""
        entry = mount_at(self.mountpoint)
        # mountinfo first, the connection after: a device number is free for another mount
        # only once our superblock is gone, and that ends the connection for good.
        return (
            entry is not None
            and self.device is not None
            and entry.device == self.device
            and self.connected()
        )

    def unmount(self) -> None:
        """Detach the mount, if what is mounted at our path is still ours; the serving threads
        see ENODEV and end. A mount made there since (an unmount, then a new mount at once, as
        scripts and service restarts do) belongs to another process and is left alone."""
        if self.detached or self.fd < 0:
            return
        self.detached = True
        if not self.mounted_here():
            log.info("%s is no longer this process's mount: leaving it alone", self.mountpoint)
            return
        # By path, as fusermount3 needs: our mount would have to go and another come in the
        # microseconds since the check to be mistaken for ours.
        subprocess.run(
            [fusermount(), "-u", "-z", "-q", self.mountpoint],
            capture_output=True,
        )

    def close(self, timeout: float = 2.0) -> None:
        """After unmount: wait a little for the threads (files still open on a lazily detached
        mount keep them serving), then let go; the kernel aborts the connection when the fd
        closes with this process."""
        ended = True
        if self.loop is not None:
            ended = self.loop.join(timeout)
            self.loop.shutdown()
        self._notify.shutdown(wait=False, cancel_futures=True)
        # A thread still blocked in read(2) would read whatever reused the fd number next.
        if ended and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._keep is not None:
            self._keep.close()
            self._keep = None
            if self._fusermount is not None:
                try:
                    self._fusermount.wait(5)
                except subprocess.TimeoutExpired:
                    log.warning("fusermount3 (auto_unmount) did not exit")

    def counts(self) -> Counter[str]:
        """Requests seen, by kind, over every serving thread (and process)."""
        if self.counters is None:
            return Counter()
        return +Counter(self.counters.totals(OPCODE_NAMES))

    # ---- notifications

    def invalidate_entry_async(self, parent: int, name: bytes) -> None:
        """Make the kernel forget a cached name. In a thread of its own: the kernel takes the
        folder's lock, which a request waiting on our caller may hold."""
        self._last_invalidation = self._notify.submit(self._invalidate_entry, parent, name)

    def after_invalidations(self, callback: Callable[[], None]) -> None:
        """Call `callback` (in the notify thread) once the invalidations asked so far are done."""
        try:
            self._notify.submit(callback)
        except RuntimeError:
            pass  # shutting down

    def wait_invalidations(self, timeout: float = 1.0) -> None:
        """Wait for the invalidations asked so far (only where no folder lock is held)."""
        last = self._last_invalidation
        if last is None or last.done():
            return  # the common case: nothing was dropped since
        try:
            last.result(timeout)  # one thread runs them in order: the last done, all done
        except (TimeoutError, CancelledError):
            pass  # a folder lock held elsewhere, or shutting down: the kernel catches up later

    def invalidate_pages_async(self, inodes: list[int]) -> None:
        """Make the kernel drop its cached pages (and attributes) of `inodes`, whole; one it
        does not know is skipped. In the notify thread, as entries are."""
        self._last_invalidation = self._notify.submit(self._invalidate_pages, inodes)

    def _invalidate_pages(self, inodes: list[int]) -> None:
        for ino in inodes:
            body = INVAL_INODE.pack(ino, 0, 0)  # from offset 0, length 0: to the end
            header = OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0)
            try:
                os.writev(self.fd, [header, body])
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue  # not cached
                if e.errno not in (errno.EBADF, errno.ENODEV):
                    log.warning("cannot drop the cached pages of inode %d: %s", ino, e)
                return

    def _invalidate_entry(self, parent: int, name: bytes) -> None:
        body = INVAL_ENTRY.pack(parent, len(name), 0) + name + b"\0"
        header = OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0)
        try:
            os.writev(self.fd, [header, body])
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                log.warning("cannot invalidate %r: %s", name, e)

    def resend_pending(self) -> bool:
        """Have the kernel queue again every request read but not answered (those a killed
        worker held, kept alive by its fd that we hold); False where the kernel cannot."""
        header = OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0)
        try:
            os.writev(self.fd, [header])
        except OSError as e:
            log.warning("the kernel cannot resend the requests of a dead worker: %s", e)
            return False
        return True

    def inherited_fds(self) -> tuple[int, ...]:
        """What a serving process must hold besides its clone: the auto_unmount socket, so that
        fusermount3 sees it close only once the last process that serves the mount is gone
        (it does not unmount a connection a clone still keeps alive)."""
        return (self._keep.fileno(),) if self._keep is not None else ()

    def clone_fd(self) -> int:
        """A new /dev/fuse fd bound to this mount: requests spread over all of them."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", self.fd))
        except OSError:
            os.close(fd)
            raise
        return fd

    def set_read_ahead(self, kib: int) -> None:
        """Raise the mount's read-ahead (INIT can only lower the kernel's 128 KiB) so that a
        typical file is one READ; needs root, so a refusal is only logged."""
        if self.device is None:
            return
        path = f"/sys/class/bdi/{self.device}/read_ahead_kb"
        try:
            with open(path, "w") as f:
                f.write(str(kib))
        except OSError as e:
            log.info("read-ahead stays as it is (%s: %s)", path, e.strerror)


def pack_entries(
    entries: Iterable[tuple[bytes, Attr]], offset: int, size: int, plus: bool
) -> bytes:
    """A READDIR(PLUS) reply built entry by entry: those from position `offset` (the first of
    `entries`) that fit in `size` bytes."""
    out = bytearray()
    pos = offset
    for name, attr in entries:
        pos += 1
        dirent = DIRENT.pack(attr.ino, pos, len(name), (attr.mode >> 12) & 0xF) + name
        dirent += b"\0" * (-len(dirent) % 8)
        if plus:
            dirent = attr.pack_entry() + dirent
        if len(out) + len(dirent) > size:
            break
        out += dirent
    return bytes(out)


def _sized(value: bytes, size: int) -> bytes:
    """getxattr/listxattr: size 0 asks for the length; a buffer too small is ERANGE."""
    if size == 0:
        return GETXATTR_OUT.pack(len(value), 0)
    if len(value) > size:
        raise FuseError(errno.ERANGE)
    return value


def fusermount() -> str:
    tool = shutil.which("fusermount3")
    if tool is None:
        raise OSError(errno.ENOENT, "fusermount3 not found: install the fuse3 package")
    return tool
