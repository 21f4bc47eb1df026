"""Three node daemons, a real FUSE mount and torchvision ImageFolder: every byte equals the
source's; kill -9 a node mid-epoch (replica, then source, then EIO); a restarted node rejoins."""

from __future__ import annotations

import errno
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from clusterutil import Cluster, held_on_disk, running
from conftest import MountProcess, NodeProcess, wait_for
from torchvision import datasets, transforms

from kspeedfs.client.nodepool import DOWN_FOR_S
from kspeedfs.format import placement
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.format.manifest import Manifest
from kspeedfs.sample import make_sample

pytestmark = pytest.mark.fuse

FIXED = transforms.Compose(
    [transforms.Resize(40), transforms.CenterCrop(32), transforms.ToTensor()]
)


@pytest.fixture
def cluster(token_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    # 32 KiB segments: ~12 KiB images two to a segment, so ~30 segments over 3 nodes.
    with running(Cluster(token_file, tmp_path, segment_size="32KiB")) as c:
        yield c


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """Dataset root holding train/ with 4 classes of 15 JPEGs."""
    make_sample(tmp_path / "imagenet" / "train", classes=4, per_class=15, file_size=12 * 1024)
    return tmp_path / "imagenet"


def mount(cluster: Cluster, tmp_path: Path, mounts: list[MountProcess], name: str) -> Path:
    """A mount that runs "on" node 0: node 0's segments from shm, the others' over TCP."""
    m = MountProcess(tmp_path / name, cluster.env(local=cluster.nodes[0]), tmp_path)
    mounts.append(m)
    return m.start().mountpoint


def file_bytes(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, root)] = fh.read()
    return out


def read_uncached(path: Path) -> bytes:
    """Read a file through the daemon, not the kernel's page cache (the mount keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def mount_stats(mountpoint: Path) -> dict[str, int]:
    """Where the mount's cluster reads were served from: local, remote, source."""
    stats: dict[str, int] = json.loads(os.getxattr(mountpoint, "user.kspeedfs.sources"))
    return stats


def owners_of_files(node: NodeProcess, name: str) -> dict[str, set[str]]:
    """Relative path -> the nodes that hold its segments, from the manifest and placement."""
    m = Manifest(node.shm_dir / "datasets" / name / MANIFEST_FILE)
    where = placement.Placement(name, m.segments, m.header["members"], int(m.header["replicas"]))
    out = {}
    for i in m.iter_files():
        segs = {seg for seg, _, _ in m.ranges(i)}
        holders = {n for seg in segs for n in where.owners(seg)}
        out[os.fsdecode(m.path(i))] = holders
    return out


def best_owner_of_files(node: NodeProcess, name: str) -> dict[str, str]:
    m = Manifest(node.shm_dir / "datasets" / name / MANIFEST_FILE)
    where = placement.Placement(name, m.segments, m.header["members"], int(m.header["replicas"]))
    return {os.fsdecode(m.path(i)): where.owners(m.ranges(i)[0][0])[0] for i in m.iter_files()}


