"""Nodes in memory for the read path's unit tests: a transport (kspeedfs.net.transport's
HedgeableTransport) and a request connection over a dict of segments, each node up, down
(connecting and sending fail), frozen (its answers wait until it thaws) or lacking a segment
(it answers that it does not hold it). A transport's answers are signalled on a pipe, so the
hedged read's poll over file descriptors runs unchanged."""

from __future__ import annotations

import itertools
import os
import select
import threading
from pathlib import Path

from kspeedfs.client.health import NodeHealth
from kspeedfs.client.nodepool import NodePool
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import Pong
from kspeedfs.format.errors import DataError, NodeUnreachable
from kspeedfs.format.units import Address, parse_address
from kspeedfs.net.transport import Range


class FakeNode:
    """One node: the segments it holds and how it behaves."""

    def __init__(self, name: str, segments: dict[int, bytes]):
        self.name = name
        self.segments = segments
        self.down = False
        self.frozen = False
        self.answers = 0  # read answers it sent
        self.pings = 0
        self.transports: list[FakeTransport] = []
        self.awake = threading.Event()  # cleared while frozen: a ping waits for it
        self.awake.set()

    def freeze(self) -> None:
        self.frozen = True
        self.awake.clear()

    def thaw(self) -> None:
        self.frozen = False
        self.awake.set()
        for t in self.transports:
            t.answer_pending()


class FakeTransport:
    """A connection to a FakeNode; a read is sent, then answered at once (or on thawing)."""

    name = "fake"

    def __init__(self, node: FakeNode, address: Address):
        if node.down:
            raise NodeUnreachable(f"no kspeedfs node at {address}")
        self.node = node
        self.address = address
        self.closed = False
        self._r, self._w = os.pipe()
        self._ids = itertools.count(1)
        self._sent: dict[int, tuple[str, list[Range]]] = {}
        self._unanswered: list[int] = []
        self._timeout: float | None = None
        node.transports.append(self)

    def send_read(self, dataset: str, instance: str, ranges: list[Range]) -> int:
        if self.node.down or self.closed:
            raise NodeUnreachable(f"{self.node.name}: connection reset")
        rid = next(self._ids)
        self._sent[rid] = (instance, ranges)
        self._unanswered.append(rid)
        if not self.node.frozen:
            self.answer_pending()
        return rid

    def answer_pending(self) -> None:
        while self._unanswered and not self.closed:
            self._unanswered.pop(0)
            os.write(self._w, b"!")

    def wait_readable(self, timeout: float) -> bool:
        return bool(select.select([self._r], [], [], max(0.0, timeout))[0])

    def set_timeout(self, seconds: float) -> None:
        self._timeout = seconds

    def receive_read(self, rid: int, out: memoryview) -> None:
        if not self.wait_readable(self._timeout if self._timeout is not None else 10.0):
            raise NodeUnreachable(f"{self.node.name}: the answer stalled")
        os.read(self._r, 1)
        _instance, ranges = self._sent.pop(rid)
        at = 0
        for seg, off, n in ranges:
            data = self.node.segments.get(seg)
            if data is None:
                raise DataError(f"{self.node.name} does not hold segment {seg}")
            out[at : at + n] = data[off : off + n]
            at += n
        self.node.answers += 1

    def read_into(self, dataset: str, instance: str, ranges: list[Range], out: memoryview) -> None:
        self.receive_read(self.send_read(dataset, instance, ranges), out)

    def fileno(self) -> int:
        return self._r

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._r)
            os.close(self._w)


class FakeCaller:
    """A request connection to a FakeNode: it answers a ping, and nothing else."""

    def __init__(self, node: FakeNode):
        self.node = node

    def __enter__(self) -> FakeCaller:
        self.node.awake.wait()
        if self.node.down:
            raise NodeUnreachable(f"no kspeedfs node at {self.node.name}")
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def call(self, request: Request[Answer], *, answer_within: float | None = None) -> Answer:
        if request.OP != "ping":
            raise AssertionError(f"a fake node answers ping, not {request.OP}")
        self.node.pings += 1
        return request.answer(Pong(node=self.node.name, version=1).to_wire())


class FakeCluster:
    """FakeNodes by address, and a NodePool over them."""

    def __init__(self, tmp_path: Path, segments: dict[str, dict[int, bytes]], timeout: float = 5):
        self.nodes = {name: FakeNode(name, held) for name, held in segments.items()}
        self.settings = Settings(
            nodes=[parse_address(n) for n in segments],
            timeout=timeout,
            health_table=tmp_path / "health",
        )
        self.health = NodeHealth(str(tmp_path / "health"))

    def pool(self, local_node: str | None = None) -> NodePool:
        return NodePool(
            self.settings,
            local_node,
            self.health,
            transports=lambda address, _settings: FakeTransport(self.nodes[str(address)], address),
            connect=lambda address, _settings, _timeout: FakeCaller(self.nodes[str(address)]),
        )
