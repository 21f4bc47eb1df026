"""One memory budget: read-through data evicted LRU (to a spill folder when set), pinned data
kept. The nodes here run `--eviction lru`: tests/system/test_eviction_over_epochs.py compares the
policies."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, run_cli
from rt_util import (
    cache_status,
    deleted_maps,
    file_count,
    mount_source,
    shm_bytes,
    write_files,
)

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # read-through data filled and evicted

BUDGET = 6 << 20
PAGE = 4096


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[type[NodeProcess]]:
    """Start nodes with a 6 MiB budget, LRU (and extra flags); all stopped and cleaned
    afterwards."""
    made: list[NodeProcess] = []

    def start(*extra: str) -> NodeProcess:
        shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
        n = NodeProcess(
            shm, token_file, tmp_path, memory=str(BUDGET), extra=("--eviction", "lru", *extra)
        )
        made.append(n)
        return n.start()

    yield start  # type: ignore[misc]
    for n in made:
        n.stop()
        shutil.rmtree(n.shm_dir, ignore_errors=True)


def within_budget(node: NodeProcess) -> bool:
    # The budget counts bytes; tmpfs hands out whole pages (one partial page a file at most).
    return shm_bytes(node.shm_dir) <= BUDGET + PAGE * file_count(node.shm_dir)


def test_reading_more_than_the_budget_evicts_and_keeps_pinned_data(
    make_node, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    node = make_node()
    pinned_src = tmp_path / "pinned"
    write_files(pinned_src, 3, 500_000)
    done = run_cli("preload", str(pinned_src), "--name", "pinned", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    pinned_files = sorted((node.shm_dir / "datasets" / "pinned" / "seg").iterdir())

    src = tmp_path / "big"
    files = write_files(src, 16, 700_000)  # one file a segment: 16 segments, 11 MB
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        assert (m.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    st = cache_status(node, "big")
    assert st["evictions"] > 0
    assert 0 < st["in_memory"] < st["segments"] == 16
    pinned = cache_status(node, "pinned")
    assert pinned["in_memory"] == pinned["segments"] == len(pinned_files)
    assert sorted((node.shm_dir / "datasets" / "pinned" / "seg").iterdir()) == pinned_files
    # Evicted segments are not kept alive by the mount's maps: their memory really returned.
    assert deleted_maps(m.proc.pid, node.shm_dir) == []  # type: ignore[union-attr]

    # Read back (from the source: no spill folder) through a fresh mount, still within budget.
    again = mount_source(node, tmp_path, mounts, src, mnt="mnt2")
    for rel in sorted(files):
        assert (again.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    assert cache_status(node, "big")["fills_source"] > 16
    assert cache_status(node, "pinned")["in_memory"] == len(pinned_files)


def spilling_node(
    make_node: Callable[..., NodeProcess], tmp_path: Path
) -> tuple[NodeProcess, Path, Path, dict[str, bytes]]:
    """A node with a 16 MiB spill folder, and a source of 16 files of 700,000 bytes (about
    11 MiB): the node, its spill folder, the source and the files' bytes by name."""
    spill = tmp_path / "spill"
    node = make_node("--spill-dir", str(spill), "--spill", "16MiB")
    src = tmp_path / "big"
    return node, spill, src, write_files(src, 16, 700_000)