def test_imagefolder_reads_both_datasets_spread_over_three_nodes(
    cluster: Cluster, images: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    cluster.preload(images, "one", replicas=1)
    cluster.preload(images, "two", replicas=2, via=cluster.nodes[2])
    for name, replicas in (("one", 1), ("two", 2)):
        held = [held_on_disk(n, name) for n in cluster.nodes]
        assert all(held), f"{name}: some node holds nothing: {held}"
        assert sum(len(h) for h in held) == replicas * len(set().union(*map(set, held)))
    mnt = mount(cluster, tmp_path, mounts, "mnt")
    source = file_bytes(images)
    assert len(source) == 60
    for name in ("one", "two"):
        assert file_bytes(mnt / name) == source, name
    src = datasets.ImageFolder(str(images / "train"), transform=FIXED)
    for name in ("one", "two"):
        served = datasets.ImageFolder(str(mnt / name / "train"), transform=FIXED)
        assert served.classes == src.classes and served.targets == src.targets
        assert [os.path.relpath(p, mnt / name) for p, _ in served.samples] == [
            os.path.relpath(p, images) for p, _ in src.samples
        ]
        for i in range(len(src)):
            assert torch.equal(served[i][0], src[i][0]), f"{name}: sample {i} differs"
    stats = mount_stats(mnt)
    # Node 0's segments came from shared memory, the others' over TCP, none from the source.
    assert stats.get("remote", 0) > 0, stats
    assert stats.get("source", 0) == 0, stats


def test_kill9_mid_epoch_replicas_serve_every_read(
    cluster: Cluster, images: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    cluster.preload(images, "two", replicas=2)
    local = cluster.nodes[0]
    # The victim is the node that reads of remote-only files go to first, so they must fail over.
    remote_only = [
        p for p, holders in owners_of_files(local, "two").items() if local.address not in holders
    ]
    firsts = [best_owner_of_files(local, "two")[p] for p in remote_only]
    assert firsts, "placement put no segment on the two other nodes only; nothing to test"
    victim = next(n for n in cluster.nodes if n.address == max(set(firsts), key=firsts.count))
    source = file_bytes(images)
    # With the source gone, every read after the kill can only come from a replica.
    images.rename(tmp_path / "moved-away")
    mnt = mount(cluster, tmp_path, mounts, "mnt")
    epoch = datasets.ImageFolder(str(mnt / "two" / "train"), loader=read_uncached)
    order = list(range(len(epoch)))
    random.Random(7).shuffle(order)
    for step, i in enumerate(order):
        if step == len(order) // 2:
            victim.kill9()
        data, _target = epoch[i]
        assert data == source[os.path.relpath(epoch.samples[i][0], mnt / "two")], i
    # A second epoch: every file again, now all with the victim down.
    for path, data in source.items():
        assert read_uncached(mnt / "two" / path) == data, path
    stats = mount_stats(mnt)
    assert stats.get("source", 0) == 0, stats
    assert stats.get("remote", 0) >= len(remote_only), stats
    assert os.path.ismount(mnt)


def test_kill9_replicas1_source_then_eio_then_the_node_rejoins(
    cluster: Cluster, images: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    cluster.preload(images, "one", replicas=1)
    local = cluster.nodes[0]
    best = best_owner_of_files(local, "one")
    others = cluster.nodes[1:]
    victim = max(others, key=lambda n: sum(1 for o in best.values() if o == n.address))
    on_victim = sorted(p for p, o in best.items() if o == victim.address)
    elsewhere = sorted(p for p, o in best.items() if o != victim.address)
    assert on_victim and elsewhere
    uuid = cluster.listing(victim)["one"]["uuid"]
    source = file_bytes(images)
    mnt = mount(cluster, tmp_path, mounts, "mnt") / "one"
    for path in elsewhere[: len(elsewhere) // 2]:
        assert read_uncached(mnt / path) == source[path]
    victim.kill9()
    for path in sorted(source):
        assert read_uncached(mnt / path) == source[path], path
    before = mount_stats(mnt.parent)
    assert before.get("source", 0) >= len(on_victim), before

    # No copy and no source: EIO for the victim's files, the rest still served, mount up.
    moved = images.rename(tmp_path / "moved-away")
    for path in on_victim:
        with pytest.raises(OSError) as exc:
            read_uncached(mnt / path)
        assert exc.value.errno == errno.EIO, path
    for path in elsewhere:
        assert read_uncached(mnt / path) == source[path], path
    assert os.path.ismount(mnt.parent)
    assert sorted(os.listdir(mnt.parent)) == ["one"]

    # Restart: the node finds its segments in shared memory and serves them, no reload.
    victim.start()
    assert "found dataset one" in victim.log()
    assert cluster.listing(victim)["one"]["uuid"] == uuid
    assert held_on_disk(victim, "one")

    def victim_files_served() -> bool:
        try:
            return all(read_uncached(mnt / p) == source[p] for p in on_victim)
        except OSError:
            return False  # still marked down in the mount: reads go to the (gone) source

    wait_for(victim_files_served, timeout=DOWN_FOR_S + 20, what="the restarted node to serve")
    after = mount_stats(mnt.parent)
    assert after.get("remote", 0) > before.get("remote", 0), (before, after)
    moved.rename(images)
