"""Damage found by anyone is news to every reader on the machine before its next read.

A real node run as root (it seals its segments) with a dataset on its disk tier, and readers
that live through the damage, each of which read every file before it: a real mount (its
serving processes and the kernel's page cache), the fast path's views and copies, kspeedfs://
and the fast path over TCP (the node's own reads, as a reader on another machine gets them).
One byte of a disk-tier segment is flipped below the filesystem (the immutable flag cleared for
the write and set again: a failing disk), and those readers read the flipped file again before
anyone finds it (what they serve then is what they checked before: not counted). Then a first
finder (a new reader's report, the scrubber, a restart with `verify_on_start`) finds it, and
from then on every long-lived reader reads 0 wrong bytes, counted against the source.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import hypothesis.strategies as st
import pytest
from conftest import MountProcess, NodeProcess, wait_for
from disktier import (
    all_sound,
    damage,
    dataset_on_disk,
    disk_segment,
    integrity,
    read_in_a_new_process,
)
from hypothesis import HealthCheck, given, settings
from rt_util import read_uncached, wrong_bytes

from kspeedfs.testing.node import can_seal
from pytorch_ext import KSpeedFolder

pytestmark = pytest.mark.slow

HEARD = "found damaged: the kernel's pages"  # the mount's line once it dropped them


class LongLivedReaders:
    """One reader of each door, opened once and kept: `wrong(rels)` is the wrong bytes each
    door reads of files `rels`."""

    def __init__(self, node: NodeProcess, src: Path, token_file: Path, mount: MountProcess):
        env = node.env()
        nodes, token = env["KSPEEDFS_NODES"], str(token_file)
        self.fast = KSpeedFolder(str(src), nodes=nodes, token=token)
        self.tcp = KSpeedFolder(str(src), nodes=nodes, token=token, local=False)
        self.fs = fsspec.filesystem("kspeedfs", nodes=nodes, token=token, skip_instance_cache=True)
        self.mount = mount
        self.name = src.name

    def read(self, door: str, rel: str, past_the_page_cache: bool = False) -> bytes:
        reader = self.fast._reader
        if door == "view":
            return bytes(self.fast.read(rel))
        if door == "copy":
            entry = reader.manifest.resolve(os.fsencode(rel))
            return bytes(reader.fetch([entry])[entry])
        if door == "tcp":
            return bytes(self.tcp.read(rel))
        if door == "fsspec":
            with self.fs.open(f"{self.name}/{rel}", "rb") as f:
                data: bytes = f.read()
                return data
        path = self.mount.mountpoint / self.name / rel
        return read_uncached(path) if past_the_page_cache else path.read_bytes()

    def wrong(self, files: dict[str, bytes], rels: list[str]) -> dict[str, int]:
        return {
            door: sum(wrong_bytes(self.read(door, r), files[r]) for r in rels) for door in DOORS
        }


DOORS = ("mount", "view", "copy", "fsspec", "tcp")


def heard(mount: MountProcess, since: int = 0) -> set[int]:
    """The segments the mount dropped the kernel's pages of (damage news), in its log from
    byte `since`."""
    with open(mount.log_path, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    found: set[int] = set()
    for line in lines:
        if HEARD in line:
            found.update(int(k) for k in line.split("segments ")[1].split(" ")[0].split(","))
    return found


def flipped_segment(readers: LongLivedReaders, rel: str) -> tuple[int, int, int]:
    m = readers.fast._reader.manifest
    seg, off, n = m.ranges(m.resolve(os.fsencode(rel)))[0]
    return seg, off, n


def flip_in(tmp_path: Path, record: dict, readers: LongLivedReaders, rel: str) -> int:
    """Flip one byte of file `rel` where it lies on the disk tier, below the flag; its
    segment."""
    seg, off, n = flipped_segment(readers, rel)
    path = disk_segment(tmp_path, record, seg)
    assert damage(path, "flip", (off + n // 2) / path.stat().st_size, below_the_flag=True)
    return seg


def found_by_a_report(node: NodeProcess, src: Path, files: dict[str, bytes]) -> None:
    assert read_in_a_new_process(node, src, files) == 0  # it reads elsewhere, and reports
    assert integrity(node)["reported"] >= 1


def found_by_the_scrubber(node: NodeProcess, src: Path, files: dict[str, bytes]) -> None:
    wait_for(lambda: integrity(node)["damaged"] >= 1, what="the scrubber finding the flip")


def found_at_a_restart(node: NodeProcess, src: Path, files: dict[str, bytes]) -> None:
    node.stop()
    node.start()  # verify_on_start (the default)
    assert integrity(node)["damaged"] >= 1


@pytest.mark.parametrize(
    ("scrub_rate", "find"),
    [
        ("0", found_by_a_report),
        # Slow enough that the readers' reads before the find are served from their old checks.
        ("2MiB", found_by_the_scrubber),
        ("0", found_at_a_restart),
    ],
    ids=["report", "scrubber", "restart"],
)
def test_after_the_first_finder_no_reader_serves_the_flipped_byte(
    tmp_path: Path,
    token_file: Path,
    nodes: list[NodeProcess],
    mounts: list[MountProcess],
    scrub_rate: str,
    find: Callable[[NodeProcess, Path, dict[str, bytes]], None],
) -> None:
    """The case of the module's docstring, with `find` the first finder."""
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, scrub_rate)
    # One serving process: it has checked every file before the flip, so the read before the
    # find fills the kernel's page cache with the flipped byte (which only news drops).
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path, args=("--workers", "1"))
    mounts.append(mount.start())
    readers = LongLivedReaders(node, src, token_file, mount)
    rels = sorted(files)
    assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0)  # each checked every file
    victim = rels[len(rels) // 2]
    since = mount.log_path.stat().st_size
    seg = flip_in(tmp_path, record, readers, victim)
    early = {  # before anyone found it: what each checked before (not counted)
        door: wrong_bytes(readers.read(door, victim, past_the_page_cache=True), files[victim])
        for door in DOORS
    }
    find(node, src, files)
    wait_for(lambda: seg in heard(mount, since), what="the mount dropping the kernel's pages")
    assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0), early
    wait_for(lambda: all_sound(tmp_path, node, src.name), what="the segment fetched again")
    assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0)
    assert os.path.ismount(mount.mountpoint) and mount.proc is not None
    assert mount.proc.poll() is None


