"""What every harness process shares: the command, free ports, waiting, stopping, a private env."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kspeedfs.format import auth

# This interpreter: children run the checkout and virtualenv under test, not an installed one.
KSPEEDFS = [sys.executable, "-m", "kspeedfs.cli"]
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0

# Each node and mount these helpers start, as (its log, its process), so that a test harness
# can read what they logged (tests/conftest.py fails a test whose processes logged a traceback
# it did not expect) and forget those that exited.
STARTED: list[tuple[Path, subprocess.Popen[bytes]]] = []


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (the kernel may hand the same one out twice in a row)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` until it is true; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ensure_token(path: Path) -> Path:
    """An admin token at `path`, made when there is none yet."""
    if not path.exists():
        auth.write_token(path, auth.new_admin_token())
    return path


def is_users_setting(key: str) -> bool:
    """Whether a variable is a KSPEEDFS_* setting of the user's, which a test's children must
    not inherit: all of them but the health table the test chose (tests/conftest.py)."""
    return key.startswith("KSPEEDFS_") and key != "KSPEEDFS_HEALTH_TABLE"


def private_env(config_file: Path) -> dict[str, str]:
    """This environment without KSPEEDFS_* variables and with `config_file` (write it empty)
    as the config: the children read nothing of the user's. KSPEEDFS_HEALTH_TABLE stays: the
    readers a test starts share the table it chose (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if not is_users_setting(k)}
    env["KSPEEDFS_CONFIG"] = str(config_file)
    return env


def log_tail(path: Path) -> str:
    """The last lines of a log, on one line (for the error of a child that died)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-3:])


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for a process that was asked to stop; kill it when it does not."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
