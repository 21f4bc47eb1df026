"""A mount's life is one thing: `mount` returns once the dataset answers, `umount` once the mount
process has ended, and no mount process (nor mountd, nor mount.kspeedfs) unmounts a mount that
is not its own, so that an unmount followed at once by a mount leaves the new mount up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from mountdutil import MountdProcess, alive, declare, unmount_all_under

from kspeedfs.fuse.mount import unmount
from kspeedfs.system.mountinfo import kspeedfs_mounted

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # mounts racing umount, mount.kspeedfs and mountd

ROUNDS = 50
HELPER = str(Path(sys.executable).parent / "mount.kspeedfs")


@pytest.fixture
def loaded(node: NodeProcess, tree: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    done = run_cli("preload", str(tree), "--name", "ds", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    yield node
    unmount_all_under(tmp_path)


def mount(node: NodeProcess, mp: Path, log: Path) -> None:
    args = ("mount", str(mp), "--dataset", "ds", "--workers", "1", "--log-file", str(log))
    done = run_cli(*args, env=node.env())
    assert done.returncode == 0, done.stderr


def umount(node: NodeProcess, mp: Path) -> None:
    done = run_cli("umount", str(mp), env=node.env())
    assert done.returncode == 0, done.stderr


def assert_serves(mp: Path, tree: Path) -> None:
    """Right now, through the kernel: the dataset's top level, and a file's bytes."""
    assert sorted(os.listdir(os.fsencode(mp))) == sorted(os.listdir(os.fsencode(tree)))
    assert (mp / "a" / "f007.bin").read_bytes() == (tree / "a" / "f007.bin").read_bytes()


def mount_processes(mp: Path) -> list[int]:
    """The pids of `kspeedfs mount MP` and `mount.kspeedfs DS MP` processes (a background
    mount keeps the command line it was started with; its serving processes have their own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        cli = b"kspeedfs.cli" in argv and b"mount" in argv
        helper = any(arg.endswith(b"/mount.kspeedfs") for arg in argv)
        if (cli or helper) and os.fsencode(mp) in argv and alive(int(pid)):
            found.append(int(pid))
    return found


def test_umount_then_mount_at_once_leaves_the_new_mount_up(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mp, log = tmp_path / "mnt", tmp_path / "mount.log"
    mp.mkdir()
    mount(loaded, mp, log)
    for _ in range(ROUNDS):
        # `kspeedfs umount`'s own code, without a CLI start per round: the rounds fit a minute.
        # The previous round's mount must still be there to unmount: nothing took it away.
        unmount(str(mp))
        mount(loaded, mp, log)
        assert_serves(mp, tree)
    unmount(str(mp))
    assert not kspeedfs_mounted(mp)


def test_umount_returns_once_the_mount_process_has_ended(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    mount(loaded, mp, tmp_path / "mount.log")
    [pid] = mount_processes(mp)
    umount(loaded, mp)
    assert not alive(pid)


def test_a_mount_process_leaves_a_mount_that_took_its_place_alone(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    old = MountProcess(mp, loaded.env(), tmp_path, args=("--dataset", "ds")).start()
    assert old.proc is not None
    wait_for(lambda: " mounted ds at " in old.log(), what="the first mount to be ready")
    try:
        # A file held open keeps the old mount (and its process) alive once detached.
        with open(mp / "a" / "small.txt", "rb"):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=True)
            mount(loaded, mp, tmp_path / "mount.log")
            old.proc.send_signal(signal.SIGTERM)  # its teardown: not its mount at mp any more
            assert old.proc.wait(30) == 0
        assert_serves(mp, tree)
        umount(loaded, mp)
    finally:
        if old.proc.poll() is None:
            old.proc.kill()
            old.proc.wait()


def test_mount_helper_after_umount8_at_once_keeps_its_mount(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    """mount(8)/umount(8) in a loop: umount(8) does not wait for the mount process, so each new
    mount.kspeedfs mount meets the teardown of the one before it."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    opts = f"nodes={loaded.address},token_file={loaded.token_file}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
    for _ in range(10):
        done = subprocess.run(
            [HELPER, "ds", str(mp), "-o", opts], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        assert_serves(mp, tree)
        subprocess.run(["umount", str(mp)], check=True)
    wait_for(lambda: not mount_processes(mp), what="the last mount process to end")
    assert not kspeedfs_mounted(mp)


def test_mountd_leaves_a_live_mount_of_another_process_alone(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mp, mounts_dir = tmp_path / "mnt", tmp_path / "mounts.d"
    mp.mkdir()
    mount(loaded, mp, tmp_path / "mount.log")
    declare(mounts_dir, "a", mountpoint=str(mp), dataset="ds")
    mountd = MountdProcess(mounts_dir, tmp_path / "state.json", loaded.env(), tmp_path / "log")
    try:
        mountd.start()
        mountd.wait_mount(
            "a", lambda m: "busy" in (m["last_error"] or ""), "refused the busy mountpoint"
        )
        assert_serves(mp, tree)
        # Once its owner unmounts it, mountd mounts its own there.
        umount(loaded, mp)
        mountd.wait_mount("a", lambda m: m["state"] == "mounted", "mounted its own")
        assert_serves(mp, tree)
    finally:
        mountd.stop()
