"""Two tiers for preloads (memory, then the node's disk tier) and partial datasets.

Real node daemons on 127.0.0.1 with small budgets: a preload bigger than the memory budget
places the rest of its segments on the disk tier (`spill_dir`) and reads byte-equal through
the fast path and the mount; disk segments move to memory once an unload frees it; without a
disk tier it is NoSpace as before; `--partial` loads what fits and reads the rest through.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from clusterutil import Cluster, running
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from etcdutil import EtcdCluster
from hypothesis import HealthCheck, given, settings
from rt_util import make_source

from kspeedfs.format.errors import KSpeedError, SourceChanged, StaleDataset
from pytorch_ext import KSpeedFolder

MiB = 1 << 20


def tiered_node(tmp_path: Path, token_file: Path, memory: str, disk: str | None) -> NodeProcess:
    shm = Path("/dev/shm") / f"kspeedfs-test-{os.urandom(5).hex()}"
    extra = ("--spill-dir", str(tmp_path / "disk"), "--spill", disk) if disk else ()
    return NodeProcess(shm, token_file, tmp_path, memory=memory, extra=extra)


@pytest.fixture
def small_node(tmp_path: Path, token_file: Path) -> Iterator[NodeProcess]:
    """4 MiB of memory, a 64 MiB disk tier, 1 MiB segments."""
    n = tiered_node(tmp_path, token_file, "4MiB", "64MiB")
    try:
        yield n.start()
    finally:
        n.stop()
        _remove(n.shm_dir)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def wrong_bytes(got: bytes, want: bytes) -> int:
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def read_all_fast(src: Path, node_env: dict[str, str], files: dict[str, bytes]) -> int:
    """Wrong bytes of every file read through the fast path (mapped where local)."""
    ds = KSpeedFolder(str(src), nodes=node_env["KSPEEDFS_NODES"], token=node_env["tok"])
    return sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items())


def read_all_mount(mnt: Path, name: str, files: dict[str, bytes]) -> int:
    return sum(wrong_bytes((mnt / name / rel).read_bytes(), data) for rel, data in files.items())


def listing(node: NodeProcess) -> dict[str, dict]:
    return {d["name"]: d for d in node.request("list")["datasets"]}


def test_auto_preload_spills_to_the_disk_tier_reads_equal_and_promotes(
    small_node: NodeProcess, tmp_path: Path, mounts: list[MountProcess], token_file: Path
) -> None:
    node = small_node
    filler_src = tmp_path / "filler"
    make_source(filler_src, 2, MiB, seed=1)
    src = tmp_path / "src"
    files = make_source(src, 24, 400_000)  # ~9 MiB: over twice the memory budget
    env = node.env()
    for folder in (filler_src, src):
        done = run_cli("preload", str(folder), "-q", env=env)
        assert done.returncode == 0, done.stderr
    record = listing(node)["src"]
    assert record["disk"] and record["disk_stored"] > 4 * MiB, record
    assert 0 < record["stored"] <= 4 * MiB
    status = node.request("status")
    assert status["used"] <= status["budget"]
    assert status["disk_tier"]["used"] == record["disk_stored"]
    assert status["cache"]["datasets"]["src"]["disk_bytes"] == record["disk_stored"]
    shown = run_cli("ls", env=env)
    assert shown.returncode == 0 and "DISK" in shown.stdout.splitlines()[0], shown
    shown = run_cli("status", env=env)
    assert shown.returncode == 0 and "DISK TIER" in shown.stdout, shown
    print(shown.stdout, run_cli("ls", env=env).stdout)  # shown with -s

    fast_env = {"KSPEEDFS_NODES": node.address, "tok": str(token_file)}
    assert read_all_fast(src, fast_env, files) == 0
    mount = MountProcess(tmp_path / "mnt", env, tmp_path)
    mounts.append(mount.start())
    assert read_all_mount(mount.mountpoint, "src", files) == 0

    # Memory frees up: the disk segments move in, and still read equal.
    before = record["disk_stored"]
    done = run_cli("unload", "filler", env=env)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: listing(node)["src"]["disk_stored"] < before, what="a promotion")
    after = listing(node)["src"]
    assert after["stored"] + after["disk_stored"] == record["stored"] + record["disk_stored"]
    assert node.request("status")["used"] <= 4 * MiB
    assert read_all_fast(src, fast_env, files) == 0
    assert read_all_mount(mount.mountpoint, "src", files) == 0

    # Unloaded: nothing is left on the disk tier.
    done = run_cli("unload", "src", env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "disk" / "tier")) == [".staging"]
    assert node.request("status")["disk_tier"]["used"] == 0


def test_without_a_disk_tier_a_preload_too_big_is_nospace_as_before(
    tmp_path: Path, token_file: Path
) -> None:
    node = tiered_node(tmp_path, token_file, "4MiB", None)
    src = tmp_path / "src"
    make_source(src, 24, 400_000)
    try:
        node.start()
        done = run_cli("preload", str(src), "-q", env=node.env())
        assert done.returncode == 7, done
        assert len(done.stderr.splitlines()) == 1 and "budget is free" in done.stderr
        assert listing(node) == {}
        done = run_cli("preload", str(src), "-q", "--tier", "disk", env=node.env())
        assert done.returncode == 7 and "needs a disk tier" in done.stderr, done
    finally:
        node.stop()
        _remove(node.shm_dir)


def test_tier_memory_on_a_small_budget_is_nospace(small_node: NodeProcess, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_source(src, 24, 400_000)
    done = run_cli("preload", str(src), "-q", "--tier", "memory", env=small_node.env())
    assert done.returncode == 7, done
    assert len(done.stderr.splitlines()) == 1 and "NoSpace" not in done.stdout
    assert listing(small_node) == {}
    assert small_node.request("status")["disk_tier"]["used"] == 0
    done = run_cli("preload", str(src), "-q", "--tier", "disk", env=small_node.env())
    assert done.returncode == 0, done.stderr
    # All of it went to disk; promotion may already be moving some into the free memory,
    # so what is in memory is what it moved between the two looks at its counter.
    before = small_node.request("status")["disk_tier"]["promoted"]["segments"]
    record = listing(small_node)["src"]
    after = small_node.request("status")["disk_tier"]["promoted"]["segments"]
    assert set(record["disk"]) <= set(record["held"]) and record["held"], record
    assert before <= len(record["held"]) - len(record["disk"]) <= after, (before, after, record)


def test_partial_serves_every_byte_of_the_source_and_refuses_its_changes(
    tmp_path: Path, token_file: Path
) -> None:
    node = tiered_node(tmp_path, token_file, "4MiB", None)
    src = tmp_path / "src"
    files = make_source(src, 24, 400_000)
    try:
        node.start()
        done = run_cli("preload", str(src), "-q", "--partial", env=node.env())
        assert done.returncode == 0, done.stderr
        loaded, total = (int(w) for w in done.stdout.split("partial, ")[1].split()[0:3:2])
        assert 0 < loaded < total, done.stdout
        fast_env = {"KSPEEDFS_NODES": node.address, "tok": str(token_file)}
        assert read_all_fast(src, fast_env, files) == 0

        # Every file changed at the source: what the reader gets is the listed version or a
        # refusal, never the new bytes: a fill refused (SourceChanged), or the reader's own
        # verified read of the source (StaleDataset: "source file changed since preload").
        for rel, data in files.items():
            (src / rel).write_bytes(bytes(len(data)))
        ds = KSpeedFolder(str(src), nodes=node.address, token=str(token_file))
        refused = wrong = 0
        for rel, data in files.items():
            try:
                wrong += wrong_bytes(bytes(ds.read(rel)), data)
            except (SourceChanged, StaleDataset):
                refused += 1
            except KSpeedError as e:
                raise AssertionError(f"{rel}: {type(e).__name__}: {e}") from None
        assert wrong == 0
        assert refused > 0  # the evicted or never loaded ones
    finally:
        node.stop()
        _remove(node.shm_dir)


@pytest.mark.slow
def test_512mib_on_256mib_with_a_disk_tier_survives_a_node_killed(
    tmp_path: Path, token_file: Path, mounts: list[MountProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: 512 MiB on 256 MiB of memory and 1 GiB of disk per node, 2 copies;
    one node killed, its replicas on the other's disk tier serve every byte."""
    src = tmp_path / "big"
    files = make_source(src, 128, 4 * MiB)
    cluster = Cluster(token_file, tmp_path, size=2, segment_size="8MiB", memory="256MiB")
    for i, n in enumerate(cluster.nodes):
        n.extra += ("--spill-dir", str(tmp_path / f"disk{i}"), "--spill", "1GiB")
    with running(cluster):
        here, there = cluster.nodes
        cluster.preload(src, "big", replicas=2)
        for n in cluster.nodes:
            record = cluster.listing(n)["big"]
            assert record["disk_stored"] > 200 * MiB and record["stored"] <= 256 * MiB
        monkeypatch.setenv("KSPEEDFS_LISTEN", here.address)
        fast_env = {"KSPEEDFS_NODES": ",".join(cluster.addresses), "tok": str(token_file)}
        mount = MountProcess(tmp_path / "mnt", cluster.env(local=here), tmp_path)
        mounts.append(mount.start())
        assert read_all_fast(src, fast_env, files) == 0
        here.kill9()  # the local node: every byte from the other's memory and disk
        monkeypatch.delenv("KSPEEDFS_LISTEN")
        assert read_all_fast(src, fast_env, files) == 0
        assert read_all_mount(mount.mountpoint, "big", files) == 0


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tier=st.sampled_from(["auto", "memory", "disk", "ram", 3]),
    nbytes=st.one_of(st.integers(-5, 4096), st.integers(0, 200 * MiB)),
    parts=st.lists(st.tuples(st.integers(-2, 40), st.integers(-2, 40 * MiB)), max_size=6),
    extra_length=st.booleans(),
)
def test_hostile_claims_are_refused_in_one_line_and_give_everything_back(
    small_node: NodeProcess, tier: object, nbytes: int, parts: list, extra_length: bool
) -> None:
    """stage_claim as any admin could send it: claimed on the tiers, or refused in one line;
    an abort gives back every byte either way."""
    segments = [s for s, _ in parts]
    lengths = [n for _, n in parts] + ([1] if extra_length else [])
    claim = {"name": "x", "uuid": "u1", "bytes": nbytes, "tier": tier}
    try:
        answer = small_node.request("stage_claim", **claim, segments=segments, lengths=lengths)
        assert answer["memory"] + answer["disk"] == nbytes and answer["memory"] <= 4 * MiB
        assert answer["memory"] >= 0 and answer["disk"] >= 0
        held = small_node.request("status")
        assert (held["used"], held["disk_tier"]["used"]) == (answer["memory"], answer["disk"])
    except KSpeedError as e:
        assert "\n" not in str(e)
    small_node.request("abort", name="x", uuid="u1")
    status = small_node.request("status")
    assert status["used"] == 0 and status["disk_tier"]["used"] == 0


