"""The read-through part of the disk tier (node/readthrough/disktier.py) in process, over a real
store with a disk tier: segments evicted from memory are spilled into the instance's disk
folder and counted in the disk budget by its places; a restart after a crash keeps whole
copies only; a refreshed (another) instance never sees the old one's spilled bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from kspeedfs.format.localdata import segment_path
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.nodefolders import MARKER
from kspeedfs.node.readthrough.build import InstanceBuilder
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances, file_checksum
from kspeedfs.node.readthrough.disktier import SPILL_DIR, DiskTier
from kspeedfs.node.readthrough.policy import make_policy
from kspeedfs.node.safedir import remove_beneath
from kspeedfs.node.store import TIER_DIR, SegmentStore
from kspeedfs.sources.source import open_source

SEG = 16 << 10  # one file a segment
FILES = 6


class Node:
    """A store with a disk tier and the read-through instances and disk tier over it, as a
    (re)started node builds them."""

    def __init__(self, work: Path, disk_budget: int = 1 << 30):
        self.work = work
        self.store = SegmentStore(
            work / "shm",
            1 << 30,
            disk_root=work / "spill" / TIER_DIR,
            disk_budget=disk_budget,
            events=DatasetEvents(),
        )
        self.store.recover(verify=False)
        self.instances = Instances(self.store, "127.0.0.1:1", make_policy("lru"))
        self.disk = DiskTier(self.store, self.instances)

    def publish(self) -> CachedDataset:
        src = open_source(str(self.work / "src"))
        builder = InstanceBuilder(self.store, SEG, "127.0.0.1:1")
        staging, meta, _ = builder.build("ds", src, src.scan(), None)
        ds, _ = self.instances.open(self.store.publish(staging, meta), False)
        self.instances.add(ds)
        return ds

    def restart(self) -> tuple[Node, CachedDataset]:
        """The same folders opened by a new node, as its cache recovers them."""
        node = Node(self.work, self.store.budgets.disk)
        (record,) = node.store.datasets.values()
        ds, _ = node.instances.open(record, True)
        node.disk.remove_old_spill()
        node.disk.recover(ds, verify=True)
        node.instances.add(ds)
        return node, ds


def fill(ds: CachedDataset, seg: int) -> bytes:
    """Segment `seg` in memory, as a fill leaves it."""
    data = os.urandom(ds.seg_len(seg))
    path = segment_path(ds.record.path, seg)
    path.write_bytes(data)
    ds.sums[seg] = file_checksum(path)
    ds.places.cached(seg)
    return data


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    (tmp_path / "src").mkdir()
    for i in range(FILES):
        (tmp_path / "src" / f"f{i}.bin").write_bytes(os.urandom(SEG))
    yield Node(tmp_path)
    for folder in ("shm", "spill"):
        remove_beneath(None, os.fspath(tmp_path / folder))


def test_a_spilled_segment_is_a_claim_on_the_disk_budget_in_the_instances_folder(
    node: Node,
) -> None:
    ds = node.publish()
    data = fill(ds, 2)
    assert trio.run(node.disk.spill, ds, 2)
    assert not trio.run(node.disk.spill, ds, 2)  # there already: nothing written
    assert set(ds.places.spilled) == {2} and 2 in ds.resident
    assert node.disk.spill_path(ds, 2).read_bytes() == data
    assert node.disk.spill_path(ds, 2).parent.parent == node.disk.folder(ds)
    assert node.store.budgets.disk_used() == ds.seg_len(2) == node.disk.spilled_bytes()
    node.disk.drop_spilled(ds, 2)
    assert node.store.budgets.disk_used() == 0 and not node.disk.spill_path(ds, 2).exists()


def test_the_spill_keeps_its_budget_dropping_the_least_recently_used(node: Node) -> None:
    small = Node(node.work, disk_budget=2 * SEG)
    ds = small.publish()
    for seg in range(3):
        fill(ds, seg)
        assert trio.run(small.disk.spill, ds, seg)
    assert set(ds.places.spilled) == {1, 2}  # 0 gave way
    assert small.store.budgets.disk_used() == 2 * SEG
    assert not small.disk.spill_path(ds, 0).exists()
    # A miss onto the disk tier takes the spill's room too: the spill keeps what it leaves.
    assert small.disk.claim(ds, 5)
    assert set(ds.places.spilled) == {2} and small.store.budgets.disk_used() == 2 * SEG


def test_a_restart_after_a_crash_keeps_whole_spilled_copies_only(node: Node) -> None:
    ds = node.publish()
    kept = {seg: fill(ds, seg) for seg in range(4)}
    for seg in kept:
        assert trio.run(node.disk.spill, ds, seg)
    folder = node.disk.folder(ds)
    spill = folder / SPILL_DIR
    # What a crash (or a hand) leaves: a copy half written, one cut short, one grown, junk.
    (folder / f".spill.{4:08d}.0123abcd").write_bytes(b"half")
    (spill / f"{1:08d}").write_bytes(kept[1][:-1])
    (spill / f"{2:08d}").write_bytes(kept[2] + b"x")
    (spill / "junk").write_bytes(b"junk")
    (spill / f"{FILES + 3:08d}").write_bytes(kept[0])  # out of range
    (node.work / "spill" / "ds.olduuid").mkdir()  # the spill folder's old layout
    (node.work / "spill" / "ds.olduuid" / f"{0:08d}").write_bytes(kept[0])

    after, ds2 = node.restart()

    assert set(ds2.places.spilled) == {0, 3}
    assert sorted(os.listdir(spill)) == [f"{0:08d}", f"{3:08d}"]
    assert sorted(os.listdir(folder)) == sorted(["seg", SPILL_DIR])
    assert sorted(os.listdir(node.work / "spill")) == sorted([TIER_DIR, MARKER])
    assert after.store.budgets.disk_used() == 2 * SEG
    assert (spill / f"{3:08d}").read_bytes() == kept[3]


def test_a_refreshed_instance_never_sees_the_old_ones_spilled_bytes(node: Node) -> None:
    old = node.publish()
    fill(old, 1)
    assert trio.run(node.disk.spill, old, 1)
    old_folder = node.disk.folder(old)
    node.store.unload("ds")
    node.instances.forget(old)
    assert not old_folder.exists()  # the spilled copies went with their instance
    assert node.store.budgets.disk_used() == 0
    new = node.publish()
    assert new.uuid != old.uuid and node.disk.folder(new) != old_folder
    assert dict(new.places.spilled) == {}
    assert not node.disk.spill_path(new, 1).exists()
    # Bytes planted under the new instance's name are not taken: they are not its fill's.
    (node.disk.folder(new) / SPILL_DIR).mkdir()
    node.disk.spill_path(new, 1).write_bytes(os.urandom(SEG))
    _, again = node.restart()
    assert dict(again.places.spilled) == {}


def test_a_refresh_carries_the_unchanged_spilled_copies_by_link(node: Node) -> None:
    old = node.publish()
    data = fill(old, 3)
    assert trio.run(node.disk.spill, old, 3)
    staging = node.disk.carry(old, {3: 0})
    assert staging is not None
    assert (staging / SPILL_DIR / f"{0:08d}").read_bytes() == data
    assert os.stat(staging / SPILL_DIR / f"{0:08d}").st_nlink == 2
    node.store.discard_disk_staging(staging)
