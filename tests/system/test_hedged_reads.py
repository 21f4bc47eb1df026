"""Hedged reads and shared node health (issue 29): a frozen node costs a hedge delay, not a
timeout; what one process learns of a node every other reader of the machine knows."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from clusterutil import Cluster, running
from conftest import make_tree, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.client.health import NodeHealth
from kspeedfs.client.nodepool import HEDGE_FLOOR_S, HEDGE_MIN_S
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import load_settings
from kspeedfs.format.contract.node import Ping
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import RTO_MIN_S, TCP_RTO_MIN_US, NodeClient
from kspeedfs.testing.node import NodeProcess


def test_suspicion_is_shared_between_processes(tmp_path: Path) -> None:
    table = tmp_path / "health"
    health = NodeHealth(str(table))
    pid = os.fork()
    if pid == 0:  # another reader of the machine, which opens the table by itself
        other = NodeHealth(str(table))
        other.suspect_for("10.0.0.9:7420", 30)
        other.down_for("10.0.0.8:7420", 30)
        os._exit(0)
    os.waitpid(pid, 0)
    assert health.is_suspect("10.0.0.9:7420") and not health.is_down("10.0.0.9:7420")
    assert health.is_down("10.0.0.8:7420")
    assert not health.is_suspect("10.0.0.7:7420")
    health.trust("10.0.0.9:7420")
    assert not NodeHealth(str(table)).is_suspect("10.0.0.9:7420")


def test_a_table_that_is_not_ours_is_not_used(tmp_path: Path) -> None:
    link = tmp_path / "health"
    link.symlink_to(tmp_path / "elsewhere")
    health = NodeHealth(str(link))  # a symlink is never followed: a private table instead
    health.suspect_for("10.0.0.9:7420", 30)
    assert health.is_suspect("10.0.0.9:7420")
    assert not (tmp_path / "elsewhere").exists()
    open_to_all = tmp_path / "open"
    open_to_all.touch(mode=0o666)
    os.chmod(open_to_all, 0o666)
    NodeHealth(str(open_to_all)).suspect_for("10.0.0.9:7420", 30)
    assert open_to_all.stat().st_size == 0


def test_latency_sets_the_hedge_delay(tmp_path: Path) -> None:
    health = NodeHealth(str(tmp_path / "health"))
    assert health.expected("n:1") == 0
    for _ in range(50):
        health.observe("n:1", 0.002)
    assert 0.0019 < health.expected("n:1") < 0.01
    health.observe("n:1", 0.5)  # one slow answer widens it, as RTTVAR does TCP's RTO
    assert health.expected("n:1") > 0.2


def _reader(tmp_path: Path, health: NodeHealth) -> ClusterReader:
    (tmp_path / "empty.toml").touch()
    env = {"KSPEEDFS_CONFIG": str(tmp_path / "empty.toml"), "KSPEEDFS_NODES": "127.0.0.1:9"}
    return ClusterReader(load_settings(env=env), local_node=None, health=health)


def _weather(seed: int, n: int, lost: float) -> list[float]:
    """Times to a first byte: mostly a fraction of a millisecond, a heavy tail (a loaded
    machine's scheduling), and a share `lost` of 200 ms (a lost packet's retransmission)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < lost:
            out.append(0.2)
        else:
            out.append(0.0003 * rng.lognormvariate(0, 1.0) + (rng.random() < 0.01) * 0.02)
    return out


def _hedges(reader: ClusterReader, node: str, firsts: list[float]) -> tuple[int, list[float]]:
    """What the reader does with each answer: waits its hedge delay; a later first byte is a
    hedge (and a miss in the table), an earlier one a sample. (hedges, the delays used)."""
    hedged, delays = 0, []
    for first in firsts:
        delay = reader.pool.hedge_delay(node, 0)
        delays.append(delay)
        if first > delay:
            hedged += 1
            reader.pool.health.missed(node, delay)
        else:
            reader.pool.health.first_byte(node, first)
    return hedged, delays


