"""Distributed preload on three node daemons: each node loads only its own segments, the
manifest is on every node, unload is cluster-wide, and a member dying mid-preload rolls back."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, held_on_disk, running, staging_left
from conftest import NodeProcess, make_tree, run_cli, wait_for

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import placement
from kspeedfs.format.config import load_settings
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.format.manifest import Manifest

pytestmark = pytest.mark.slow  # three nodes

SEGMENT = 64 * 1024


@pytest.fixture
def cluster(token_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    with running(Cluster(token_file, tmp_path, segment_size="64KiB")) as c:
        yield c


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """make_tree's awkward cases plus enough small files for ~40 segments."""
    root = make_tree(tmp_path / "src", segment_size=SEGMENT)
    rng = random.Random(3)
    for i in range(120):
        (root / "many" / f"{i // 40}").mkdir(parents=True, exist_ok=True)
        (root / "many" / f"{i // 40}" / f"x{i:03d}.bin").write_bytes(rng.randbytes(17_000))
    return root


def reader_for(cluster: Cluster) -> ClusterReader:
    """A client on no node: every byte comes over TCP."""
    return ClusterReader(load_settings(env=cluster.env()), local_node=None)


def assert_reads_equal_source(cluster: Cluster, name: str, source: Path) -> None:
    reader = reader_for(cluster)
    try:
        ds = reader.open_dataset(name)
        for i in ds.manifest.iter_files():
            rel = ds.manifest.path(i)
            expected = (source / os.fsdecode(rel)).read_bytes()
            assert reader.read(ds, i, 0, len(expected) + 10) == expected, rel
        assert reader.stats["source"] == 0 and reader.stats["remote"] > 0
    finally:
        reader.close()


def test_each_node_loads_only_its_own_segments(cluster: Cluster, source: Path) -> None:
    # Any node can coordinate: ask the second for one dataset, the third for the other.
    cluster.preload(source, "spread", replicas=1, via=cluster.nodes[1])
    cluster.preload(source, "twice", replicas=2, via=cluster.nodes[2])
    stored_per_node = {n.address: 0 for n in cluster.nodes}
    for name, replicas in (("spread", 1), ("twice", 2)):
        m = Manifest(cluster.nodes[0].shm_dir / "datasets" / name / MANIFEST_FILE)
        assert m.header["members"] == cluster.addresses
        assert m.segments >= 30
        expected = placement.Placement(name, m.segments, cluster.addresses, replicas).assignment()
        uuids = set()
        for node in cluster.nodes:
            on_disk = held_on_disk(node, name)
            assert on_disk == sorted(expected[node.address]), node.address
            entry = cluster.listing(node)[name]
            assert entry["state"] == "ready" and entry["held"] == on_disk
            uuids.add(entry["uuid"])
            # Every node holds the whole manifest, so any node can answer metadata.
            assert Manifest(node.shm_dir / "datasets" / name / MANIFEST_FILE).uuid == entry["uuid"]
            stored_per_node[node.address] += len(on_disk)
            # Segment files are exactly the manifest's lengths (nothing else was loaded).
            for seg in on_disk:
                seg_file = node.shm_dir / "datasets" / name / "seg" / f"{seg:08d}"
                assert seg_file.stat().st_size == int(m.seg_len[seg])
        assert len(uuids) == 1
        assert sum(len(held_on_disk(n, name)) for n in cluster.nodes) == replicas * m.segments
        assert_reads_equal_source(cluster, name, source)
    for node in cluster.nodes:
        status = node.request("status")
        # The node's own statistics: it loaded from the source exactly the segments it holds.
        assert status["loaded"]["segments"] == stored_per_node[node.address]
        assert status["segments"] == stored_per_node[node.address]
        assert staging_left(node) == []


def test_preload_places_over_the_live_nodes_only(cluster: Cluster, source: Path) -> None:
    down = cluster.nodes[2]
    down.stop()
    done = run_cli(
        "preload",
        str(source),
        "--name",
        "three",
        "--replicas",
        "3",
        "-q",
        env=cluster.env(first=cluster.nodes[0]),
    )
    assert done.returncode == 5, done.stderr
    assert "replicas must be between 1 and the 2 live nodes" in done.stderr
    cluster.preload(source, "two-live", replicas=2)
    live = cluster.addresses[:2]
    for node in cluster.nodes[:2]:
        entry = cluster.listing(node)["two-live"]
        assert entry["members"] == live
        assert len(held_on_disk(node, "two-live")) == entry["segments"]
    assert_reads_equal_source(cluster, "two-live", source)
    down.start()
    assert "two-live" not in cluster.listing(down)
    assert_reads_equal_source(cluster, "two-live", source)


