"""Caps per dataset on preloads and partial datasets (`--max-memory`, `--max-disk`).

Real node daemons on 127.0.0.1 with an 8 MiB memory budget, a 64 MiB disk tier and 1 MiB
segments: a capped preload puts at most its cap in memory and the rest on the disk tier, and
reads byte-equal; a cap the node cannot give is refused in one line and leaves nothing; the
caps hold for promotion, after a restart and for a heal (etcd, three nodes); a capped partial
dataset stays under its cap whatever is read; caps of the wrong type or range are refused off
the wire.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from etcdutil import EtcdCluster
from hypothesis import HealthCheck, given, settings
from rt_util import make_source, wrong_bytes

from kspeedfs.format.errors import InvalidArgument, KSpeedError
from kspeedfs.format.localdata import SEGMENT_DIR
from kspeedfs.format.units import MAX_SIZE
from pytorch_ext import KSpeedFolder

MiB = 1 << 20
BUDGET = 8 * MiB


@pytest.fixture
def node(tmp_path: Path, token_file: Path) -> Iterator[NodeProcess]:
    """8 MiB of memory, a 64 MiB disk tier, 1 MiB segments."""
    shm = Path("/dev/shm") / f"kspeedfs-test-{os.urandom(5).hex()}"
    extra = ("--spill-dir", str(tmp_path / "disk"), "--spill", "64MiB")
    n = NodeProcess(shm, token_file, tmp_path, memory="8MiB", extra=extra)
    try:
        yield n.start()
    finally:
        n.stop()
        shutil.rmtree(shm, ignore_errors=True)


def preload(node: NodeProcess, src: Path, *flags: str) -> Any:
    return run_cli("preload", str(src), "-q", *flags, env=node.env())


def ls_json(node: NodeProcess) -> dict[str, dict[str, Any]]:
    shown = run_cli("ls", "--json", env=node.env())
    assert shown.returncode == 0, shown.stderr
    return {d["name"]: d for d in json.loads(shown.stdout)}


def listing(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in node.request("list")["datasets"]}


def in_memory(node: NodeProcess, name: str) -> int:
    """Bytes of the dataset's segment files in the node's shm folder: what memory holds."""
    seg_dir = node.shm_dir / "datasets" / name / SEGMENT_DIR
    return sum(f.stat().st_size for f in seg_dir.iterdir())


def read_all_fast(node: NodeProcess, src: Path, files: dict[str, bytes]) -> int:
    """Wrong bytes of every file read through the fast path (mapped: the node is local)."""
    ds = KSpeedFolder(str(src), nodes=node.address, token=str(node.token_file))
    return sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items())


def assert_nothing_left(node: NodeProcess, tmp_path: Path) -> None:
    """No dataset, no claim on either tier, no folder in the shm or the disk tier."""
    assert listing(node) == {}
    status = node.request("status")
    assert status["used"] == 0 and status["disk_tier"]["used"] == 0, status
    for folder in ("datasets", "staging"):
        assert os.listdir(node.shm_dir / folder) == []
    tier = tmp_path / "disk" / "tier"
    assert os.listdir(tier) == [".staging"] and os.listdir(tier / ".staging") == []


def test_a_capped_preload_lands_at_most_its_cap_in_memory_and_reads_equal(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "src"
    files = make_source(src, 16, 400_000, folders=3)  # about 6 MiB: it would all fit in memory
    done = preload(node, src, "--max-memory", "2MiB")
    assert done.returncode == 0, done.stderr
    record = ls_json(node)["src"]
    assert (record["max_memory"], record["max_disk"]) == (2 * MiB, 0)
    assert 0 < in_memory(node, "src") <= 2 * MiB
    assert record["disk"] and record["disk_stored"] >= 3 * MiB, record
    assert len(record["held"]) == record["segments"]

    status = json.loads(run_cli("status", "--json", env=node.env()).stdout)
    shown = status["nodes"][0]["cache"]["datasets"]["src"]
    assert (shown["max_memory"], shown["max_disk"]) == (2 * MiB, 0)
    table = run_cli("status", env=node.env()).stdout
    assert any(
        line.startswith(node.address) and "2.0 MiB / -" in line for line in table.split("\n")
    )

    assert read_all_fast(node, src, files) == 0
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(mount.start())
    got = {rel: (mount.mountpoint / "src" / rel).read_bytes() for rel in files}
    assert sum(wrong_bytes(got[rel], data) for rel, data in files.items()) == 0
    assert in_memory(node, "src") <= 2 * MiB


def test_caps_a_node_cannot_give_are_refused_in_one_line_and_leave_nothing(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    make_source(src, 16, 400_000, folders=3)
    refusals = [
        (("--max-memory", "64MiB"), 7, "has free"),  # more than the 8 MiB budget
        (("--max-disk", "1GiB"), 7, "has free"),  # more than the 64 MiB disk tier
        (("--tier", "memory", "--max-memory", "2MiB"), 7, "--max-memory"),  # 6 MiB held
        (("--max-memory", "1MiB", "--max-disk", "2MiB"), 7, "--max-disk"),  # the rest: 5 MiB
        (("--tier", "memory", "--max-disk", "8MiB"), 5, "--tier auto or disk"),
        (("--max-memory", "lots"), 5, "not a size"),
    ]
    for flags, code, why in refusals:
        done = preload(node, src, *flags)
        assert done.returncode == code, (flags, done)
        assert len(done.stderr.strip().splitlines()) == 1 and why in done.stderr, (flags, done)
        assert_nothing_left(node, tmp_path)
    done = preload(node, src, "--tier", "disk", "--max-memory", "1MiB", "--max-disk", "8MiB")
    assert done.returncode == 0, done.stderr


def test_promotion_stops_at_the_cap_and_the_caps_survive_a_restart(
    node: NodeProcess, tmp_path: Path
) -> None:
    """aaa (capped) and zzz (not) both spill to disk; after a restart an unload frees memory:
    zzz moves in, aaa stays at its cap though memory has room for its next segment."""
    sources = {
        name: make_source(tmp_path / name, files, size, seed, folders=3)
        for name, files, size, seed in (
            ("filler", 3, MiB, 1),
            ("aaa", 16, 400_000, 2),
            ("zzz", 14, 400_000, 3),
        )
    }
    assert preload(node, tmp_path / "filler").returncode == 0
    done = preload(node, tmp_path / "aaa", "--max-memory", "2MiB", "--max-disk", "32MiB")
    assert done.returncode == 0, done.stderr
    assert preload(node, tmp_path / "zzz").returncode == 0
    before = listing(node)
    assert before["aaa"]["disk"] and before["zzz"]["disk"], before
    capped = in_memory(node, "aaa")
    assert capped <= 2 * MiB

    node.stop()
    node.start()
    after_restart = ls_json(node)
    assert (after_restart["aaa"]["max_memory"], after_restart["aaa"]["max_disk"]) == (
        2 * MiB,
        32 * MiB,
    )
    assert after_restart["zzz"]["max_memory"] == 0
    assert run_cli("unload", "filler", env=node.env()).returncode == 0
    wait_for(lambda: listing(node)["zzz"]["disk"] == [], what="zzz promoted")
    status = node.request("status")
    assert status["budget"] - status["used"] >= 1 * MiB  # room for one more segment of aaa
    assert listing(node)["aaa"]["disk"] == before["aaa"]["disk"]
    assert in_memory(node, "aaa") == capped
    assert read_all_fast(node, tmp_path / "aaa", sources["aaa"]) == 0


def test_a_capped_partial_dataset_never_holds_more_after_every_file_is_read(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    files = make_source(src, 16, 400_000, folders=3)  # about 6 MiB: it would all fit in memory
    done = preload(node, src, "--partial", "--max-memory", "2MiB", "--max-disk", "4MiB")
    assert done.returncode == 0, done.stderr
    loaded, total = (int(w) for w in done.stdout.split("partial, ")[1].split()[0:3:2])
    assert 0 < loaded < total, done.stdout
    assert 0 < in_memory(node, "src") <= 2 * MiB
    record = ls_json(node)["src"]
    assert (record["max_memory"], record["max_disk"]) == (2 * MiB, 4 * MiB)
    for _ in range(2):  # every file, twice: the cap holds whatever the traffic
        assert read_all_fast(node, src, files) == 0
        assert in_memory(node, "src") <= 2 * MiB


def test_a_heal_keeps_the_memory_cap_and_lands_the_rest_on_the_disk_tier(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """Three nodes with room in memory, 2 copies capped at 256 KiB of memory; one killed: the
    survivors heal its segments onto their disk tiers, past the cap, and every byte reads."""
    cluster = etcd_cluster
    for i in range(3):
        node = NodeProcess(
            cluster.root / f"node{i}",
            cluster.token_file,
            tmp_path,
            memory="8MiB",
            segment_size="64KiB",
            extra=("--spill-dir", str(tmp_path / f"disk{i}"), "--spill", "64MiB"),
            base_env=cluster.base_env(),
        )
        cluster.nodes.append(node.start())
    wait_for(lambda: list(cluster.members().values()) == ["up"] * 3, what="3 members up")
    src = tmp_path / "src"
    files = make_source(src, 40, 60_000, folders=3)
    env = cluster.client_env()
    flags = ("--name", "heal", "--replicas", "2", "--max-memory", "256KiB", "-q")
    done = run_cli("preload", str(src), *flags, env=env)
    assert done.returncode == 0, done.stderr
    segments = cluster.entry("heal").segments
    assert all(0 < in_memory(n, "heal") <= 256 << 10 for n in cluster.nodes)
    *survivors, victim = cluster.nodes
    victim.kill9()

    wait_for(
        lambda: (
            victim.address in cluster.lost("heal")
            and all(len(listing(n)["heal"]["held"]) == segments for n in survivors)
        ),
        timeout=90,
        what="both survivors hold every segment",
    )
    for n in survivors:
        assert in_memory(n, "heal") <= 256 << 10
        assert listing(n)["heal"]["max_memory"] == 256 << 10
    ds = KSpeedFolder(
        str(src), nodes=",".join(n.address for n in survivors), token=str(cluster.token_file)
    )
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0


HOSTILE = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=MAX_SIZE + 1),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.none(),
    st.lists(st.integers(0, 9), max_size=2),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(field=st.sampled_from(["max_memory", "max_disk"]), value=HOSTILE, claim=st.booleans())
def test_hostile_caps_on_the_wire_are_one_line_invalid_arguments(
    node: NodeProcess, tmp_path: Path, field: str, value: object, claim: bool
) -> None:
    if claim:
        op, args = "stage_claim", {"name": "x", "uuid": "u1", "bytes": MiB}
    else:
        op, args = "preload", {"name": "x", "source": str(tmp_path)}
    with pytest.raises(InvalidArgument) as refused:
        node.request(op, **args, **{field: value})
    assert "\n" not in str(refused.value) and field in str(refused.value)
    assert_nothing_left(node, tmp_path)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tier=st.sampled_from(["auto", "memory", "disk"]),
    lengths=st.lists(st.integers(0, 2 * MiB), max_size=8),
    overhead=st.integers(0, MiB),
    max_memory=st.one_of(st.just(0), st.integers(0, 12 * MiB)),
    max_disk=st.one_of(st.just(0), st.integers(0, 80 * MiB)),
)
def test_claims_keep_their_caps_or_are_refused_in_one_line_and_give_everything_back(
    node: NodeProcess,
    tmp_path: Path,
    tier: str,
    lengths: list[int],
    overhead: int,
    max_memory: int,
    max_disk: int,
) -> None:
    """stage_claim with caps as any admin could send it: claimed within the caps (segments in
    memory under max_memory, on disk under max_disk), or refused in one line with nothing
    claimed; an abort gives back every byte either way."""
    claim = {
        "name": "x",
        "uuid": "u1",
        "bytes": sum(lengths) + overhead,
        "tier": tier,
        "segments": list(range(len(lengths))),
        "lengths": lengths,
        "max_memory": max_memory,
        "max_disk": max_disk,
    }
    try:
        answer = node.request("stage_claim", **claim)
    except KSpeedError as e:
        assert "\n" not in str(e)
        assert_nothing_left(node, tmp_path)
    else:
        assert max_memory <= BUDGET and max_disk <= 64 * MiB
        assert answer["memory"] + answer["disk"] == claim["bytes"]
        assert answer["memory"] - overhead <= (max_memory or BUDGET)
        assert answer["disk"] <= (max_disk or 64 * MiB)
        assert tier != "memory" or answer["disk"] == 0
    node.request("abort", name="x", uuid="u1")
    assert_nothing_left(node, tmp_path)