@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_the_hedge_delay_reads_a_few_in_a_hundred_twice(seed: int, tmp_path: Path) -> None:
    """In quiet weather the delay settles near the time 3% of first bytes exceed: a few
    milliseconds here (not the 30 ms floor a node with no history gets), and at most 5% of
    reads are hedged, whatever the tail's shape."""
    reader = _reader(tmp_path, NodeHealth(""))  # private to this example
    node = "127.0.0.1:9"
    assert reader.pool.hedge_delay(node, 0) == HEDGE_FLOOR_S  # nothing known yet
    firsts = _weather(seed, 6000, 0.0)
    hedged, delays = _hedges(reader, node, firsts)
    assert hedged <= 0.05 * len(firsts)
    settled = sorted(delays[1000:])[len(delays[1000:]) // 2]
    assert HEDGE_MIN_S <= settled < 0.01
    reader.close()


@given(seed=st.integers(0, 2**32 - 1))
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_lost_packets_do_not_raise_the_hedge_delay(seed: int, tmp_path: Path) -> None:
    """1.5% of answers held 200 ms (lost packets) on top of the quiet tail: each is a hedge,
    at a delay near the quiet answers' p99, never the retransmission's 200 ms."""
    reader = _reader(tmp_path, NodeHealth(""))  # private to this example
    node = "127.0.0.1:9"
    _hedges(reader, node, _weather(seed, 3000, 0.0))
    firsts = _weather(seed + 1, 6000, 0.015)
    hedged, delays = _hedges(reader, node, firsts)
    held = sum(f >= 0.2 for f in firsts)
    assert held <= hedged <= held + 0.05 * len(firsts)  # every held answer was hedged
    quiet = sorted(f for f in firsts if f < 0.2)
    p99 = quiet[int(0.99 * len(quiet))]
    assert sorted(delays)[len(delays) // 2] < 2 * p99
    assert max(delays) < 0.1
    reader.close()


def test_a_miss_raises_the_delay_and_answers_bring_it_down(tmp_path: Path) -> None:
    health = NodeHealth(str(tmp_path / "health"))
    reader = _reader(tmp_path, health)
    node = "127.0.0.1:9"
    for _ in range(500):
        health.first_byte(node, 0.004)
    low = reader.pool.hedge_delay(node, 0)
    assert 0.003 < low < 0.006
    for _ in range(10):
        health.missed(node, reader.pool.hedge_delay(node, 0))
    assert reader.pool.hedge_delay(node, 0) > 2 * low
    for _ in range(2000):
        health.first_byte(node, 0.004)
    assert reader.pool.hedge_delay(node, 0) < 0.006
    for _ in range(2000):
        health.first_byte(node, 0.0002)  # a node that answers in 0.2 ms: the least delay
    assert reader.pool.hedge_delay(node, 0) == HEDGE_MIN_S
    # A large read is given its transfer time on top.
    assert reader.pool.hedge_delay(node, 50_000_000) > reader.pool.hedge_delay(node, 0) + 0.09
    assert NodeHealth(str(tmp_path / "health")).late_after(node) == health.late_after(node)
    reader.close()


def _rto_min_us(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US)


def test_both_ends_retransmit_a_lost_packet_in_milliseconds(
    node: NodeProcess, tmp_path: Path
) -> None:
    """A lost request is found only by TCP's retransmission timer (nothing follows it), 200
    ms by the kernel's floor: the client's connections and the node's accepted ones set a
    floor of RTO_MIN_S where the kernel has TCP_RTO_MIN_US (Linux 6.15)."""
    probe = socket.socket()
    try:
        probe.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 200_000)
    except OSError:
        pytest.skip("this kernel has no TCP_RTO_MIN_US")
    finally:
        probe.close()
    (tmp_path / "empty.toml").touch()
    config = load_settings(env={**node.env(), "KSPEEDFS_CONFIG": str(tmp_path / "empty.toml")})
    with NodeClient(parse_address(node.address), config.credential(), 5.0) as c:
        c.call(Ping())
        assert c._sock is not None
        assert RTO_MIN_S * 1e6 <= _rto_min_us(c._sock) < 200_000
        port = c._sock.getsockname()[1]
        # The node's end of this connection, as the kernel shows it: its timer under 200 ms.
        shown = subprocess.run(
            ["ss", "-tinH", "state", "established", f"( dport = :{port} )"],
            capture_output=True,
            text=True,
            check=False,
        )
        if shown.returncode != 0 or "rto:" not in shown.stdout:
            pytest.skip(f"ss cannot show the node's socket: {shown.stderr.strip()}")
        rto_ms = float(re.search(r"rto:([\d.]+)", shown.stdout).group(1))  # type: ignore[union-attr]
        assert rto_ms < 100, shown.stdout


@pytest.mark.slow
def test_a_frozen_node_costs_a_hedge_delay_not_a_timeout(tmp_path: Path, token_file: Path) -> None:
    src = make_tree(tmp_path / "src", 64 * 1024)
    with running(Cluster(token_file, tmp_path, size=3)) as cluster:
        cluster.preload(src, "weather", replicas=2)
        (tmp_path / "empty.toml").touch()
        env = {**cluster.env(), "KSPEEDFS_TIMEOUT": "4"}
        settings = load_settings(env={**env, "KSPEEDFS_CONFIG": str(tmp_path / "empty.toml")})
        health = NodeHealth(str(tmp_path / "health"))
        reader = ClusterReader(settings, local_node=None, health=health)
        ds = reader.open_dataset("weather")
        files = [
            (i, os.fsdecode(ds.manifest.path(i)))
            for i in range(len(ds.manifest.size))
            if ds.manifest.is_file(i)
        ]

        def read_all() -> tuple[int, float]:
            wrong, longest = 0, 0.0
            for i, rel in files:
                started = time.monotonic()
                got = reader.read(ds, i, 0, int(ds.manifest.size[i]))
                longest = max(longest, time.monotonic() - started)
                wrong += sum(a != b for a, b in zip(got, (src / rel).read_bytes(), strict=True))
            return wrong, longest

        assert read_all()[0] == 0
        frozen = cluster.nodes[1]
        assert frozen.proc is not None
        os.kill(frozen.proc.pid, signal.SIGSTOP)  # alive, connected, silent: a partition
        try:
            wrong, longest = read_all()
            assert wrong == 0
            assert longest < settings.timeout  # the documented bound; a hedge took ~30 ms
            assert reader.stats["hedged"] >= 1
            assert health.is_suspect(frozen.address)
            hedged = reader.stats["hedged"]
            assert read_all()[0] == 0  # suspect: new reads go to the others first
            assert reader.stats["hedged"] == hedged
            started = time.monotonic()
            status = run_cli("status", "--json", env=env)  # never hangs on a silent node
            assert status.returncode == 0, status.stderr
            assert time.monotonic() - started < 10  # 2 s per node at most, asked together
            states = {n["node"]: n["state"] for n in json.loads(status.stdout)["nodes"]}
            assert states[frozen.address] == "down"
            assert {states[n.address] for n in cluster.nodes if n is not frozen} <= {
                "up",
                "suspect",
            }
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        wait_for(lambda: not health.is_suspect(frozen.address), timeout=10, what="the probe")
        reader.close()


def test_a_mark_left_by_a_reader_that_is_gone_is_probed_away(
    node: NodeProcess, tmp_path: Path
) -> None:
    """A node marked down by a process that exited (its prober with it), then started again at
    the same address: the next reader to see the mark probes it and trusts it in about a
    probe interval, instead of skipping it until the mark runs out."""
    table = tmp_path / "health"
    keeper = NodeHealth(str(table))  # another reader of the machine: the table stays
    NodeHealth(str(table)).down_for(node.address, 3600)  # the reader that saw it die
    (tmp_path / "empty.toml").touch()
    settings = load_settings(
        env={
            **node.env(),
            "KSPEEDFS_CONFIG": str(tmp_path / "empty.toml"),
            "KSPEEDFS_HEALTH_TABLE": str(table),
        }
    )
    reader = ClusterReader(settings, local_node=None)
    try:
        assert reader.pool.is_down(node.address)
        wait_for(lambda: not reader.pool.is_down(node.address), timeout=5, what="the probe")
        assert not keeper.is_down(node.address)  # every reader sees it
    finally:
        reader.close()
        keeper.close()
