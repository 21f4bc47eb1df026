"""Fixtures that start real node daemons on 127.0.0.1 and real FUSE mounts as subprocesses."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

from kspeedfs.client import admin
from kspeedfs.format.config import load_settings
from kspeedfs.testing.mount import MountProcess as MountProcess
from kspeedfs.testing.node import NodeProcess as NodeProcess
from kspeedfs.testing.node import remove_tree

# The process helpers live in the package (the demo and the benches use them too); tests import
# them from here.
from kspeedfs.testing.process import KSPEEDFS as KSPEEDFS
from kspeedfs.testing.process import STARTED, wait_until
from kspeedfs.testing.process import free_port as free_port

if TYPE_CHECKING:
    from etcdutil import EtcdCluster

    from kspeedfs.testing.etcd import EtcdProcess


# Examples run beside node and mount processes on a shared 2-core machine: hypothesis's per-example
# deadline (200 ms) measures that load, not the code, so it is off for every property test.
settings.register_profile("kspeedfs", deadline=None)
settings.load_profile("kspeedfs")


# Nodes run as root seal the segments they publish (the immutable flag, `chattr +i`): nobody can
# remove them until the flag is cleared, so a plain rmtree of a node's shm or spill folder (the
# tests' own, pytest's tmp_path cleanup) would leave them behind. Every rmtree by a path in the
# test process clears the flags beneath it first (remove_tree); one by a folder descriptor (the
# node's own code, run in-process) already does.
_rmtree = shutil.rmtree


def _rmtree_unsealed(path, *args, **kwargs):  # type: ignore[no-untyped-def]
    if kwargs.get("dir_fd") is None:
        from kspeedfs.format.sealing import unseal_tree

        try:
            unseal_tree(None, os.fspath(path))
        except (OSError, TypeError):
            pass
    return _rmtree(path, *args, **kwargs)


_rmtree_unsealed.avoids_symlink_attacks = _rmtree.avoids_symlink_attacks  # type: ignore[attr-defined]
shutil.rmtree = _rmtree_unsealed

# A test that uses one of these is slow (out of `make quick`; `make test` runs it): several
# nodes, etcd, a booted container, the mount daemon or an S3 server.
SLOW_FIXTURES = frozenset(
    {
        "cluster",
        "etcd",
        "etcd_cluster",
        "two_nodes",
        "tls_cluster",
        "tls_etcd",
        "box",
        "mountds",
        "s3",
    }
)


# Whole modules out of `make quick` (measured with --durations=0: 180 of the quick loop's
# 265 s): each test starts several CLI processes, several nodes or DataLoader processes, or
# reads epochs of a dataset.
SLOW_MODULES = frozenset(
    {
        "test_cli_errors.py",  # a CLI process (about 1.4 s to start) per case
        "test_cli_settings.py",
        "test_sampler_resume.py",  # a StatefulDataLoader resumed in a new process
        "test_eviction_over_epochs.py",  # three epochs per policy
        "test_tiers.py",  # datasets of hundreds of MiB
        "test_caps.py",  # node and CLI processes per case, a three-node heal
        "test_readthrough_disk.py",  # three epochs per policy, with a disk tier
        "test_tier_views.py",  # a three-node cluster
        "test_plan_ranks.py",  # two ranks' DataLoaders, three epochs per policy
        "test_webdataset.py",  # a three-node cluster per sampler
        "test_fsspec.py",  # pyarrow and datasets against one and three nodes
    }
)


UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(UNIT):
            continue  # in-process: its `etcd` is the in-memory one (tests/unit/conftest.py)
        fixtures = getattr(item, "fixturenames", ())
        if SLOW_FIXTURES.intersection(fixtures) or item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tracebacks(*expected): the nodes and mounts the test starts may log tracebacks that "
        "contain one of `expected` (none given: any traceback)",
    )


TRACEBACK = "Traceback (most recent call last):"


def logged_tracebacks(text: str) -> list[str]:
    """Each traceback in a log (an exception group's with the ones inside it), with the line
    before it (the log record that printed it) and, after its indented frames, the line of the
    exception."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        if TRACEBACK not in lines[i]:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][0] in " |+"):
            end += 1
        if lines[i][0] not in " |+" and end < len(lines):
            end += 1  # a plain traceback ends with the exception, unindented
        found.append("\n".join(lines[max(0, i - 1) : end]))
        i = end
    return found


def log_sizes() -> dict[Path, int]:
    """The size now of each log of the nodes and mounts started (and not yet forgotten)."""
    sizes = {}
    for path, _proc in STARTED:
        try:
            sizes[path] = path.stat().st_size
        except FileNotFoundError:
            sizes[path] = 0
    return sizes


def tracebacks_since(sizes: dict[Path, int]) -> list[tuple[Path, str]]:
    """(log, traceback) of each traceback logged past `sizes` (a log not in it: from its
    start); then forgets the processes that have exited."""
    found = []
    for path in dict.fromkeys(path for path, _proc in STARTED):
        try:
            with open(path, "rb") as f:
                f.seek(sizes.get(path, 0))
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            continue
        found += [(path, tb) for tb in logged_tracebacks(text)]
    STARTED[:] = [(path, proc) for path, proc in STARTED if proc.poll() is None]
    return found


# The machine's io_uring switches (/sys/module/fuse/parameters/enable_uring,
# /proc/sys/kernel/io_uring_disabled) are one for every test: the tests that change them or
# depend on them hold this lock, so that under xdist (`make test`, `make quick`) one of them
# runs at a time whatever the worker. (Not xdist_group: `--dist loadgroup` in pytest-xdist 3.8
# hangs for good once a crashed worker is replaced, pytest-xdist#1323/#1327/#1378.)
MACHINE_SWITCHES_LOCK = Path("/tmp/kspeedfs-tests-machine-switches.lock")


@pytest.fixture
def machine_switches() -> Iterator[None]:
    with open(MACHINE_SWITCHES_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def own_health_table(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test's readers share a node-health table of their own: tests reuse loopback
    ports, and a node one test killed must not be skipped as down in the next one."""
    table = tmp_path_factory.mktemp("health") / "table"
    monkeypatch.setenv("KSPEEDFS_HEALTH_TABLE", str(table))


@pytest.fixture(autouse=True)
def no_sealed_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Clears the immutable flag of whatever a test's nodes sealed in its tmp_path (spill
    folders, disk tiers): pytest keeps the last runs' tmp_path, and a later run's cleanup (or
    another checkout's) could not remove a sealed file."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp is not None:
        from kspeedfs.format.sealing import unseal_tree

        unseal_tree(None, os.fspath(tmp))


@pytest.fixture(autouse=True)
def no_unexpected_tracebacks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test when a node or mount (kspeedfs.testing's NodeProcess, MountProcess) logged
    a traceback during it, unless its `tracebacks` mark expects it: an error the test never
    looks at must not pass unseen."""
    sizes = log_sizes()
    yield
    mark = request.node.get_closest_marker("tracebacks")
    expected: tuple[str, ...] = mark.args if mark is not None else ()
    unexpected = [
        f"{path}:\n{tb}"
        for path, tb in tracebacks_since(sizes)
        if mark is None or (expected and not any(e in tb for e in expected))
    ]
    if unexpected:
        pytest.fail(
            "a process this test started logged a traceback (mark the test "
            "`@pytest.mark.tracebacks(...)` if it provokes it on purpose):\n"
            + "\n\n".join(unexpected),
            pytrace=False,
        )


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    try:
        wait_until(predicate, timeout, what)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def run_cli(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KSPEEDFS, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def new_cas(root: Path, *names: str) -> None:
    """CAs made the way a user makes them (`kspeedfs tls new-ca`), in root/NAME, each with a
    certificate for 127.0.0.1 (`tls issue`) beside it."""
    for ca in names:
        for args in (
            ("tls", "new-ca", str(root / ca)),
            ("tls", "issue", "127.0.0.1", "--ca", str(root / ca), "--out", str(root / ca)),
        ):
            done = run_cli(*args, env=dict(os.environ))
            assert done.returncode == 0, done.stderr


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    yield path
    remove_tree(path)  # (sealed segments too)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    from kspeedfs.format import auth

    path = tmp_path / "token"
    auth.write_token(path, auth.new_admin_token())
    return path


@pytest.fixture
def node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(shm_dir, token_file, tmp_path).start()
    yield n
    n.stop()


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    """Nodes a test starts itself (appended here): stopped, their folders removed after."""
    made: list[NodeProcess] = []
    yield made
    for n in made:
        n.stop()
        shutil.rmtree(n.shm_dir, ignore_errors=True)
        shutil.rmtree(n.shm_dir.with_name(n.shm_dir.name + ".run"), ignore_errors=True)  # socket


@contextlib.contextmanager
def node_in(folder: Path, **options: Any) -> Iterator[NodeProcess]:
    """A started node with an admin token in `folder` (its logs there too) and a /dev/shm folder
    of its own, for a fixture that outlives one test; stopped and its folder removed after.
    `options`: NodeProcess's (memory, base_env, ...)."""
    from kspeedfs.format import auth

    token = folder / "token"
    auth.write_token(token, auth.new_admin_token())
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    node = NodeProcess(shm, token, folder, **options).start()
    try:
        yield node
    finally:
        node.stop()
        remove_tree(shm)


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


def preload(node: NodeProcess, source: Path, name: str) -> None:
    """An offline preload of `source` as `name` on `node`."""
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    admin.preload(settings, str(source), name, show_progress=False)


def kw(node: NodeProcess) -> dict[str, str]:
    """The fast-path datasets' arguments that point them at `node`."""
    return {"nodes": node.address, "token": str(node.token_file)}


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


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A real etcd on free loopback ports with its own data folder."""
    from kspeedfs.testing.etcd import EtcdProcess

    server = EtcdProcess(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path, token_file: Path, etcd: EtcdProcess) -> Iterator[EtcdCluster]:
    """Nodes that find each other through `etcd` (tests/etcdutil.py); stopped afterwards."""
    from etcdutil import EtcdCluster

    c = EtcdCluster(tmp_path, token_file, etcd)
    yield c
    c.stop()


@contextlib.contextmanager
def public_folder() -> Iterator[Path]:
    """A folder an unprivileged uid can reach (pytest's tmp_path is root's 0700), removed
    after."""
    path = Path("/tmp") / f"kspeedfs-public-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        remove_tree(path)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    with public_folder() as path:
        yield path
