"""Fixtures that start real node daemons on 127.0.0.1 and real FUSE mounts as subprocesses."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kspeedfs.client import NodeClient
from kspeedfs.errors import KSpeedError
from kspeedfs.units import Address

KSPEEDFS = [sys.executable, "-m", "kspeedfs.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class NodeProcess:
    """One `kspeedfs node` subprocess with its own port and shm folder."""

    def __init__(
        self,
        shm_dir: Path,
        token_file: Path,
        log_dir: Path,
        memory: str = "1GiB",
        segment_size: str = "1MiB",
        port: int | None = None,
        extra: tuple[str, ...] = (),
    ):
        self.shm_dir = shm_dir
        self.token_file = token_file
        self.memory = memory
        self.segment_size = segment_size
        self.port = port or free_port()
        self.extra = extra
        self.log_path = log_dir / f"node-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KSPEEDFS_TOKEN_FILE": str(self.token_file),
            "KSPEEDFS_NODES": self.address,
        }

    def command(self) -> list[str]:
        return [
            *KSPEEDFS,
            "node",
            "--listen",
            self.address,
            "--shm-dir",
            str(self.shm_dir),
            "--memory",
            self.memory,
            "--segment-size",
            self.segment_size,
            *self.extra,
        ]

    def start(self) -> NodeProcess:
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
            )
        wait_for(self._answers, what=f"node on {self.address}")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"node exited with {self.proc.returncode}: {self.log_path.read_text()}"
            )
        try:
            with self.client() as c:
                c.request("ping")
            return True
        except KSpeedError:
            return False

    def client(self) -> NodeClient:
        return NodeClient(Address("127.0.0.1", self.port), self.token_file, timeout=10)

    def request(self, op: str, **args: object) -> dict:  # type: ignore[type-arg]
        with self.client() as c:
            return c.request(op, **args)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def run_cli(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KSPEEDFS, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


class MountProcess:
    """A foreground `kspeedfs mount` subprocess; always unmounted in teardown."""

    def __init__(
        self, mountpoint: Path, env: dict[str, str], log_dir: Path, args: tuple[str, ...] = ()
    ):
        self.mountpoint = mountpoint
        self.env = env
        self.args = args
        self.log_path = log_dir / f"mount-{mountpoint.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MountProcess:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [*KSPEEDFS, "mount", str(self.mountpoint), "--foreground", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

        def mounted() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"mount exited: {self.log_path.read_text()}")
            return os.path.ismount(self.mountpoint)

        wait_for(mounted, what=f"mount at {self.mountpoint}")
        return self

    def stop(self) -> None:
        if os.path.ismount(self.mountpoint) or _stale(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _stale(path: Path) -> bool:
    try:
        os.stat(path)
        return False
    except OSError:
        return True


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    from kspeedfs import auth

    path = tmp_path / "token"
    auth.write_token(path, auth.new_admin_token())
    return path


@pytest.fixture
def node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(shm_dir, token_file, tmp_path).start()
    yield n
    n.stop()


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[MountProcess]]:
    """Collects mounts made by a test and unmounts them all afterwards."""
    made: list[MountProcess] = []
    yield made
    for m in made:
        m.stop()


@pytest.fixture
def mount_all(node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]) -> MountProcess:
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    return m.start()


def make_tree(root: Path, segment_size: int = 1 << 20) -> Path:
    """A tree with the awkward cases: nesting, empty files and folders, a file bigger than a
    segment, non-ASCII and non-UTF-8 names, a symlink."""
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "a" / "small.txt").write_bytes(b"hello kspeedfs\n")
    (root / "a" / "empty.bin").write_bytes(b"")
    (root / "a" / "b" / "c" / "deep.bin").write_bytes(os.urandom(5000))
    (root / "big.bin").write_bytes(os.urandom(segment_size * 2 + 12345))
    (root / "ünïcødé-数据.txt").write_bytes(b"non-ascii\n")
    os.mkdir(os.path.join(os.fsencode(root), b"raw-\xff\xfe"))
    with open(os.path.join(os.fsencode(root), b"raw-\xff\xfe", b"latin1-\xe9.bin"), "wb") as f:
        f.write(os.urandom(777))
    for i in range(30):
        (root / "a" / f"f{i:03d}.bin").write_bytes(os.urandom(1000 + 997 * i))
    os.symlink("a/small.txt", root / "link-to-small")
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src")
