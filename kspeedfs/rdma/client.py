"""The RDMA transport: one RC queue pair per node, batched RDMA READs into a registered pool.

`kspeedfs.client.transport.open_transport` picks it when this process has a usable device;
the node's handshake (its probe region reads back right) decides, else TCP with one log line
saying why. The TCP connection stays as the control channel (handshake, segment tables) and
the fallback for a dataset the node could not register.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.rdma import (
    RdmaConnect,
    RdmaRefused,
    RdmaSegments,
)
from kspeedfs.format.errors import (
    DataError,
    InvalidArgument,
    KSpeedError,
    NodeUnreachable,
    ProtocolError,
)
from kspeedfs.format.units import Address
from kspeedfs.net.transport import Range, TcpTransport
from kspeedfs.rdma.verbs import (
    Completion,
    DeviceProbe,
    ReadChannel,
    ReadRequest,
    VerbsError,
    open_device,
)
from kspeedfs.rdma.wire import Endpoint, SegmentTable, table_from_wire

log = logging.getLogger(__name__)

POOL_BYTES = 8 * 1024 * 1024  # the registered receive pool of one queue pair
MAX_PIECE = 1024 * 1024  # larger ranges are split so that reads overlap their copy-out
VERDICT_S = 60.0  # how long "this node cannot do RDMA" holds before another handshake
NO_TABLE_RETRY_S = 10.0  # how long a dataset the node did not register is read over TCP
SPIN_POLLS = 256  # empty polls before sleeping between polls


class StaleKey(KSpeedError):
    """The node refused a key: the region was deregistered (unload, node restart)."""


class Channel(Protocol):
    """A connected RC queue pair with its pool: verbs.ReadChannel, or a fake in tests."""

    pool: memoryview
    depth: int
    endpoint: Endpoint

    @property
    def pool_size(self) -> int: ...

    def connect(self, remote: Endpoint) -> None: ...

    def post_reads(self, reads: Sequence[ReadRequest]) -> None: ...

    def poll(self, max_entries: int) -> list[Completion]: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RdmaRead:
    """One RDMA READ: remote bytes to `out[out_offset:out_offset + length]`."""

    remote_addr: int
    rkey: int
    length: int
    out_offset: int


def plan_pieces(ranges: Sequence[Range], table: SegmentTable, max_piece: int) -> list[RdmaRead]:
    """Ranges of one dataset to READs, checked against the table, none over `max_piece`."""
    pieces = []
    out_offset = 0
    for seg, offset, length in ranges:
        addr, rkey = table.locate(seg, offset, length)
        done = 0
        while done < length:
            n = min(max_piece, length - done)
            pieces.append(RdmaRead(addr + done, rkey, n, out_offset + done))
            done += n
        out_offset += length
    return pieces


class PoolRing:
    """Space in the receive pool, handed out in posting order and freed in completion order
    (an RC queue pair completes its requests in the order they were posted)."""

    def __init__(self, size: int):
        self.size = size
        self._head = 0  # where the next piece goes
        self._held: collections.deque[tuple[int, int]] = collections.deque()  # (pos, length)

    def alloc(self, length: int) -> int | None:
        if not 0 < length <= self.size:
            raise ValueError(f"cannot hold {length} bytes in a pool of {self.size}")
        if not self._held:
            self._head = 0
            pos: int | None = 0
        else:
            tail = self._held[0][0]
            if self._head > tail:  # held: [tail, head)
                if self._head + length <= self.size:
                    pos = self._head
                elif length <= tail:
                    pos = 0
                else:
                    pos = None
            else:  # wrapped, held: [tail, end) and [0, head); head == tail means full
                pos = self._head if self._head + length <= tail else None
        if pos is not None:
            self._held.append((pos, length))
            self._head = pos + length
        return pos

    def free_oldest(self) -> tuple[int, int]:
        return self._held.popleft()

    def __len__(self) -> int:
        return len(self._held)


def run_reads(
    channel: Channel, pieces: Sequence[RdmaRead], out: memoryview, timeout: float
) -> None:
    """Post the pieces as fast as pool and queue allow, copy each out as it completes."""
    ring = PoolRing(channel.pool_size)
    pool = channel.pool
    posted = 0
    done = 0
    spins = 0
    deadline = time.monotonic() + timeout
    while done < len(pieces):
        batch = []
        while posted < len(pieces) and len(ring) < channel.depth:
            p = pieces[posted]
            pos = ring.alloc(p.length)
            if pos is None:
                break
            batch.append(ReadRequest(posted, pos, p.length, p.remote_addr, p.rkey))
            posted += 1
        if batch:
            channel.post_reads(batch)
        completions = channel.poll(len(ring))
        if not completions:
            spins += 1
            if spins > SPIN_POLLS:
                if time.monotonic() > deadline:
                    raise NodeUnreachable(f"no RDMA completion in {timeout:.0f}s")
                time.sleep(0)
            continue
        spins = 0
        deadline = time.monotonic() + timeout
        for c in completions:
            if not c.ok:
                if c.stale:
                    raise StaleKey(f"node refused an RDMA key ({c.text})")
                raise NodeUnreachable(f"RDMA read failed: {c.text}")
            pos, length = ring.free_oldest()
            if c.wr_id != done:
                raise ProtocolError(f"RDMA completion {c.wr_id} out of order (expected {done})")
            start = pieces[done].out_offset
            out[start : start + length] = pool[pos : pos + length]
            done += 1


ChannelFactory = Callable[[], Channel]


class Control(Protocol):
    """The TCP side of an RDMA transport: control requests, and reads RDMA cannot do."""

    client: Any  # NodeClient: request(op, **args) -> dict

    def read_into(
        self, dataset: str, instance: str, ranges: list[Range], out: memoryview
    ) -> None: ...

    def close(self) -> None: ...


# Per process: nodes that said no to RDMA, and until when that holds (pid, node) -> (until, why).
_verdicts: dict[tuple[int, str], tuple[float, str]] = {}
_verdicts_lock = threading.Lock()


class RdmaTransport:
    """Transport over RDMA READs; TCP for what the node cannot offer over RDMA."""

    def __init__(
        self,
        address: Address,
        settings: Settings,
        channel_factory: ChannelFactory,
        control_factory: Callable[[], Control] | None = None,
    ):
        self.address = address
        self.settings = settings
        self.forced = settings.transport == "rdma"
        self._factory = channel_factory
        self._control_factory = control_factory or (lambda: TcpTransport(address, settings))
        self._tcp = self._control_factory()
        self._pid = os.getpid()
        self._channel: Channel | None = None
        self._tables: dict[str, SegmentTable | float] = {}
        self.name = "rdma"  # "tcp" once RDMA is off for this transport
        self.fallback_reason = ""

    def read_into(self, dataset: str, instance: str, ranges: list[Range], out: memoryview) -> None:
        self._check_fork()
        total = sum(r[2] for r in ranges)
        if total != len(out):
            raise InvalidArgument(f"read of {total} bytes into a buffer of {len(out)}")
        for _attempt in range(2):
            if not self.fallback_reason and self._channel is None:
                self.connect()
            table = None if self.fallback_reason else self._table(dataset)
            if table is not None and table.uuid != instance:
                # Loaded again under the same name since we fetched its table: never read the
                # new instance's memory for the old one. The node's answer over TCP decides.
                self._tables.pop(dataset, None)
                table = None
            if table is None:
                self._tcp.read_into(dataset, instance, ranges, out)
                return
            assert self._channel is not None
            # Pieces small enough that several are in flight even in a small pool.
            pieces = plan_pieces(ranges, table, min(MAX_PIECE, self._channel.pool_size // 4))
            try:
                run_reads(self._channel, pieces, out, self.settings.timeout)
                return
            except StaleKey as e:
                # Never retry with the old key: new queue pair, new table, then one more try.
                self._drop_channel()
                self._tables.pop(dataset, None)
                log.info(
                    "node %s: stale RDMA key for %s (%s); fetching its segment table again",
                    self.address,
                    dataset,
                    e,
                )
            except BaseException:
                self._drop_channel()
                raise
        raise DataError(f"node {self.address}: the RDMA keys of {dataset} keep going stale")

    def connect(self) -> None:
        """The handshake: a queue pair each side, then the node's probe region read back."""
        key = (os.getpid(), str(self.address))
        with _verdicts_lock:
            verdict = _verdicts.get(key)
        if verdict is not None and verdict[0] > time.monotonic():
            self._fall_back(verdict[1], log_it=False)
            return
        try:
            channel = self._factory()
        except VerbsError as e:
            self._fall_back(f"cannot set up RDMA here: {e}")
            return
        try:
            reason = self._handshake(channel)
        except BaseException:
            channel.close()
            raise
        if reason:
            channel.close()
            with _verdicts_lock:
                _verdicts[key] = (time.monotonic() + VERDICT_S, reason)
            self._fall_back(reason)
            return
        self._channel = channel
        log.debug("node %s: RDMA connected", self.address)

    def _handshake(self, channel: Channel) -> str:
        """'' when connected, else why not; NodeUnreachable when the node does not answer."""
        try:
            connected = self._tcp.client.call(RdmaConnect(endpoint=channel.endpoint.to_wire()))
        except InvalidArgument as e:
            return f"node does not offer RDMA ({e})"
        if isinstance(connected, RdmaRefused):
            return f"node has no RDMA: {connected.reason}"
        try:
            channel.connect(Endpoint.from_wire(connected.endpoint))
            probe = connected.probe
            expected = bytes.fromhex(probe.data)
            got = bytearray(len(expected))
            piece = RdmaRead(probe.addr, probe.rkey, len(expected), 0)
            run_reads(channel, [piece], memoryview(got), min(self.settings.timeout, 5.0))
        except (KSpeedError, KeyError, ValueError, TypeError) as e:
            return f"RDMA handshake failed: {e}"
        if bytes(got) != expected:
            return "RDMA handshake failed: the probe region read back wrong"
        return ""

    def _fall_back(self, reason: str, log_it: bool = True) -> None:
        if self.forced:
            raise InvalidArgument(f"transport is rdma, but node {self.address}: {reason}")
        self.name = "tcp"
        self.fallback_reason = reason
        if log_it:
            log.info("node %s: using TCP: %s", self.address, reason)

    def _table(self, dataset: str) -> SegmentTable | None:
        entry = self._tables.get(dataset)
        if isinstance(entry, SegmentTable):
            return entry
        if entry is not None and entry > time.monotonic():
            return None
        answer = self._tcp.client.call(RdmaSegments(name=dataset))
        if isinstance(answer, RdmaRefused):
            log.info("node %s: reading %s over TCP: %s", self.address, dataset, answer.reason)
            self._tables[dataset] = time.monotonic() + NO_TABLE_RETRY_S
            return None
        table = table_from_wire(dataset, answer.table)
        self._tables[dataset] = table
        return table

    def _check_fork(self) -> None:
        # A forked child inherited the parent's queue pair and socket: it uses neither (the verbs
        # objects were disowned at fork, see verbs.py) and connects on its own.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._channel = None
            self._tables = {}
            self._tcp = self._control_factory()

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                channel.close()
            except Exception as e:
                log.warning("node %s: closing the RDMA queue pair: %s", self.address, e)

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._drop_channel()
            self._tcp.close()


def device_channel_factory(found: DeviceProbe, settings: Settings) -> ChannelFactory:
    """Queue pairs with their pool on the device `found` by the probe."""

    def make() -> Channel:
        device = open_device(found.device, found.port, settings.rdma_gid_index)
        return ReadChannel(device, POOL_BYTES)

    return make
