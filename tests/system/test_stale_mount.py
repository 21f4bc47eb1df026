"""A mount whose FUSE process died: a clear error on mount, and `umount -z` clears it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for

from kspeedfs.system.mountinfo import is_stale, kspeedfs_mounted

pytestmark = pytest.mark.slow  # stale mounts left by killed processes


@pytest.mark.fuse
def test_stale_mount_is_reported_and_cleared(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    assert m.proc is not None
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait()
    wait_for(lambda: is_stale(m.mountpoint), what="the mount to go stale")

    again = run_cli("mount", str(m.mountpoint), env=node.env())
    assert again.returncode == 8
    assert "stale kspeedfs mount" in again.stderr and "umount -z" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

    cleared = run_cli("umount", "-z", str(m.mountpoint), env=node.env())
    assert cleared.returncode == 0, cleared.stderr
    assert not kspeedfs_mounted(m.mountpoint)

    m2 = MountProcess(m.mountpoint, node.env(), tmp_path)
    mounts.append(m2)
    m2.start()
    assert os.listdir(m2.mountpoint) == []


@pytest.mark.fuse
def test_auto_unmount_leaves_no_stale_mount(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path, args=("-o", "auto_unmount"))
    mounts.append(m)
    m.start()
    assert m.proc is not None
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait()
    # fusermount3 holds the other end of our socket and unmounts when it closes.
    wait_for(lambda: not kspeedfs_mounted(m.mountpoint), what="fusermount3 to unmount")
    assert not is_stale(m.mountpoint)
