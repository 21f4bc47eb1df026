"""What the tiers look like from outside: `ls` per tier over the cluster, copies of disk-tier
segments read with pread (maps kept for views), and fast-path reads of read-through datasets
counted by the node.

Real node daemons on 127.0.0.1 with small budgets and disk tiers, real readers in this process
and in DataLoader workers, the node's own `status` and `/metrics`.
"""

from __future__ import annotations

import json
import os
import random
import stat
import time
import urllib.request
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from clusterutil import Cluster, running
from conftest import NodeProcess, free_port, run_cli, wait_for
from hypothesis import given, settings
from prometheus_client.parser import text_string_to_metric_families

from kspeedfs.client import admin
from kspeedfs.client.dataset_reader import CacheRef, Reader
from kspeedfs.format import localdata
from kspeedfs.format.contract.node import DatasetEntry
from kspeedfs.format.errors import DataError, KSpeedError
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.sealing import sealed_beneath
from kspeedfs.format.units import format_size
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.testing.node import NO_IMMUTABLE, can_seal
from pytorch_ext import KSpeedFolder

KiB, MiB = 1 << 10, 1 << 20


def make_source(root: Path, files: int, size: int, seed: int = 0) -> dict[str, bytes]:
    """`files` random files of `size` bytes each, in a few folders."""
    rng = random.Random(seed)
    made = {}
    for i in range(files):
        rel = f"d{i % 3}/f{i:04d}.bin"
        data = rng.randbytes(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        made[rel] = data
    return made


def shm_node(tmp_path: Path, token_file: Path, *extra: str, **kw: Any) -> NodeProcess:
    shm = Path("/dev/shm") / f"kspeedfs-test-{os.urandom(5).hex()}"
    return NodeProcess(shm, token_file, tmp_path, extra=extra, **kw)


def ls_json(env: dict[str, str]) -> dict[str, dict]:
    done = run_cli("ls", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return {d["name"]: d for d in json.loads(done.stdout)}


def ls_row(env: dict[str, str], name: str) -> dict[str, str]:
    """The row of `name` in `ls`, by column (cells are cut at the header's column starts)."""
    done = run_cli("ls", env=env)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    columns = header.split()
    starts = [header.index(c) for c in columns] + [None]
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:], strict=False)]
        if cells[0] == name:
            return dict(zip(columns, cells, strict=True))
    raise AssertionError(f"no row of {name} in:\n{done.stdout}")


def test_ls_sums_each_tier_over_the_members_and_marks_one_that_does_not_answer(
    tmp_path: Path, token_file: Path
) -> None:
    """Three nodes, one with memory for a few segments (the rest of its share on its disk
    tier): MEMORY and DISK are the sums of the members' own figures; one member killed, `ls`
    still answers, its sums marked."""
    cluster = Cluster(token_file, tmp_path, size=3, segment_size="256KiB", memory="64MiB")
    small = cluster.nodes[2]
    small.memory = "1MiB"
    for i, n in enumerate(cluster.nodes):
        n.extra += ("--spill-dir", str(tmp_path / f"disk{i}"), "--spill", "64MiB")
    src = tmp_path / "src"
    make_source(src, 48, 200_000)  # about 9 MiB: 3 MiB a member, 2 of them on small's disk
    with running(cluster):
        cluster.preload(src, "spread")

        def tiers() -> dict[str, dict]:
            return {n.address: cluster.listing(n)["spread"] for n in cluster.nodes}

        seg_len = Manifest(small.shm_dir / "datasets" / "spread" / MANIFEST_FILE).seg_len

        def settled() -> bool:  # small's promotions done: no segment on its disk fits memory
            status = small.request("status")  # before the listing: a free figure never too low
            on_disk = cluster.listing(small)["spread"]["disk"]
            free = status["budget"] - status["used"]
            return not status["loading"] and all(seg_len[seg] > free for seg in on_disk)

        wait_for(settled, what="the promotions to end")
        own = tiers()
        assert all(d["stored"] > 0 for d in own.values()), own
        assert own[small.address]["disk_stored"] > MiB, own[small.address]
        memory = sum(d["stored"] for d in own.values())
        disk = sum(d["disk_stored"] for d in own.values())
        asked = cluster.nodes[0].address
        assert own[asked]["stored"] < memory  # the node asked holds only its part

        shown = ls_json(cluster.env())["spread"]
        assert (shown["memory_bytes"], shown["disk_bytes"]) == (memory, disk)
        assert shown["unanswered"] == []
        assert shown["member_bytes"] == {
            a: {"memory_bytes": d["stored"], "disk_bytes": d["disk_stored"]} for a, d in own.items()
        }
        row = ls_row(cluster.env(), "spread")
        assert (row["MEMORY"], row["DISK"]) == (format_size(memory), format_size(disk)), row

        small.kill9()
        shown = ls_json(cluster.env())["spread"]
        assert shown["unanswered"] == [small.address]
        assert "error" in shown["member_bytes"][small.address]
        rest = [d for a, d in own.items() if a != small.address]
        assert shown["memory_bytes"] == sum(d["stored"] for d in rest)
        assert shown["disk_bytes"] == sum(d["disk_stored"] for d in rest)
        row = ls_row(cluster.env(), "spread")
        assert row["MEMORY"] == format_size(shown["memory_bytes"]) + "?", row
        assert row["DISK"] == format_size(shown["disk_bytes"]) + "?", row


