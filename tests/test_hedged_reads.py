"""Hedged reads and shared node health (issue 29): a frozen node costs a hedge delay, not a
timeout; what one process learns of a node every other reader of the machine knows."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from clusterutil import Cluster, running
from conftest import make_tree, run_cli, wait_for

from kspeedfs.client.health import NodeHealth
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import load_settings
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
        assert reader.is_down(node.address)
        wait_for(lambda: not reader.is_down(node.address), timeout=5, what="the probe")
        assert not NodeHealth(str(table)).is_down(node.address)  # every reader sees it
    finally:
        reader.close()
