"""Under a real systemd: the units, mountd and the fstab helper in a booted container.

One container for the module (a copy of a cached debootstrap root), driven the way a user
drives a machine: install-systemd, enable --now, mount -a, kill -9, restart, reboot, stop.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for
from nspawnutil import REPO, Container, missing

pytestmark = [pytest.mark.slow, pytest.mark.fuse]

SOURCE = "/srv/data/imagenet"
FILES = {"train/n01/a.bin": 3_000_000, "train/n01/b.bin": 100_000, "train/n02/c.bin": 1_200_000}
BIG = "train/n01/a.bin"
DECLARED = "/mnt/declared"
FSTAB = "/mnt/fstab"
AUTO = "/mnt/auto"
DECLARATION = f"""\
mountpoint = "{DECLARED}"
dataset = "imagenet"
source = "{SOURCE}"
options = ["allow_other"]
"""


def readme_fstab_options() -> str:
    """The options of the fstab line in docs/mounts.md: what is tested is what users copy."""
    lines = (REPO / "docs" / "mounts.md").read_text().splitlines()
    return next(line.split()[3] for line in lines if line.startswith("imagenet  /mnt/imagenet "))


# The docs' line, and the same with x-systemd.automount (mounted at its first access).
FSTAB_LINES = f"""\
imagenet  {FSTAB}  fuse.kspeedfs  {readme_fstab_options()}  0 0
imagenet  {AUTO}  fuse.kspeedfs  {readme_fstab_options()},x-systemd.automount  0 0
"""
SERVED = {DECLARED, FSTAB, AUTO}


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    why = missing()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("nspawn")
    box = Container(tmp / "root", tmp / "nspawn.log")
    try:
        box.prepare()
        for rel, size in FILES.items():
            path = box.root / SOURCE.lstrip("/") / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
        for mp in SERVED:
            (box.root / mp.lstrip("/")).mkdir(parents=True)
        box.boot()
        yield box
    finally:
        box.stop()
        shutil.rmtree(box.root, ignore_errors=True)  # 300 MB a copy


def source_bytes(box: Container, rel: str) -> bytes:
    return (box.root / SOURCE.lstrip("/") / rel).read_bytes()


def assert_serves(box: Container, mountpoint: str) -> None:
    for rel in FILES:
        got = box.host_path(f"{mountpoint}/{rel}").read_bytes()
        assert got == source_bytes(box, rel), f"{mountpoint}/{rel}"


def kspeedfs(box: Container, *args: str) -> str:
    return box.run(str(Path(sys.executable).parent / "kspeedfs"), *args).stdout


def declared_mount(box: Container) -> dict[str, object]:
    state = json.loads(kspeedfs(box, "mounts", "--json"))
    return next(m for m in state["mounts"] if m["mountpoint"] == DECLARED)


def assert_started_and_notified(box: Container) -> None:
    """Type=notify honoured: active only after READY=1, with the STATUS= the node sent."""
    node = box.unit("kspeedfs-node", "ActiveState", "Type", "StatusText", "NRestarts")
    assert node["ActiveState"] == "active" and node["Type"] == "notify", node
    assert node["StatusText"].startswith("serving "), node
    assert node["NRestarts"] == "0", node
    # READY=1 means serving: the node answers at once, no retry.
    assert "127.0.0.1:7420" in kspeedfs(box, "status", "--token-file", "/etc/kspeedfs/token")
    mountd = box.unit("kspeedfs-mountd", "ActiveState", "Type", "StatusText")
    assert mountd["ActiveState"] == "active" and mountd["Type"] == "notify", mountd
    # mountd is READY once each declared mount had its first try: this one is up.
    assert declared_mount(box)["state"] == "mounted"


def test_install_systemd_then_enable_now_starts_the_node_and_mountd(box: Container) -> None:
    out = kspeedfs(box, "install-systemd")
    assert "wrote /etc/systemd/system/kspeedfs-node.service" in out
    (box.root / "etc/kspeedfs/mounts.d/declared.toml").write_text(DECLARATION)
    with open(box.root / "etc/fstab", "a") as fstab:
        fstab.write(FSTAB_LINES)
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "enable", "--now", "kspeedfs-node", "kspeedfs-mountd")
    assert_started_and_notified(box)
    assert box.mounts()[DECLARED] == "fuse.kspeedfs"
    assert_serves(box, DECLARED)


def test_reload_starts_and_stops_declared_mounts(box: Container) -> None:
    added = box.root / "etc/kspeedfs/mounts.d/every.toml"
    (box.root / "mnt/every").mkdir()
    added.write_text('mountpoint = "/mnt/every"\n')
    box.run("systemctl", "reload", "kspeedfs-mountd")
    wait_for(lambda: box.mounts().get("/mnt/every") == "fuse.kspeedfs", 60, "the new mount")
    assert_serves(box, "/mnt/every/imagenet")
    added.unlink()
    box.run("systemctl", "reload", "kspeedfs-mountd")
    wait_for(lambda: "/mnt/every" not in box.mounts(), 60, "the removed mount to go")
    assert box.mounts()[DECLARED] == "fuse.kspeedfs"


def test_mount_a_mounts_the_fstab_lines(box: Container) -> None:
    box.run("mount", "-a")
    mounts = box.mounts()
    assert mounts[FSTAB] == mounts[AUTO] == "fuse.kspeedfs", mounts
    assert_serves(box, FSTAB)
    assert_serves(box, AUTO)


def test_a_killed_mount_process_is_mounted_again(box: Container) -> None:
    before = declared_mount(box)
    box.run("/bin/sh", "-c", f"kill -9 {before['pid']}")

    def back() -> bool:
        now = declared_mount(box)
        return now["state"] == "mounted" and now["pid"] != before["pid"]

    wait_for(back, 60, "mountd to mount the killed mount again")
    assert_serves(box, DECLARED)


def test_node_restart_leaves_readers_with_old_bytes_or_a_clear_error(box: Container) -> None:
    want = source_bytes(box, BIG)
    with contextlib.ExitStack() as files:
        readers = {
            mp: files.enter_context(open(box.host_path(f"{mp}/{BIG}"), "rb", buffering=0))
            for mp in SERVED
        }
        for f in readers.values():
            assert f.read(1 << 20) == want[: 1 << 20]
        box.run("systemctl", "restart", "kspeedfs-node")
        for mp, f in readers.items():
            try:
                rest = f.read()
            except OSError as e:
                assert e.errno == errno.EIO, (mp, e)
            else:
                assert rest == want[1 << 20 :], mp
    for mp in SERVED:
        assert_serves(box, mp)


def test_reboot_brings_every_mount_back(box: Container) -> None:
    box.reboot()  # the cache was in the container's /dev/shm: mountd loads it again
    assert_started_and_notified(box)
    mounts = box.mounts()
    assert mounts[DECLARED] == mounts[FSTAB] == "fuse.kspeedfs", mounts
    assert mounts[AUTO] == "autofs", mounts
    assert_serves(box, DECLARED)
    assert_serves(box, FSTAB)
    # The first access mounts it: from inside, as autofs answers no one outside its namespace.
    assert box.run("ls", f"{AUTO}/train").stdout.split() == ["n01", "n02"]
    assert_serves(box, AUTO)
    assert box.mounts()[AUTO] == "fuse.kspeedfs"


def test_systemctl_stop_unmounts_cleanly(box: Container) -> None:
    box.run("systemctl", "stop", "kspeedfs-mountd", "mnt-fstab.mount", "mnt-auto.mount")
    mounts = box.mounts()
    assert DECLARED not in mounts and FSTAB not in mounts, mounts
    assert mounts.get(AUTO) == "autofs", mounts  # the automount waits for the next access
    for name in ("kspeedfs-mountd.service", "mnt-fstab.mount", "mnt-auto.mount"):
        unit = box.unit(name, "ActiveState", "Result")
        assert unit == {"ActiveState": "inactive", "Result": "success"}, (name, unit)
    box.run("systemctl", "stop", "kspeedfs-node")
    node = box.unit("kspeedfs-node", "ActiveState", "Result")
    assert node == {"ActiveState": "inactive", "Result": "success"}, node
    # Through every scenario of both boots, errors were log lines: no traceback.
    journal = box.run("journalctl", "--no-pager", "-o", "cat").stdout
    assert "Traceback" not in journal
