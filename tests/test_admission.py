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


def race(node: NodeProcess, srcs: list[Path]) -> dict[str, Any]:
    """Both preloads sent at the same moment, each on its own open connection: name -> the
    answer, or the error it got."""
    clients = [node.client() for _ in srcs]
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
            outcome = race(node, srcs)
            refused = [n for n, got in outcome.items() if isinstance(got, KSpeedError)]
            assert len(refused) == 1, (round_, outcome)
            loser = outcome[refused[0]]
            assert isinstance(loser, NoSpace) and loser.exit_code == 7, (round_, loser)
            (winner,) = set(outcome) - set(refused)
            wait_for(functools.partial(ready, node, winner), what=f"{winner} ready")
            listed = {d["name"]: d["state"] for d in node.request("list")["datasets"]}
            assert listed == {winner: "ready"}, (round_, listed)
            node.request("unload", name=winner)
            wait_for(lambda: node.request("list")["datasets"] == [], what="the unload")
    finally:
        node.stop()
