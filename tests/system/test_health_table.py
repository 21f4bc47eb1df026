"""The shared node-health table (/dev/shm/kspeedfs-health.UID) is removed when its last user
goes: processes that exit in turn, one killed with -9, a multiprocessing child as the last."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from kspeedfs.client.health import NodeHealth

# A user of the table: opens it, marks a node, says so, and holds it until its stdin closes.
USER = """
import sys
from kspeedfs.client.health import NodeHealth
health = NodeHealth(sys.argv[1])
health.suspect_for("10.0.0.9:7420", 60)
print("open", flush=True)
sys.stdin.read()
"""


def start_user(table: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", USER, str(table)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    return proc


def leave(proc: subprocess.Popen[str]) -> None:
    """The user exits as a process does at its end (its stdin closed)."""
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_the_file_is_gone_once_both_users_exit(tmp_path: Path) -> None:
    table = tmp_path / "health"
    first, second = start_user(table), start_user(table)
    leave(first)
    assert table.exists()
    probe = NodeHealth(str(table))
    assert probe.is_suspect("10.0.0.9:7420")  # the second's table, still shared
    probe.close()
    leave(second)
    assert not table.exists()


def test_a_user_killed_with_sigkill_does_not_hold_the_file(tmp_path: Path) -> None:
    table = tmp_path / "health"
    crashed, other = start_user(table), start_user(table)
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait(timeout=30)
    assert table.exists()
    leave(other)
    assert not table.exists()


_held: list[NodeHealth] = []


def _use(table: str) -> None:
    _held.append(NodeHealth(table))  # held until the child ends
    _held[0].down_for("10.0.0.8:7420", 60)


def test_a_multiprocessing_child_as_the_last_user_removes_it(tmp_path: Path) -> None:
    """A DataLoader worker ends without atexit: its leaving runs all the same."""
    table = tmp_path / "health"
    child = multiprocessing.get_context("spawn").Process(target=_use, args=(str(table),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert not table.exists()
