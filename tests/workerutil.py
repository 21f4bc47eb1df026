"""A mount's serving processes, for the tests that kill them (test_mount_workers,
test_fuse_uring, test_fuse_files): its children, its request counters, and a mount started with
N workers and waited for until every one is ready."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from conftest import MountProcess, wait_for


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (each thread lists those it started)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return found


def stats(mountpoint: Path) -> dict[str, Any]:
    """The mount's request counters (`user.kspeedfs.stats`)."""
    found: dict[str, Any] = json.loads(os.getxattr(mountpoint, "user.kspeedfs.stats"))
    return found


def start_workers_mount(
    env: dict[str, str], tmp_path: Path, mounts: list[MountProcess], workers: int
) -> MountProcess:
    """A mount at tmp_path/mnt served by `workers` processes, once every one is ready: one
    killed before its first start fails the mount ("failed to start"), which a loaded machine
    showed when a test killed one too early."""
    m = MountProcess(tmp_path / "mnt", env, tmp_path, args=("--workers", str(workers)))
    mounts.append(m)
    m.start()
    assert m.proc is not None
    pid = m.proc.pid
    wait_for(lambda: len(children(pid)) == workers, what=f"{workers} workers")
    wait_for(lambda: " served by " in m.log(), what="every worker ready")
    return m
