"""Admission reserves the memory atomically: of two preloads racing for the last of it, exactly
one loads and the other is refused with NoSpace before any copying; nothing is left failed."""

from __future__ import annotations

import functools
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusterutil import Cluster, running
from conftest import NodeProcess, wait_for

from kspeedfs.format.errors import KSpeedError, NoSpace

ROUNDS = 10
FILE = 2 << 20
FILES = 5  # 10 MiB a dataset: one fits in the 16 MiB filesystem, two do not


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: the node's budget (1 GiB) is more than its filesystem can hold, as on a
    machine whose /dev/shm is small or shared with others."""
    mountpoint = tmp_path / "shm"
    mountpoint.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def sources(root: Path) -> list[Path]:
    made = []
    for name in ("left", "right"):
        folder = root / name
        folder.mkdir()
        for i in range(FILES):
            (folder / f"f{i}.bin").write_bytes(os.urandom(FILE))
        made.append(folder)
    return made


def race(nodes: list[NodeProcess], srcs: list[Path]) -> dict[str, Any]:
    """The preloads sent at the same moment, each on its own open connection (to the nodes in
    turn): name -> the answer, or the error it got."""
    clients = [nodes[i % len(nodes)].client() for i in range(len(srcs))]
    for c in clients:
        c.connect()
    start = threading.Barrier(len(srcs))
    outcome: dict[str, Any] = {}

    def preload(c: Any, src: Path) -> None:
        start.wait()
        try:
            outcome[src.name] = c.request("preload", name=src.name, source=str(src))
        except KSpeedError as e:
            outcome[src.name] = e

    threads = [
        threading.Thread(target=preload, args=pair) for pair in zip(clients, srcs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return outcome


def check_round(round_: int, nodes: list[NodeProcess], srcs: list[Path]) -> None:
    """Two preloads raced: exactly one refused with NoSpace (exit 7), the other loads, nothing
    else is listed anywhere, failed or not; then it is unloaded for the next round."""
    outcome = race(nodes, srcs)
    refused = [n for n, got in outcome.items() if isinstance(got, KSpeedError)]
    assert len(refused) == 1, (round_, outcome)
    loser = outcome[refused[0]]
    assert isinstance(loser, NoSpace) and loser.exit_code == 7, (round_, loser)
    (winner,) = set(outcome) - set(refused)
    coordinator = nodes[[src.name for src in srcs].index(winner) % len(nodes)]
    wait_for(functools.partial(ready, coordinator, winner), what=f"{winner} ready")
    for node in nodes:
        listed = {d["name"]: d["state"] for d in node.request("list")["datasets"]}
        assert listed == {winner: "ready"}, (round_, node.address, listed)
    nodes[0].request("unload", name=winner)
    for node in nodes:
        wait_for(lambda n=node: n.request("list")["datasets"] == [], what="the unload")


def ready(node: NodeProcess, name: str) -> bool:
    progress = node.request("progress", name=name)
    assert progress["state"] != "failed", progress  # the winner never fails mid-load
    return bool(progress["state"] == "ready")


def test_of_two_racing_preloads_exactly_the_one_that_fits_loads(
    small_shm: Path, token_file: Path, tmp_path: Path
) -> None:
    srcs = sources(tmp_path)
    node = NodeProcess(small_shm / "kspeedfs", token_file, tmp_path).start()
    try:
        for round_ in range(ROUNDS):
            check_round(round_, [node], srcs)
    finally:
        node.stop()


@pytest.mark.slow  # two nodes
def test_of_two_preloads_racing_over_a_cluster_exactly_one_loads(
    token_file: Path, tmp_path: Path
) -> None:
    """Two coordinators, each placing its dataset over both members: each member's budget
    holds its part of one dataset, not of both. Claimed in parallel, each coordinator got its
    own member and lost the other: both refused."""
    srcs = sources(tmp_path)
    cluster = Cluster(token_file, tmp_path, size=2, segment_size="1MiB", memory="8MiB")
    with running(cluster):
        for round_ in range(ROUNDS):
            check_round(round_, cluster.nodes, srcs)


def test_a_preload_evicts_read_through_data_to_find_room_on_the_filesystem(
    small_shm: Path, token_file: Path, tmp_path: Path
) -> None:
    """The filesystem, not the budget, is full of read-through segments: they give way to a
    preload as they do when the budget is short."""
    cached, pinned = sources(tmp_path)
    node = NodeProcess(small_shm / "kspeedfs", token_file, tmp_path).start()
    try:
        node.request("register_source", name="cached", source=str(cached))
        wait_for(functools.partial(ready, node, "cached"), what="the listing")
        segments = node.request("status")["cache"]["datasets"]["cached"]["segments"]
        for seg in range(segments):
            assert node.request("fill", name="cached", segment=seg)["state"] == "cached"
        node.request("preload", name=pinned.name, source=str(pinned))
        wait_for(functools.partial(ready, node, pinned.name), what="the preload")
        status = node.request("status")["cache"]["datasets"]["cached"]
        assert status["evictions"] > 0, status
    finally:
        node.stop()
