"""The client's nodes: one pool of transports per node, their health, probes and calls.

What 3FS's `StorageMessenger` and `TargetSelection` are to its read policy: the policy
(client/reader.py) asks which owner is best (`rank`) and for a connection to it; the pool
keeps the connections (never shared across fork), marks nodes down or suspect for every
reader of the machine (client/health.py) and pings them in the background until they answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kspeedfs.client.health import NodeHealth
from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import Ping
from kspeedfs.format.discovery import NodeWatch
from kspeedfs.format.errors import KSpeedError, NodeUnreachable
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import Address, parse_address
from kspeedfs.net.connection import NodeClient
from kspeedfs.net.transport import CONNECT_TIMEOUT, Range, Transport

log = logging.getLogger(__name__)

DOWN_FOR_S = 10.0  # a node that refused or stayed silent is skipped this long, or until a
# probe finds it answering again
SUSPECT_FOR_S = 10.0  # a node late to answer is tried after the others this long, or until
# a probe finds it answering
# How long a read waits for a node's first byte before it asks another owner too: the time
# that about 3% of the node's answers exceed (NodeHealth.late_after, from every reader of the
# machine), at least HEDGE_MIN_S; HEDGE_FLOOR_S while the node's latency is not known yet.
HEDGE_FLOOR_S = 0.03
HEDGE_MIN_S = 0.002
HEDGE_CEILING_S = 1.0  # and the most
HEDGE_BYTES_PER_S = 500e6  # a large read is given its transfer time at this rate on top
PROBE_EVERY_S = 0.5  # a suspect or down node is pinged this often (once per machine)
# An answer that has begun but stops arriving for this long fails (the node is cut off
# mid-answer) and its ranges go to another owner; one lost packet's retransmission (TCP's
# 200 ms at least) stays under it, two in a row (1 in 10,000 at 1% loss) do not.
RECEIVE_STALL_S = 0.5
# Losing answers of hedged reads read and dropped in the background at most this many at once.
DRAIN_MAX = 8


class Caller(Protocol):
    """A connection that answers typed requests (NodeClient)."""

    def __enter__(self) -> Caller: ...

    def __exit__(self, *exc: object) -> None: ...

    def call(self, request: Request[Answer], *, answer_within: float | None = None) -> Answer: ...


OpenTransport = Callable[[Address, Settings], Transport]
Connect = Callable[[Address, Settings, float], Caller]


def connect_node(address: Address, settings: Settings, timeout: float) -> NodeClient:
    """A request connection to a node (opened on entering it)."""
    return NodeClient(
        address,
        settings.credential(),
        timeout,
        client_context(settings),
        connect_timeout=CONNECT_TIMEOUT,
    )


def stall_limit(deadline: float) -> float:
    """The socket timeout while receiving: RECEIVE_STALL_S without a byte, within the read's
    deadline."""
    return min(RECEIVE_STALL_S, deadline - time.monotonic())


class NodePool:
    """Thread-safe: FUSE worker threads and DataLoader workers (one per process) share one."""

    def __init__(
        self,
        settings: Settings,
        local_node: str | None = None,
        health: NodeHealth | None = None,
        transports: OpenTransport = open_transport,
        connect: Connect = connect_node,
    ):
        """`health`: the table of node health shared with the machine's other readers (by
        default the user's own in /dev/shm); `transports` and `connect` open a node's data
        transport and its request connection."""
        self.settings = settings
        self.local_node = local_node
        self.health = health if health is not None else NodeHealth(settings.health_table)
        self._node_watch = NodeWatch(settings.nodes, settings.dns_refresh)  # dns: followed
        self._transports = transports
        self._connect = connect
        self._idle: dict[str, list[Transport]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._probing: set[str] = set()
        self._draining = 0  # losing answers of hedged reads being read (HedgedRead._drain)

    @property
    def nodes(self) -> list[str]:
        """The nodes to ask: settings.nodes (dns: entries as looked up last, kspeedfs.format.
        discovery)."""
        return [str(a) for a in self._node_watch.current()]

    # Node health.

    def is_down(self, node: str) -> bool:
        down = self.health.is_down(node)
        if down and node not in self._probing:
            self._probe(node)  # the mark may be another process's, whose prober is gone
        return down

    def is_suspect(self, node: str) -> bool:
        suspect = self.health.is_suspect(node)
        if suspect and node not in self._probing:
            self._probe(node)
        return suspect

    def mark_down(self, node: str, reason: str) -> None:
        if not self.is_down(node):
            log.warning("node %s marked down (probed every %.1fs): %s", node, PROBE_EVERY_S, reason)
        self.health.down_for(node, DOWN_FOR_S)
        # Its other kept connections are as dead as the one that failed (a restarted node
        # closed them all): the next read after the probe connects afresh.
        self._check_fork()
        with self._lock:
            stale = self._idle.pop(node, [])
        for transport in stale:
            transport.close()
        self._probe(node)

    def suspect(self, node: str, reason: str) -> None:
        if not self.is_suspect(node):
            log.info("node %s suspect (probed every %.1fs): %s", node, PROBE_EVERY_S, reason)
        self.health.suspect_for(node, SUSPECT_FOR_S)
        self._probe(node)

    def _probe(self, node: str) -> None:
        """Ping `node` in the background until it answers, then trust it again."""
        self._check_fork()
        with self._lock:
            if node in self._probing:
                return
            self._probing.add(node)
        threading.Thread(
            target=self._probe_loop, args=(node,), name=f"probe-{node}", daemon=True
        ).start()

    def _probe_loop(self, node: str) -> None:
        try:
            while self.is_suspect(node) or self.is_down(node):
                if self.health.claim_probe(node, PROBE_EVERY_S):
                    try:
                        timeout = min(self.settings.timeout, 1.0)
                        with self._connect(parse_address(node), self.settings, timeout) as c:
                            c.call(Ping())
                    except KSpeedError:
                        # Silent to a ping too: down, tried after every suspect owner.
                        self.health.down_for(node, DOWN_FOR_S)
                    else:
                        self.health.trust(node)
                        log.info("node %s answers again", node)
                        return
                time.sleep(PROBE_EVERY_S)
        finally:
            with self._lock:
                self._probing.discard(node)

    def rank(self, node: str, placed: bool = True) -> tuple[bool, bool, bool, float]:
        """Owners are tried healthy first (in placement order), then suspect ones (the
        fastest first), then down ones; among the nodes not down, the segment's placed owners
        before the candidates where a healing cluster would re-make a lost owner's copies
        (which hold it only once that has happened)."""
        suspect = self.is_suspect(node)
        expected = self.health.expected(node) if suspect else 0.0
        return self.is_down(node), not placed, suspect, expected

    def hedge_delay(self, node: str, nbytes: int) -> float:
        """How long a read of `nbytes` from `node` is waited for before another owner is
        asked too."""
        late = self.health.late_after(node)
        wait = max(HEDGE_MIN_S, late) if late > 0 else HEDGE_FLOOR_S
        return min(HEDGE_CEILING_S, wait + nbytes / HEDGE_BYTES_PER_S)

    # Connections.

    def _check_fork(self) -> None:
        # Connections must not be shared across fork: a child starts with none.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._idle = {}
            self._lock = threading.Lock()
            self._probing = set()  # the parent's probe threads did not come along
            self._draining = 0

    def acquire(self, node: str) -> tuple[bool, Transport]:
        """A connection to `node`: (True, one from the pool) or (False, a new one)."""
        self._check_fork()
        with self._lock:
            pool = self._idle.get(node)
            if pool:
                return True, pool.pop()
        return False, self._transports(parse_address(node), self.settings)

    def release(self, node: str, transport: Transport) -> None:
        with self._lock:
            self._idle.setdefault(node, []).append(transport)

    def open(self, node: str) -> Transport:
        """A connection to `node` (pooled, else new, with CONNECT_TIMEOUT); a node that cannot
        be reached is marked down."""
        try:
            return self.acquire(node)[1]
        except NodeUnreachable as e:
            self.mark_down(node, str(e))
            raise

    def begin_drain(self) -> bool:
        """Whether one more losing answer may be drained now (at most DRAIN_MAX at once);
        True counts it until `end_drain`."""
        self._check_fork()
        with self._lock:
            if self._draining >= DRAIN_MAX:
                return False
            self._draining += 1
            return True

    def end_drain(self) -> None:
        with self._lock:
            self._draining -= 1

    def read_ranges(
        self,
        node: str,
        dataset: str,
        instance: str,
        ranges: list[Range],
        out: memoryview,
        deadline: float | None = None,
    ) -> None:
        """One vectored read from one node, within `deadline` (time.monotonic(); default
        `timeout` from now). A node that fails or stays silent is marked down at once: no
        second try on a fresh connection (a pooled one the node closed when it restarted
        fails at once, and the probe finds the node again within PROBE_EVERY_S)."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout
        _pooled, transport = self.acquire(node)
        try:
            if hasattr(transport, "set_timeout"):
                transport.set_timeout(stall_limit(deadline))
            transport.read_into(dataset, instance, ranges, out)
        except NodeUnreachable as e:
            transport.close()
            self.mark_down(node, str(e))
            raise
        except BaseException:
            transport.close()
            raise
        self.release(node, transport)
        self.health.trust(node)

    # Requests.

    def call(
        self, node: str, request: Request[Answer], answer_within: float | None = None
    ) -> Answer:
        """A typed request (kspeedfs.format.contract) to `node` and its answer."""
        with self._connect(parse_address(node), self.settings, self.settings.timeout) as c:
            return c.call(request, answer_within=answer_within)

    def live_call(
        self, request: Request[Answer], answer_within: float | None = None
    ) -> tuple[str, Answer]:
        """A typed request to the first node that answers (the local one first)."""
        order = sorted(
            self.nodes, key=lambda n: (n != self.local_node, self.is_down(n), self.is_suspect(n))
        )
        last: KSpeedError | None = None
        for node in order:
            try:
                return node, self.call(node, request, answer_within)
            except NodeUnreachable as e:
                self.mark_down(node, str(e))
                last = e
        raise last or NodeUnreachable("no nodes configured")

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for t in pool:
                    t.close()
            self._idle = {}
