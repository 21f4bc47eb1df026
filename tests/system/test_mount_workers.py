"""A mount served by several processes: bytes, worker deaths, unmount, reloads, interrupts."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, remote_only_files, running
from conftest import MountProcess, NodeProcess, make_tree, run_cli, wait_for
from workerutil import children, start_workers_mount, stats

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # several mount workers, a second node

BIG = 80 * 1024 * 1024 + 4321  # across many 1 MiB segments


def preload(node: NodeProcess, source: Path, name: str) -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


def files_of(root: Path) -> dict[bytes, bytes]:
    """Relative path -> bytes of every regular file under root (bytes paths: odd names)."""
    base = os.fsencode(root)
    out = {}
    for dirpath, _dirs, names in os.walk(base):
        for name in names:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                with open(full, "rb") as f:
                    out[os.path.relpath(full, base)] = f.read()
    return out


def start_mount(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess], workers: int
) -> MountProcess:
    return start_workers_mount(node.env(), tmp_path, mounts, workers)


class Readers:
    """`count` threads reading random ranges of the files (preads past the page cache, and
    mmap reads), each byte compared with `expected`; errors and mismatches are kept."""

    def __init__(self, root: Path, expected: dict[bytes, bytes], count: int = 8):
        self.root = os.fsencode(root)
        self.expected = expected
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.reads = 0
        self.threads = [
            threading.Thread(target=self._run, args=(random.Random(i),)) for i in range(count)
        ]

    def __enter__(self) -> Readers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads)

    def _run(self, rng: random.Random) -> None:
        paths = sorted(p for p, data in self.expected.items() if data)
        while not self.stop.is_set():
            rel = rng.choice(paths)
            data = self.expected[rel]
            try:
                fd = os.open(os.path.join(self.root, rel), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reach the daemon
                    off = rng.randrange(len(data))
                    n = rng.randrange(1, 300_000)
                    if rng.random() < 0.5:
                        got = os.pread(fd, n, off)
                    else:
                        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
                            got = m[off : off + n]
                finally:
                    os.close(fd)
            except OSError as e:
                self.problems.append(f"{os.fsdecode(rel)}: {e}")
                continue
            if got != data[off : off + n]:
                self.problems.append(f"{os.fsdecode(rel)}: wrong bytes at {off}+{n}")
            self.reads += 1


@pytest.fixture
def big_tree(tmp_path: Path) -> Path:
    root = make_tree(tmp_path / "src")
    with open(root / "a" / "b" / "c" / "eighty.bin", "wb") as f:
        f.write(os.urandom(BIG))
    return root


@pytest.mark.parametrize("workers", [2, 4])
def test_every_byte_equal_through_several_workers(
    node: NodeProcess, big_tree: Path, tmp_path: Path, mounts: list[MountProcess], workers: int
) -> None:
    preload(node, big_tree, "held")
    m = start_mount(node, tmp_path, mounts, workers)
    served = m.mountpoint / "held"
    expected = files_of(big_tree)
    assert files_of(served) == expected
    assert os.readlink(served / "link-to-small") == "a/small.txt"
    with Readers(served, expected) as readers:
        wait_for(lambda: readers.reads >= 400, timeout=120, what="400 random reads")
    assert readers.problems == []
    by_worker = stats(m.mountpoint)["by_worker"]
    assert isinstance(by_worker, list) and len(by_worker) == workers
    assert sum(1 for n in by_worker if n > 0) >= 2, by_worker


def test_a_killed_worker_comes_back_and_no_reader_notices(
    node: NodeProcess, big_tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, big_tree, "held")
    m = start_mount(node, tmp_path, mounts, 2)
    assert m.proc is not None
    expected = files_of(big_tree)
    with Readers(m.mountpoint / "held", expected) as readers:
        pid = m.proc.pid
        for _ in range(3):
            wait_for(lambda: readers.reads >= 100, what="reads")
            before = set(children(pid))
            os.kill(min(before), signal.SIGKILL)

            def replaced(before: set[int] = before) -> bool:
                return len(set(children(pid)) - before) == 1

            wait_for(replaced, what="a new worker")
            readers.reads = 0
        wait_for(lambda: readers.reads >= 100, what="reads after the restarts")
    assert readers.problems == []
    assert os.path.ismount(m.mountpoint)
    assert m.log().count("was killed by SIGKILL: restarting it") == 3
    assert "Traceback" not in m.log()


def test_sigterm_ends_every_worker_and_unmounts(
    node: NodeProcess, big_tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node, big_tree, "held")
    m = start_mount(node, tmp_path, mounts, 3)
    assert m.proc is not None
    workers = children(m.proc.pid)
    assert (m.mountpoint / "held" / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(30) == 0
    assert not os.path.ismount(m.mountpoint)
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists()


def test_unload_and_reload_while_readers_run_through_several_workers(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    names = [f"f{i:02d}.bin" for i in range(20)]
    old = {n: os.urandom(200_000 + i) for i, n in enumerate(names)}
    for n, data in old.items():
        (source / n).write_bytes(data)
    preload(node, source, "ds")
    m = start_mount(node, tmp_path, mounts, 3)
    served = m.mountpoint / "ds"
    new = {n: os.urandom(len(data)) for n, data in old.items()}
    outcomes: list[str] = []
    stop = threading.Event()

    def reader(name: str) -> None:
        # An open file of the old instance: its bytes, or ESTALE/EIO; never the new bytes.
        with open(served / name, "rb", buffering=0) as f:
            while not stop.is_set():
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                try:
                    got = os.pread(f.fileno(), 1 << 20, 0)
                except OSError as e:
                    assert e.errno in (errno.EIO, errno.ESTALE), e
                    outcomes.append("error")
                    return
                # A read of several pages may end early where a later page failed.
                if got and got == old[name][: len(got)]:
                    outcomes.append("old")
                else:
                    outcomes.append(f"{name}: {len(got)} bytes, not the old instance's")

    threads = [threading.Thread(target=reader, args=(n,)) for n in names[:6]]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(outcomes) >= 30, what="reads of the old instance")
        done = run_cli("unload", "ds", env=node.env())
        assert done.returncode == 0, done.stderr
        for n, data in new.items():
            (source / n).write_bytes(data)
        preload(node, source, "ds")
        count = len(outcomes)
        wait_for(lambda: len(outcomes) > count + 30 or "error" in outcomes, what="later reads")

        def new_bytes_everywhere() -> bool:  # each open lands on some worker
            return all((served / n).read_bytes() == new[n] for n in names)

        wait_for(new_bytes_everywhere, what="the new instance through every worker")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert set(outcomes) <= {"old", "error"}, set(outcomes)
    assert os.path.ismount(m.mountpoint)


@pytest.fixture
def pair(token_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    with running(Cluster(token_file, tmp_path, size=2, segment_size="64KiB")) as c:
        yield c


def daemon_reads(mountpoint: Path) -> int:
    n = stats(mountpoint).get("read", 0)
    assert isinstance(n, int)
    return n


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_reader_blocked_on_a_frozen_node_can_be_killed(
    pair: Cluster, tmp_path: Path, mounts: list[MountProcess], sig: signal.Signals
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for i in range(16):
        (source / f"f{i:02d}.bin").write_bytes(os.urandom(50_000))
    pair.preload(source, "ds", replicas=1)
    local, remote = pair.nodes
    victims = remote_only_files(pair, "ds")
    assert victims
    want = (source / victims[0]).read_bytes()
    # No other copy: with the source there, a read would go to it once the frozen node is
    # late (issue 29's hedging), and nothing would block.
    shutil.move(source, tmp_path / "gone")
    env = {**pair.env(local=local), "KSPEEDFS_TIMEOUT": "60"}  # reads would wait a minute
    m = MountProcess(tmp_path / "mnt", env, tmp_path, args=("--workers", "2"))
    mounts.append(m)
    m.start()
    path = m.mountpoint / "ds" / victims[0]
    assert remote.proc is not None
    remote.proc.send_signal(signal.SIGSTOP)
    try:
        reads = daemon_reads(m.mountpoint)
        code = f"open({str(path)!r}, 'rb').read()"
        reader = subprocess.Popen([sys.executable, "-c", code])
        wait_for(lambda: daemon_reads(m.mountpoint) > reads, what="the read to arrive")
        # Under test: the read stays blocked on the frozen node (nothing to wait for but time).
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(timeout=0.5)
        reader.send_signal(sig)
        wait_for(lambda: reader.poll() is not None, timeout=2.0, what="the reader to go")
    finally:
        remote.proc.send_signal(signal.SIGCONT)
    assert os.path.ismount(m.mountpoint)
    assert m.proc is not None and m.proc.poll() is None
    assert (m.mountpoint / "ds" / victims[0]).read_bytes() == want  # from the node, thawed
