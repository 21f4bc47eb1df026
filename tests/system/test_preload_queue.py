"""`preload --queue` on a real node through the CLI: a preload that does not fit waits in the
node's queue (shown by `status --json`) and loads once an unload frees room; without
`--queue` it is refused in one line naming who holds the memory. Every byte of the queued
dataset is compared with its source once loaded."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, run_cli
from rt_util import policy_nodes, write_files, wrong_bytes

from kspeedfs.testing.process import KSPEEDFS
from pytorch_ext import KSpeedFolder

SEGMENT = 256 << 10
BUDGET = 8 << 20

StartNode = Callable[..., NodeProcess]


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[StartNode]:
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as start:
        yield start


def status(node: NodeProcess) -> dict:
    done = run_cli("status", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    found: dict = json.loads(done.stdout)
    return found["nodes"][0] if "nodes" in found else found


def test_a_queued_preload_waits_for_room_and_loads_after_an_unload(
    make_node: StartNode, tmp_path: Path
) -> None:
    node = make_node("stable")
    first, second = tmp_path / "first", tmp_path / "second"
    write_files(first, 20, SEGMENT)  # 5 MiB of the 8 MiB budget
    files = write_files(second, 20, SEGMENT)
    done = run_cli("preload", str(first), "--name", "first", "-q", env=node.env())
    assert done.returncode == 0, done.stderr

    refused = run_cli("preload", str(second), "--name", "second", "-q", env=node.env())
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    assert "held by first 5.0 MiB" in refused.stderr, refused.stderr

    # A queued preload waits in the node's queue (the CLI waits too, in the background).
    waiter = subprocess.Popen(
        [*KSPEEDFS, "preload", str(second), "--name", "second", "--queue"],
        env=node.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (queue := status(node).get("queue")):
            assert waiter.poll() is None, waiter.communicate()
            assert time.monotonic() < deadline, "the preload never showed in the queue"
            time.sleep(0.2)
        (head,) = queue
        assert head["name"] == "second" and head["position"] == 1, head
        assert head["short_by"] > 0 and "held by first" in head["reason"], head
        assert "second" not in status(node)["held"]
        done = run_cli("unload", "first", env=node.env())
        assert done.returncode == 0, done.stderr
        out, err = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert "second: ready" in out and "queued for room, position 1" in err, (out, err)
    assert status(node)["queue"] == []
    ds = KSpeedFolder(second, objname="second", nodes=node.address, token=node.token_file)
    assert sum(wrong_bytes(ds[i], files[ds.files[i]]) for i in range(len(ds))) == 0


def test_a_jobs_active_preload_that_does_not_fit_reads_through(
    make_node: StartNode, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs whose active preloads together exceed the budget: the first loads (leased),
    the second is read through within its share, said in one line; it never fails at
    construction, and both read every byte right."""
    node = make_node("stable")
    sources = [tmp_path / "job1", tmp_path / "job2"]
    files = [write_files(src, 20, SEGMENT) for src in sources]  # 5 MiB each, 8 MiB budget
    jobs = []
    for k, src in enumerate(sources):
        with caplog.at_level("WARNING", logger="pytorch_ext.cache"):
            jobs.append(
                KSpeedFolder(src, objname=f"job{k + 1}", nodes=node.address, token=node.token_file)
            )
    said = [r.getMessage() for r in caplog.records if r.name == "pytorch_ext.cache"]
    assert len(said) == 1 and "read through within its share" in said[0], said
    assert "held by job1" in said[0], said
    for _epoch in range(2):
        for ds, want in zip(jobs, files, strict=True):
            assert sum(wrong_bytes(ds[i], want[ds.files[i]]) for i in range(len(ds))) == 0
    lifetimes = {n: d["lifetime"] for n, d in status(node)["cache"]["datasets"].items()}
    assert lifetimes == {"job1": "leased", "job2": "readthrough"}, lifetimes
