"""Read-through mounts of a local folder: fill on first read, serve from memory after, snapshots."""

from __future__ import annotations

import errno
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, make_tree, run_cli, wait_for
from rt_util import EnvNode, cache_status, mount_source, read_uncached, write_files
from treeutil import walk

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # read-through fills, refreshes and node kills


def listing(node: NodeProcess) -> list[dict]:  # type: ignore[type-arg]
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_first_pass_fills_the_cache_second_reads_nothing_from_the_source(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    first = mount_source(node, tmp_path, mounts, tree)
    assert walk(first.mountpoint) == walk(tree)
    (entry,) = listing(node)
    assert (entry["name"], entry["lifetime"], entry["source"]) == ("src", "readthrough", str(tree))
    after_first = cache_status(node, "src")
    segments = after_first["segments"]
    assert segments >= 3  # the big file spans segments
    assert after_first["in_memory"] == segments
    assert after_first["misses"] == segments  # each segment fetched once
    assert after_first["source_reads"] > 0

    # A new mount (empty kernel cache) of the same source: served from the cache alone.
    second = mount_source(node, tmp_path, mounts, tree, mnt="mnt2")
    assert walk(second.mountpoint) == walk(tree)
    src_big = (tree / "big.bin").read_bytes()
    with open(second.mountpoint / "big.bin", "rb") as f:
        f.seek((1 << 20) - 7)
        assert f.read(20000) == src_big[(1 << 20) - 7 : (1 << 20) + 19993]
    wait_for(lambda: cache_status(node, "src")["hits"] > after_first["hits"], what="hit reports")
    after_second = cache_status(node, "src")
    assert after_second["source_reads"] == after_first["source_reads"]
    assert after_second["misses"] == after_first["misses"]
    assert len(listing(node)) == 1  # the second mount found the dataset, made none
    for m in (first, second):
        assert "degraded" not in m.log()


def test_concurrent_misses_fetch_each_segment_once(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "many"
    files = write_files(src, 96, 30_000, subdirs=3)  # about 3 segments of 1 MiB
    m = mount_source(node, tmp_path, mounts, src)
    names = sorted(files)
    got: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for rel in names[k::8] + names[:k:8]:
                got[rel] = (m.mountpoint / rel).read_bytes()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == files
    st = cache_status(node, "many")
    assert st["misses"] == st["fills_source"] == st["segments"] == st["in_memory"]
    assert st["source_reads"] == len(files)  # every source file read exactly once
    assert "degraded" not in m.log()


@pytest.fixture
def checking_node(token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    """A node that checks sources for changes every 0.2 s."""
    import shutil

    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    n = EnvNode(shm, token_file, tmp_path, env_extra={"KSPEEDFS_SOURCE_CHECK_INTERVAL": "0.2"})
    try:
        yield n.start()
    finally:
        n.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_changed_source_is_served_as_cached_shown_stale_and_refreshed(
    checking_node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    node = checking_node
    tree = make_tree(tmp_path / "src")
    before = walk(tree)
    old_small = (tree / "a" / "small.txt").read_bytes()
    m = mount_source(node, tmp_path, mounts, tree)
    assert walk(m.mountpoint) == before
    segments = cache_status(node, "src")["segments"]
    assert cache_status(node, "src")["stale"] == 0

    (tree / "a" / "small.txt").write_bytes(b"changed and longer than before\n")
    (tree / "a" / "new.txt").write_bytes(b"new file\n")
    # Served as cached: a fresh mount (no kernel cache) still sees the snapshot.
    again = mount_source(node, tmp_path, mounts, tree, mnt="mnt2")
    assert (again.mountpoint / "a" / "small.txt").read_bytes() == old_small
    assert not (again.mountpoint / "a" / "new.txt").exists()
    wait_for(lambda: cache_status(node, "src")["stale"] == 2, what="the source change seen")
    done = run_cli("status", env=node.env())
    assert done.returncode == 0, done.stderr
    assert "stale: 2 files changed" in done.stdout

    reads_before = cache_status(node, "src")["fills_source"]
    done = run_cli("refresh", "src", env=node.env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("src: refreshed, 2 files changed, ")
    kept = int(done.stdout.split("files changed, ")[1].split()[0])
    assert kept >= 2  # the segments holding only big.bin did not change
    assert cache_status(node, "src")["stale"] == 0

    fresh = mount_source(node, tmp_path, mounts, tree, mnt="mnt3")
    assert walk(fresh.mountpoint) == walk(tree)
    st = cache_status(node, "src")
    new_segments = st["segments"]
    assert st["in_memory"] == new_segments
    assert st["fills_source"] - reads_before == new_segments - kept  # only changed ones re-read
    assert new_segments >= segments
    done = run_cli("refresh", "src", env=node.env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "src: unchanged"
    # A mount made before the refresh sees the new instance too.
    wait_for(
        lambda: shows(m.mountpoint / "a" / "small.txt", (tree / "a" / "small.txt").read_bytes()),
        what="the refreshed dataset on the old mount",
    )


def shows(path: Path, want: bytes) -> bool:
    """The file reads as `want`; False meanwhile, also while the kernel still holds the old
    instance's inode for the path (ESTALE, until the mount has it forget the old names)."""
    try:
        return read_uncached(path) == want
    except OSError as e:
        if e.errno == errno.ESTALE:
            return False
        raise


def test_bad_sources_are_refused_and_change_nothing(
    node: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = run_cli("mount", str(mnt), "--source", str(tmp_path / "nope"), env=node.env())
    assert done.returncode == 4
    assert done.stderr.strip().count("\n") == 0
    assert "source not found" in done.stderr
    done = run_cli("mount", str(mnt), "--source", str(tree / "a" / "small.txt"), env=node.env())
    assert done.returncode == 5
    assert "not a folder" in done.stderr
    assert listing(node) == []
    assert not os.path.ismount(mnt)

    # The same name for another source is refused; the first dataset stays as it was.
    done = run_cli("preload", str(tree), "--name", "data", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    other = tmp_path / "other"
    write_files(other, 3, 100)
    done = run_cli("mount", str(mnt), "--source", str(other), "--name", "data", env=node.env())
    assert done.returncode == 6
    assert "already holds" in done.stderr
    assert [(d["name"], d["lifetime"]) for d in listing(node)] == [("data", "offline")]
    done = run_cli("refresh", "data", env=node.env())
    assert done.returncode == 5
    assert "preloaded" in done.stderr
    done = run_cli("mount", str(mnt), "--name", "x", env=node.env())
    assert done.returncode == 5
    assert not os.path.ismount(mnt)


def test_node_killed_mount_serves_from_the_source_then_recovers(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "data"
    files = write_files(src, 24, 300_000)  # three files a segment: eight segments
    names = sorted(files)
    m = mount_source(node, tmp_path, mounts, src)
    for rel in names[:6]:
        assert (m.mountpoint / rel).read_bytes() == files[rel]
    segments = cache_status(node, "data")["segments"]
    uuid_before = listing(node)[0]["uuid"]

    # A reader keeps reading (past the kernel's cache) while the node dies: first the files
    # already cached, then, once the node is gone, all of them.
    stop, all_files = threading.Event(), threading.Event()
    rounds: list[bool] = []
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for rel in names if all_files.is_set() else names[:6]:
                try:
                    if read_uncached(m.mountpoint / rel) != files[rel]:
                        errors.append(f"{rel}: wrong bytes")
                except OSError as e:
                    errors.append(f"{rel}: {e}")
            rounds.append(all_files.is_set())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_for(lambda: len(rounds) >= 2, what="reads of cached files")
        node.kill9()
        all_files.set()
        wait_for(lambda: rounds.count(True) >= 2, what="reads while the node is down")
        assert "degraded" in m.log() or "marked down" in m.log()

        node.start()
        (entry,) = listing(node)
        assert entry["uuid"] == uuid_before  # the same instance, found again in shared memory
        # The mount notices the node is back and fills the cache again.
        wait_for(
            lambda: cache_status(node, "data")["in_memory"] == segments,
            timeout=60,
            what="the mount filling the cache again",
        )
    finally:
        stop.set()
        thread.join()
    assert errors == []


def test_a_refresh_never_makes_the_dataset_go_missing(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """A `--source` mount serves the dataset at its root: while refreshes swap its instance,
    a reader opening files there gets the old or the new bytes (ESTALE, the old instance's
    inode before the kernel forgets it, is allowed), never EIO or ENOENT."""
    tree = make_tree(tmp_path / "src")
    steady = (tree / "a" / "small.txt").read_bytes()
    m = mount_source(node, tmp_path, mounts, tree)
    path = m.mountpoint / "a" / "small.txt"
    assert read_uncached(path) == steady
    problems: list[str] = []
    reads = [0]
    stop = threading.Event()

    def read_on() -> None:
        while not stop.is_set():
            try:
                got = read_uncached(path)
            except OSError as e:
                if e.errno != errno.ESTALE:
                    problems.append(f"{e.strerror} ({e.errno})")
                continue
            if got != steady:
                problems.append(f"wrong bytes: {got[:20]!r}")
            reads[0] += 1

    reader = threading.Thread(target=read_on)
    reader.start()
    try:
        for k in range(20):
            (tree / "b.bin").write_bytes(b"version %d\n" % k)
            done = run_cli("refresh", "src", env=node.env())
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("src: refreshed"), done.stdout
            before = reads[0]
            wait_for(lambda before=before: reads[0] > before + 20, what="reads after a refresh")
    finally:
        stop.set()
        reader.join()
    assert problems == []