def open_reader(node: NodeProcess, name: str) -> Reader:
    """This process's reader of dataset `name` (the node is local: its segments are mapped)."""
    info = DatasetEntry.from_wire(_listed(node, name))
    return Reader(CacheRef(node.settings(), name, info.uuid, info.source, info, None))


def _listed(node: NodeProcess, name: str) -> dict:
    return next(d for d in node.request("list")["datasets"] if d["name"] == name)


def maps_under(folder: Path) -> list[str]:
    """This process's maps of files under `folder`."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(folder) in line]


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
def test_disk_segments_are_read_by_pread_unless_sealed_and_an_old_instance_fails(
    tmp_path: Path,
    token_file: Path,
    nodes: list[NodeProcess],
    monkeypatch: pytest.MonkeyPatch,
    sealed: bool,
) -> None:
    """A node without CAP_LINUX_IMMUTABLE (unsealed): disk segments are read by pread, never
    mapped. A node with it (root): every segment it published is sealed (the immutable flag:
    nobody can cut one short), and disk ones are mapped as memory ones are."""
    if sealed and not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and a filesystem with the immutable flag")
    # Fewer open segment files than the dataset has disk segments: the oldest are let go.
    monkeypatch.setattr(localdata, "OPEN_DISK_FILES", 2)
    disk_dir = tmp_path / "disk"
    node = shm_node(
        tmp_path,
        token_file,
        "--spill-dir",
        str(disk_dir),
        "--spill",
        "64MiB",
        memory="1MiB",
        wrapper=() if sealed else NO_IMMUTABLE,
    )
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 30, 150_000)
    files["big.bin"] = random.Random(3).randbytes(int(2.5 * MiB))  # spans the 1 MiB segments
    (src / "big.bin").write_bytes(files["big.bin"])
    done = run_cli("preload", str(src), "--name", "d", "--tier", "disk", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    assert _listed(node, "d")["disk_stored"] > 4 * MiB, _listed(node, "d")

    reader = open_reader(node, "d")
    m = reader.manifest
    entries = {rel: m.resolve(os.fsencode(rel)) for rel in files}
    for rel, entry in entries.items():
        n = len(files[rel])
        out = bytearray(n)
        reader.gather([(entry, 0, n)], memoryview(out))
        assert out == files[rel], rel
        assert bytes(reader.scratch_view(entry)) == files[rel], rel
        assert reader.cluster.read(reader.handle, entry, 7, n) == files[rel][7:], rel
        assert bytes(reader.fetch([entry])[entry]) == files[rel], rel
    assert reader.cluster.stats["local"] > 0 and not reader.cluster.stats["source"]
    segments = sorted(disk_dir.glob("tier/*/seg/*")) + sorted(node.shm_dir.glob("*/*/seg/*"))
    assert len(segments) == m.segments
    if sealed:
        assert sorted(map(Path, sealed_beneath(disk_dir))) == sorted(disk_dir.glob("tier/*/seg/*"))
        in_memory = m.segments - len(sealed_beneath(disk_dir))
        assert len(sealed_beneath(node.shm_dir)) == in_memory + 1  # and the manifest
        for path in segments[:1] + segments[-1:]:  # a stray root process cannot cut one short
            for harm in (
                lambda p: os.truncate(p, 10),
                os.unlink,
                lambda p: os.open(p, os.O_WRONLY),
            ):
                with pytest.raises(PermissionError):
                    harm(path)
        assert maps_under(disk_dir)  # mapped: a view, as in memory
    else:
        assert sealed_beneath(disk_dir) == [] and sealed_beneath(node.shm_dir) == []
        assert maps_under(disk_dir) == []  # every copy was a pread: no segment mapped
        assert 0 < len(fds_under(disk_dir)) <= 2  # of the 7 segments read, 2 stay open

    spans = [e for e in entries.values() if len(m.ranges(e)) > 1]
    assert spans, "no file spans two segments"
    for rel, entry in entries.items():
        assert bytes(reader.view(entry)) == files[rel]  # a checked copy or a sealed map
    if not sealed:  # a map of a disk file cut short would kill us (SIGBUS)
        assert maps_under(disk_dir) == []
    preads_equal_source(_listed(node, "d")["path"], m.segments, src, m)

    # An instance's copies come from its own folders: loaded again from a changed source, a
    # reader of the old one gets an error for every file it had not read, never the new bytes.
    old = open_reader(node, "d")
    for rel in files:
        (src / rel).write_bytes(bytes(len(files[rel])))
    for args in (("unload", "d"), ("preload", str(src), "--name", "d", "--tier", "disk", "-q")):
        done = run_cli(*args, env=node.env())
        assert done.returncode == 0, done.stderr
    refused = 0
    for rel, entry in entries.items():
        out = bytearray(len(files[rel]))
        try:
            old.gather([(entry, 0, len(out))], memoryview(out))
        except KSpeedError:
            refused += 1
            continue
        assert out == files[rel], rel  # only ever the old instance's bytes
    assert refused == len(files)
    # The unload cleared the flags of what it removed: none of the old instance's is left.
    old_files = {str(p) for p in segments}
    assert not old_files & set(sealed_beneath(disk_dir) + sealed_beneath(node.shm_dir))


def fds_under(folder: Path) -> list[str]:
    """This process's open files (not folders) under `folder`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own)
        if target.startswith(str(folder.resolve())) and os.path.isfile(target):
            found.append(target)
    return found


