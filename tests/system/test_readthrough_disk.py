"""Read-through datasets on the disk tier, on real nodes with small budgets: what memory does
not keep under `stable` and `plan` lands on the disk tier, and later epochs read nothing
from the source; every byte compared with the source, through the fast path and the mount."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MountProcess, NodeProcess, preload, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_util import (
    cache_status,
    mount_source,
    policy_nodes,
    read_uncached,
    write_files,
    wrong_bytes,
)

from kspeedfs.client import admin
from kspeedfs.format.sealing import unseal_at
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.readthrough.build import InstanceBuilder
from kspeedfs.node.readthrough.dataset import (
    CachedDataset,
    Instances,
    file_checksum,
)
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.readthrough.policy import make_policy
from kspeedfs.node.safedir import unlink_file
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import open_source
from pytorch_ext import ClairvoyantSampler, KSpeedFolder

SEGMENT = 256 << 10
BUDGET = 8 << 20
FILES = 64  # of one segment each: 16 MiB, twice the budget
TOTAL = FILES * SEGMENT
EPOCHS = 3

StartNode = Callable[..., NodeProcess]
Files = dict[str, bytes]


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[StartNode]:
    """Nodes with an 8 MiB budget, 256 KiB segments, a policy and a disk tier of `disk`
    bytes (twice the budget by default); stopped and removed after."""
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as nodes:

        def start(policy: str, disk: int = 2 * BUDGET) -> NodeProcess:
            spill = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
            return nodes(policy, "--spill-dir", str(spill), "--spill", str(disk))

        yield start


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Files]:
    root = tmp_path / "src" / "big"
    return root, write_files(root, FILES, SEGMENT)


def disk_folders(node: NodeProcess) -> list[Path]:
    """The read-through instances' folders on the node's disk tier."""
    tier = Path(node.extra[node.extra.index("--spill-dir") + 1]) / "tier"
    return sorted(p for p in tier.iterdir() if not p.name.startswith("."))


def fast_epochs(
    node: NodeProcess, src: Path, files: Files, name: str, planned: bool, epochs: int = EPOCHS
) -> list[float]:
    """Shuffled epochs through the fast path (a ClairvoyantSampler's DataLoader, whose
    prefetcher sends the plan, or a seeded shuffle read file by file); the share of the
    dataset read from the source in each. Every byte is compared with the source."""
    admin.register_source(node.settings(), str(src), name=name)
    ds = KSpeedFolder(src, objname=name, nodes=node.address, token=node.token_file)
    wrong, shares = 0, []
    for epoch in range(epochs):
        before = int(cache_status(node, name)["source_bytes"])
        if planned:
            sampler = ClairvoyantSampler(ds, seed=7, depth=2)
            sampler.set_epoch(epoch)
            indices = list(sampler)
            loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=list)
            got = [sample for batch in loader for sample in batch]
        else:
            indices = list(np.random.default_rng(epoch).permutation(len(ds)))
            got = [ds[int(i)] for i in indices]
        for i, data in zip(indices, got, strict=True):
            wrong += wrong_bytes(data, files[ds.files[int(i)]])
        shares.append((int(cache_status(node, name)["source_bytes"]) - before) / TOTAL)
    assert wrong == 0
    return shares


@pytest.mark.parametrize("policy", ["stable", "plan"])
def test_a_dataset_twice_the_budget_reads_nothing_from_the_source_after_the_first_epoch(
    make_node: StartNode, source: tuple[Path, Files], policy: str
) -> None:
    src, files = source
    node = make_node(policy)
    shares = fast_epochs(node, src, files, "big", planned=policy == "plan")
    assert shares[0] == pytest.approx(1.0, abs=0.01), shares
    assert shares[1:] == [0.0] * (EPOCHS - 1), shares
    st = cache_status(node, "big")
    assert st["on_disk"] > 0 and st["resident_bytes"] + st["disk_bytes"] == TOTAL, st
    assert st["disk_misses"] == st["fills_disk"] == st["on_disk"] and st["bypassed"] == 0, st
    tier = node.request("status")["disk_tier"]
    assert tier["used"] == st["disk_bytes"], tier  # counted in the disk budget
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    (listed,) = [d for d in json.loads(done.stdout) if d["name"] == "big"]
    assert (listed["memory_bytes"], listed["disk_bytes"]) == (
        st["memory_bytes"],
        st["disk_bytes"],
    ), (listed, st)  # `ls` shows both tiers of a read-through dataset too

    node.request("unload", name="big")
    assert disk_folders(node) == []  # nothing left on disk
    wait_for(lambda: node.request("status")["disk_tier"]["used"] == 0, what="claims freed")


def test_with_the_disk_tier_too_small_the_rest_is_read_from_the_source(
    make_node: StartNode, source: tuple[Path, Files]
) -> None:
    src, files = source
    node = make_node("stable", disk=BUDGET // 2)
    shares = fast_epochs(node, src, files, "big", planned=False)
    st = cache_status(node, "big")
    kept = st["resident_bytes"] + st["disk_bytes"]
    assert st["disk_bytes"] <= BUDGET // 2 < st["disk_bytes"] + SEGMENT, st  # the tier is full
    for share in shares[1:]:
        assert share == pytest.approx(1 - kept / TOTAL, abs=0.01), (shares, st)
    assert st["bypassed"] > 0, st


@pytest.mark.fuse
def test_the_mount_reads_the_disk_tier_after_the_first_epoch(
    make_node: StartNode, source: tuple[Path, Files], tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src, files = source
    node = make_node("stable")
    m = mount_source(node, tmp_path, mounts, src, "--name", "big")
    names = sorted(files)
    wrong, shares = 0, []
    for epoch in range(EPOCHS):
        before = int(cache_status(node, "big")["source_bytes"])
        for i in np.random.default_rng(epoch).permutation(len(names)):
            rel = names[int(i)]
            wrong += wrong_bytes(read_uncached(m.mountpoint / rel), files[rel])
        shares.append((int(cache_status(node, "big")["source_bytes"]) - before) / TOTAL)
    assert wrong == 0
    assert shares[0] == pytest.approx(1.0, abs=0.01) and shares[1:] == [0.0, 0.0], shares
    assert cache_status(node, "big")["on_disk"] > 0


@pytest.mark.fuse
def test_a_source_changed_after_its_segments_landed_on_disk_is_refused_never_served(
    make_node: StartNode, source: tuple[Path, Files], tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """Segments on the disk tier serve the version listed; one lost from the disk is filled
    again, and then the changed source is refused (the fill fails with SourceChanged, the
    reader's own verified read with StaleDataset: EIO through a mount), never its new bytes.
    Read through a mount started afterwards: this process's maps would still hold the lost
    files' pages."""
    src, files = source
    node = make_node("stable")
    fast_epochs(node, src, files, "big", planned=False)
    for rel, data in files.items():
        (src / rel).write_bytes(bytes(len(data)))
    (folder,) = disk_folders(node)
    lost = sorted((folder / "seg").iterdir())[::2]
    for path in lost:
        unlink_file(path)  # lost below the immutable flag (the node seals what it fills)
    m = mount_source(node, tmp_path, mounts, src, "--name", "big")
    refused = wrong = 0
    for rel, data in files.items():
        try:
            wrong += wrong_bytes(read_uncached(m.mountpoint / rel), data)
        except OSError as e:
            assert e.errno == errno.EIO, e
            refused += 1
    assert wrong == 0
    assert refused == len(lost), (refused, len(lost))
    st = cache_status(node, "big")
    assert st["stale"] > 0 and st["on_disk"] == FILES - st["in_memory"] - len(lost), st


def test_a_refresh_keeps_the_unchanged_disk_segments_and_frees_the_old_ones(
    make_node: StartNode, source: tuple[Path, Files]
) -> None:
    """One file changed and the dataset refreshed: the new instance carries every other
    segment (memory and disk tier), the old disk folder and its claims go, and the next
    epoch reads only the changed file from the source, in its new version."""
    src, files = source
    node = make_node("stable")
    fast_epochs(node, src, files, "big", planned=False, epochs=1)
    (old_folder,) = disk_folders(node)
    changed = sorted(files)[0]
    files[changed] = os.urandom(SEGMENT)
    (src / changed).write_bytes(files[changed])
    done = node.request("refresh", name="big")
    assert done["state"] == "refreshed" and done["changed"] == 1, done
    assert done["kept"] == FILES - 1, done
    (folder,) = disk_folders(node)
    assert folder != old_folder
    st = cache_status(node, "big")
    assert st["resident_bytes"] + st["disk_bytes"] == TOTAL - SEGMENT, st
    assert len(os.listdir(folder / "seg")) == st["on_disk"] > 0
    assert node.request("status")["disk_tier"]["used"] == st["disk_bytes"]
    assert fast_epochs(node, src, files, "big", planned=False, epochs=1) == [SEGMENT / TOTAL]


def test_a_preload_takes_the_disk_tier_room_read_through_data_holds(
    make_node: StartNode, source: tuple[Path, Files], tmp_path: Path
) -> None:
    """Read-through segments on the disk tier give way to a preload's disk part, as its
    memory does to a preload's memory part; the read-through dataset still reads equal."""
    src, files = source
    node = make_node("stable")
    fast_epochs(node, src, files, "big", planned=False, epochs=1)
    before = cache_status(node, "big")["disk_bytes"]
    pinned = tmp_path / "pinned"
    write_files(pinned, 40, SEGMENT)  # 10 MiB: more than the disk tier has free
    done = run_cli("preload", str(pinned), "-q", "--tier", "disk", env=node.env())
    assert done.returncode == 0, done.stderr
    st = cache_status(node, "big")
    assert st["disk_evictions"] > 0 and st["disk_bytes"] == before - st["disk_evictions"] * SEGMENT
    tier = node.request("status")["disk_tier"]
    assert tier["used"] == 40 * SEGMENT + st["disk_bytes"] <= tier["budget"], tier
    (folder,) = (f for f in disk_folders(node) if f.name.startswith("big."))
    assert len(os.listdir(folder / "seg")) == st["on_disk"]
    share = fast_epochs(node, src, files, "big", planned=False, epochs=1)[0]
    assert share == st["disk_evictions"] * SEGMENT / TOTAL  # what the preload took, again


def test_a_restarted_node_keeps_its_sound_disk_tier_segments(
    make_node: StartNode, source: tuple[Path, Files]
) -> None:
    """Killed (-9) after an epoch and started again: the sound disk segments it finds count
    again; an unfinished fill, a file of no segment and a segment cut short are removed, and
    the next epoch reads only that one from the source."""
    src, files = source
    node = make_node("stable")
    fast_epochs(node, src, files, "big", planned=False, epochs=1)
    on_disk = cache_status(node, "big")["disk_bytes"]
    (folder,) = disk_folders(node)
    (folder / ".fill.00000001.deadbeef").write_bytes(b"unfinished")
    (folder / "seg" / "junk").write_bytes(b"junk")
    (folder / "seg" / f"{FILES + 5:08d}").write_bytes(bytes(SEGMENT))
    cut = sorted((folder / "seg").glob("0*"))[0]
    # Replaced, not truncated: this process maps the file (a cut mapped file is SIGBUS).
    (folder / "short").write_bytes(cut.read_bytes()[: SEGMENT // 2])
    unseal_at(None, os.fspath(cut))  # (below the immutable flag the node sets)
    os.rename(folder / "short", cut)
    node.kill9()
    node.start()
    st = cache_status(node, "big")
    assert st["disk_bytes"] == on_disk - SEGMENT, st
    assert st["resident_bytes"] + st["disk_bytes"] == TOTAL - SEGMENT, st
    assert node.request("status")["disk_tier"]["used"] == st["disk_bytes"]
    assert sorted(os.listdir(folder)) == ["seg"]  # the unfinished fill is gone
    assert len(os.listdir(folder / "seg")) == st["on_disk"]
    # This process still maps the old file; a reader that asks gets it filled again.
    uid = folder.name.split(".")[-1]
    filled = node.request("fill", name="big", segment=int(cut.name), uuid=uid, length=SEGMENT)
    assert filled["state"] == "cached", filled
    assert cut.stat().st_size == SEGMENT and cache_status(node, "big")["source_bytes"] == SEGMENT
    assert fast_epochs(node, src, files, "big", planned=False, epochs=1) == [0.0]


def test_disk_segments_move_to_memory_when_it_frees_up(
    make_node: StartNode, source: tuple[Path, Files], tmp_path: Path
) -> None:
    """A preload pins half the budget, so the read-through dataset keeps a quarter of itself
    in memory and the rest on disk; once the preload is unloaded its disk segments move
    into the memory freed (as many as fit), and the next epoch still reads every byte equal
    and nothing from the source."""
    src, files = source
    node = make_node("stable")
    pinned = tmp_path / "pinned"
    write_files(pinned, 16, SEGMENT)
    preload(node, pinned, "pinned")
    fast_epochs(node, src, files, "big", planned=False, epochs=1)
    before = cache_status(node, "big")
    assert before["resident_bytes"] < BUDGET // 2 < before["disk_bytes"], before

    node.request("unload", name="pinned")
    seen: list[dict[str, Any]] = []

    def moved_all_that_fit() -> bool:
        """The Promoter's stopping point (the next segment does not fit, or none is left on
        disk), no move under way (its reservation is memory used beyond the dataset's, which
        is otherwise its few KiB of metadata) and the last one counted: before that, the
        counts are of a move half made."""
        seen.append(node.request("status"))
        used, big = seen[-1]["used"], seen[-1]["cache"]["datasets"]["big"]
        full = BUDGET - used < SEGMENT or big["disk_bytes"] == 0
        idle = used - big["resident_bytes"] < SEGMENT
        counted = big["resident_bytes"] == before["resident_bytes"] + big["promoted"] * SEGMENT
        return full and idle and counted

    wait_for(moved_all_that_fit, what="the promotions")
    status = seen[-1]
    after = status["cache"]["datasets"]["big"]
    assert after["promoted"] >= 15, after
    moved = after["promoted"] * SEGMENT  # in memory as many bytes more: the wait saw to that
    assert after["disk_bytes"] == before["disk_bytes"] - moved, after
    assert status["used"] <= BUDGET
    assert status["disk_tier"]["used"] == after["disk_bytes"]
    (folder,) = disk_folders(node)
    assert len(os.listdir(folder / "seg")) == after["on_disk"]
    assert fast_epochs(node, src, files, "big", planned=False, epochs=1) == [0.0]


SMALL = 64 << 10  # segment size of the recovery cases
KINDS = ("good", "short", "long", "unsummed", "badsum")


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DiskTier, CachedDataset]]:
    """A real store with a disk tier and a read-through instance of 8 one-segment files,
    published as a node publishes one (its disk folder made and named in meta.json)."""
    work = tmp_path_factory.mktemp("recover")
    root = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    store = SegmentStore(
        root, 1 << 30, disk_root=work / "tier", disk_budget=1 << 30, events=DatasetEvents()
    )
    store.recover(verify=False)
    src = open_source(str(work / "src"))
    write_files(work / "src", 8, SMALL)
    staging, meta, _ = InstanceBuilder(store, SMALL, "127.0.0.1:1").build(
        "ds", src, src.scan(), None
    )
    instances = Instances(store, "127.0.0.1:1", make_policy("stable"))
    ds, _ = instances.open(store.publish(staging, meta), False)
    yield DiskTier(store, instances), ds
    shutil.rmtree(root, ignore_errors=True)


JUNK = st.text(alphabet="0123456789ab.-", min_size=1, max_size=10).filter(
    lambda n: n not in (".", "..") and not (len(n) == 8 and n.isdigit())
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.dictionaries(st.integers(0, 7), st.sampled_from(KINDS)),
    resident=st.sets(st.integers(0, 7)),
    junk=st.lists(JUNK, max_size=4, unique=True),
    beside=st.lists(JUNK, max_size=2, unique=True),
)
def test_recovery_keeps_exactly_the_sound_disk_segments(
    instance: tuple[DiskTier, CachedDataset],
    kinds: dict[int, str],
    resident: set[int],
    junk: list[str],
    beside: list[str],
) -> None:
    """Whatever a crash (or a hand) left in an instance's disk folder, a restarted node keeps
    the segments readers would find and whose bytes are the fill's (name NNNNNNNN, in range,
    of its size, matching its checksum, not in memory already), claims exactly those in the
    disk budget, and removes everything else."""
    disk, ds = instance
    folder = disk.folder(ds)
    for entry in [*folder.iterdir(), *(folder / "seg").iterdir()]:
        if entry.name != "seg":
            entry.unlink()
    ds.places.forget()
    ds.sums[:] = 0
    ds.places.found(resident, ds.base_bytes)
    for seg, kind in kinds.items():
        data = os.urandom({"short": SMALL - 1, "long": SMALL + 1}.get(kind, SMALL))
        path = folder / "seg" / f"{seg:08d}"
        path.write_bytes(data)
        if kind != "unsummed":
            ds.sums[seg] = file_checksum(path) ^ (kind == "badsum")
    for name in junk:  # a number's junk is a copy of that segment: only its name is wrong
        copy = folder / "seg" / f"{int(name):08d}" if name.isdigit() else folder / "none"
        (folder / "seg" / name).write_bytes(copy.read_bytes() if copy.exists() else b"junk")
    for name in beside:
        (folder / name).write_bytes(b"unfinished")

    disk.recover(ds, verify=True)

    sound = {seg for seg, kind in kinds.items() if kind == "good" and seg not in resident}
    assert sorted(os.listdir(folder)) == ["seg"]
    assert sorted(os.listdir(folder / "seg")) == sorted(f"{seg:08d}" for seg in sound)
    assert ds.on_disk == sound
    assert all(ds.places.claimed(seg) == (seg in sound) for seg in range(8))
    assert disk.store.budgets.disk_used() == len(sound) * SMALL