def test_every_flip_found_by_anyone_is_served_by_no_one_afterwards(
    tmp_path: Path, token_file: Path, nodes: list[NodeProcess], mounts: list[MountProcess]
) -> None:
    """Readers of every door read in the background while random disk-tier bytes are flipped
    below the flag; the finders are whoever comes first (those readers, a new reader, the
    scrubber). Every read that starts after the node counted every flip is right, and so is
    every read of every door once the mount dropped the kernel's pages."""
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    node, src, files, record = dataset_on_disk(tmp_path, token_file, nodes, "8MiB")
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(mount.start())
    readers = LongLivedReaders(node, src, token_file, mount)
    rels = sorted(files)
    assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0)
    reads: list[tuple[float, str, int]] = []  # (when it started, door, wrong bytes)
    stop = threading.Event()

    def keep_reading() -> None:
        while not stop.is_set():
            for door in ("view", "copy", "fsspec", "tcp"):
                for rel in rels:
                    started = time.monotonic()
                    reads.append((started, door, wrong_bytes(readers.read(door, rel), files[rel])))

    planted = 0

    @settings(
        max_examples=10,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        st.lists(
            st.tuples(st.integers(0, record["segments"] - 1), st.floats(0.0, 0.999)),
            min_size=1,
            max_size=3,
            unique_by=lambda flip: flip[0],
        ),
        st.booleans(),
    )
    def flipped_while_read(flips: list[tuple[int, float]], new_reader: bool) -> None:
        nonlocal planted
        since = mount.log_path.stat().st_size
        for seg, where in flips:
            path = disk_segment(tmp_path, record, seg)
            planted += damage(path, "flip", where, below_the_flag=True)
        if new_reader:
            read_in_a_new_process(node, src, files)  # (what it reads before it finds: not counted)
        wait_for(lambda: integrity(node)["damaged"] >= planted, what="every flip found")
        found_at = time.monotonic()
        flipped = {seg for seg, _ in flips}
        wait_for(lambda: flipped <= heard(mount, since), what="the mount dropping their pages")
        assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0)
        wait_for(lambda: all_sound(tmp_path, node, src.name), what="every segment fetched again")
        late = [(door, wrong) for started, door, wrong in list(reads) if started > found_at]
        assert late and sum(wrong for _, wrong in late) == 0, late

    reader = threading.Thread(target=keep_reading)
    reader.start()
    try:
        flipped_while_read()
    finally:
        stop.set()
        reader.join()
    assert readers.wrong(files, rels) == dict.fromkeys(DOORS, 0)
    assert integrity(node)["repair_failed"] == 0
