"""FUSE over io_uring (Linux 6.14+): per-CPU rings of a serving process, and whether they can be used.

Each request is queued by the kernel on the ring of the CPU its reader runs on, and a thread
pinned to that CPU answers it there: no halted CPU to wake between reader and server, the
cost of a /dev/fuse round trip on a VM whose idle CPUs halt (docs/mounts.md). Measured by the
probe (12-15 us a round trip wherever the reader ran, against 60-200 us through /dev/fuse
when reader and server sat on different CPUs). Raw syscalls through ctypes: no liburing.

The ABI (include/uapi/linux/fuse.h 7.42+, fs/fuse/dev_uring.c): an io_uring with SQE128;
IORING_OP_URING_CMD on the /dev/fuse fd, `cmd_op` REGISTER (an entry: a header buffer and a
payload buffer) or COMMIT_AND_FETCH (the reply, then wait for the next request), the command
`fuse_uring_cmd_req {u64 flags; u64 commit_id; u16 qid}` at SQE offset 48. An entry's header
is `in_out[128]` (fuse_in_header in, fuse_out_header out), `op_in[128]` (the opcode's fixed
argument), `fuse_uring_ent_in_out {flags, commit_id, payload_sz}` at 256; the variable part of
a request (a LOOKUP's name) and the reply's body are in the payload. The kernel serves nothing
once io_uring is claimed at INIT until every possible CPU's queue has an entry, so the loop
claims it only after `ring_unusable` found a ring can be made here (kernel.py).

INTERRUPT still comes through /dev/fuse, and the kernel loses one: it queues a request's
INTERRUPT only if the request was sent already, and /dev/fuse's read looks back for a signal
that came before (FR_INTERRUPTED) while the ring's send does not (fs/fuse/dev_uring.c, 6.14 to
6.18 at least). A buffered read interrupted in its read-ahead is sent again as a one-page READ
with the signal pending (measured: 2 READs, 1 INTERRUPT): no INTERRUPT for it ever comes, and
its reader waits for the answer, on a frozen node until the read's deadline. `InterruptWatch`
gives it: every WATCH_S it looks once at each request an entry has held that long; one whose
reader has a signal pending that the kernel would have interrupted it for is interrupted.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
POSSIBLE_CPUS = Path("/sys/devices/system/cpu/possible")
DEPTH = 4  # entries per queue and serving process: replies the pool holds keep theirs
HEADER_SIZE = 4096
OP_IN, ENT_IN_OUT = 128, 256  # offsets in the header buffer
ENT = struct.Struct("<QQI")  # fuse_uring_ent_in_out: flags, commit_id, payload_sz
PAYLOAD_SZ_OFFSET = ENT_IN_OUT + 16
OUT_HEADER = struct.Struct("<IiQ")
FUSE_OVER_IO_URING = 1 << 41  # INIT flags: flags2 bit 9

SYS_IO_URING_SETUP, SYS_IO_URING_ENTER = 425, 426  # the same on x86-64 and arm64
IORING_SETUP_CQSIZE = 1 << 3
IORING_SETUP_SQE128 = 1 << 10
IORING_ENTER_GETEVENTS = 1
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
IORING_FEAT_SINGLE_MMAP = 1
IORING_OP_URING_CMD = 46
CMD_REGISTER, CMD_COMMIT_AND_FETCH = 1, 2
SQE_SIZE = 128
CMD_REQ = struct.Struct("<QQH6x")  # fuse_uring_cmd_req, at SQE offset 48
COMMIT_ID_OFFSET = 56
REGISTER_RETRY = (0.01, 0.2)  # seconds between REGISTERs refused before INIT (first, most)
GONE = frozenset({errno.ENOTCONN, errno.ECANCELED, errno.ENODEV, errno.ECONNABORTED})
# How often (and after how long) InterruptWatch looks at the requests the entries hold: a lost
# INTERRUPT comes this late. Inline answers take microseconds: never looked at.
WATCH_S = 0.1
IN_UNIQUE_PID = struct.Struct("<8xQ16xI")  # fuse_in_header's unique and pid

# op_in size of each opcode (its in_args[0]); 0 or absent: all of it is in the payload
OP_IN_SIZE = {
    3: 16, 14: 8, 15: 40, 18: 24, 22: 8, 23: 8, 25: 24, 27: 8, 28: 40, 29: 24,
    34: 8, 39: 32, 44: 40,
}  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10),
    ]  # fmt: skip


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Ring:
    """One io_uring (SQE128), its rings and SQE array mapped. Any thread may queue SQEs
    (under `lock`) and submit them; only the owner reads completions."""

    def __init__(self, entries: int):
        p = _Params()
        p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE
        p.cq_entries = entries * 2
        fd = _libc.syscall(SYS_IO_URING_SETUP, ctypes.c_uint(entries), ctypes.byref(p))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd = int(fd)
        self.lock = threading.Lock()
        sq_off, cq_off = list(p.sq_off), list(p.cq_off)
        sq_size = sq_off[6] + p.sq_entries * 4  # up to the SQ index array's end
        cq_size = cq_off[5] + p.cq_entries * 16  # up to the CQEs' end
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        try:
            if p.features & IORING_FEAT_SINGLE_MMAP:
                self._sq = self._cq = mmap.mmap(
                    self.fd, max(sq_size, cq_size), flags, prot, offset=IORING_OFF_SQ_RING
                )
            else:
                self._sq = mmap.mmap(self.fd, sq_size, flags, prot, offset=IORING_OFF_SQ_RING)
                self._cq = mmap.mmap(self.fd, cq_size, flags, prot, offset=IORING_OFF_CQ_RING)
            self._sqes = mmap.mmap(
                self.fd, p.sq_entries * SQE_SIZE, flags, prot, offset=IORING_OFF_SQES
            )
        except OSError:
            os.close(self.fd)
            raise
        self._sq_head = ctypes.c_uint32.from_buffer(self._sq, sq_off[0])
        self._sq_tail = ctypes.c_uint32.from_buffer(self._sq, sq_off[1])
        self._sq_mask = ctypes.c_uint32.from_buffer(self._sq, sq_off[2]).value
        self._cq_head = ctypes.c_uint32.from_buffer(self._cq, cq_off[0])
        self._cq_tail = ctypes.c_uint32.from_buffer(self._cq, cq_off[1])
        self._cq_mask = ctypes.c_uint32.from_buffer(self._cq, cq_off[2]).value
        self._cqes = cq_off[5]
        for i in range(p.sq_entries):  # SQ slot i holds SQE i
            struct.pack_into("<I", self._sq, sq_off[6] + 4 * i, i)
        self._tail = self._sq_tail.value

    def queue(self, sqe: bytes | bytearray) -> None:
        """Copy an SQE into the next slot and publish it (the caller holds `lock`)."""
        off = (self._tail & self._sq_mask) * SQE_SIZE
        self._sqes[off : off + SQE_SIZE] = sqe
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        self._sq_tail.value = self._tail  # x86/arm64 stores: the SQE is written before this

    def enter(self, wait: bool) -> None:
        """Submit what is queued; with `wait`, until at least one completion is there."""
        while True:
            to_submit = (self._tail - self._sq_head.value) & 0xFFFFFFFF
            flags = IORING_ENTER_GETEVENTS if wait else 0
            r = _libc.syscall(SYS_IO_URING_ENTER, self.fd, to_submit, int(wait), flags, None, 0)
            if r >= 0:
                return
            e = ctypes.get_errno()
            if e in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                if not wait or self._cq_tail.value != self._cq_head.value:
                    return
                continue
            raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    def completions(self) -> list[tuple[int, int]]:
        """(user_data, res) of every completion there, consumed."""
        head, tail = self._cq_head.value, self._cq_tail.value
        out = []
        while head != tail:
            out.append(
                struct.unpack_from("<Qi", self._cq, self._cqes + (head & self._cq_mask) * 16)
            )
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head
        return out

    def close(self) -> None:
        os.close(self.fd)


def _sqe(fuse_fd: int, cmd_op: int, addr: int, length: int, user_data: int, qid: int) -> bytearray:
    sqe = bytearray(SQE_SIZE)
    struct.pack_into("<BBHiII", sqe, 0, IORING_OP_URING_CMD, 0, 0, fuse_fd, cmd_op, 0)
    struct.pack_into("<QII", sqe, 16, addr, length, 0)
    struct.pack_into("<Q", sqe, 32, user_data)
    CMD_REQ.pack_into(sqe, 48, 0, 0, qid)
    return sqe


class RingEntry:
    """One registered entry: its request while it holds one, and its reply (`commit`)."""

    __slots__ = (
        "queue", "index", "header", "payload", "_iov", "_register", "_commit", "held_since",
        "looked_at",
    )  # fmt: skip

    def __init__(self, queue: QueueRing, index: int, payload_size: int):
        self.queue = queue
        self.index = index
        self.header = mmap.mmap(-1, HEADER_SIZE)
        self.payload = mmap.mmap(-1, payload_size)
        self._iov = (_Iovec * 2)(
            _Iovec(_address(self.header), HEADER_SIZE), _Iovec(_address(self.payload), payload_size)
        )
        fd, qid = queue.fuse_fd, queue.qid
        self._register = _sqe(fd, CMD_REGISTER, ctypes.addressof(self._iov), 2, index, qid)
        self._commit = _sqe(fd, CMD_COMMIT_AND_FETCH, 0, 0, index, qid)
        self.held_since = 0.0  # when its request was handed to the loop (0: none held)
        self.looked_at = 0.0  # the held_since InterruptWatch looked at

    def body(self, opcode: int) -> memoryview:
        """The request after its fuse_in_header, as /dev/fuse would give it."""
        size = OP_IN_SIZE.get(opcode, 0)
        _flags, _commit_id, payload_sz = ENT.unpack_from(self.header, ENT_IN_OUT)
        if not size:
            return memoryview(self.payload)[:payload_sz]
        fixed = memoryview(self.header)[OP_IN : OP_IN + size]
        if not payload_sz:
            return fixed
        return memoryview(bytes(fixed) + self.payload[:payload_sz])

    def commit(self, unique: int, error: int, data: bytes | bytearray | memoryview) -> None:
        """Reply to the request this entry holds (error: a positive errno, or 0 with `data`),
        and hand the entry back for the next request. From any thread."""
        self.held_since = 0.0
        n = len(data) if not error else 0
        if n > len(self.payload):
            error, n = errno.EIO, 0
        if n:
            self.payload[:n] = data
        OUT_HEADER.pack_into(self.header, 0, OUT_HEADER.size + n, -error, unique)
        struct.pack_into("<I", self.header, PAYLOAD_SZ_OFFSET, n)
        _flags, commit_id, _ = ENT.unpack_from(self.header, ENT_IN_OUT)
        struct.pack_into("<Q", self._commit, COMMIT_ID_OFFSET, commit_id)
        self.queue.submit(self._commit, now=threading.get_ident() != self.queue.thread_id)


class QueueRing:
    """The ring of one CPU's queue in one serving process: `depth` entries, one thread pinned
    to that CPU that waits for requests and answers them through `on_request(entry)`."""

    def __init__(
        self,
        fuse_fd: int,
        qid: int,
        depth: int,
        payload_size: int,
        on_request: Callable[[RingEntry], None],
        on_end: Callable[[QueueRing, str | None], None],
        interrupt: Callable[[int], object],
    ):
        self.fuse_fd = fuse_fd
        self.qid = qid
        self.on_request = on_request
        self.on_end = on_end
        self.interrupt = interrupt  # the loop's: what an INTERRUPT of a request does
        self.ring = Ring(depth * 2)
        self.entries = [RingEntry(self, i, payload_size) for i in range(depth)]
        self.thread_id = 0
        self.thread = threading.Thread(target=self._run, name=f"fuse-ring-{qid}", daemon=True)

    def submit(self, sqe: bytes | bytearray, now: bool) -> None:
        """Queue an SQE; submit it at once with `now` (another thread than the ring's: the
        ring's own submits with its next wait)."""
        with self.ring.lock:
            self.ring.queue(sqe)
        if now:
            self.ring.enter(wait=False)

    def _run(self) -> None:
        self.thread_id = threading.get_ident()
        try:
            os.sched_setaffinity(0, {self.qid})  # this thread only
        except OSError:
            pass  # a CPU outside our set: served from elsewhere, still correct
        why: str | None = None
        WATCH.add(self)
        try:
            why = self._serve()
        except Exception as e:  # reported, never raised into a thread nobody joins
            log.exception("FUSE ring of CPU %d failed", self.qid)
            why = str(e)
        finally:
            WATCH.discard(self)
            self.ring.close()
            self.on_end(self, why)

    def _serve(self) -> str | None:
        """Serve until the connection ends (None) or the kernel refuses the ring (why)."""
        live = len(self.entries)
        for entry in self.entries:
            self.submit(entry._register, now=False)
        delay = REGISTER_RETRY[0]
        while live:
            self.ring.enter(wait=True)
            retry = []
            for index, res in self.ring.completions():
                entry = self.entries[index]
                if res >= 0:
                    entry.held_since = time.monotonic()
                    self.on_request(entry)
                elif -res == errno.EAGAIN:  # the INIT reply is not processed yet
                    retry.append(entry)
                elif -res == errno.EOPNOTSUPP:
                    return "the connection does not use io_uring"
                elif -res in GONE:
                    live -= 1  # unmounted (or the entry cancelled): no more requests here
                elif -res == errno.ENOENT:  # a commit of a request the kernel no longer has
                    log.warning("FUSE ring of CPU %d: a reply came too late", self.qid)
                    retry.append(entry)  # registered anew: the kernel keeps the old one aside
                else:
                    log.error("FUSE ring of CPU %d: %s", self.qid, os.strerror(-res))
                    live -= 1
            if retry:
                time.sleep(delay)  # the kernel says EAGAIN until the INIT reply is processed
                delay = min(delay * 2, REGISTER_RETRY[1])
                for entry in retry:
                    self.submit(entry._register, now=False)
        return None

    def interrupt_lost(self, now: float) -> None:
        """Interrupt each request an entry has held since WATCH_S or more whose reader the
        kernel would have interrupted (looked at once: a signal that comes after the request
        reached us brings its INTERRUPT through /dev/fuse)."""
        for entry in self.entries:
            since = entry.held_since
            if not since or since == entry.looked_at or now - since < WATCH_S:
                continue
            entry.looked_at = since
            unique, pid = IN_UNIQUE_PID.unpack_from(entry.header)
            if pid and signal_pending(pid):
                log.debug("FUSE ring of CPU %d: request %d: its INTERRUPT lost", self.qid, unique)
                self.interrupt(unique)


class InterruptWatch:
    """One thread per process, while it has rings, that gives their held requests the
    INTERRUPTs the kernel lost (see the module's docstring)."""

    def __init__(self) -> None:
        self._rings: set[QueueRing] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, ring: QueueRing) -> None:
        with self._lock:
            self._rings.add(ring)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fuse-ring-interrupts", daemon=True
                )
                self._thread.start()

    def discard(self, ring: QueueRing) -> None:
        with self._lock:
            self._rings.discard(ring)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                rings = list(self._rings)
                if not rings:
                    self._thread = None
                    return
            now = time.monotonic()
            for ring in rings:
                try:
                    ring.interrupt_lost(now)
                except Exception:  # logged; the watch goes on for the other requests
                    log.exception("FUSE ring of CPU %d: looking for lost interrupts", ring.qid)