def test_evicted_segments_are_read_back_from_the_spill_folder(
    make_node, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    node, spill, src, files = spilling_node(make_node, tmp_path)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        assert (m.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    st = cache_status(node, "big")
    assert st["evictions"] > 0
    assert st["on_spill"] == st["evictions"]  # every evicted segment went to disk
    assert st["in_memory"] + st["on_spill"] == 16
    assert shm_bytes(spill) <= 16 << 20

    again = mount_source(node, tmp_path, mounts, src, mnt="mnt2")
    for rel in sorted(files):
        assert (again.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    st2 = cache_status(node, "big")
    assert st2["fills_spill"] > 0
    assert st2["source_reads"] == st["source_reads"]  # nothing read from the source again
    done = run_cli("status", env=node.env())
    assert done.returncode == 0, done.stderr
    assert f"in {spill}" in done.stdout


def test_a_refresh_carries_the_unchanged_spilled_segments_and_never_the_old_bytes(
    make_node, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """Spilled segments are the disk tier's, in their instance's folder: a refresh links the
    unchanged ones into the new instance's folder (read back from there, not the source), the
    changed file's segment is read from the source, and the old folder goes."""
    node, spill, src, files = spilling_node(make_node, tmp_path)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        assert (m.mountpoint / rel).read_bytes() == files[rel]
    st = cache_status(node, "big")
    assert st["on_spill"] > 0 and st["in_memory"] + st["on_spill"] == 16
    changed = sorted(files)[0]
    files[changed] = bytes(reversed(files[changed]))
    (src / changed).write_bytes(files[changed])
    done = node.request("refresh", name="big")
    assert done["state"] == "refreshed" and done["changed"] == 1 and done["kept"] == 15, done
    record = next(d for d in node.request("list")["datasets"] if d["name"] == "big")
    folders = [f.name for f in (spill / "tier").iterdir() if f.name.startswith("big.")]
    assert folders == [f"big.{record['uuid']}"]  # the old instance's copies went with it

    again = mount_source(node, tmp_path, mounts, src, mnt="mnt2")
    for rel in sorted(files):
        assert (again.mountpoint / rel).read_bytes() == files[rel]
    st2 = cache_status(node, "big")
    assert st2["fills_spill"] > st["fills_spill"]
    assert st2["source_reads"] == st["source_reads"] + 1  # the changed file's segment only


def test_spill_budget_is_kept(make_node, tmp_path: Path, mounts: list[MountProcess]) -> None:
    spill = tmp_path / "spill"
    node = make_node("--spill-dir", str(spill), "--spill", "2MiB")
    src = tmp_path / "big"
    files = write_files(src, 16, 700_000)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        assert (m.mountpoint / rel).read_bytes() == files[rel]
        assert shm_bytes(spill) <= 2 << 20
    st = cache_status(node, "big")
    assert st["evictions"] > 2
    assert 0 < st["on_spill"] <= 2
    status = node.request("status")["cache"]["spill"]
    assert status["used"] <= status["budget"] == 2 << 20


def test_a_preload_makes_room_by_evicting_read_through_data(
    make_node, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    node = make_node()
    src = tmp_path / "big"
    files = write_files(src, 16, 700_000)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        (m.mountpoint / rel).read_bytes()
    held = cache_status(node, "big")["in_memory"]
    pinned_src = tmp_path / "pinned"
    write_files(pinned_src, 4, 700_000)
    done = run_cli("preload", str(pinned_src), "--name", "pinned", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    assert cache_status(node, "pinned")["in_memory"] == 4
    assert cache_status(node, "big")["in_memory"] < held
    assert within_budget(node)
    # And the read-through dataset still reads right, around the pinned data.
    again = mount_source(node, tmp_path, mounts, src, mnt="mnt2")
    for rel in sorted(files):
        assert (again.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    assert cache_status(node, "pinned")["in_memory"] == 4


def test_pinned_data_filling_the_budget_leaves_reads_to_the_source(
    make_node, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    node = make_node()
    pinned_src = tmp_path / "pinned"
    write_files(pinned_src, 8, 700_000)  # 8 of the 6 MiB budget's segments: about 5.6 MB
    done = run_cli("preload", str(pinned_src), "--name", "pinned", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    src = tmp_path / "big"
    files = write_files(src, 4, 700_000)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in sorted(files):
        assert (m.mountpoint / rel).read_bytes() == files[rel]
        assert within_budget(node)
    assert cache_status(node, "big")["in_memory"] == 0
    assert cache_status(node, "pinned")["in_memory"] == 8
    assert "no room" in m.log()  # why it reads the source, said once in the mount's log
