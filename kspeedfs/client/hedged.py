"""Hedged reads: a node's read that has not begun to answer in time is sent to other owners too.

The read policy (client/reader.py) says which owner comes next (`NextOwner`); this module sends
the hedges, races the answers (the first complete one wins), scatters the hedges' answers into
the caller's buffer, and reads the losing answer in the background to keep its connection.
Which owner is healthy, and the connections themselves, are the pool's (client/nodepool.py).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple, TypeGuard

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.nodepool import HEDGE_FLOOR_S, RECEIVE_STALL_S, NodePool, stall_limit
from kspeedfs.format.errors import DataError, KSpeedError, NodeUnreachable
from kspeedfs.net.transport import HedgeableTransport, Range, Transport

log = logging.getLogger(__name__)

# A late read that no other owner could take (all down, or none holds it) tries again this
# often while it waits: an owner may be back (a probe trusts it) before the read's deadline.
REHEDGE_EVERY_S = 0.25
# The losing answer of a hedged read is read and dropped in the background (its connection
# kept) when it is at most this large (and NodePool's DRAIN_MAX at once).
DRAIN_MAX_BYTES = 4 * 1024 * 1024

# The policy's next owner of a segment of a dataset, not one of the nodes given (None: none).
NextOwner = Callable[[DatasetHandle, int, set[str]], str | None]


class _Hedge(NamedTuple):
    """A hedge in flight: the ranges (by index in the whole request) sent to another owner."""

    node: str
    transport: HedgeableTransport
    rid: int
    picks: list[int]
    buf: bytearray


def hedgeable(transport: Transport) -> TypeGuard[HedgeableTransport]:
    return hasattr(transport, "send_read") and hasattr(transport, "wait_readable")


class HedgedRead:
    """Reads ranges from a node, hedged to the segments' next owners when it is late."""

    def __init__(self, pool: NodePool, next_owner: NextOwner, stats: Counter[str]):
        self.pool = pool
        self.next_owner = next_owner
        self.stats = stats

    def read(
        self,
        ds: DatasetHandle,
        node: str,
        ranges: list[Range],
        out: memoryview,
        deadline: float | None,
    ) -> None:
        """The ranges from `node`; if it has not begun to answer within its hedge delay, from
        the segments' other owners too, the first complete answer winning. A losing answer
        is drained or its connection closed, so nothing writes into `out` after this
        returns."""
        if deadline is None:
            deadline = time.monotonic() + self.pool.settings.timeout
        started = time.monotonic()
        sent = self._send_primary(ds, node, ranges, out, started, deadline)
        if sent is None:
            return
        primary, rid, delay = sent
        # Late: suspect now, for every reader of the machine; ask the other owners too.
        self.pool.health.missed(node, delay)
        if delay >= HEDGE_FLOOR_S:
            # A few ms late is weather (a lost packet, a busy machine), not a sign of this node:
            # suspicion reorders every reader's owners, so it waits for a real delay, or for
            # the drained answer to fail (_drain_one).
            self.pool.suspect(node, f"no answer within {delay * 1000:.1f} ms")
        hedges = self.send_hedges(ds, node, ranges)
        _Race(self, ds, node, (primary, rid), ranges, out, (started, deadline), hedges).run()

    def _send_primary(
        self,
        ds: DatasetHandle,
        node: str,
        ranges: list[Range],
        out: memoryview,
        started: float,
        deadline: float,
    ) -> tuple[HedgeableTransport, int, float] | None:
        """The read sent to `node` and, when it answers within its hedge delay, received
        (None); else (its connection, the request's id, the delay waited)."""
        pool = self.pool
        delay = pool.hedge_delay(node, sum(r[2] for r in ranges))
        for attempt in (1, 2):
            try:
                pooled, primary = pool.acquire(node)
            except NodeUnreachable as e:
                pool.mark_down(node, str(e))
                raise
            if not hedgeable(primary) or ds.readthrough:
                pool.release(node, primary)
                pool.read_ranges(node, ds.name, ds.uuid, ranges, out, deadline)
                return None
            try:
                rid = primary.send_read(ds.name, ds.uuid, ranges)
                if primary.wait_readable(min(delay, deadline - started)):
                    pool.health.first_byte(node, time.monotonic() - started)
                    primary.set_timeout(stall_limit(deadline))
                    primary.receive_read(rid, out)
                    pool.release(node, primary)
                    pool.health.observe(node, time.monotonic() - started)
                    pool.health.trust(node)
                    return None
            except NodeUnreachable as e:
                primary.close()
                if pooled and attempt == 1 and time.monotonic() - started < HEDGE_FLOOR_S:
                    continue  # a kept connection the node closed (it restarted): no wait lost
                pool.mark_down(node, str(e))
                raise
            except BaseException:
                primary.close()
                raise
            return primary, rid, delay
        raise AssertionError("unreachable: the second attempt returns or raises")

    def send_hedges(
        self,
        ds: DatasetHandle,
        node: str,
        ranges: list[Range],
        refused: frozenset[str] = frozenset(),
    ) -> list[_Hedge]:
        """The ranges sent to their next owners (never `node`, nor a node in `refused`: it
        said it does not hold one of them), one request per owner; [] when some range has no
        other owner that is not down (then only `node` can answer it: a hedge to a down node
        would only wait on its connect)."""
        by_owner: dict[str, list[int]] = {}
        for k, (seg, _off, _n) in enumerate(ranges):
            other = self.next_owner(ds, seg, {node, *refused})
            if other is None or self.pool.is_down(other):
                return []
            by_owner.setdefault(other, []).append(k)
        hedges: list[_Hedge] = []
        for other, picks in by_owner.items():
            hedge = self._send_hedge(ds, other, [ranges[k] for k in picks], picks)
            if hedge is None:
                for h in hedges:
                    h.transport.close()
                return []
            hedges.append(hedge)
        self.stats["hedged"] += 1
        self.stats["hedged_bytes"] += sum(len(h.buf) for h in hedges)
        return hedges

    def _send_hedge(
        self, ds: DatasetHandle, other: str, part: list[Range], picks: list[int]
    ) -> _Hedge | None:
        """`part` of a read sent to `other`; None: it cannot be asked."""
        try:
            transport = self.pool.open(other)
        except KSpeedError:
            return None
        if not hedgeable(transport):
            self.pool.release(other, transport)
            return None
        try:
            rid = transport.send_read(ds.name, ds.uuid, part)
        except KSpeedError as e:
            transport.close()
            self.pool.mark_down(other, str(e))
            return None
        return _Hedge(other, transport, rid, picks, bytearray(sum(r[2] for r in part)))

    def answer_failed(self, node: str, e: KSpeedError) -> None:
        """A read's answer from `node` failed: down when the node could not be heard (the
        connection, a stall, a bad frame); a refusal it answered (a segment it does not hold,
        as a placement candidate of a healing cluster may not yet) says it is up."""
        if isinstance(e, DataError):
            log.info("node %s could not serve a read: %s", node, e)
        else:
            self.pool.mark_down(node, str(e))

    def drain(self, node: str, transport: HedgeableTransport, rid: int, nbytes: int) -> None:
        """The losing answer of a hedged read, read in the background and dropped, and its
        connection kept: closing it would cost the next read of that node a new connection
        (a handshake, and on a lossy link a lost SYN's connect limit). A large answer, or too
        many at once, is not waited for: its connection is closed."""
        if nbytes > DRAIN_MAX_BYTES or not self.pool.begin_drain():
            transport.close()
            return
        threading.Thread(
            target=self._drain_one,
            args=(node, transport, rid, nbytes),
            name=f"drain-{node}",
            daemon=True,
        ).start()

    def _drain_one(self, node: str, transport: HedgeableTransport, rid: int, nbytes: int) -> None:
        try:
            transport.set_timeout(RECEIVE_STALL_S)
            transport.receive_read(rid, memoryview(bytearray(nbytes)))
        except Exception as e:  # whatever the answer was, the connection is not reused
            transport.close()
            if not isinstance(e, DataError):
                self.pool.suspect(node, f"the answer a hedge raced never came: {e}")
        else:
            self.pool.release(node, transport)
            self.stats["drained"] += 1
        finally:
            self.pool.end_drain()


