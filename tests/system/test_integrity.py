"""Bytes at rest are checked before they are served; a damaged segment costs that segment.

A real node with a memory tier and a disk tier (`spill_dir`), a dataset preloaded onto the
disk tier (`--tier disk --max-memory 4KiB`, so that nothing moves to memory): random bytes of
random disk segments flipped, segments cut short or grown, while this process reads through
the fast path (views and copies), the fast path over TCP (no local node, as from another
machine), kspeedfs:// and a real mount. Every door serves 0 wrong bytes, no reader dies (a
SIGBUS would kill this process or the mount), and each damaged segment is counted in `status`
and /metrics, quarantined and fetched again. The scrubber finds a flip no reader touched; a
restart with `verify_on_start` keeps the sound segments.

That property runs a node without CAP_LINUX_IMMUTABLE (it cannot seal its segments: readers
take the pread path). A node run as root seals every segment it publishes (the immutable flag):
then no harm gets through at all (each attempt is refused, memory and disk tier), and a
segment whose flag a deliberate root cleared and cut short is found by the size check of a
reader that maps it afterwards (no SIGBUS), and repaired. Damage below the flag (a failing
disk: `damage` clears the flag, flips, and puts it back) is found by the scrubber and at start.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
import hypothesis.strategies as st
import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from disktier import (
    MiB,
    all_sound,
    damage,
    dataset_on_disk,
    disk_node,
    disk_segment,
    integrity,
    listing,
    preload_on_disk,
    read_in_a_new_process,
    sizes,
)
from hypothesis import HealthCheck, given, settings
from rt_util import make_source, wrong_bytes

from kspeedfs.format.sealing import sealed_beneath, set_sealed
from kspeedfs.node.segments import segment_fault
from kspeedfs.testing.node import can_seal
from pytorch_ext import KSpeedFolder

if TYPE_CHECKING:
    from etcdutil import EtcdCluster

pytestmark = pytest.mark.slow


def test_damaged_disk_segments_never_serve_a_wrong_byte_nor_kill_a_reader(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess], mounts: list[MountProcess]
) -> None:
    # Readers, not the scrub, find it; a node that cannot seal its segments (as one not run
    # as root): they are read by pread, checked, and a harm to them is caught by the check.
    node = disk_node(tmp_path, token_file, scrub_rate="0", sealing=False)
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 40, 120_000)  # ~4 MiB: 5 segments of 1 MiB on the disk tier
    files["big.bin"] = random.Random(7).randbytes(int(1.5 * MiB))  # spans segments
    (src / "big.bin").write_bytes(files["big.bin"])
    record = preload_on_disk(node, src, "src")
    env = node.env()
    fast = KSpeedFolder(str(src), nodes=env["KSPEEDFS_NODES"], token=str(token_file))
    # No local node: every read over TCP, as a reader on another machine reads.
    tcp = KSpeedFolder(str(src), nodes=env["KSPEEDFS_NODES"], token=str(token_file), local=False)
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
            wrong += wrong_bytes(bytes(tcp.read(rel)), want)  # TCP
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


def test_a_flip_after_a_file_was_checked_is_caught_by_the_next_copy_of_it(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    """Copies (gather) of a file checked once are a pread and an fstat of its unsealed disk
    segment: a byte flipped in place afterwards changes the segment's times, and the next copy,
    whole or a part, reads the file again and checks it (the source serves it meanwhile)."""
    node, src, files, record = dataset_on_disk(
        tmp_path, token_file, nodes, scrub_rate="0", sealing=False
    )
    reader = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    r = reader._reader
    m = r.manifest
    entries = {rel: m.resolve(os.fsencode(rel)) for rel in files}

    def copied(rel: str, offset: int = 0) -> bytes:
        out = bytearray(len(files[rel]) - offset)
        r.gather([(entries[rel], offset, len(out))], memoryview(out))
        return bytes(out)

    for _ in range(2):  # checked, then copied with nothing but the segment's stamp looked at
        assert sum(wrong_bytes(copied(rel), data) for rel, data in files.items()) == 0
    assert not r.cluster.stats["source"]
    seg_of = {rel: int(m.data[e]) // m.segment_size for rel, e in entries.items()}
    whole = sorted(files)[3]  # and one in another segment (the first one's is fetched again)
    part = next(rel for rel in sorted(files) if seg_of[rel] != seg_of[whole])
    for rel, offset in ((whole, 0), (part, 7)):
        seg, off = divmod(int(m.data[entries[rel]]), m.segment_size)
        with open(disk_segment(tmp_path, record, seg), "r+b") as f:
            pos = off + len(files[rel]) // 2
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x5A]))
        assert wrong_bytes(copied(rel, offset), files[rel][offset:]) == 0, rel
    assert r.cluster.stats["source"] >= 2  # both read elsewhere, not from the flipped copy
    assert sum(wrong_bytes(copied(rel), data) for rel, data in files.items()) == 0


def test_the_scrubber_finds_a_planted_flip_with_no_reader(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, scrub_rate="64MiB")
    wait_for(lambda: integrity(node)["passes"] >= 1, what="a first scrub pass")
    seg = record["disk"][len(record["disk"]) // 2]
    damage(disk_segment(tmp_path, record, seg), "flip", 0.5, below_the_flag=True)
    # A pass over ~3 MiB at 64 MiB/s takes well under a second; the wait allows for a slow box.
    wait_for(lambda: integrity(node)["damaged"] == 1, what="the scrubber finding the flip")
    wait_for(lambda: all_sound(tmp_path, node, "src"), what="the segment fetched again")
    status = integrity(node)
    assert status["repaired"] == 1 and status["scrubbed_bytes"] > 0, status
    if can_seal(tmp_path):  # the one fetched again is sealed as the rest
        assert len(sealed_beneath(tmp_path / "disk")) == len(record["disk"])
    ds = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0


def test_a_reader_maps_a_repaired_sealed_segment_again(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    """A sealed disk segment damaged below the flag (a failing disk) fails the checksum of
    the file a long-lived reader reads from it: the reader gets the right bytes elsewhere (the
    source), the node fetches the segment again, and the same reader then reads that
    segment's files from its new copy here (mapped again; with the source gone, to be sure),
    not from elsewhere for the rest of its life."""
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, scrub_rate="0")
    ds = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    reader = ds._reader
    seg = record["disk"][0]
    in_seg = [
        rel
        for rel in sorted(files)
        if any(
            s == seg
            for s, _, _ in reader.manifest.ranges(reader.manifest.resolve(os.fsencode(rel)))
        )
    ]
    first, rest = in_seg[0], [rel for rel in files if rel not in in_seg]
    assert sum(wrong_bytes(bytes(ds.read(rel)), files[rel]) for rel in rest) == 0  # maps kept
    path = disk_segment(tmp_path, record, seg)
    ranges = reader.manifest.ranges(reader.manifest.resolve(os.fsencode(first)))
    (_, off, n) = next(r for r in ranges if r[0] == seg)
    damage(path, "flip", (off + n // 2) / path.stat().st_size, below_the_flag=True)
    assert wrong_bytes(bytes(ds.read(first)), files[first]) == 0  # read elsewhere: checked
    wait_for(lambda: integrity(node)["repaired"] >= 1, what="the segment fetched again")
    shutil.move(src, tmp_path / "gone")  # nothing else to read them from
    served = node.request("status")["stats"]["reads"]
    for rel in in_seg:
        assert wrong_bytes(bytes(ds.read(rel)), files[rel]) == 0
    assert node.request("status")["stats"]["reads"] == served  # all read here, from the new copy


def test_a_restart_with_one_damaged_segment_keeps_the_others(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, scrub_rate="0")
    node.stop()
    seg = record["disk"][0]
    damage(disk_segment(tmp_path, record, seg), "flip", 0.3, below_the_flag=True)
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


def test_sealed_segments_refuse_every_harm_and_a_deliberate_root_is_caught_by_the_size_check(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess], mounts: list[MountProcess]
) -> None:
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    node = disk_node(tmp_path, token_file, scrub_rate="0")  # root: it seals its segments
    nodes.append(node.start())
    files: dict[str, dict[str, bytes]] = {}
    for name, n in (("mem", 24), ("dsk", 24)):
        files[name] = make_source(tmp_path / name, n, 120_000, seed=len(name) + n)
    done = run_cli("preload", str(tmp_path / "mem"), "--name", "mem", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    preload_on_disk(node, tmp_path / "dsk", "dsk")
    shown = listing(node)
    assert not shown["mem"]["disk"], shown["mem"]
    segments = {
        "mem": sorted(Path(shown["mem"]["path"]).glob("seg/*")),
        "dsk": sorted((tmp_path / "disk" / "tier").glob("dsk.*/seg/*")),
    }
    assert len(segments["mem"]) == shown["mem"]["segments"] >= 2
    assert len(segments["dsk"]) == shown["dsk"]["segments"] >= 2
    manifests = [str(Path(shown[name]["path"]) / "manifest.ksm") for name in segments]
    every = sorted([str(p) for ps in segments.values() for p in ps] + manifests)
    assert sorted(sealed_beneath(node.shm_dir) + sealed_beneath(tmp_path / "disk")) == every
    for manifest in manifests:  # readers map it too
        with pytest.raises(PermissionError):
            os.truncate(manifest, 0)

    env = node.env()
    fast = {
        name: KSpeedFolder(str(tmp_path / name), nodes=env["KSPEEDFS_NODES"], token=str(token_file))
        for name in files
    }
    tcp = {  # no local node: every read over TCP, as a reader on another machine reads
        name: KSpeedFolder(
            str(tmp_path / name), nodes=env["KSPEEDFS_NODES"], token=str(token_file), local=False
        )
        for name in files
    }
    fs = fsspec.filesystem(
        "kspeedfs", nodes=env["KSPEEDFS_NODES"], token=str(token_file), skip_instance_cache=True
    )
    mount = MountProcess(tmp_path / "mnt", env, tmp_path)
    mounts.append(mount.start())

    def read_every_door(name: str, rels: list[str]) -> int:
        wrong = 0
        reader = fast[name]._reader
        for rel in rels:
            want = files[name][rel]
            wrong += wrong_bytes(bytes(fast[name].read(rel)), want)  # views (maps)
            entry = reader.manifest.resolve(os.fsencode(rel))
            wrong += wrong_bytes(bytes(reader.fetch([entry])[entry]), want)  # copies
            wrong += wrong_bytes(bytes(tcp[name].read(rel)), want)
            with fs.open(f"{name}/{rel}", "rb") as f:
                wrong += wrong_bytes(f.read(), want)
            wrong += wrong_bytes((mount.mountpoint / name / rel).read_bytes(), want)
        return wrong

    stop = threading.Event()
    background_wrong: list[int] = []

    def keep_reading() -> None:
        while not stop.is_set():
            background_wrong.append(sum(read_every_door(n, sorted(files[n])[:4]) for n in files))

    @settings(
        max_examples=6,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(sorted(files)),
                st.integers(0, 1 << 10),
                st.sampled_from(["flip", "truncate", "extend", "unlink", "replace"]),
                st.floats(0.0, 0.999),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def harmed_while_read(harms: list[tuple[str, int, str, float]]) -> None:
        stop.clear()
        reader = threading.Thread(target=keep_reading)
        reader.start()
        try:
            for name, k, kind, where in harms:
                path = segments[name][k % len(segments[name])]
                with pytest.raises(PermissionError):  # even as root: the flag refuses it
                    damage(path, kind, where)
            for name in files:
                assert read_every_door(name, sorted(files[name])) == 0
        finally:
            stop.set()
            reader.join()
        assert sum(background_wrong) == 0

    harmed_while_read()
    assert sorted(sealed_beneath(node.shm_dir) + sealed_beneath(tmp_path / "disk")) == every
    assert integrity(node)["damaged"] == 0  # nothing got through

    # A deliberate root clears the flag of a memory segment and cuts it short: outside what
    # the flag guards. This process and the mount mapped it while it was sealed (no check:
    # they must not touch it again, a SIGBUS would follow); a reader that maps it now finds
    # the wrong size before any touch (no SIGBUS), reads elsewhere (the source), and its
    # report has the node quarantine it and fetch it again, sealed.
    cut = segments["mem"][0]
    damage(cut, "truncate", 0.5, below_the_flag=True)
    assert read_in_a_new_process(node, tmp_path / "mem", files["mem"]) == 0
    wait_for(lambda: integrity(node)["repaired"] >= 1, what="the cut segment fetched again")
    assert str(cut) in sealed_beneath(node.shm_dir)  # its new copy, sealed
    assert read_in_a_new_process(node, tmp_path / "mem", files["mem"]) == 0
    found = integrity(node)
    assert found["damaged"] == found["repaired"] == 1 and found["repair_failed"] == 0, found
    assert read_every_door("dsk", sorted(files["dsk"])) == 0
    assert os.path.ismount(mount.mountpoint) and mount.proc.poll() is None


def test_a_node_killed_and_restarted_leaves_no_sealed_file_behind(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    """kill -9 leaves sealed segments (published, staged, being promoted): the restart keeps
    the published ones sealed, removes the rest, and an unload removes every one of them; the
    test's own cleanup (remove_tree, the rmtree of conftest) removes what a node left."""
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, scrub_rate="0")
    done = run_cli("preload", str(src), "--name", "mem", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    assert len(sealed_beneath(tmp_path / "disk")) == len(record["disk"])
    held = sealed_beneath(node.shm_dir)
    assert held, "no memory segment sealed"
    # What a node killed mid-work leaves: a sealed segment in staging and in the trash.
    for leftover in (
        node.shm_dir / "staging" / "x.0" / "seg",
        node.shm_dir / "trash" / "y" / "seg",
    ):
        leftover.mkdir(parents=True)
        (leftover / "00000000").write_bytes(b"left")
        fd = os.open(leftover / "00000000", os.O_RDONLY)
        set_sealed(fd, True)
        os.close(fd)
    node.kill9()
    node.start()
    assert sorted(sealed_beneath(node.shm_dir)) == sorted(held)  # kept; leftovers removed
    assert not (node.shm_dir / "staging" / "x.0").exists()
    assert not (node.shm_dir / "trash" / "y").exists()
    ds = KSpeedFolder(str(src), nodes=node.env()["KSPEEDFS_NODES"], token=str(token_file))
    assert sum(wrong_bytes(bytes(ds.read(rel)), data) for rel, data in files.items()) == 0
    for name in ("src", "mem"):
        done = run_cli("unload", name, env=node.env())
        assert done.returncode == 0, done.stderr
    assert sealed_beneath(node.shm_dir) == [] and sealed_beneath(tmp_path / "disk") == []
    # A node killed with its datasets loaded: the harness's cleanup removes them all.
    done = run_cli("preload", str(src), "--name", "again", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    assert sealed_beneath(node.shm_dir)
    node.kill9()
    from kspeedfs.testing.node import remove_tree

    remove_tree(node.shm_dir)
    assert not node.shm_dir.exists()


def test_a_damaged_segment_is_fetched_again_from_the_replica_on_another_node(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """Two nodes, two copies on their disk tiers, the source gone: a flip below the flag on
    one node's segment is found by its scrubber and fetched again from the other node."""
    cluster = etcd_cluster
    for i in range(2):
        node = NodeProcess(
            cluster.root / f"node{i}",
            cluster.token_file,
            tmp_path,
            memory="8MiB",
            extra=("--spill-dir", str(tmp_path / f"disk{i}"), "--spill", "64MiB"),
            base_env={**cluster.base_env(), "KSPEEDFS_SCRUB_RATE": "64MiB"},
        )
        cluster.nodes.append(node.start())
    wait_for(lambda: list(cluster.members().values()) == ["up"] * 2, what="2 members up")
    src = tmp_path / "src"
    files = make_source(src, 24, 120_000)
    flags = ("--name", "rep", "--replicas", "2", "--tier", "disk", "--max-memory", "4KiB", "-q")
    done = run_cli("preload", str(src), *flags, env=cluster.client_env())
    assert done.returncode == 0, done.stderr
    victim, other = cluster.nodes
    record = listing(victim)["rep"]
    assert len(record["disk"]) == record["segments"] == len(listing(other)["rep"]["disk"])
    os.rename(src, tmp_path / "gone")  # the other node's copy is the only good one left
    seg = record["disk"][-1]
    path = tmp_path / "disk0" / "tier" / f"rep.{record['uuid']}" / "seg" / f"{seg:08d}"
    damage(path, "flip", 0.5, below_the_flag=True)
    wait_for(lambda: integrity(victim)["repaired"] >= 1, timeout=60, what="the repair")
    found = integrity(victim)
    assert found["damaged"] == found["repaired"] == 1, found
    assert found["from_source"] == 0 and found["repair_failed"] == 0, found
    assert not segment_fault(path, *sizes(victim, record, seg))
    if can_seal(tmp_path):
        assert str(path) in sealed_beneath(tmp_path / "disk0")
    fs = fsspec.filesystem(
        "kspeedfs", nodes=victim.address, token=str(cluster.token_file), skip_instance_cache=True
    )
    wrong = 0
    for rel, data in files.items():
        with fs.open(f"rep/{rel}", "rb") as f:
            wrong += wrong_bytes(f.read(), data)
    assert wrong == 0
