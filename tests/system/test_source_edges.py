"""Sources that change or hang under a copy, with real nodes and mounts: every copy is one
version of its file or nothing, opening a source never blocks, and a source read that hangs
never keeps the node from stopping."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from rt_util import mount_source, read_uncached

from kspeedfs.client import admin
from kspeedfs.system.local_dataset import LocalDataset

pytestmark = pytest.mark.slow  # sources that change or hang mid-copy

MiB = 1 << 20
BIG = 64 * MiB
STOP_BOUND = 5.0  # what the issue promises: SIGTERM ends the node within 5 s

# Rewrites the first and the last MiB of a file in place, in a loop, each time with the next
# version number: a complete version has the same number in both.
WRITER = """
import os, random, sys, time
path, ready, size, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), 1 << 20
fd = os.open(path, os.O_WRONLY)
v = 0
while True:
    v += 1
    block = v.to_bytes(8, "little") * (mib // 8)
    os.pwrite(fd, block, 0)
    os.pwrite(fd, block, size - mib)
    if v == 1:
        open(ready, "w").close()
    time.sleep(random.choice((0.001, 0.01, 0.4)))  # now and then a pause a copy fits in
"""


def _block(version: int) -> bytes:
    return version.to_bytes(8, "little") * (MiB // 8)


def _version_of(block: bytes) -> int | None:
    """The version number a MiB written by WRITER holds; None when it is a mix of two."""
    v = int.from_bytes(block[:8], "little")
    return v if block == _block(v) else None


@contextlib.contextmanager
def _rewriting(path: Path, tmp_path: Path) -> Iterator[None]:
    """A writer process rewriting path in place for as long as the block runs."""
    ready = tmp_path / f"writer-{uuid.uuid4().hex[:8]}"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(ready), str(path.stat().st_size)]
    )
    try:
        wait_for(ready.exists, what="the writer's first rewrite")
        yield
    finally:
        writer.kill()
        writer.wait()


def _published(node: NodeProcess, name: str, relpath: str) -> bytes:
    ds = LocalDataset(node.shm_dir / "datasets" / name)
    try:
        i = ds.manifest.resolve(relpath)
        return bytes(ds.read(i, 0, int(ds.manifest.size[i])))
    finally:
        ds.release()


def _entry(node: NodeProcess, name: str) -> dict[str, Any] | None:
    return next((d for d in node.request("list")["datasets"] if d["name"] == name), None)


def _assert_nothing_left(node: NodeProcess, name: str) -> None:
    """A failed load: not published, listed only as failed, no staged bytes left."""
    assert not (node.shm_dir / "datasets" / name).exists()
    entry = _entry(node, name)
    assert entry is None or entry["state"] == "failed", entry
    wait_for(lambda: not os.listdir(node.shm_dir / "staging"), what="staging emptied")


def _assert_stops_within_bound(node: NodeProcess) -> None:
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    try:
        node.proc.wait(STOP_BOUND)
    except subprocess.TimeoutExpired:
        node.proc.kill()
        node.proc.wait()
        pytest.fail(f"the node did not end within {STOP_BOUND:.0f}s of SIGTERM")


def _swap_for_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.fixture
def whole_file_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    """A node whose segments hold the 64 MiB file in one piece: one open, one copy (with
    smaller segments each piece is opened and checked on its own)."""
    n = NodeProcess(shm_dir, token_file, tmp_path, segment_size="64MiB").start()
    yield n
    n.stop()


def test_a_file_rewritten_during_its_copy_is_published_whole_or_not_at_all(
    whole_file_node: NodeProcess, tmp_path: Path
) -> None:
    node = whole_file_node
    src = tmp_path / "src"
    src.mkdir()
    big = src / "big.bin"
    middle = os.urandom(BIG - 2 * MiB)
    big.write_bytes(_block(0) + middle + _block(0))
    outcomes = {"ready": 0, "failed": 0}
    for attempt in range(20):
        name = f"torn{attempt}"
        with _rewriting(big, tmp_path):
            done = run_cli("preload", str(src), "--name", name, "-q", env=node.env())
        if done.returncode == 0:
            data = _published(node, name, "big.bin")
            assert data[MiB:-MiB] == middle
            first, last = _version_of(data[:MiB]), _version_of(data[-MiB:])
            assert first is not None and first == last, f"torn: versions {first} and {last}"
            node.request("unload", name=name)
            outcomes["ready"] += 1
        else:
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 10 and len(lines) == 1, done.stderr
            assert "source changed" in lines[0] and "big.bin" in lines[0]
            _assert_nothing_left(node, name)
            outcomes["failed"] += 1
    print(f"20 preloads under a rewriting writer: {outcomes}")


def _with_a_late_file(src: Path) -> Path:
    """src with a large (sparse) first file and a small last one: the copy reaches the last
    file well after the preload op has answered, so a change made to it right after that
    answer lands after the scan and before the file is opened."""
    src.mkdir()
    with open(src / "a.bin", "wb") as f:
        f.truncate(512 * MiB)
    late = src / "z.bin"
    late.write_bytes(os.urandom(4096))
    return late


def _wait_ended(node: NodeProcess, name: str, timeout: float) -> dict[str, Any]:
    def ended() -> bool:
        entry = _entry(node, name)
        return entry is not None and entry["state"] in ("ready", "failed")

    wait_for(ended, timeout=timeout, what=f"the preload of {name} to end")
    entry = _entry(node, name)
    assert entry is not None
    return entry


def test_a_fifo_swapped_in_after_the_scan_fails_the_preload_in_one_line(
    node: NodeProcess, tmp_path: Path
) -> None:
    late = _with_a_late_file(tmp_path / "src")
    admin.preload(node.settings(), str(tmp_path / "src"), "fifo", wait=False)
    _swap_for_fifo(late)
    entry = _wait_ended(node, "fifo", node.client_timeout)
    assert entry["state"] == "failed", entry
    assert "non-regular file" in entry["error"] and "z.bin" in entry["error"]
    assert "\n" not in entry["error"]
    _assert_nothing_left(node, "fifo")
    _assert_stops_within_bound(node)


def test_a_file_changed_once_after_the_scan_is_loaded_again_from_a_new_scan(
    node: NodeProcess, tmp_path: Path
) -> None:
    late = _with_a_late_file(tmp_path / "src")
    admin.preload(node.settings(), str(tmp_path / "src"), "again", wait=False)
    new = os.urandom(4096)
    late.write_bytes(new)
    entry = _wait_ended(node, "again", 120)
    assert entry["state"] == "ready", entry
    assert _published(node, "again", "z.bin") == new
    assert "attempt 1 of 3" in node.log()


def test_a_read_through_file_turned_fifo_is_an_eio_and_the_node_still_stops(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(100_000))
    m = mount_source(node, tmp_path, mounts, src)  # scanned now; nothing read yet
    _swap_for_fifo(src / "f.bin")
    with pytest.raises(OSError) as e:
        read_uncached(m.mountpoint / "f.bin")
    assert e.value.errno == errno.EIO
    assert "non-regular file" in node.log()
    _assert_stops_within_bound(node)


def _blocked_in_fuse(pid: int) -> bool:
    """Whether a thread of pid waits on a FUSE request (its server stopped answering)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if "fuse" in Path(f"/proc/{pid}/task/{tid}/stack").read_text():
                return True
    return False


@pytest.mark.fuse
def test_a_source_read_that_hangs_never_keeps_the_node_from_stopping(
    node: NodeProcess, token_file: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    # A hung filesystem under the source, as an NFS server that stopped answering: a kspeedfs
    # mount of another node, its mount processes stopped with SIGSTOP.
    other_shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    other = NodeProcess(other_shm, token_file, tmp_path / "other").start()
    hung = MountProcess(tmp_path / "hung", other.env(), tmp_path, own_session=True)
    reader: subprocess.Popen[bytes] | None = None
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "f.bin").write_bytes(os.urandom(300_000))
        admin.preload(other.settings(), str(src), "ds", show_progress=False)
        hung.start()
        m = mount_source(node, tmp_path, mounts, hung.mountpoint / "ds")  # scanned: it answers
        assert hung.proc is not None
        os.killpg(hung.proc.pid, signal.SIGSTOP)
        reader = subprocess.Popen(
            [sys.executable, "-c", f"open({str(m.mountpoint / 'f.bin')!r}, 'rb').read()"],
            stderr=subprocess.DEVNULL,
        )
        assert node.proc is not None
        pid = node.proc.pid
        wait_for(lambda: _blocked_in_fuse(pid), what="the node's fill blocked in a source read")
        _assert_stops_within_bound(node)
        # A restart cleans up what the abandoned fill had staged.
        again = NodeProcess(node.shm_dir, token_file, tmp_path / "again").start()
        try:
            assert os.listdir(node.shm_dir / "staging") == []
        finally:
            again.stop()
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        if hung.proc is not None and hung.proc.poll() is None:
            os.killpg(hung.proc.pid, signal.SIGCONT)
        hung.stop()
        other.stop()
        shutil.rmtree(other_shm, ignore_errors=True)
