"""The etcd control plane under failures, with a real etcd, real nodes, a real FUSE mount and the
fast path: a node killed mid-epoch, nodes away during an unload or a preload, a coordinator
killed mid-preload, etcd itself stopped."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from clusterutil import held_on_disk, staging_left
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from etcdutil import EtcdCluster, copies

from kspeedfs.client.reader import ClusterReader
from kspeedfs.node.control import placed
from kspeedfs.testing.process import is_users_setting

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> EtcdCluster:
    return etcd_cluster  # the shared fixture (conftest.py), by the name these tests use


def random_tree(root: Path, files: int, size: int = 20_000) -> dict[str, bytes]:
    """`files` files of random bytes in two folders; returns relative path -> bytes."""
    out = {}
    for i in range(files):
        rel = f"d{i % 2}/f{i:04d}.bin"
        data = os.urandom(size + 997 * (i % 40))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def client_env(cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a client that knows only etcd (as a training job would)."""
    for key in [k for k in os.environ if is_users_setting(k)]:
        monkeypatch.delenv(key)
    for key, value in cluster.client_env().items():
        if key.startswith("KSPEEDFS_"):
            monkeypatch.setenv(key, value)


def test_a_node_killed_mid_epoch_fuse_and_fast_path(
    cluster: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_ext import KSpeedFolder

    nodes = [cluster.add() for _ in range(3)]
    source = tmp_path / "src"
    expected = random_tree(source, 120)
    cluster.preload(source, "epochs", replicas=2)
    segments = cluster.entry("epochs").segments
    assert min(copies("epochs", nodes).values()) == 2 and len(copies("epochs", nodes)) == segments

    mount = MountProcess(tmp_path / "mnt", cluster.client_env(), tmp_path)  # nodes from etcd
    client_env(cluster, monkeypatch)
    try:
        mount.start()
        fast = KSpeedFolder(str(source), local=False)  # nodes from etcd
        files = sorted(expected)
        assert sorted(fast.files) == files
        failures: list[str] = []

        def check(path: str, how: str, read: object) -> None:
            try:
                data = read() if callable(read) else b""
            except Exception as e:  # every failure counts, of whatever kind
                failures.append(f"{how} {path}: {type(e).__name__}: {e}")
                return
            if data != expected[path]:
                failures.append(f"{how} {path}: wrong bytes")

        def fuse_read(rel: str) -> None:
            check(rel, "fuse", lambda: (tmp_path / "mnt" / "epochs" / rel).read_bytes())

        def fast_read(rel: str) -> None:
            check(rel, "fast", lambda: bytes(fast.read(rel)))

        half = len(files) // 2
        for rel in files[:half]:  # both epochs under way ...
            fuse_read(rel)
            fast_read(rel)
        victim, survivors = nodes[2], nodes[:2]
        victim.kill9()  # ... when a node holding a third of the copies dies
        for rel in files[half:]:
            fuse_read(rel)
            fast_read(rel)
        for rel in files:  # a second fast-path epoch, the victim still down
            fast_read(rel)
        assert failures == []

        def healed() -> bool:
            if victim.address not in cluster.lost("epochs"):
                return False
            counts = copies("epochs", survivors)
            return len(counts) == segments and min(counts.values()) == 2

        wait_for(healed, timeout=60, what="two live copies of every segment")
        where = placed("epochs", cluster.entry("epochs"))
        assert victim.address in where.lost
        for seg in range(segments):
            for owner in where.owners(seg):
                node = next(n for n in survivors if n.address == owner)
                assert seg in held_on_disk(node, "epochs")
        # The copies serve alone now: the source is gone, a fresh reader reads every file.
        shutil.move(source, tmp_path / "gone")
        again = KSpeedFolder(str(source), local=False)
        for rel in files:
            assert bytes(again.read(rel)) == expected[rel]
        assert again._reader.cluster.stats["source"] == 0
    finally:
        mount.stop()


def listing(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in node.request("list")["datasets"]}


def read_all_through(node: NodeProcess, name: str, expected: dict[str, bytes]) -> None:
    """Every file of `name` read by a reader that knows only `node` (remote reads)."""
    reader = ClusterReader(node.settings())
    try:
        ds = reader.open_dataset(name)
        for i in ds.manifest.iter_files():
            rel = os.fsdecode(ds.manifest.path(i))
            assert reader.read(ds, i, 0, 1 << 30) == expected[rel], rel
    finally:
        reader.close()


def test_nodes_away_during_an_unload_and_a_preload_converge(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    a, b, c = (cluster.add() for _ in range(3))
    source = tmp_path / "src"
    random_tree(source, 40)
    cluster.preload(source, "again", replicas=2)
    old = listing(c)["again"]["uuid"]
    assert held_on_disk(c, "again")
    c.stop()  # away during the unload and the next preload of the name
    done = run_cli("unload", "again", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    expected = random_tree(source, 40)  # new contents, a new instance
    cluster.preload(source, "again", replicas=2)
    new = cluster.entry("again").uuid
    assert new != old and list(cluster.entry("again").members) == sorted([a.address, b.address])
    c.start()

    # It drops the instance unloaded while it was away and lists the new one, holding no part
    # of it (it was not placed on), so a reader that asks it reads from the owners.
    wait_for(lambda: listing(c).get("again", {}).get("uuid") == new, 15, "c lists the new one")
    assert listing(c)["again"]["held"] == []
    assert copies("again", [c]) == {}
    assert f"dropping again (instance {old[:8]})" in c.log()
    read_all_through(c, "again", expected)


def test_a_coordinator_killed_mid_preload_is_rolled_back(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    coordinator, *others = (cluster.add() for _ in range(3))
    source = tmp_path / "src"
    random_tree(source, 60, size=400_000)  # ~25 MB: loading outlasts the kill
    reply = coordinator.request("preload", name="orphan", source=str(source), replicas=2)
    assert sorted(reply["nodes"]) == sorted(n.address for n in cluster.nodes)
    coordinator.kill9()  # stages under way on every member, nothing committed
    assert cluster.catalog_state("orphan") == "loading"

    def rolled_back() -> bool:
        return all(
            not staging_left(n) and "orphan" not in listing(n) and not copies("orphan", [n])
            for n in others
        )

    wait_for(rolled_back, timeout=30, what="the survivors dropped every staged part")
    assert cluster.catalog_state("orphan") is None  # the claim went with the coordinator's lease
    assert all(n.request("status")["used"] == 0 for n in others)
    # The name is free again: the survivors load it.
    expected = random_tree(source, 10)
    for extra in source.glob("d*/f00[1-5]?.bin"):
        extra.unlink()
    expected = {rel: data for rel, data in expected.items() if (source / rel).exists()}
    cluster.preload(source, "orphan", replicas=2)
    read_all_through(others[0], "orphan", expected)


def test_etcd_stopped_reads_go_on_control_ops_fail_then_converge(
    cluster: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_ext import KSpeedFolder

    nodes = [cluster.add() for _ in range(3)]
    source = tmp_path / "src"
    expected = random_tree(source, 60)
    cluster.preload(source, "steady", replicas=2)
    mount = MountProcess(tmp_path / "mnt", cluster.client_env(), tmp_path)
    client_env(cluster, monkeypatch)
    try:
        mount.start()
        fast = KSpeedFolder(str(source), local=False)
        cluster.etcd.pause()
        # The data plane goes on without etcd: the mount and the fast path read every file.
        for rel, data in expected.items():
            assert (tmp_path / "mnt" / "steady" / rel).read_bytes() == data
            assert bytes(fast.read(rel)) == data
        # Control ops fail with one line that names etcd, and change nothing.
        other = tmp_path / "other"
        random_tree(other, 5)
        given = {**cluster.client_env(), "KSPEEDFS_NODES": nodes[0].address}
        for args, env in (
            (("preload", str(other), "--name", "other", "-q"), cluster.client_env()),
            (("preload", str(other), "--name", "other", "-q"), given),
            (("unload", "steady"), given),
            (("status",), cluster.client_env()),
        ):
            done = run_cli(*args, env=env)
            assert done.returncode != 0, (args, done.stdout)
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and "etcd" in lines[0], (args, done.stderr)
        assert all(set(listing(n)) == {"steady"} for n in nodes)
        time.sleep(3)  # under test: an etcd outage past the members' lease TTL

        cluster.etcd.resume()
        # No restart: the members join again, control ops work, every node follows them.
        wait_for(lambda: set(cluster.members().values()) == {"up"}, 20, "members up again")
        assert len(cluster.members()) == 3
        cluster.preload(other, "other")
        done = run_cli("unload", "steady", env=cluster.client_env())
        assert done.returncode == 0, done.stderr
        wait_for(
            lambda: all(set(listing(n)) == {"other"} for n in nodes), 20, "every node converged"
        )
        assert cluster.catalog_state("steady") is None and cluster.catalog_state("other") == "ready"
    finally:
        mount.stop()