def scatter(ranges: list[Range], done: list[_Hedge], out: memoryview) -> None:
    """The hedges' answers into `out`, each range where it lies in the whole request."""
    starts = []
    pos = 0
    for _seg, _off, n in ranges:
        starts.append(pos)
        pos += n
    for h in done:
        at = 0
        for k in h.picks:
            n = ranges[k][2]
            out[starts[k] : starts[k] + n] = h.buf[at : at + n]
            at += n


class _Race:
    """One late read's race: `node`'s answer (the primary) against the hedges' together, until
    the deadline; the first complete answer (the primary's, or every hedge's) fills `out`,
    the rest are drained or closed."""

    def __init__(
        self,
        hedge: HedgedRead,
        ds: DatasetHandle,
        node: str,
        primary: tuple[HedgeableTransport, int],
        ranges: list[Range],
        out: memoryview,
        times: tuple[float, float],
        hedges: list[_Hedge],
    ):
        self.hedge, self.pool, self.ds, self.node = hedge, hedge.pool, ds, node
        self.primary, self.rid = primary
        self.ranges, self.out = ranges, out
        self.started, self.deadline = times
        self.hedges = hedges
        self.waiting: dict[int, _Hedge | None] = {self.primary.fileno(): None}
        self.waiting.update({h.transport.fileno(): h for h in hedges})
        self.done: list[_Hedge] = []
        self.refused: frozenset[str] = frozenset()
        self.primary_failed = False
        self.restarted = False  # the hedges were sent again: what was ready is stale

    def run(self) -> None:
        try:
            while self.waiting:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                self.restarted = False
                for fd in self._ready(left):
                    h = self.waiting.pop(fd)
                    if self._primary_answered() if h is None else self._hedge_answered(h):
                        return
                    if self.restarted:
                        break
            timeout = self.pool.settings.timeout
            self.pool.mark_down(self.node, f"no answer within the read's {timeout:.1f}s")
            raise NodeUnreachable(f"node {self.node} did not answer within {timeout}s")
        finally:
            for h in self.waiting.values():
                (self.primary if h is None else h.transport).close()
            for h in self.done:
                h.transport.close()

    def _ready(self, left: float) -> list[int]:
        """The waiting connections with an answer to read, waiting up to `left` for one (a
        read no other owner could take sends its hedges again every REHEDGE_EVERY_S)."""
        waiting = self.waiting
        ready = [
            fd
            for fd, h in waiting.items()
            if (self.primary if h is None else h.transport).wait_readable(0)
        ]
        if ready:
            return ready
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        alone = not self.hedges and not self.primary_failed
        ready = [
            fd for fd, _ev in poller.poll((min(left, REHEDGE_EVERY_S) if alone else left) * 1000)
        ]
        if not ready and alone:
            # No other owner could be asked (down, or refused): one may be back.
            self._send_again()
        return ready

    def _send_again(self) -> None:
        self.hedges = self.hedge.send_hedges(self.ds, self.node, self.ranges, self.refused)
        self.waiting.update({h.transport.fileno(): h for h in self.hedges})
        self.restarted = True

    def _release_done(self) -> None:
        for h in self.done:
            self.pool.release(h.node, h.transport)
        self.done = []

    def _primary_answered(self) -> bool:
        """The primary's answer received: True, the race is won (the hedges drained)."""
        pool, node = self.pool, self.node
        try:
            self.primary.set_timeout(stall_limit(self.deadline))
            self.primary.receive_read(self.rid, self.out)
        except KSpeedError as e:
            self.primary_failed = True
            self.primary.close()
            self.hedge.answer_failed(node, e)
            if not self.hedges or len(self.done) + len(self.waiting) < len(self.hedges):
                raise
            return False
        self.hedge.stats["hedge_lost"] += 1
        pool.release(node, self.primary)
        pool.health.observe(node, time.monotonic() - self.started)
        pool.health.trust(node)
        self._release_done()
        for late in self.waiting.values():  # still to answer: their answers dropped
            assert late is not None
            self.hedge.drain(late.node, late.transport, late.rid, len(late.buf))
        self.waiting.clear()
        return True

    def _hedge_answered(self, h: _Hedge) -> bool:
        """A hedge's answer received: True, every hedge has answered and the race is won."""
        try:
            h.transport.set_timeout(stall_limit(self.deadline))
            h.transport.receive_read(h.rid, memoryview(h.buf))
        except KSpeedError as e:
            h.transport.close()
            self.hedge.answer_failed(h.node, e)
            if self.primary_failed:
                raise
            self._hedges_failed(h, e)
            return False
        self.done.append(h)
        if not self.hedges or len(self.done) != len(self.hedges):
            return False
        scatter(self.ranges, self.done, self.out)
        self.hedge.stats["hedge_won"] += 1
        # What `node` took at least: it ranks after faster suspects.
        self.pool.health.observe(self.node, time.monotonic() - self.started)
        self._release_done()
        if not self.primary_failed:
            del self.waiting[self.primary.fileno()]
            self.hedge.drain(self.node, self.primary, self.rid, len(self.out))
        return True

    def _hedges_failed(self, h: _Hedge, e: KSpeedError) -> None:
        """The hedges start again without `h` (a node that said it does not hold a range: a
        placement candidate), or, with no one else, the read waits for `node` alone."""
        self._release_done()
        for fd, pending in list(self.waiting.items()):
            if pending is not None:
                del self.waiting[fd]
                pending.transport.close()
        if isinstance(e, DataError):
            self.refused = self.refused | {h.node}
            self._send_again()
        else:
            self.hedges = []
            self.restarted = True
