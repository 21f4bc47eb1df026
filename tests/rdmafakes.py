"""Stand-ins for the verbs layer, so that what sits around it can be tested without a device."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

from kspeedfs.rdma.verbs import Completion, ReadRequest
from kspeedfs.rdma.wire import Endpoint

_rkeys = itertools.count(100)


class FakeRegion:
    def __init__(self, registrar: FakeRegistrar, buffer: Any, length: int):
        self.registrar = registrar
        self.buffer = buffer
        self.addr = registrar.next_addr
        registrar.next_addr += (length + 4095) // 4096 * 4096 + 4096
        self.length = length
        self.rkey = next(_rkeys)
        self.closed = False

    def close(self) -> None:
        assert not self.closed, "deregistered twice"
        if self.registrar.on_close is not None:
            self.registrar.on_close(self)
        self.closed = True
        self.registrar.live.pop(self.rkey)


class FakeRegistrar:
    """Hands out regions with fresh rkeys; remembers which are still registered."""

    def __init__(self) -> None:
        self.next_addr = 0x10000
        self.live: dict[int, FakeRegion] = {}
        self.made: list[FakeRegion] = []
        self.fail_after: int | None = None
        self.on_register: Callable[[], None] | None = None
        self.on_close: Callable[[FakeRegion], None] | None = None

    def register(self, buffer: Any, length: int) -> FakeRegion:
        if self.fail_after is not None and len(self.made) >= self.fail_after:
            from kspeedfs.rdma.verbs import VerbsError

            raise VerbsError("cannot register: locked-memory limit")
        if self.on_register is not None:
            self.on_register()
        r = FakeRegion(self, buffer, length)
        self.live[r.rkey] = r
        self.made.append(r)
        return r

    def read(self, addr: int, rkey: int, length: int) -> bytes | None:
        """What an RDMA READ would get: None where the device would refuse the key."""
        r = self.live.get(rkey)
        if r is None or not r.addr <= addr <= addr + length <= r.addr + r.length:
            return None
        off = addr - r.addr
        return bytes(memoryview(r.buffer)[off : off + length])


class FakeChannel:
    """An RC queue pair over a FakeRegistrar's memory. Data lands in the pool only when a
    completion is polled, a few at a time and in order, so that a pool slot reused too early
    shows up as wrong bytes."""

    def __init__(
        self,
        memory: FakeRegistrar,
        pool_size: int = 64 * 1024,
        depth: int = 16,
        seed: int = 0,
    ):
        self.memory = memory
        self.pool = memoryview(bytearray(pool_size))
        self.depth = depth
        self.endpoint = Endpoint(qpn=77, psn=5, lid=0, gid="fe80::1", mtu=3, rd_atomic=8)
        self.remote: Endpoint | None = None
        self.posted: list[ReadRequest] = []
        self._queue: list[ReadRequest] = []
        self._rand = random.Random(seed)
        self.closed = False
        self.broken = False  # after an error completion, like a QP in the error state
        self.max_outstanding = 0

    @property
    def pool_size(self) -> int:
        return len(self.pool)

    def connect(self, remote: Endpoint) -> None:
        self.remote = remote

    def post_reads(self, reads: Sequence[ReadRequest]) -> None:
        assert not self.closed
        self.posted.extend(reads)
        self._queue.extend(reads)
        assert len(self._queue) <= self.depth, "more reads posted than the queue holds"
        self.max_outstanding = max(self.max_outstanding, len(self._queue))

    def poll(self, max_entries: int) -> list[Completion]:
        n = min(len(self._queue), self._rand.randint(0, max(1, max_entries)))
        out = []
        for _ in range(n):
            r = self._queue.pop(0)
            data = None if self.broken else self.memory.read(r.remote_addr, r.rkey, r.length)
            if data is None:
                stale = not self.broken
                self.broken = True
                out.append(Completion(r.wr_id, False, 10 if stale else 5, "error", stale))
                continue
            self.pool[r.pool_offset : r.pool_offset + r.length] = data
            out.append(Completion(r.wr_id, True, 0, "success", False))
        return out

    def close(self) -> None:
        self.closed = True


_qpns = itertools.count(0x100)


class FakeQP:
    def __init__(self) -> None:
        self.qp_num = next(_qpns)
        self.remote: Endpoint | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeDeviceAttr:
    max_qp_rd_atom = 16
    max_qp_init_rd_atom = 16
    max_qp_wr = 1024


class FakeDevice:
    """What RdmaService and ResponderQP use of verbs.Device, over a FakeRegistrar."""

    name = "fake0"
    port = 1
    gid = "fe80::2"
    gid_index = 0
    label = "fake0:1"
    attr = FakeDeviceAttr()

    def __init__(self, registrar: FakeRegistrar):
        self.registrar = registrar
        self.qps: list[FakeQP] = []

    def make_cq(self, depth: int) -> object:
        return object()

    def make_qp(self, cq: object, depth: int) -> FakeQP:
        qp = FakeQP()
        self.qps.append(qp)
        return qp

    def register(self, buffer: Any, length: int) -> FakeRegion:
        return self.registrar.register(buffer, length)

    def connect(self, qp: FakeQP, psn: int, remote: Endpoint, responder: bool) -> None:
        qp.remote = remote

    def endpoint(self, qp: FakeQP, psn: int, rd_atomic: int) -> Endpoint:
        return Endpoint(qp.qp_num, psn, 0, self.gid, 3, rd_atomic)
