"""Read-through datasets over an etcd cluster: the segments are placed over the members, each
filled on its owner, and the cluster's memory is one cache (real etcd, nodes, FUSE mounts)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from clusterutil import held_on_disk
from conftest import MountProcess, NodeProcess, wait_for
from etcdutil import EtcdCluster, scrape

from kspeedfs.node.control import placed
from kspeedfs.testing.process import free_port

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> EtcdCluster:
    return etcd_cluster  # the shared fixture (conftest.py), by the name these tests use


def _source_tree(root: Path) -> dict[str, bytes]:
    out = {}
    for i in range(90):  # ~2.3 MB in 64 KiB segments: ~35 of them over 3 members
        rel = f"d{i % 3}/r{i:03d}.bin"
        data = os.urandom(10_000 + 331 * i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def _cache(node: NodeProcess, name: str) -> dict[str, int]:
    return node.request("status")["cache"]["datasets"][name]


def _read_all(mountpoint: Path, expected: dict[str, bytes]) -> int:
    """Reads every file through the mount; returns how many came back wrong."""
    return sum((mountpoint / rel).read_bytes() != data for rel, data in expected.items())


def test_readthrough_fills_land_on_owners_and_a_second_epoch_reads_no_source(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    node_port = free_port()  # the first node's metrics: its fills' latency histogram
    nodes = [cluster.add(KSPEEDFS_METRICS_LISTEN=f"127.0.0.1:{node_port}")]
    nodes += [cluster.add() for _ in range(2)]
    source = tmp_path / "src"
    expected = _source_tree(source)
    mounts: list[MountProcess] = []

    def mount_on(node: NodeProcess, tag: str, *more: str) -> MountProcess:
        env = {**cluster.client_env(), "KSPEEDFS_LISTEN": node.address}  # the mount's machine
        args = ("--source", str(source), "--name", "rt", "--workers", "1", *more)
        m = MountProcess(tmp_path / tag, env, tmp_path, args=args)
        mounts.append(m)
        return m.start()

    try:
        # Epoch 1 through a mount on the first node: it registers the source.
        first = mount_on(nodes[0], "mnt0")
        record = cluster.entry("rt")
        assert record.state == "ready" and record.lifetime == "readthrough"
        where = placed("rt", record)
        assert list(where.members) == sorted(n.address for n in nodes) and not where.lost
        # Every member adopted it (the manifest, no segment) before the listing returned.
        for n in nodes:
            listed = {d["name"]: d for d in n.request("list")["datasets"]}
            assert listed["rt"]["uuid"] == record.uuid
        assert _read_all(first.mountpoint, expected) == 0

        # Each segment was filled once, on its owner by placement over the members.
        segments = record.segments
        owned = {n.address: [] for n in nodes}  # type: dict[str, list[int]]
        for seg in range(segments):
            owned[where.owners(seg)[0]].append(seg)
        for n in nodes:
            assert owned[n.address], "each member owns a share"
            assert held_on_disk(n, "rt") == owned[n.address]
            assert _cache(n, "rt")["fills_source"] == len(owned[n.address])
        source_bytes = {n.address: _cache(n, "rt")["source_bytes"] for n in nodes}
        assert sum(source_bytes.values()) == sum(len(d) for d in expected.values())
        fills = scrape(node_port)
        origin = (("origin", "source"),)
        assert fills[("kspeedfs_readthrough_fill_seconds_count", origin)] == len(
            owned[nodes[0].address]
        )
        assert fills[("kspeedfs_readthrough_fill_seconds_sum", origin)] > 0
        assert fills[("kspeedfs_readthrough_fill_seconds_bucket", (("le", "+Inf"), *origin))] == (
            len(owned[nodes[0].address])
        )

        # Epoch 2 through a mount on another node (its own page cache): it joins the dataset
        # already cataloged and reads every byte from the members, none from the source.
        port = free_port()
        second = mount_on(nodes[1], "mnt1", "--metrics-listen", f"127.0.0.1:{port}")
        assert cluster.entry("rt").uuid == record.uuid
        assert _read_all(second.mountpoint, expected) == 0
        after = scrape(port)
        for n in nodes:
            assert _cache(n, "rt")["source_bytes"] == source_bytes[n.address]
            assert _cache(n, "rt")["fills_source"] == len(owned[n.address])
        assert after[("kspeedfs_mount_read_bytes_total", (("path", "source"),))] == 0
        # What the mount's node owns it maps (those reads are not the cluster path's); the rest
        # came from the other two owners.
        remote = after[("kspeedfs_mount_read_bytes_total", (("path", "remote"),))]
        assert 0 < remote < sum(len(d) for d in expected.values())
        # Every read from another node is one observation of the latency histogram.
        reads = after[("kspeedfs_mount_reads_total", (("path", "remote"),))]
        assert after[("kspeedfs_mount_remote_read_seconds_count", ())] == reads > 0
        assert after[("kspeedfs_mount_remote_read_seconds_bucket", (("le", "+Inf"),))] == reads
        assert after[("kspeedfs_mount_remote_read_seconds_sum", ())] > 0
    finally:
        for m in mounts:
            m.stop()

    # Unloading from any node takes it away everywhere.
    nodes[2].request("unload", name="rt")
    assert cluster.catalog_state("rt") is None
    for n in nodes:
        wait_for(lambda n=n: not (n.shm_dir / "datasets" / "rt").exists(), 15, "rt unloaded")
