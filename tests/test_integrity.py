"""Bytes at rest are checked before they are served; a damaged segment costs that segment.

A real node with a memory tier and a disk tier (`spill_dir`), a dataset preloaded onto the
disk tier (`--tier disk --max-memory 4KiB`, so that nothing moves to memory): random bytes of
random disk segments flipped, segments cut short or grown, while this process reads through
the fast path (views and copies), kspeedfs:// and a real mount. Every door serves 0 wrong
bytes, no reader dies (a SIGBUS would kill this process or the mount), and each damaged
segment is counted in `status` and /metrics, quarantined and fetched again. The scrubber finds
a flip no reader touched; a restart with `verify_on_start` keeps the sound segments.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import hypothesis.strategies as st
import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from rt_util import EnvNode, make_source, wrong_bytes

from kspeedfs.node.store import segment_fault
from pytorch_ext import KSpeedFolder

MiB = 1 << 20
pytestmark = pytest.mark.slow


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    made: list[NodeProcess] = []
    yield made
    for n in made:
        n.stop()
        shutil.rmtree(n.shm_dir, ignore_errors=True)
        shutil.rmtree(n.shm_dir.with_name(n.shm_dir.name + ".run"), ignore_errors=True)


def disk_node(tmp_path: Path, token_file: Path, scrub_rate: str) -> NodeProcess:
    shm = Path("/dev/shm") / f"kspeedfs-test-{os.urandom(5).hex()}"
    return EnvNode(
        shm,
        token_file,
        tmp_path,
        memory="8MiB",
        extra=("--spill-dir", str(tmp_path / "disk"), "--spill", "64MiB"),
        env_extra={"KSPEEDFS_SCRUB_RATE": scrub_rate},
    )


def preload_on_disk(node: NodeProcess, src: Path, name: str) -> dict[str, Any]:
    done = run_cli(
        "preload", str(src), "--name", name, "--tier", "disk", "--max-memory", "4KiB", "-q",
        env=node.env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = listing(node)[name]
    assert record["disk"] and len(record["disk"]) == record["segments"], record
    return record


def listing(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in node.request("list")["datasets"]}


def disk_segment(tmp_path: Path, record: dict[str, Any], seg: int) -> Path:
    return tmp_path / "disk" / "tier" / f"{record['name']}.{record['uuid']}" / "seg" / f"{seg:08d}"


def integrity(node: NodeProcess) -> dict[str, Any]:
    found: dict[str, Any] = node.request("status")["integrity"]
    return found


def damage(path: Path, kind: str, where: float) -> bool:
    """What a failing disk or a stray process does to a segment file, in place; False when
    the file is gone (quarantined meanwhile: a reader's earlier report)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if kind == "flip":
        pos = min(size - 1, int(where * size))
        with open(path, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x5A]))
    elif kind == "truncate":
        os.truncate(path, int(where * size))
    else:
        with open(path, "ab") as f:
            f.write(b"\xff" * (1 + int(where * 4096)))
    return True


def all_sound(tmp_path: Path, node: NodeProcess, name: str) -> bool:
    """Every segment of `name` held again, and every disk one sound."""
    record = listing(node).get(name)
    if record is None or len(record["held"]) != record["segments"]:
        return False
    return all(
        not segment_fault(disk_segment(tmp_path, record, seg), *sizes(node, record, seg))
        for seg in record["disk"]
    )


_SIZES: dict[tuple[str, int], tuple[int, int]] = {}


def sizes(node: NodeProcess, record: dict[str, Any], seg: int) -> tuple[int, int]:
    """Segment `seg`'s length and checksum, from the manifest."""
    from kspeedfs.format.manifest import Manifest

    key = (record["uuid"], seg)
    if key not in _SIZES:
        m = Manifest(Path(record["path"]) / "manifest.ksm")
        for k in range(m.segments):
            _SIZES[(record["uuid"], k)] = (int(m.seg_len[k]), int(m.seg_checksum[k]))
    return _SIZES[key]


