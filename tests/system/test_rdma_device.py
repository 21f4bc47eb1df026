"""Real RDMA between node processes: needs a device (a NIC, or Soft-RoCE: see docs/rdma.md).

Every transport here is opened with transport = "rdma", so a silent fall back to TCP fails.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, make_tree, run_cli, wait_for

from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import KSpeedError, NodeUnreachable, NotFound
from kspeedfs.format.units import parse_address
from kspeedfs.net.transport import Transport
from kspeedfs.rdma.verbs import has_device
from kspeedfs.system.local_dataset import LocalDataset

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not has_device(), reason="no RDMA device"),
]


@pytest.fixture
def two_nodes(token_file: Path, tmp_path: Path) -> Iterator[list[NodeProcess]]:
    import shutil
    import uuid

    nodes = [
        NodeProcess(
            Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}", token_file, tmp_path
        )
        for _ in range(2)
    ]
    try:
        for n in nodes:
            n.start()
        yield nodes
    finally:
        for n in nodes:
            n.stop()
            shutil.rmtree(n.shm_dir, ignore_errors=True)


def preload(node: NodeProcess, source: Path, name: str = "ds") -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


def rdma_transport(node: NodeProcess) -> Transport:
    settings = load_settings({"transport": "rdma"}, env=node.env())
    return open_transport(parse_address(node.address), settings)


def files_of(node: NodeProcess, source: Path) -> list[tuple[list[tuple[int, int, int]], bytes]]:
    """(ranges, source bytes) of every file of dataset "ds" on the node."""
    m = LocalDataset(node.shm_dir / "datasets" / "ds").manifest
    return [(m.ranges(i), (source / os.fsdecode(m.path(i))).read_bytes()) for i in m.iter_files()]


def read(t: Transport, node: NodeProcess, ranges: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(sum(r[2] for r in ranges))
    uuid = LocalDataset(node.shm_dir / "datasets" / "ds").uuid
    t.read_into("ds", uuid, ranges, memoryview(out))
    return bytes(out)


def test_reads_from_two_nodes_equal_the_source(
    two_nodes: list[NodeProcess], tmp_path: Path
) -> None:
    sources = [make_tree(tmp_path / f"src{k}") for k in range(2)]
    for node, src in zip(two_nodes, sources, strict=True):
        preload(node, src)
        status = node.request("status")
        assert status["transport"].startswith("rdma"), status.get("rdma")
        wait_for(lambda n=node: n.request("status")["rdma"]["datasets"] == 1, what="registration")
    for node, src in zip(two_nodes, sources, strict=True):
        t = rdma_transport(node)
        files = files_of(node, src)
        # One batch of every file: many RDMA READs posted at once.
        batch = [r for ranges, _ in files for r in ranges]
        assert read(t, node, batch) == b"".join(data for _, data in files)
        # And file by file, small reads each.
        for ranges, data in files:
            assert read(t, node, ranges) == data
        assert t.name == "rdma"
        assert node.request("status")["rdma"]["peers"] >= 1
        t.close()
    done = run_cli("status", "--json", env=two_nodes[0].env())
    assert done.returncode == 0, done.stderr
    assert "rdma" in json.dumps(json.loads(done.stdout))


def test_a_reloaded_dataset_is_read_with_fresh_keys(
    two_nodes: list[NodeProcess], tmp_path: Path
) -> None:
    node = two_nodes[0]
    src = make_tree(tmp_path / "src")
    preload(node, src)
    t = rdma_transport(node)
    files = files_of(node, src)
    batch = [r for ranges, _ in files for r in ranges]
    expected = b"".join(data for _, data in files)
    assert read(t, node, batch) == expected
    # Unloaded and loaded again: the transport's keys are stale, the node refuses them.
    done = run_cli("unload", "ds", env=node.env())
    assert done.returncode == 0, done.stderr
    (src / "a" / "small.txt").write_bytes(b"changed between loads\n")
    preload(node, src)
    files = files_of(node, src)
    batch = [r for ranges, _ in files for r in ranges]
    assert read(t, node, batch) == b"".join(data for _, data in files)
    done = run_cli("unload", "ds", env=node.env())
    assert done.returncode == 0, done.stderr
    with pytest.raises(NotFound):
        read(t, node, batch)
    t.close()


def test_a_node_killed_mid_read(two_nodes: list[NodeProcess], tmp_path: Path) -> None:
    victim, survivor = two_nodes
    src = make_tree(tmp_path / "src")
    for n in two_nodes:
        preload(n, src)
    big = next(f for f in files_of(victim, src) if len(f[1]) > 2 * (1 << 20))
    good = 0
    failure: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        nonlocal good
        t = rdma_transport(victim)
        try:
            while not stop.is_set():
                data = read(t, victim, big[0])
                assert data == big[1], "a wrong byte from a dying node"
                good += 1
        except KSpeedError as e:
            failure.append(e)
        finally:
            t.close()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_for(lambda: good >= 3 or bool(failure), what="reads before the kill")
        victim.kill9()
        wait_for(lambda: bool(failure) or not thread.is_alive(), timeout=60, what="the failure")
    finally:
        stop.set()
        thread.join(60)
    assert good >= 3
    assert len(failure) == 1 and isinstance(failure[0], NodeUnreachable), failure
    # The other node is unaffected.
    t = rdma_transport(survivor)
    files = files_of(survivor, src)
    assert read(t, survivor, [r for ranges, _ in files for r in ranges]) == b"".join(
        d for _, d in files
    )
    t.close()
    # Restarted, the node registers its segments again and serves without a reload.
    victim.start()
    wait_for(lambda: victim.request("status")["rdma"]["datasets"] == 1, what="re-registration")
    t = rdma_transport(victim)
    assert read(t, victim, big[0]) == big[1]
    t.close()


def test_a_transport_used_across_fork(two_nodes: list[NodeProcess], tmp_path: Path) -> None:
    node = two_nodes[0]
    src = make_tree(tmp_path / "src")
    preload(node, src)
    t = rdma_transport(node)
    files = files_of(node, src)
    batch = [r for ranges, _ in files for r in ranges]
    expected = b"".join(data for _, data in files)
    assert read(t, node, batch) == expected
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            os.close(r)
            # A DataLoader worker: same object, its own queue pair.
            ok = read(t, node, batch) == expected and t.name == "rdma"
            t.close()
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child_ok = f.read()
    os.waitpid(pid, 0)
    assert child_ok == b"1"
    # The parent's queue pair survived the child.
    assert read(t, node, batch) == expected
    t.close()
