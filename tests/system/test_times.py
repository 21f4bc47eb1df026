"""Times as the filesystem gives them: files and folders dated before 1970, at 0 and far in the
future are preloaded and served with their own times through the mount (every dataset, one at
the root with --dataset, a read-through --source), the fast path and kspeedfs://."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from conftest import MountProcess, NodeProcess, kw, preload, run_cli, wait_for
from rt_util import EnvNode, cache_status

from kspeedfs.format.errors import InvalidArgument
from pytorch_ext import KSpeedFolder

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # a node and three mounts

NS = 1_000_000_000
# The times the issue names, and two at the nanosecond on either side of 1970.
WANTED = {
    "before-2^40s.bin": -(2**40) * NS,
    "minus-1s.bin": -NS,
    "minus-1ns.bin": -1,
    "epoch.bin": 0,
    "plus-1ns.bin": 1,
    "at-2^33s.bin": 2**33 * NS,
    "year-2300.bin": 10_413_792_000 * NS,
}


def held(folder: Path, want: int) -> int:
    """The mtime a file in `folder` gets when set to `want` (the filesystem clamps)."""
    probe = folder / ".probe"
    probe.write_bytes(b"")
    try:
        os.utime(probe, ns=(0, want))
        return os.stat(probe).st_mtime_ns
    finally:
        probe.unlink()


@pytest.fixture
def dated(tmp_path: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    """A source folder whose files, a subfolder and the root carry odd times: on tmpfs where
    there is one (it holds any 64-bit second; ext4 holds 1901 to 2446), each time the
    filesystem holds, and the largest and the smallest it accepts."""
    shm = Path("/dev/shm")
    root = shm / f"kspeedfs-times-{uuid.uuid4().hex[:10]}" if shm.is_dir() else tmp_path / "src"
    root.mkdir()
    try:
        times = {name: t for name, t in WANTED.items() if held(root, t) == t}
        times["largest.bin"] = held(root, (2**63 - 1) * NS + NS - 1)
        times["smallest.bin"] = held(root, -(2**63) * NS)
        for i, (name, t) in enumerate(sorted(times.items())):
            (root / name).write_bytes(b"%d %s\n" % (i, name.encode()) * (i + 1))
            os.utime(root / name, ns=(0, t))
        old = root / "old-folder"
        old.mkdir()
        (old / "inside.txt").write_bytes(b"inside\n")
        os.utime(old / "inside.txt", ns=(0, times["smallest.bin"]))
        os.utime(old, ns=(0, min(times.values())))
        times["old-folder/inside.txt"] = times["smallest.bin"]
        times["old-folder"] = min(times.values())
        os.utime(root, ns=(0, -NS))  # the root of a --dataset or --source mount
        times[""] = -NS
        assert len(times) >= 7, times
        yield root, times
    finally:
        shutil.rmtree(root, ignore_errors=True)


def mount(node: NodeProcess, where: Path, mounts: list[MountProcess], *args: str) -> Path:
    """A mount that passed its readiness check (a failed one exits and unmounts)."""
    m = MountProcess(where, node.env(), where.parent, args=args)
    mounts.append(m)
    m.start()
    wait_for(lambda: "mounted" in m.log() or m.proc is None or m.proc.poll() is not None)
    assert m.proc is not None and m.proc.poll() is None, m.log()
    assert os.path.ismount(where)
    return where


def test_odd_times_through_every_door(
    node: NodeProcess,
    dated: tuple[Path, dict[str, int]],
    tmp_path: Path,
    mounts: list[MountProcess],
) -> None:
    src, times = dated
    preload(node, src, "dated")  # a file dated 2300 once failed the whole preload
    every = mount(node, tmp_path / "every", mounts)
    single = mount(node, tmp_path / "single", mounts, "--dataset", "dated")
    through = mount(node, tmp_path / "through", mounts, "--source", str(src), "--name", "rt")
    for served in (every / "dated", single, through):
        for rel, t in times.items():
            st = os.stat(served / rel)
            assert st.st_mtime_ns == t, (served, rel)
            assert st.st_mtime_ns == os.stat(src / rel).st_mtime_ns
            if rel.endswith((".bin", ".txt")):
                assert (served / rel).read_bytes() == (src / rel).read_bytes()
        assert sorted(os.listdir(served)) == sorted(os.listdir(src))

    # The fast path: the same bytes, and the manifest it reads holds the same times.
    ds = KSpeedFolder(str(src), **kw(node))
    m = ds._reader.manifest
    for rel, t in times.items():
        entry = m.resolve(rel)
        assert m.mtime_ns[entry] == t, rel
        if m.is_file(entry):
            assert bytes(ds.read(rel)) == (src / rel).read_bytes()

    # kspeedfs:// says what fsspec's local filesystem says.
    fs = fsspec.filesystem(
        "kspeedfs", nodes=node.address, token=str(node.token_file), skip_instance_cache=True
    )
    local = fsspec.filesystem("file")
    for rel in times:
        path = f"dated/{rel}".rstrip("/")
        assert fs.info(path)["mtime"] == local.info(str(src / rel))["mtime"], rel
        try:
            want = local.modified(str(src / rel))
        except (ValueError, OverflowError, OSError):  # past what datetime holds
            with pytest.raises(InvalidArgument, match="datetime"):
                fs.modified(path)
        else:
            assert fs.modified(path) == want, rel


def test_a_rewrite_with_its_mtime_put_back_is_refreshed(
    token_file: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    """`refresh` and the source check compare what a fill compares (size, mtime, ctime,
    inode, device): a file rewritten in place with its mtime put back is a change, and the
    segment that held its old bytes is not carried to the new instance."""
    node = EnvNode(
        Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}",
        token_file,
        tmp_path,
        env_extra={"KSPEEDFS_SOURCE_CHECK_INTERVAL": "0.2"},
    )
    try:
        node.start()
        src = tmp_path / "src"
        src.mkdir()
        # 700 kB each: every file opens a segment of its own (1 MiB segments).
        old = {name: os.urandom(700_000) for name in ("a.bin", "b.bin")}
        for name, data in old.items():
            (src / name).write_bytes(data)
        m = mount(node, tmp_path / "mnt", mounts, "--source", str(src), "--name", "rt")
        assert (m / "a.bin").read_bytes() == old["a.bin"]  # a.bin's segment filled, b.bin's not
        new = {name: os.urandom(len(data)) for name, data in old.items()}
        for name, data in new.items():
            before = os.stat(src / name)
            with open(src / name, "r+b") as f:  # in place: the same inode
                f.write(data)
            os.utime(src / name, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = os.stat(src / name)
            assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
                before.st_size,
                before.st_mtime_ns,
                before.st_ino,
            )
            assert after.st_ctime_ns != before.st_ctime_ns
        wait_for(lambda: cache_status(node, "rt")["stale"] == 2, what="the change seen")
        with pytest.raises(OSError):  # its fill sees another version: never served torn
            (m / "b.bin").read_bytes()
        done = run_cli("refresh", "rt", env=node.env())
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("rt: refreshed, 2 files changed, 0 of "), done.stdout
        assert cache_status(node, "rt")["stale"] == 0
        fresh = mount(node, tmp_path / "fresh", mounts, "--source", str(src), "--name", "rt")
        for name, data in new.items():
            assert (fresh / name).read_bytes() == data
        done = run_cli("refresh", "rt", env=node.env())
        assert done.stdout.strip() == "rt: unchanged", done.stdout
    finally:
        node.stop()
        shutil.rmtree(node.shm_dir, ignore_errors=True)