def test_damaged_disk_segments_never_serve_a_wrong_byte_nor_kill_a_reader(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess], mounts: list[MountProcess]
) -> None:
    node = disk_node(tmp_path, token_file, scrub_rate="0")  # readers, not the scrub, find it
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 40, 120_000)  # ~4 MiB: 5 segments of 1 MiB on the disk tier
    files["big.bin"] = random.Random(7).randbytes(int(1.5 * MiB))  # spans segments
    (src / "big.bin").write_bytes(files["big.bin"])
    record = preload_on_disk(node, src, "src")
    env = node.env()
    fast = KSpeedFolder(str(src), nodes=env["KSPEEDFS_NODES"], token=str(token_file))
    fs = fsspec.filesystem(
        "kspeedfs", nodes=env["KSPEEDFS_NODES"], token=str(token_file), skip_instance_cache=True
    )
    mount = MountProcess(tmp_path / "mnt", env, tmp_path)
    mounts.append(mount.start())
    planted = 0

    def read_every_door(rels: list[str]) -> int:
        wrong = 0
        reader = fast._reader
        for rel in rels:
            want = files[rel]
            wrong += wrong_bytes(bytes(fast.read(rel)), want)  # the view door
            entry = reader.manifest.resolve(os.fsencode(rel))
            wrong += wrong_bytes(bytes(reader.fetch([entry])[entry]), want)  # copies
            with fs.open(f"src/{rel}", "rb") as f:
                wrong += wrong_bytes(f.read(), want)
        return wrong

    stop = threading.Event()
    background_wrong: list[int] = []

    def keep_reading() -> None:
        """A long-lived reader of the fast path while segments are damaged under it."""
        while not stop.is_set():
            background_wrong.append(read_every_door(sorted(files)[:8]))

    @settings(
        max_examples=4,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        st.lists(
            st.tuples(
                st.integers(0, record["segments"] - 1),
                st.sampled_from(["flip", "truncate", "extend"]),
                st.floats(0.0, 0.999),
            ),
            min_size=1,
            max_size=3,
            unique_by=lambda harm: harm[0],
        ),
        st.integers(0, 1 << 16),
    )
    def damaged_while_read(harms: list[tuple[int, str, float]], seed: int) -> None:
        nonlocal planted
        current = listing(node)["src"]
        stop.clear()
        reader = threading.Thread(target=keep_reading)
        reader.start()
        try:
            for seg, kind, where in harms:
                planted += damage(disk_segment(tmp_path, current, seg), kind, where)
            order = sorted(files)
            random.Random(seed).shuffle(order)
            assert read_every_door(order) == 0
            mounted = mount.mountpoint / "src"
            assert sum(wrong_bytes((mounted / r).read_bytes(), files[r]) for r in order) == 0
        finally:
            stop.set()
            reader.join()
        assert sum(background_wrong) == 0

        # Every damaged segment found (the reads touched every file), counted and made again.
        # (a segment damaged again by a later harm while being fetched counts twice: >=)
        def counted() -> bool:  # readers keep reading: they find what is left, and report it
            assert read_every_door(sorted(files)) == 0
            return integrity(node)["damaged"] >= planted

        wait_for(counted, what="damage counted")
        wait_for(lambda: all_sound(tmp_path, node, "src"), what="damaged segments fetched again")
        found = integrity(node)
        assert found["repaired"] == found["damaged"], found

    damaged_while_read()  # (the source stays: with no replica, repairs come from it)
    assert os.path.ismount(mount.mountpoint) and mount.proc.poll() is None
    shown = run_cli("status", env=env)
    assert shown.returncode == 0, shown.stderr
    assert integrity(node)["repair_failed"] == 0
    assert record["uuid"] == listing(node)["src"]["uuid"]  # the same instance throughout


def test_the_scrubber_finds_a_planted_flip_with_no_reader(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    node = disk_node(tmp_path, token_file, scrub_rate="64MiB")
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 20, 150_000)
    record = preload_on_disk(node, src, "src")
    wait_for(lambda: integrity(node)["passes"] >= 1, what="a first scrub pass")
    seg = record["disk"][len(record["disk"]) // 2]
    damage(disk_segment(tmp_path, record, seg), "flip", 0.5)
    # A pass over ~3 MiB at 64 MiB/s takes well under a second; the wait allows for a slow box.
    wait_for(lambda: integrity(node)["damaged"] == 1, what="the scrubber finding the flip")
    wait_for(lambda: all_sound(tmp_path, node, "src"), what="the segment fetched again")
    status = integrity(node)
    assert status["repaired"] == 1 and status["scrubbed_bytes"] > 0, status
    ds = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0


def test_a_restart_with_one_damaged_segment_keeps_the_others(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    node = disk_node(tmp_path, token_file, scrub_rate="0")
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 20, 150_000)
    record = preload_on_disk(node, src, "src")
    node.stop()
    seg = record["disk"][0]
    damage(disk_segment(tmp_path, record, seg), "flip", 0.3)
    others = {k: disk_segment(tmp_path, record, k).stat().st_ino for k in record["disk"][1:]}
    node.start()  # verify_on_start (the default)
    after = listing(node).get("src")
    assert after is not None and after["uuid"] == record["uuid"], "the dataset was dropped"
    # Every other segment kept as it was (the same files), the damaged one fetched again.
    kept = {k: disk_segment(tmp_path, record, k).stat().st_ino for k in others}
    assert kept == others
    wait_for(lambda: all_sound(tmp_path, node, "src"), what="the damaged segment fetched again")
    status = integrity(node)
    assert status["damaged"] == 1 and status["repaired"] == 1, status
    ds = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0
