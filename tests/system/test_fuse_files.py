"""Real FUSE mounts: every byte equals the source's, read-only everywhere, live dataset changes."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from treeutil import walk
from workerutil import children

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # a node and a mount per test


def preload(node: NodeProcess, source: Path, name: str) -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


def test_every_file_through_the_mount_equals_the_source(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, tree, "awkward")
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    served = m.mountpoint / "awkward"
    expected = walk(tree)
    assert walk(served) == expected
    # The awkward cases are in there, not just skipped by both sides.
    assert expected[b"big.bin"][0] == "file"
    assert (served / "big.bin").stat().st_size > 2 * (1 << 20)
    assert expected[b"raw-\xff\xfe/latin1-\xe9.bin"][0] == "file"
    assert os.readlink(served / "link-to-small") == "a/small.txt"
    assert (served / "link-to-small").read_bytes() == b"hello kspeedfs\n"
    assert os.listdir(served / "empty_dir") == []
    assert (served / "a" / "empty.bin").read_bytes() == b""
    # Reads at odd offsets across the segment boundary.
    src_big = (tree / "big.bin").read_bytes()
    with open(served / "big.bin", "rb") as f:
        for off in (0, (1 << 20) - 7, 2 * (1 << 20) + 12000, len(src_big) - 1):
            f.seek(off)
            assert f.read(4099) == src_big[off : off + 4099]
    st_src, st_mnt = (tree / "a" / "small.txt").stat(), (served / "a" / "small.txt").stat()
    assert st_mnt.st_size == st_src.st_size
    assert st_mnt.st_mtime_ns == st_src.st_mtime_ns
    with pytest.raises(FileNotFoundError):
        (served / "no-such-file").stat()
    with pytest.raises(FileNotFoundError):
        (m.mountpoint / "no-such-dataset").stat()


def test_single_dataset_at_the_root(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, tree, "awkward")
    m = MountProcess(tmp_path / "one", node.env(), tmp_path, args=("--dataset", "awkward"))
    mounts.append(m)
    m.start()
    assert walk(m.mountpoint) == walk(tree)


def _open(path: Path, mode: str) -> None:
    with open(path, mode):
        pass


def _errno_of(fn: Callable[[], object]) -> int | None:
    try:
        fn()
    except OSError as e:
        return e.errno
    raise AssertionError("the write was allowed")


def test_writes_fail_with_erofs(node: NodeProcess, tree: Path, mount_all: MountProcess) -> None:
    preload(node, tree, "ro")
    root = mount_all.mountpoint / "ro"
    wait_for(root.exists, what="dataset folder")
    small = root / "a" / "small.txt"
    attempts = {
        "open for write": lambda: _open(small, "r+b"),
        "open for append": lambda: _open(small, "ab"),
        "create": lambda: _open(root / "new.txt", "wb"),
        "create at top": lambda: _open(mount_all.mountpoint / "new.txt", "wb"),
        "mkdir": lambda: os.mkdir(root / "newdir"),
        "mkdir at top": lambda: os.mkdir(mount_all.mountpoint / "newdataset"),
        "unlink": lambda: os.unlink(small),
        "rmdir": lambda: os.rmdir(root / "empty_dir"),
        "rename": lambda: os.rename(small, root / "a" / "moved.txt"),
        "symlink": lambda: os.symlink("x", root / "newlink"),
        "link": lambda: os.link(small, root / "hardlink"),
        "setxattr": lambda: os.setxattr(small, "user.x", b"1"),
        "removexattr": lambda: os.removexattr(small, "user.kspeedfs.xxh3"),
        "truncate": lambda: os.truncate(small, 0),
        "chmod": lambda: os.chmod(small, 0o777),
        "utime": lambda: os.utime(small, (0, 0)),
    }
    for what, attempt in attempts.items():
        assert _errno_of(attempt) == errno.EROFS, what
    assert small.read_bytes() == b"hello kspeedfs\n"
    assert walk(root) == walk(tree)


def test_checksum_xattr_matches_the_manifest(
    node: NodeProcess, tree: Path, mount_all: MountProcess
) -> None:
    import xxhash

    preload(node, tree, "xa")
    small = mount_all.mountpoint / "xa" / "a" / "small.txt"
    wait_for(small.exists, what="file")
    assert "user.kspeedfs.xxh3" in os.listxattr(small)
    expected = b"%016x" % xxhash.xxh3_64_intdigest(b"hello kspeedfs\n")
    assert os.getxattr(small, "user.kspeedfs.xxh3") == expected


def test_dataset_preloaded_after_the_mount_appears(
    node: NodeProcess, tree: Path, mount_all: MountProcess
) -> None:
    assert os.listdir(mount_all.mountpoint) == []
    preload(node, tree, "late")
    wait_for(lambda: "late" in os.listdir(mount_all.mountpoint), what="late dataset listed")
    assert walk(mount_all.mountpoint / "late") == walk(tree)
    done = run_cli("unload", "late", env=node.env())
    assert done.returncode == 0, done.stderr
    wait_for(lambda: "late" not in os.listdir(mount_all.mountpoint), what="dataset gone")
    # The kernel may keep the old entry until its (one second) timeout or invalidation.
    wait_for(lambda: not (mount_all.mountpoint / "late").exists(), what="entry gone")


def test_unload_while_a_file_is_open_and_being_read(
    node: NodeProcess, tree: Path, mount_all: MountProcess
) -> None:
    preload(node, tree, "victim")
    big = mount_all.mountpoint / "victim" / "big.bin"
    wait_for(big.exists, what="big file")
    source = (tree / "big.bin").read_bytes()
    outcomes: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        with open(big, "rb", buffering=0) as f:
            while not stop.is_set():
                # Drop this file's cached pages so that every pass reaches the daemon.
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                for off in range(0, len(source), 256 * 1024):
                    try:
                        chunk = os.pread(f.fileno(), 65536, off)
                    except OSError as e:
                        # EIO: no copy and no matching source; ESTALE: the mount forgot the
                        # instance (its memory is freed). Never another instance's bytes.
                        assert e.errno in (errno.EIO, errno.ESTALE), e
                        outcomes.append("error")
                        return
                    assert chunk == source[off : off + 65536]
                outcomes.append("ok")

    def daemon_reads() -> int:
        return int(json.loads(os.getxattr(mount_all.mountpoint, "user.kspeedfs.stats"))["read"])

    t = threading.Thread(target=reader)
    t.start()
    try:
        wait_for(lambda: len(outcomes) >= 1, what="first full read")
        done = run_cli("unload", "victim", env=node.env())
        assert done.returncode == 0, done.stderr
        reads, count = daemon_reads(), len(outcomes)
        # Listing the top makes the mount notice the unload while the file stays open.
        wait_for(lambda: "victim" not in os.listdir(mount_all.mountpoint), what="victim unlisted")
        # Passes the page cache served (its pages not dropped yet) do not count: wait for
        # reads that reached the daemon.
        wait_for(
            lambda: (len(outcomes) > count + 2 and daemon_reads() > reads) or "error" in outcomes,
            what="reads after unload",
        )
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert set(outcomes) <= {"ok", "error"}
    if "error" not in outcomes:
        # An EIO or ESTALE may come from the kernel itself (an inode it marked bad after the
        # unload) without a READ; passes that succeeded must have been served, not cached.
        assert daemon_reads() > reads, "the reads after unload never reached the daemon"
    # The mount is still up and answers.
    assert os.path.ismount(mount_all.mountpoint)
    assert mount_all.proc is not None and mount_all.proc.poll() is None
    preload(node, tree, "after")
    wait_for(lambda: "after" in os.listdir(mount_all.mountpoint), what="new dataset")
    assert (mount_all.mountpoint / "after" / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"


def test_a_frozen_node_does_not_hold_up_reads_of_local_data(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, tree, "frozen")
    m = MountProcess(tmp_path / "mnt", {**node.env(), "KSPEEDFS_TIMEOUT": "30"}, tmp_path)
    mounts.append(m)
    m.start()
    path = m.mountpoint / "frozen" / "a" / "small.txt"
    assert path.read_bytes() == (tree / "a" / "small.txt").read_bytes()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGSTOP)
    reads: list[bytes] = []

    def read_many() -> None:
        for _ in range(30):  # over several seconds: the root's attributes expire meanwhile
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                reads.append(f.read())
            time.sleep(0.1)

    try:
        # Unknown top-level names make the mount ask the node, which does not answer now.
        askers = [
            threading.Thread(target=os.path.exists, args=(m.mountpoint / f"new{i}",))
            for i in range(3)
        ]
        for t in askers:
            t.start()
        reader = threading.Thread(target=read_many)
        reader.start()
        # Each walk through the root would wait for the node (30 s) if requests at the
        # root waited for it: 30 reads would take many minutes.
        wait_for(lambda: not reader.is_alive(), timeout=60, what="reads while the node is frozen")
        assert reads == [b"hello kspeedfs\n"] * 30
        for t in askers:
            t.join(30)
            assert not t.is_alive()
    finally:
        node.proc.send_signal(signal.SIGCONT)
    assert os.path.ismount(m.mountpoint)
    assert path.read_bytes() == (tree / "a" / "small.txt").read_bytes()


def test_unload_frees_the_memory_a_mount_had_mapped(
    node: NodeProcess, tree: Path, mount_all: MountProcess
) -> None:
    preload(node, tree, "mapped")
    wait_for(lambda: "mapped" in os.listdir(mount_all.mountpoint), what="dataset listed")
    assert walk(mount_all.mountpoint / "mapped") == walk(tree)  # maps every segment
    assert mount_all.proc is not None
    pid = mount_all.proc.pid

    def segment_maps() -> int:  # in the mount process and its serving processes
        return sum(
            1
            for p in [pid, *children(pid)]
            for line in Path(f"/proc/{p}/maps").read_text().splitlines()
            if str(node.shm_dir) in line and "/seg/" in line
        )

    assert segment_maps() > 0
    done = run_cli("unload", "mapped", env=node.env())
    assert done.returncode == 0, done.stderr
    # Nobody touches the mount: its own periodic refresh notices, and lets go of the maps.
    wait_for(lambda: segment_maps() == 0, timeout=30, what="the mount to unmap the segments")
    assert os.path.ismount(mount_all.mountpoint)
