"""The etcd control plane with a real etcd and real nodes on 127.0.0.1: membership, the
catalog (racing preloads, a missed unload), healing after a member stays down, rebalance."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from clusterutil import held_on_disk
from conftest import MountProcess, NodeProcess, make_tree, run_cli, wait_for
from etcdutil import EtcdCluster, copies, scrape

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import placement
from kspeedfs.format.errors import AlreadyExists, InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.sealing import unseal_tree
from kspeedfs.format.units import parse_address
from kspeedfs.node.control import placed

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> EtcdCluster:
    return etcd_cluster  # the shared fixture (conftest.py), by the name these tests use


def test_membership_lease_expiry_marks_a_killed_node_down(cluster: EtcdCluster) -> None:
    nodes = [cluster.add() for _ in range(3)]
    wait_for(lambda: set(cluster.members().values()) == {"up"} and len(cluster.members()) == 3)
    # A client given only etcd finds the nodes there.
    done = run_cli("status", "--json", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    assert "MEMBER" not in done.stdout
    nodes[2].kill9()
    wait_for(lambda: cluster.members()[nodes[2].address] == "down", timeout=15)
    assert cluster.members()[nodes[0].address] == "up"
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
    wait_for(lambda: cluster.catalog_state("race") == "ready")
    uuids = {d["uuid"] for n in (a, b) for d in n.request("list")["datasets"]}
    assert len(uuids) == 1  # one instance everywhere


def test_a_node_that_missed_an_unload_drops_it(cluster: EtcdCluster, tmp_path: Path) -> None:
    c = [cluster.add() for _ in range(3)][2]
    source = make_tree(tmp_path / "src", 64 * 1024)
    cluster.preload(source, "gone")
    assert "gone" in {d["name"] for d in c.request("list")["datasets"]}
    c.stop()
    done = run_cli("unload", "gone", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    assert cluster.state().dataset("gone") is None
    assert (c.shm_dir / "datasets" / "gone").exists()  # it was down: its copy is still there
    c.start()
    wait_for(lambda: not (c.shm_dir / "datasets" / "gone").exists(), timeout=15)
    assert "gone" not in {d["name"] for d in c.request("list")["datasets"]}


def test_healing_restores_replicas_while_reads_go_on(cluster: EtcdCluster, tmp_path: Path) -> None:
    nodes = [cluster.add() for _ in range(3)]
    source = make_tree(tmp_path / "src", 64 * 1024)
    for i in range(40):
        (source / f"x{i:02d}.bin").write_bytes(os.urandom(20_000 + 1000 * i))
    cluster.preload(source, "heal", replicas=2)
    segments = cluster.entry("heal").segments
    assert min(copies("heal", nodes).values()) == 2

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
            if victim.address not in cluster.lost("heal"):
                return False
            counts = copies("heal", survivors)
            return len(counts) == segments and min(counts.values()) == 2

        wait_for(healed, timeout=60, what="two live copies of every segment")
        where = placed("heal", cluster.entry("heal"))
        for seg in range(segments):
            for owner in where.owners(seg):
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
    cluster.preload(source, "moved", replicas=1)
    victim, survivors = nodes[2], nodes[:2]
    lost_segments = held_on_disk(victim, "moved")
    assert lost_segments  # the victim held a share: reading it needs the healed copies
    victim.kill9()
    segments = cluster.entry("moved").segments
    wait_for(
        lambda: len(copies("moved", survivors)) == segments,
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


def test_a_heal_refuses_a_corrupt_copy_and_leaves_no_partial_file(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A copy received from a peer is checked before it is kept: a peer's corrupted segment
    is thrown away (the source serves it instead), and nothing half-made is left behind."""
    nodes = [cluster.add() for _ in range(3)]
    source = tmp_path / "src"
    source.mkdir()
    for i in range(30):
        (source / f"x{i:02d}.bin").write_bytes(os.urandom(20_000 + 1000 * i))
    cluster.preload(source, "fix", replicas=2)
    victim, survivors = nodes[2], nodes[:2]
    rec = cluster.entry("fix")
    where = placed("fix", rec)
    seg = next(s for s in range(rec.segments) if victim.address in where.owners(s))
    holder = next(n for n in survivors if n.address in where.owners(seg))
    healer = next(n for n in survivors if n is not holder)
    path = holder.shm_dir / "datasets" / "fix" / "seg" / f"{seg:08d}"
    good = path.read_bytes()
    unseal_tree(None, str(path))  # (a node run as root sealed it: bit rot ignores that)
    with open(path, "r+b") as f:  # one byte flipped behind the holder's back
        f.write(bytes([good[0] ^ 0xFF]))
    victim.kill9()
    copied = healer.shm_dir / "datasets" / "fix" / "seg" / f"{seg:08d}"
    wait_for(copied.exists, timeout=60, what="the healer's copy of the corrupted segment")
    assert copied.read_bytes() == good
    heal = healer.request("status")["control"]["heal"]
    assert heal["from_source"] >= 1
    assert heal["failed"] == 0
    # Other segments may still be healing (their .seg- file in the making); a refused copy's
    # file would stay forever.
    folder = copied.parent.parent
    wait_for(
        lambda: not [f for f in os.listdir(folder) if f.startswith(".seg-")],
        timeout=30,
        what="no partial segment file left",
    )
    assert "fails its checksum" in healer.log()