def test_a_heal_onto_full_memory_lands_on_the_disk_tier(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """Three nodes, memory for a few segments each and a disk tier, 2 copies; one killed: the
    survivors heal its segments onto their disk tiers and every byte still reads equal."""
    cluster = etcd_cluster
    nodes = []
    for i in range(3):
        node = NodeProcess(
            cluster.root / f"node{i}",
            cluster.token_file,
            tmp_path,
            memory="1MiB",
            segment_size="64KiB",
            extra=("--spill-dir", str(tmp_path / f"disk{i}"), "--spill", "64MiB"),
            base_env=cluster.base_env(),
        )
        cluster.nodes.append(node)
        nodes.append(node.start())
    wait_for(lambda: list(cluster.members().values()) == ["up"] * 3, what="3 members up")
    src = tmp_path / "src"
    files = make_source(src, 40, 60_000)
    cluster.preload(src, "heal", replicas=2)
    segments = cluster.entry("heal").segments
    victim, survivors = nodes[2], nodes[:2]
    victim.kill9()

    def copies_on_both_tiers() -> dict[int, int]:
        counts: dict[int, int] = {}
        for n in survivors:
            for seg in listing(n)["heal"]["held"]:
                counts[seg] = counts.get(seg, 0) + 1
        return counts

    wait_for(
        lambda: (
            victim.address in cluster.lost("heal")
            and len(copies_on_both_tiers()) == segments
            and min(copies_on_both_tiers().values()) == 2
        ),
        timeout=90,
        what="two live copies of every segment",
    )
    assert all(listing(n)["heal"]["stored"] <= 1 * MiB for n in survivors)
    assert sum(len(listing(n)["heal"]["disk"]) for n in survivors) > segments  # healed to disk
    ds = KSpeedFolder(
        str(src), nodes=",".join(n.address for n in survivors), token=str(cluster.token_file)
    )
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0
