"""A mount served through FUSE over io_uring (setting fuse_uring): bytes, listings and stat
equal to the source, remote reads answered later through the ring entry, interrupts, and what
a killed serving process means (docs/mounts.md)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, remote_only_files, running
from conftest import MountProcess, NodeProcess, make_tree, run_cli, wait_for
from workerutil import children, start_workers_mount, stats

from kspeedfs.fuse import uring

# The kernel's switches (enable_uring, io_uring_disabled) are the machine's: each test here
# holds the lock of the tests that change them (conftest.machine_switches, taken by the
# autouse fixture below before it reads them).
pytestmark = [pytest.mark.fuse, pytest.mark.slow]

URING = {"KSPEEDFS_FUSE_URING": "1"}


@pytest.fixture(autouse=True)
def enable_uring(machine_switches: None) -> Iterator[None]:
    """Skips where FUSE over io_uring cannot be had; puts enable_uring back as it was (the
    mount sets it to Y and leaves it)."""
    why = uring.ring_unusable()
    if why is None and os.geteuid() != 0 and not uring.kernel_offers():
        why = "enable_uring is N and only root may set it"
    if why is not None:
        pytest.skip(f"FUSE over io_uring unavailable: {why}")
    before = uring.ENABLE_URING.read_text()
    yield
    if os.geteuid() == 0:
        uring.ENABLE_URING.write_text(before)


def start(
    env: dict[str, str], tmp_path: Path, mounts: list[MountProcess], workers: int = 2
) -> MountProcess:
    return start_workers_mount({**env, **URING}, tmp_path, mounts, workers)


def preload(node: NodeProcess, source: Path, name: str) -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = make_tree(tmp_path / "src")
    for d in range(8):
        folder = root / f"many{d}"
        folder.mkdir()
        for i in range(60):
            (folder / f"f{i:03d}.bin").write_bytes(os.urandom((i * 997 + d * 131) % 150_000))
    return root


def walk(root: Path) -> dict[bytes, os.stat_result]:
    base = os.fsencode(root)
    out = {}
    for dirpath, dirs, names in os.walk(base):
        for name in dirs + names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, base)] = os.lstat(full)
    return out


def wrong_bytes(got: bytes, want: bytes) -> int:
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def test_a_tree_reads_back_equal_through_the_rings(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, tree, "ds")
    m = start(node.env(), tmp_path, mounts)
    served = m.mountpoint / "ds"
    source, mounted = walk(tree), walk(served)
    assert sorted(mounted) == sorted(source)
    for rel, want in source.items():
        got = mounted[rel]
        assert got.st_mtime_ns == want.st_mtime_ns, rel
        assert got.st_mode & ~0o222 == want.st_mode & ~0o222, rel  # read-only: no write bits
        if not stat.S_ISDIR(want.st_mode):
            assert got.st_size == want.st_size, rel
    before = stats(m.mountpoint)
    wrong = 0
    files = [rel for rel, st in source.items() if stat.S_ISREG(st.st_mode)]
    for rel in files:
        want = (tree / os.fsdecode(rel)).read_bytes()
        fd = os.open(os.path.join(os.fsencode(served), rel), os.O_RDONLY)  # unbuffered
        try:
            got = b"".join(iter(lambda fd=fd: os.read(fd, 1 << 20), b""))
        finally:
            os.close(fd)
        wrong += wrong_bytes(got, want)
        with open(os.path.join(os.fsencode(served), rel), "rb") as f:  # buffered: isatty too
            wrong += wrong_bytes(f.read(), want)
    assert wrong == 0
    assert os.readlink(served / "link-to-small") == "a/small.txt"
    after = stats(m.mountpoint)
    # Every READ and IOCTL of the pass came through the rings, none through /dev/fuse.
    through = after["uring"] - before["uring"]
    asked = sum(after.get(k, 0) - before.get(k, 0) for k in ("read", "ioctl", "lookup"))
    assert through >= asked >= len(files)
    assert "serving from a ring per CPU" in m.log()


@pytest.fixture
def pair(token_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    with running(Cluster(token_file, tmp_path, size=2, segment_size="64KiB")) as c:
        yield c


def remote_files(
    pair: Cluster, tmp_path: Path
) -> tuple[list[str], dict[str, bytes], dict[str, str]]:
    """Dataset "ds" over the pair, one copy of each segment, its source gone (no fallback: the
    other node or nothing): the files only the second node holds, their bytes, and the
    environment of a mount on the first node."""
    source = tmp_path / "src"
    source.mkdir()
    for i in range(16):
        (source / f"f{i:02d}.bin").write_bytes(os.urandom(50_000 + i))
    pair.preload(source, "ds", replicas=1)
    victims = remote_only_files(pair, "ds")
    assert len(victims) >= 2
    wants = {v: (source / v).read_bytes() for v in victims}
    shutil.move(source, tmp_path / "gone")
    return victims, wants, {**pair.env(local=pair.nodes[0]), "KSPEEDFS_TIMEOUT": "60"}


def test_remote_reads_are_answered_later_through_the_ring_entry(
    pair: Cluster, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """Reads of files only the other node holds go to the pool and commit through the entry
    that holds them; one blocked on a frozen node is interrupted (SIGINT: EINTR committed
    through its entry), and the next read of it, thawed, is right.

    The reader's read-ahead READ gets its INTERRUPT; the kernel then sends a one-page READ
    with the signal pending, whose INTERRUPT it never sends over io_uring (uring.py): the
    reader must end by its SIGINT all the same, not by that READ's answer (an EIO when the
    node pool gives up: the test passed by that, or failed when it came after 5 s)."""
    victims, wants, env = remote_files(pair, tmp_path)
    remote = pair.nodes[1]
    m = start(env, tmp_path, mounts)
    served = m.mountpoint / "ds"
    wrong = sum(wrong_bytes((served / v).read_bytes(), wants[v]) for v in victims[1:])
    assert wrong == 0
    assert stats(m.mountpoint)["uring"] > 0
    path = served / victims[0]
    assert remote.proc is not None
    remote.proc.send_signal(signal.SIGSTOP)
    try:
        reads = stats(m.mountpoint).get("read", 0)
        reader = subprocess.Popen([sys.executable, "-c", f"open({str(path)!r}, 'rb').read()"])
        wait_for(lambda: stats(m.mountpoint).get("read", 0) > reads, what="the read to arrive")
        # Under test: the read stays blocked on the frozen node (nothing to wait for but time).
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(timeout=0.5)
        reader.send_signal(signal.SIGINT)
        wait_for(lambda: reader.poll() is not None, timeout=5.0, what="the reader to go")
        assert reader.returncode == -signal.SIGINT  # its KeyboardInterrupt, not an EIO
        assert stats(m.mountpoint).get("read", 0) - reads >= 2  # the READ sent again
    finally:
        remote.proc.send_signal(signal.SIGCONT)
    assert path.read_bytes() == wants[victims[0]]
    assert m.proc is not None and m.proc.poll() is None


def reading(path: Path) -> subprocess.Popen[str]:
    """A process reading `path` whole (buffered), printing its length or its error."""
    code = f"import sys\ntry: print(len(open({str(path)!r}, 'rb').read()))\nexcept OSError as e: sys.exit(e.errno)"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def rings_registered(pid: int) -> bool:
    """Whether every possible CPU's ring of serving process `pid` has its entries registered,
    read from the kernel (/proc/PID/fdinfo of its io_uring fds): each ring's submissions the
    kernel took (SqHead) less its completions (CqTail, a REGISTER refused before INIT or a
    request) is what stays registered."""
    outstanding: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[io_uring]":
                continue
            fields = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                if ":" in line
            )
        except OSError:
            continue  # closed meanwhile
        head, done = int(fields["SqHead"]), int(fields["CqTail"])
        outstanding[fields["ino"].strip()] = head - done
    return len(outstanding) == uring.possible_cpus() and all(
        n >= uring.DEPTH for n in outstanding.values()
    )


def replaced(m: MountProcess, worker: int) -> bool:
    assert m.proc is not None
    now = children(m.proc.pid)
    return len(now) == 1 and now[0] != worker


def test_a_request_on_its_way_to_a_killed_worker_fails_with_ecanceled(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """Dispatched to the worker's ring entry but not yet in its hands (the worker stopped):
    when the worker dies the kernel ends the request with ECANCELED (docs/mounts.md); the
    restarted worker serves the next one."""
    preload(node, tree, "ds")
    m = start(node.env(), tmp_path, mounts, workers=1)
    assert m.proc is not None
    (worker,) = children(m.proc.pid)
    path = m.mountpoint / "ds" / "many3" / "f007.bin"
    os.kill(worker, signal.SIGSTOP)
    reader = reading(path)
    # Under test: the request reaches the stopped worker's entry (nothing to watch for).
    with pytest.raises(subprocess.TimeoutExpired):
        reader.wait(timeout=1.0)
    os.kill(worker, signal.SIGKILL)
    assert reader.wait(timeout=20) == errno.ECANCELED
    wait_for(lambda: replaced(m, worker), what="a new worker")
    # A request made before the new worker's rings are registered would wait for the next
    # request on its CPU (docs/mounts.md): the kernel's count of them is waited for.
    (new,) = children(m.proc.pid)
    wait_for(lambda: rings_registered(new), what="the new worker's rings registered")
    assert path.read_bytes() == (tree / "many3" / "f007.bin").read_bytes()


def test_a_request_a_killed_worker_held_waits_until_the_mount_ends(
    pair: Cluster, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """A request in a worker's hands when it dies (here a read waiting on a frozen node in
    its pool) is never resent: unlike /dev/fuse, the kernel keeps a ring entry's request for
    that entry alone. Its reader waits, signals or not, until the mount ends; then it gets an
    error. Other reads go on (docs/mounts.md: why fuse_uring is off by default)."""
    victims, wants, env = remote_files(pair, tmp_path)
    remote = pair.nodes[1]
    m = start(env, tmp_path, mounts, workers=1)
    assert m.proc is not None and remote.proc is not None
    (worker,) = children(m.proc.pid)
    path = m.mountpoint / "ds" / victims[0]
    os.stat(path)
    remote.proc.send_signal(signal.SIGSTOP)
    try:
        reads = stats(m.mountpoint).get("read", 0)
        reader = reading(path)
        wait_for(lambda: stats(m.mountpoint).get("read", 0) > reads, what="the read to arrive")
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: replaced(m, worker), what="a new worker")
    finally:
        remote.proc.send_signal(signal.SIGCONT)
    (new,) = children(m.proc.pid)
    wait_for(lambda: rings_registered(new), what="the new worker's rings registered")
    assert (m.mountpoint / "ds" / victims[1]).read_bytes() == wants[victims[1]]
    reader.send_signal(signal.SIGINT)
    # Under test: thawed, interrupted, the held read still gets no answer.
    with pytest.raises(subprocess.TimeoutExpired):
        reader.wait(timeout=3.0)
    assert "a request it held gets no answer until the mount ends" in m.log()
    m.stop()
    assert reader.wait(timeout=30) != 0