def test_unload_from_any_node_removes_it_everywhere(cluster: Cluster, source: Path) -> None:
    cluster.preload(source, "gone", replicas=2)
    done = run_cli("unload", "gone", env=cluster.env(first=cluster.nodes[1]))
    assert done.returncode == 0, done.stderr
    for node in cluster.nodes:
        assert "gone" not in cluster.listing(node)
        assert not (node.shm_dir / "datasets" / "gone").exists()
        assert node.request("status")["used"] == 0


def test_member_killed_mid_preload_rolls_back_everywhere(cluster: Cluster, tmp_path: Path) -> None:
    # Many files, so that staging takes long enough to be caught in the act.
    big = tmp_path / "big"
    block = os.urandom(1 << 20)
    for d in range(8):
        (big / str(d)).mkdir(parents=True)
        for i in range(250):
            k = (d * 250 + i) * 4099 % len(block)
            (big / str(d) / f"{i:04d}.bin").write_bytes((block[k:] + block[:k])[:16_000])
    coordinator, victim = cluster.nodes[0], cluster.nodes[2]
    reply = coordinator.request("preload", name="doomed", source=str(big), replicas=1)
    assert reply["nodes"] == cluster.addresses
    wait_for(lambda: staging_left(victim) != [], timeout=30, what="the victim to start staging")
    victim.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        # Frozen mid-preload: nothing is published anywhere yet.
        for node in cluster.nodes[:2]:
            assert cluster.listing(node).get("doomed", {}).get("state") != "ready"
        assert not (victim.shm_dir / "datasets" / "doomed").exists()
    finally:
        victim.kill9()

    def failed() -> bool:
        return bool(coordinator.request("progress", name="doomed")["state"] == "failed")

    wait_for(failed, timeout=30, what="the preload to fail")
    error = coordinator.request("progress", name="doomed")["error"]
    assert victim.address in error, error
    for node in cluster.nodes[:2]:
        wait_for(lambda n=node: staging_left(n) == [], timeout=10, what="staging removed")
        assert not (node.shm_dir / "datasets" / "doomed").exists()
        assert node.request("status")["used"] == 0, "budget still reserved"
        entry = cluster.listing(node).get("doomed")
        assert entry is None or entry["state"] == "failed", entry
    # The killed node left its half-staged part behind; its restart clears it.
    assert staging_left(victim) != []
    victim.start()
    assert staging_left(victim) == []
    assert "doomed" not in cluster.listing(victim)
    # Nothing left that blocks the name: the same preload now succeeds on all three.
    cluster.preload(big, "doomed", replicas=1)
    for node in cluster.nodes:
        assert cluster.listing(node)["doomed"]["state"] == "ready"


def _can_hide_paths() -> bool:
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "none", "/mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


class SourceBlindNode(NodeProcess):
    """A node in its own mount namespace where `hidden` is an empty tmpfs: like a machine
    that does not share the source's filesystem."""

    def __init__(self, base: NodeProcess, hidden: Path):
        super().__init__(
            base.shm_dir,
            base.token_file,
            base.log_path.parent,
            base.memory,
            base.segment_size,
            base.port,
            base.extra,
        )
        self.hidden = hidden

    def start(self) -> NodeProcess:
        node = shlex.join(self.command())
        cmd = f"mount -t tmpfs none {shlex.quote(str(self.hidden))} && exec {node}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
            )
        wait_for(self._answers, what=f"node on {self.address}")
        return self


@pytest.mark.skipif(not _can_hide_paths(), reason="needs unshare -m (root or user namespaces)")
def test_a_node_that_cannot_read_the_source_gets_its_segments_pushed(
    token_file: Path, tmp_path: Path
) -> None:
    hidden = tmp_path / "shared"
    src = make_tree(hidden / "src", segment_size=SEGMENT)
    for i in range(40):
        (src / "many").mkdir(exist_ok=True)
        (src / "many" / f"x{i:03d}.bin").write_bytes(os.urandom(20_000))
    cluster = Cluster(token_file, tmp_path, segment_size="64KiB")
    blind = SourceBlindNode(cluster.nodes[2], hidden)
    cluster.nodes[2] = blind
    with running(cluster):
        cluster.preload(src, "pushed", replicas=1)
        assert "cannot read the source" in cluster.nodes[0].log()
        m = Manifest(blind.shm_dir / "datasets" / "pushed" / MANIFEST_FILE)
        expected = placement.Placement("pushed", m.segments, cluster.addresses).assignment()
        assert expected[blind.address], "placement gave the blind node nothing to receive"
        for node in cluster.nodes:
            assert held_on_disk(node, "pushed") == expected[node.address]
        assert_reads_equal_source(cluster, "pushed", src)