def test_rebalance_gives_a_new_member_its_share(cluster: EtcdCluster, tmp_path: Path) -> None:
    a, b = cluster.add(), cluster.add()
    source = make_tree(tmp_path / "src", 64 * 1024)
    for i in range(60):
        (source / f"y{i:02d}.bin").write_bytes(os.urandom(30_000))
    cluster.preload(source, "grow")
    segments = cluster.entry("grow").segments
    c = cluster.add()
    # A new member receives no segment (the manifest alone, so that it lists the dataset).
    wait_for(lambda: "grow" in {d["name"] for d in c.request("list")["datasets"]}, 10, "listed")
    assert copies("grow", [c]) == {}
    done = run_cli("rebalance", "grow", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    members = sorted(n.address for n in (a, b, c))
    assert list(cluster.entry("grow").members) == members
    new = placement.Placement("grow", segments, members).assignment()
    wanted = new[c.address]
    wait_for(lambda: copies("grow", [c]) == dict.fromkeys(wanted, 1), 30, "c's share")
    # What c gains moves (and what follows the room it frees, when loads are at the cap);
    # the old owners let go of what moved once it is in place, and a reader that opens the
    # dataset now finds it on its new owner (the node lists the catalog's placement): not
    # one byte from the source.
    wait_for(
        lambda: all(held_on_disk(n, "grow") == new[n.address] for n in (a, b, c)),
        30,
        "each member holding exactly its share",
    )
    expected = {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    shutil.move(source, tmp_path / "gone")
    settings = cluster.settings()
    settings.nodes = [parse_address(n.address) for n in (a, b, c)]
    reader = ClusterReader(settings)
    try:
        ds = reader.open_dataset("grow")
        for i in ds.manifest.iter_files():
            rel = Path(os.fsdecode(ds.manifest.path(i)))
            if rel in expected:
                assert reader.read(ds, i, 0, 1 << 30) == expected[rel]
        assert reader.stats["source"] == 0
    finally:
        reader.close()


def test_metrics_count_the_reads_served(cluster: EtcdCluster, tmp_path: Path) -> None:
    from kspeedfs.testing.process import free_port

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
    cluster.preload(source, "scraped")
    info = {d["name"]: d for d in node.request("list")["datasets"]}["scraped"]
    with node.client() as c:
        data = c.read("scraped", info["uuid"], [(0, 0, 1000), (0, 1000, 24)])
    assert len(data) == 1024
    samples = scrape(port)
    assert samples[("kspeedfs_node_reads_total", ())] == 1
    assert samples[("kspeedfs_node_read_bytes_total", ())] == 1024
    assert samples[("kspeedfs_dataset_resident_bytes", (("dataset", "scraped"),))] == info["stored"]
    assert samples[("kspeedfs_dataset_disk_bytes", (("dataset", "scraped"),))] == 0
    assert samples[("kspeedfs_node_disk_tier_budget_bytes", ())] == 0  # no disk tier
    assert samples[("kspeedfs_members_live", ())] == 1
    assert samples[("kspeedfs_dataset_leases", (("dataset", "scraped"),))] == 0
    assert samples[("kspeedfs_heal_segments_total", ())] == 0
    # Latency histograms, exposed before anything was observed.
    for origin in ("source", "spill"):
        assert samples[("kspeedfs_readthrough_fill_seconds_count", (("origin", origin),))] == 0
    for origin in ("peer", "source"):
        assert samples[("kspeedfs_heal_copy_seconds_count", (("origin", origin),))] == 0


def test_join_and_rebalance_move_one_nth_and_old_owners_let_go(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    a, b = cluster.add("16KiB"), cluster.add("16KiB")
    source = tmp_path / "src"
    source.mkdir()
    expected = {}
    for i in range(1200):  # ~1,200 segments: the share moved is measured, not guessed
        expected[f"z{i:04d}.bin"] = data = os.urandom(16_000)
        (source / f"z{i:04d}.bin").write_bytes(data)
    cluster.preload(source, "spread", replicas=1)
    segments = cluster.entry("spread").segments
    c = cluster.add("16KiB")
    done = run_cli("rebalance", "spread", env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    members = sorted(n.address for n in (a, b, c))
    new = placement.Placement("spread", segments, members)
    old = placement.Placement("spread", segments, [a.address, b.address])
    moved = [s for s in range(segments) if new.owners(s) != old.owners(s)]
    assert abs(len(moved) / segments - 1 / 3) <= 0.05, (len(moved), segments)
    share = new.assignment()

    # Each segment ends on exactly its one new owner: the old owners dropped what moved,
    # after the new one had it.
    def settled() -> bool:
        return all(held_on_disk(n, "spread") == share[n.address] for n in (a, b, c))

    wait_for(settled, 60, "one copy of each segment, on its new owner")
    assert copies("spread", [a, b, c]) == dict.fromkeys(range(segments), 1)
    dropped = sum(n.request("status")["control"]["heal"]["dropped"] for n in (a, b))
    assert dropped == len(moved)
    reader = ClusterReader(c.settings())
    try:
        ds = reader.open_dataset("spread")
        for i in ds.manifest.iter_files():
            rel = os.fsdecode(ds.manifest.path(i))
            assert reader.read(ds, i, 0, 1 << 30) == expected[rel]
    finally:
        reader.close()


def test_mount_metrics_count_bytes_by_path(cluster: EtcdCluster, tmp_path: Path) -> None:
    from kspeedfs.testing.process import free_port

    for _ in range(2):
        cluster.add()
    source = tmp_path / "src"
    source.mkdir()
    sizes = {}
    for i in range(20):
        (source / f"m{i:02d}.bin").write_bytes(os.urandom(10_000 + 1000 * i))
        sizes[f"m{i:02d}.bin"] = 10_000 + 1000 * i
    cluster.preload(source, "watched")
    port = free_port()
    mount = MountProcess(
        tmp_path / "mnt",
        cluster.client_env(),
        tmp_path,
        args=("--metrics-listen", f"127.0.0.1:{port}"),
    )
    try:
        mount.start()
        before = scrape(port)
        assert before[("kspeedfs_mount_read_bytes_total", (("path", "remote"),))] == 0
        for rel in sizes:  # each file once: the page cache keeps it after
            assert (tmp_path / "mnt" / "watched" / rel).read_bytes() == (source / rel).read_bytes()
        after = scrape(port)
    finally:
        mount.stop()
    by_path = {
        p: after[("kspeedfs_mount_read_bytes_total", (("path", p),))]
        for p in ("local", "remote", "source")
    }
    # No node is this machine's "local" one and every owner is up: all bytes came remote.
    assert by_path == {"local": 0, "remote": sum(sizes.values()), "source": 0}
    assert after[("kspeedfs_mount_reads_total", (("path", "remote"),))] >= 1
    # The latency of each remote read: one observation per read, buckets cumulative.
    reads = after[("kspeedfs_mount_reads_total", (("path", "remote"),))]
    assert after[("kspeedfs_mount_remote_read_seconds_count", ())] == reads
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in after.items()
        if name == "kspeedfs_mount_remote_read_seconds_bucket"
    )
    assert [v for _le, v in buckets] == sorted(v for _le, v in buckets)
    assert buckets[-1] == (float("inf"), reads)
    assert after[("kspeedfs_mount_requests_total", (("op", "read"),))] >= len(sizes)
    assert after[("kspeedfs_mount_requests_total", (("op", "lookup"),))] >= len(sizes)


def test_adopt_takes_the_catalogs_instance_and_refuses_another_in_one_line(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """`adopt` (contract.control.Adopt): a field missing or of another type is refused before
    the handler, an instance the catalog does not have is NotFound, and the catalog's ready
    one is listed by a member that was down while it was loaded."""
    a, b = cluster.add(), cluster.add()
    b.stop()
    source = make_tree(tmp_path / "src", 64 * 1024)
    cluster.preload(source, "late")
    entry = cluster.entry("late")
    b.start()
    with b.client() as c:
        for args, message in (
            ({"name": "late"}, "op adopt: field 'uuid' is missing"),
            ({"name": "late", "uuid": 7}, "op adopt: uuid must be a string"),
            ({"name": "../late", "uuid": entry.uuid}, "op adopt: name"),
        ):
            with pytest.raises(InvalidArgument) as refused:
                c.request("adopt", **args)
            assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
        with pytest.raises(NotFound, match="no ready instance 00000000 of 'late'"):
            c.request("adopt", name="late", uuid="0" * 32)
        assert c.request("adopt", name="late", uuid=entry.uuid) == {
            "name": "late",
            "adopted": True,
        }
    listed = {d["name"]: d["uuid"] for d in b.request("list")["datasets"]}
    assert listed["late"] == entry.uuid
    assert a.request("ping")["node"] == a.address
