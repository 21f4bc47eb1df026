"""The etcd control plane with a real etcd and real nodes on 127.0.0.1: membership, the
catalog (racing preloads, a missed unload), healing after a member stays down, rebalance."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from clusterutil import held_on_disk
from conftest import NodeProcess, make_tree, run_cli, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import placement
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import AlreadyExists, KSpeedError
from kspeedfs.format.units import parse_address
from kspeedfs.localetcd import EtcdProcess
from kspeedfs.node.controlplane import placed_members

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


class EtcdCluster:
    """Nodes that find each other in one etcd (no node list anywhere)."""

    def __init__(self, tmp_path: Path, token_file: Path, etcd: EtcdProcess):
        self.tmp = tmp_path
        self.token_file = token_file
        self.etcd = etcd
        self.root = Path("/dev/shm") / f"kspeedfs-etcd-{uuid.uuid4().hex[:10]}"
        self.nodes: list[NodeProcess] = []
        self.cluster = f"t{uuid.uuid4().hex[:8]}"

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
        config = self.tmp / "empty.toml"
        config.touch()
        env.update(
            KSPEEDFS_CONFIG=str(config),
            KSPEEDFS_ETCD=self.etcd.endpoint,
            KSPEEDFS_CLUSTER=self.cluster,
            KSPEEDFS_MEMBER_TTL="2",
            KSPEEDFS_HEAL_AFTER="2",
            KSPEEDFS_TOKEN_FILE=str(self.token_file),
        )
        return env

    def add(self) -> NodeProcess:
        node = NodeProcess(
            self.root / f"node{len(self.nodes)}",
            self.token_file,
            self.tmp,
            segment_size="64KiB",
            base_env=self.base_env(),
        )
        self.nodes.append(node)
        return node.start()

    def client_env(self) -> dict[str, str]:
        return self.base_env()

    def settings(self) -> Settings:
        return Settings(etcd=[self.etcd.endpoint], cluster=self.cluster, token_file=self.token_file)

    def state(self) -> ClusterState:
        return ClusterState([self.etcd.endpoint], self.cluster)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    server = EtcdProcess(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path: Path, token_file: Path, etcd: EtcdProcess) -> Iterator[EtcdCluster]:
    c = EtcdCluster(tmp_path, token_file, etcd)
    yield c
    c.stop()


def _members(c: EtcdCluster) -> dict[str, str]:
    return {m["node"]: m["state"] for m in c.state().member_table()}


def _preload(c: EtcdCluster, source: Path, name: str, replicas: int = 1) -> None:
    done = run_cli(
        "preload", str(source), "--name", name, "--replicas", str(replicas), "-q",
        env=c.client_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_membership_lease_expiry_marks_a_killed_node_down(cluster: EtcdCluster) -> None:
    nodes = [cluster.add() for _ in range(3)]
    wait_for(lambda: set(_members(cluster).values()) == {"up"} and len(_members(cluster)) == 3)
    # A client given only etcd finds the nodes there.
    done = run_cli("status", "--json", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    assert "MEMBER" not in done.stdout
    nodes[2].kill9()
    wait_for(lambda: _members(cluster)[nodes[2].address] == "down", timeout=15)
    assert _members(cluster)[nodes[0].address] == "up"
    table = run_cli("status", env=cluster.client_env())
    assert table.returncode == 0, table.stderr
    assert nodes[2].address in table.stdout and "down" in table.stdout


def test_two_preloads_of_one_name_one_wins(cluster: EtcdCluster, tmp_path: Path) -> None:
    a, b = cluster.add(), cluster.add()
    source = make_tree(tmp_path / "src", 64 * 1024)
    replies: list[Any] = []

    def preload(node: NodeProcess) -> None:
        try:
            replies.append(node.request("preload", name="race", source=str(source)))
        except KSpeedError as e:
            replies.append(e)

    threads = [threading.Thread(target=preload, args=(n,)) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in replies if isinstance(r, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], AlreadyExists), replies
    wait_for(lambda: (cluster.state().dataset("race") or ({}, 0))[0].get("state") == "ready")
    uuids = {d["uuid"] for n in (a, b) for d in n.request("list")["datasets"]}
    assert len(uuids) == 1  # one instance everywhere


def test_a_node_that_missed_an_unload_drops_it(cluster: EtcdCluster, tmp_path: Path) -> None:
    c = [cluster.add() for _ in range(3)][2]
    source = make_tree(tmp_path / "src", 64 * 1024)
    _preload(cluster, source, "gone")
    assert "gone" in {d["name"] for d in c.request("list")["datasets"]}
    c.stop()
    done = run_cli("unload", "gone", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    assert cluster.state().dataset("gone") is None
    assert (c.shm_dir / "datasets" / "gone").exists()  # it was down: its copy is still there
    c.start()
    wait_for(lambda: not (c.shm_dir / "datasets" / "gone").exists(), timeout=15)
    assert "gone" not in {d["name"] for d in c.request("list")["datasets"]}


def _copies(cluster: EtcdCluster, name: str, live: list[NodeProcess]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in live:
        try:
            for seg in held_on_disk(n, name):
                counts[seg] = counts.get(seg, 0) + 1
        except FileNotFoundError:
            pass
    return counts


def test_healing_restores_replicas_while_reads_go_on(cluster: EtcdCluster, tmp_path: Path) -> None:
    nodes = [cluster.add() for _ in range(3)]
    source = make_tree(tmp_path / "src", 64 * 1024)
    for i in range(40):
        (source / f"x{i:02d}.bin").write_bytes(os.urandom(20_000 + 1000 * i))
    _preload(cluster, source, "heal", replicas=2)
    entry, _rev = cluster.state().dataset("heal") or ({}, 0)
    segments = int(entry["segments"])
    assert min(_copies(cluster, "heal", nodes).values()) == 2

    settings = cluster.settings()
    settings.nodes = [parse_address(n.address) for n in nodes]
    reader = ClusterReader(settings)
    ds = reader.open_dataset("heal")
    files = [(i, ds.manifest.path(i)) for i in ds.manifest.iter_files()]
    failures: list[str] = []
    reads = [0]
    stop = threading.Event()

    def read_all() -> None:
        while not stop.is_set():
            for i, rel in files:
                try:
                    data = reader.read(ds, i, 0, 1 << 30)
                    if data != (source / os.fsdecode(rel)).read_bytes():
                        failures.append(f"wrong bytes in {rel!r}")
                    reads[0] += 1
                except KSpeedError as e:
                    failures.append(f"{rel!r}: {e}")

    thread = threading.Thread(target=read_all)
    thread.start()
    try:
        victim = nodes[2]
        victim.kill9()
        survivors = nodes[:2]

        def healed() -> bool:
            rec = (cluster.state().dataset("heal") or ({}, 0))[0]
            if victim.address not in rec.get("lost", []):
                return False
            counts = _copies(cluster, "heal", survivors)
            return len(counts) == segments and min(counts.values()) == 2

        wait_for(healed, timeout=60, what="two live copies of every segment")
        rec = (cluster.state().dataset("heal") or ({}, 0))[0]
        placed = placed_members(rec)
        for seg in range(segments):
            for owner in placement.owners("heal", seg, placed, 2):
                n = next(x for x in survivors if x.address == owner)
                assert seg in held_on_disk(n, "heal")
    finally:
        stop.set()
        thread.join()
        reader.close()
    assert reads[0] > 0
    assert failures == []


def test_readers_find_the_healed_copies_when_the_source_is_gone(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    nodes = [cluster.add() for _ in range(3)]
    source = tmp_path / "src"
    source.mkdir()
    for i in range(30):
        (source / f"x{i:02d}.bin").write_bytes(os.urandom(20_000 + 1000 * i))
    expected = {f"x{i:02d}.bin": (source / f"x{i:02d}.bin").read_bytes() for i in range(30)}
    _preload(cluster, source, "moved", replicas=1)
    victim, survivors = nodes[2], nodes[:2]
    lost_segments = held_on_disk(victim, "moved")
    assert lost_segments  # the victim held a share: reading it needs the healed copies
    victim.kill9()
    segments = int((cluster.state().dataset("moved") or ({}, 0))[0]["segments"])
    wait_for(
        lambda: len(_copies(cluster, "moved", survivors)) == segments,
        timeout=60,
        what="every segment on a survivor",
    )
    shutil.move(source, tmp_path / "gone")  # only the cache can serve now

    settings = cluster.settings()
    settings.nodes = [parse_address(n.address) for n in nodes]
    reader = ClusterReader(settings)  # on no node: every read crosses the network
    try:
        ds = reader.open_dataset("moved")
        for i in ds.manifest.iter_files():
            rel = os.fsdecode(ds.manifest.path(i))
            assert reader.read(ds, i, 0, 1 << 30) == expected[rel]
        assert reader.stats["source"] == 0
    finally:
        reader.close()


def test_rebalance_gives_a_new_member_its_share(cluster: EtcdCluster, tmp_path: Path) -> None:
    a, b = cluster.add(), cluster.add()
    source = make_tree(tmp_path / "src", 64 * 1024)
    for i in range(60):
        (source / f"y{i:02d}.bin").write_bytes(os.urandom(30_000))
    _preload(cluster, source, "grow")
    segments = int((cluster.state().dataset("grow") or ({}, 0))[0]["segments"])
    c = cluster.add()
    assert not (c.shm_dir / "datasets" / "grow").exists()  # a new member receives nothing
    done = run_cli("rebalance", "grow", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    members = sorted(n.address for n in (a, b, c))
    assert (cluster.state().dataset("grow") or ({}, 0))[0]["members"] == members
    wanted = [s for s in range(segments) if placement.owners("grow", s, members)[0] == c.address]
    wait_for(lambda: _copies(cluster, "grow", [c]) == dict.fromkeys(wanted, 1), 30, "c's share")
    # Only the segments whose owner changed moved: those now c's.
    old = [a.address, b.address]
    moved = [
        s
        for s in range(segments)
        if placement.owners("grow", s, members) != placement.owners("grow", s, old)
    ]
    assert moved == wanted


def test_metrics_count_the_reads_served(cluster: EtcdCluster, tmp_path: Path) -> None:
    from kspeedfs.localproc import free_port

    port = free_port()
    node = NodeProcess(
        cluster.root / "metrics",
        cluster.token_file,
        tmp_path,
        segment_size="64KiB",
        base_env={**cluster.base_env(), "KSPEEDFS_METRICS_LISTEN": f"127.0.0.1:{port}"},
    )
    cluster.nodes.append(node)
    node.start()
    source = make_tree(tmp_path / "src", 64 * 1024)
    _preload(cluster, source, "scraped")
    info = {d["name"]: d for d in node.request("list")["datasets"]}["scraped"]
    with node.client() as c:
        data = c.read("scraped", info["uuid"], [(0, 0, 1000), (0, 1000, 24)])
    assert len(data) == 1024
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("kspeedfs_node_reads_total", ())] == 1
    assert samples[("kspeedfs_node_read_bytes_total", ())] == 1024
    assert samples[("kspeedfs_dataset_resident_bytes", (("dataset", "scraped"),))] == info["stored"]
    assert samples[("kspeedfs_members_live", ())] == 1