WATCH = InterruptWatch()


def signal_pending(tid: int) -> bool:
    """Whether thread `tid` (a request's reader) has a signal pending that it does not block:
    what the kernel interrupts a FUSE request for. Its own, or its process's when it is the
    main thread, which the kernel gives a signal sent to the process first."""
    try:
        status = Path(f"/proc/{tid}/status").read_text()
    except OSError:
        return False  # gone
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        pending = int(fields["SigPnd"], 16)
        if fields["Tgid"].strip() == str(tid):
            pending |= int(fields["ShdPnd"], 16)
        return bool(pending & ~int(fields["SigBlk"], 16))
    except (KeyError, ValueError):
        return False


def possible_cpus() -> int:
    """The kernel's num_possible_cpus(): it keeps one queue for each."""
    count = 0
    for part in POSSIBLE_CPUS.read_text().strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def payload_size(max_write: int, max_pages: int) -> int:
    """What the kernel requires of an entry's payload buffer."""
    return max(8192, max_write, max_pages * mmap.PAGESIZE)


def ring_unusable() -> str | None:
    """Why this process cannot serve through io_uring (None: it can): a ring with SQE128 is
    made and closed, so a seccomp filter, `kernel.io_uring_disabled` or an old kernel shows."""
    if not ENABLE_URING.exists():
        return "this kernel has no FUSE over io_uring (6.14+, CONFIG_FUSE_IO_URING)"
    try:
        Ring(2).close()
    except OSError as e:
        return f"io_uring cannot be used here ({e.strerror})"
    return None


def kernel_offers() -> bool:
    return ENABLE_URING.read_text().strip() == "Y"


def enable_in_kernel(is_root: bool) -> str | None:
    """Make the kernel offer io_uring to the mount about to be made: `enable_uring` set to Y
    when it is N and we are root, and left so: the kernel reads it again when the INIT reply
    comes, and some kernels at each ring command (docs/mounts.md). Why not, or None."""
    why = ring_unusable()
    if why is not None:
        return why
    if kernel_offers():
        return None
    if not is_root:
        return f"{ENABLE_URING} is N and only root may set it"
    try:
        ENABLE_URING.write_text("Y\n")
    except OSError as e:
        return f"cannot set {ENABLE_URING}: {e.strerror}"
    return None
