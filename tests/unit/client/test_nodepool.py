"""NodePool in-process over fake nodes: connections kept and not shared across fork, nodes marked
down or suspect for every reader, probed until they answer, ranked for the read policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kspeedfs.client.health import NodeHealth
from kspeedfs.client.nodepool import HEDGE_FLOOR_S, NodePool
from kspeedfs.format.contract.node import Ping, Pong
from kspeedfs.format.errors import NodeUnreachable
from kspeedfs.testing.process import wait_until

from .fakenodes import FakeCluster, FakeTransport

A, B, C = "10.0.0.1:7420", "10.0.0.2:7420", "10.0.0.3:7420"


@pytest.fixture
def cluster(tmp_path: Path) -> FakeCluster:
    return FakeCluster(tmp_path, {A: {0: b"a" * 64}, B: {0: b"b" * 64}, C: {}})


def test_a_released_connection_is_the_next_acquired(cluster: FakeCluster) -> None:
    pool = cluster.pool()
    pooled, first = pool.acquire(A)
    assert not pooled
    pool.release(A, first)
    assert pool.acquire(A) == (True, first)
    assert pool.acquire(A)[0] is False  # the one kept is in use: a new one
    pool.close()


def test_a_forked_child_starts_with_no_connection(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = cluster.pool()
    _pooled, parents = pool.acquire(A)
    pool.release(A, parents)
    child = os.getpid() + 1
    monkeypatch.setattr(os, "getpid", lambda: child)
    pooled, fresh = pool.acquire(A)
    assert not pooled and fresh is not parents
    assert not isinstance(parents, FakeTransport) or not parents.closed  # the parent's own
    pool.close()


def test_a_node_marked_down_loses_its_connections_and_is_probed_back(
    cluster: FakeCluster,
) -> None:
    pool = cluster.pool()
    _pooled, kept = pool.acquire(A)
    pool.release(A, kept)
    cluster.nodes[A].down = True
    pool.mark_down(A, "refused")
    assert pool.is_down(A)
    assert isinstance(kept, FakeTransport) and kept.closed
    assert NodeHealth(str(cluster.settings.health_table)).is_down(A)  # every reader sees it
    cluster.nodes[A].down = False
    wait_until(lambda: not pool.is_down(A), 10, "the probe to find the node again")
    assert cluster.nodes[A].pings >= 1
    assert pool.acquire(A)[0] is False  # connected afresh after its return


def test_a_suspect_node_is_ranked_after_healthy_ones_and_before_down_ones(
    cluster: FakeCluster,
) -> None:
    pool = cluster.pool()
    cluster.nodes[B].freeze()  # its probe's ping waits: it stays suspect
    cluster.nodes[C].down = True
    pool.suspect(B, "late")
    pool.mark_down(C, "refused")
    order = sorted([C, B, A], key=pool.rank)
    assert order == [A, B, C]
    assert pool.rank(A, placed=False) > pool.rank(A)  # a candidate after the placed owners
    cluster.nodes[B].thaw()
    wait_until(lambda: not pool.is_suspect(B), 10, "the probe to trust the node again")


def test_live_call_skips_a_down_node_and_marks_it(cluster: FakeCluster) -> None:
    pool = cluster.pool(local_node=A)
    cluster.nodes[A].down = True
    node, answer = pool.live_call(Ping())
    assert node != A and answer == Pong(node=node, version=1)
    assert pool.is_down(A)
    for fake in cluster.nodes.values():
        fake.down = True
    with pytest.raises(NodeUnreachable):
        pool.live_call(Ping())


def test_read_ranges_reads_and_a_failed_node_is_down(cluster: FakeCluster) -> None:
    pool = cluster.pool()
    out = bytearray(8)
    pool.read_ranges(A, "ds", "u", [(0, 4, 8)], memoryview(out))
    assert out == b"a" * 8
    assert pool.acquire(A)[0] is True  # its connection was kept
    pool.release(B, pool.acquire(B)[1])
    cluster.nodes[B].down = True  # its kept connection fails
    with pytest.raises(NodeUnreachable):
        pool.read_ranges(B, "ds", "u", [(0, 0, 8)], memoryview(out))
    assert pool.is_down(B)


def test_the_hedge_delay_is_the_floor_until_latency_is_known(tmp_path: Path) -> None:
    pool = NodePool(FakeCluster(tmp_path, {A: {}}).settings, health=NodeHealth(str(tmp_path / "h")))
    assert pool.hedge_delay(A, 0) == HEDGE_FLOOR_S
    assert pool.hedge_delay(A, 50_000_000) > HEDGE_FLOOR_S


def test_drains_are_bounded(cluster: FakeCluster) -> None:
    pool = cluster.pool()
    started = 0
    while pool.begin_drain():
        started += 1
    assert started == 8
    pool.end_drain()
    assert pool.begin_drain() and not pool.begin_drain()