def preads_equal_source(path: str, segments: int, src: Path, m: Manifest) -> None:
    """Any range of any segment, as a caller may ask: the pread copy is the source's bytes
    laid out as the manifest says, or both refuse it (DataError), and nothing else goes
    wrong."""
    preads = LocalDataset(path)
    stream = bytearray()
    for e in range(m.entries):
        if stat.S_ISREG(int(m.mode[e])) and int(m.size[e]):
            start = int(m.data[e])
            stream[len(stream) :] = bytes(start - len(stream))
            stream += (src / os.fsdecode(m.path(e))).read_bytes()

    @settings(max_examples=150, deadline=None)
    @given(
        seg=st.integers(-2, segments + 1),
        offset=st.one_of(st.integers(-3, 8), st.integers(0, 2 * MiB)),
        length=st.one_of(st.integers(0, 8), st.integers(0, 2 * MiB)),
    )
    def check(seg: int, offset: int, length: int) -> None:
        out = bytearray(length)
        inside = 0 <= seg < segments and offset >= 0 and offset + length <= m.seg_len[seg]
        try:
            preads.read_into(seg, offset, memoryview(out))
        except DataError:
            assert not inside
            return
        assert inside
        start = seg * m.segment_size + offset
        assert out == stream[start : start + length].ljust(length, b"\0")

    check()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_fast_path_reads_of_a_read_through_dataset_count_as_hits_on_the_node(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess]
) -> None:
    """Every file is one segment: the first epoch's reads are fills (misses); every later
    read, in this process or in two DataLoader workers, is a hit through the map, reported by
    the readers, and the node's `status` and `/metrics` count each once."""
    segment = 64 * KiB
    port = free_port()
    node = shm_node(
        tmp_path,
        token_file,
        "--metrics-listen",
        f"127.0.0.1:{port}",
        memory="32MiB",
        segment_size=str(segment),
    )
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 40, segment)
    admin.register_source(node.settings(), str(src), name="rt")
    ds = KSpeedFolder(str(src), objname="rt", nodes=node.address, token=str(token_file))
    index = {rel: i for i, rel in enumerate(ds.files)}
    for rel, data in files.items():  # the first epoch: every segment filled
        assert bytes(ds.read_index(index[rel])) == data

    def counted() -> dict:
        return node.request("status")["cache"]["datasets"]["rt"]

    wait_for(lambda: counted()["misses"] == len(files), what="a miss per file")
    assert counted()["hits"] == 0

    # Hits in this process just before the workers fork: theirs to report, not the workers'.
    by_index = {index[rel]: data for rel, data in files.items()}
    here = [random.Random(2).randrange(len(files)) for _ in range(50)]
    for i in here:
        assert bytes(ds.read_index(i)) == by_index[i]
    order = [random.Random(1).randrange(len(files)) for _ in range(300)]  # with repeats
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, num_workers=2, sampler=order, collate_fn=list
    )
    got = [bytes(a) for batch in loader for a in batch]
    assert got == [by_index[i] for i in order]

    reads = len(order) + len(here)
    wait_for(lambda: counted()["hits"] == reads, timeout=10, what=f"{reads} hits")
    # No read counted twice: a report more (every second at most) would come within this.
    time.sleep(1.5)  # under test: nothing to wait for but the time a report more takes
    status = counted()
    assert (status["hits"], status["misses"], status["memory_hits"]) == (reads, len(files), reads)
    metrics = scrape(port)
    assert metrics[("kspeedfs_readthrough_hits_total", (("dataset", "rt"),))] == reads
    tier = (("dataset", "rt"), ("tier", "memory"))
    assert metrics[("kspeedfs_readthrough_tier_hits_total", tier)] == reads
    assert metrics[("kspeedfs_readthrough_tier_misses_total", tier)] == len(files)
