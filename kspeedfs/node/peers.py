"""Connections from this node to the other members, kept and reused across calls.

A preload asks every member for its state (long-polled) while it loads; a connection (and a
handshake) per call cost more than the calls. Each member gets a few idle connections; a call takes one (or opens one
when all are busy: a long "stage" scan must not hold up a ping) and gives it back after.
Bulk reads from worker threads (healing copies whole segments) take blocking connections kept
the same way: a new one per segment cost its handshake and TCP's ramp-up, ~4x the copy time.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.metaindexes import MetaAdd
from kspeedfs.format.contract.preload import Preload, StageReq
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.units import parse_address
from kspeedfs.net.aconnection import AsyncNodeClient
from kspeedfs.net.connection import SCAN_TIMEOUT, NodeClient

log = logging.getLogger(__name__)

IDLE_PER_MEMBER = 4
# Ops that scan a whole source (or read and index a meta file) before answering.
SLOW_OPS = frozenset({StageReq.OP, Preload.OP, MetaAdd.OP})

# An op on a member: (member, op, arguments) -> its answer.
Call = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


class Ask(Protocol):
    """A typed request (kspeedfs.format.contract) to a member -> its answer."""

    def __call__(self, member: str, request: Request[Answer], /) -> Awaitable[Answer]: ...


async def ask_all(
    ask: Ask, members: Sequence[str], request: Request[Answer]
) -> tuple[dict[str, Answer], list[KSpeedError]]:
    """`request` on every member at once: the answers of those that gave one, and the
    refusals."""
    answers: dict[str, Answer] = {}
    errors: list[KSpeedError] = []

    async def one(member: str) -> None:
        try:
            answers[member] = await ask(member, request)
        except KSpeedError as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for member in members:
            nursery.start_soon(one, member)
    return answers, errors


class PeerPool:
    def __init__(
        self,
        token_file: Path,
        timeout: float,
        idle_per_member: int = IDLE_PER_MEMBER,
        tls: ssl.SSLContext | None = None,
    ):
        self.token_file = token_file
        self.timeout = timeout
        self.tls = tls  # the node's own certificate, presented to the members it calls
        self.idle_per_member = idle_per_member
        self._idle: dict[str, list[AsyncNodeClient]] = {}
        self._closed_stats: Counter[str] = Counter()  # of clients no longer kept
        self._readers: dict[str, list[NodeClient]] = {}  # blocking, for worker threads
        self._readers_lock = threading.Lock()

    async def call(self, member: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run `op` on `member`; NodeUnreachable when it cannot be reached."""
        idle = self._idle.setdefault(member, [])
        client = idle.pop() if idle else self._open(member)
        try:
            return await client.request(
                op, answer_within=SCAN_TIMEOUT if op in SLOW_OPS else None, **args
            )
        finally:
            # Kept even after an error: a client whose connection broke reconnects on its next
            # request, and one refused an op is still a good connection.
            if len(idle) < self.idle_per_member:
                idle.append(client)
            else:
                self._closed_stats.update(client.stats)
                await client.aclose()

    async def ask(self, member: str, request: Request[Answer]) -> Answer:
        """The typed request `request` on `member`; NodeUnreachable when it cannot be reached."""
        fields = request.to_wire()
        del fields["op"]
        return request.answer(await self.call(member, request.OP, fields))

    @contextlib.contextmanager
    def reader(self, member: str) -> Iterator[NodeClient]:
        """A blocking connection to `member` for a worker thread, kept for the next one; one
        that failed in any way is closed, not kept."""
        with self._readers_lock:
            idle = self._readers.setdefault(member, [])
            client = idle.pop() if idle else None
        if client is None:
            client = NodeClient(parse_address(member), self.token_file, self.timeout, self.tls)
        try:
            yield client
        except BaseException:
            client.close()
            raise
        with self._readers_lock:
            if len(idle) < self.idle_per_member:
                idle.append(client)
                return
        client.close()

    def _open(self, member: str) -> AsyncNodeClient:
        return AsyncNodeClient(parse_address(member), self.token_file, self.timeout, self.tls)

    async def aclose(self) -> None:
        with self._readers_lock:
            readers, self._readers = self._readers, {}
        for kept in readers.values():
            for reader in kept:
                reader.close()
        for clients in self._idle.values():
            for client in clients:
                self._closed_stats.update(client.stats)
                await client.aclose()
        self._idle.clear()

    def statistics(self) -> dict[str, int]:
        """Connections opened, requests sent, and requests sent again after a restart."""
        total = Counter(self._closed_stats)
        for clients in self._idle.values():
            for client in clients:
                total.update(client.stats)
        total["idle"] = sum(c.connected for cs in self._idle.values() for c in cs)
        return {k: int(total[k]) for k in ("connects", "requests", "retries", "idle")}


PEER_READ_PIECE = 8 * 1024 * 1024  # a segment is copied from a peer in ranges of this size
PEER_READ_REQUEST = 64 * 1024 * 1024  # up to this much in one request


def read_segment_into(
    pool: PeerPool, peer: str, name: str, uuid: str, seg: int, out: memoryview
) -> None:
    """Segment `seg` of instance `uuid` from `peer` (in a worker thread), received straight
    into `out` (its length is the segment's); the caller checks its checksum."""
    length = len(out)
    ranges = [
        (seg, pos, min(PEER_READ_PIECE, length - pos)) for pos in range(0, length, PEER_READ_PIECE)
    ]
    per_request = max(1, PEER_READ_REQUEST // PEER_READ_PIECE)
    with pool.reader(peer) as c:
        for k in range(0, len(ranges), per_request):
            chunk = ranges[k : k + per_request]
            start, end = chunk[0][1], chunk[-1][1] + chunk[-1][2]
            c.receive_read(c.send_read(name, uuid, chunk), out[start:end])
