"""Helpers for mountd and systemd tests: a $NOTIFY_SOCKET listener, a mountd subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import wait_for

from kspeedfs.system.mountinfo import mount_entries

MOUNTD = [sys.executable, "-m", "mountd.daemon"]


class NotifyListener:
    """A unix datagram socket in place of systemd's: records (sender pid, fields) per message."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        # The kernel then attaches the sender's pid, as systemd uses for NotifyAccess=main.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[int, dict[str, str]]] = []

    def receive_until(
        self,
        done: Callable[[list[tuple[int, dict[str, str]]]], bool],
        what: str,
        timeout: float = 60.0,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} on $NOTIFY_SOCKET; got {self.messages}")
            self.sock.settimeout(left)
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            pid = -1
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((pid, fields))

    def senders(self) -> set[int]:
        return {pid for pid, _ in self.messages}

    def close(self) -> None:
        self.sock.close()


def declare(mounts_dir: Path, name: str, **keys: Any) -> Path:
    """Write mounts_dir/NAME.toml; JSON strings and lists are valid TOML values."""
    mounts_dir.mkdir(parents=True, exist_ok=True)
    path = mounts_dir / f"{name}.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


class MountdProcess:
    """A `kspeedfs-mountd run` subprocess with short retry delays and its own status file."""

    def __init__(self, mounts_dir: Path, state_file: Path, env: dict[str, str], log_path: Path):
        self.mounts_dir = mounts_dir
        self.state_file = state_file
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True) -> MountdProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *MOUNTD,
                    "--mounts-dir",
                    str(self.mounts_dir),
                    "--state-file",
                    str(self.state_file),
                    "run",
                    "--retry-min",
                    "0.2",
                    "--retry-max",
                    "1",
                    "--check-interval",
                    "0.2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        if wait_ready:
            self.wait(lambda s: bool(s.get("ready")), "mountd ready")
        return self

    def state(self) -> dict[str, Any] | None:
        try:
            with open(self.state_file) as f:
                state: dict[str, Any] = json.load(f)
                return state
        except (FileNotFoundError, ValueError):
            return None

    def mount(self, name: str) -> dict[str, Any] | None:
        state = self.state() or {}
        return next((m for m in state.get("mounts", []) if m["name"] == name), None)

    def wait(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        def check() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"mountd exited with {self.proc.returncode}: {self.log()}")
            state = self.state()
            return state is not None and predicate(state)

        try:
            wait_for(check, timeout=60, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}; state {self.state()}; log:\n{self.log()}") from None
        state = self.state()
        assert state is not None
        return state

    def wait_mount(self, name: str, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
        def check(state: dict[str, Any]) -> bool:
            m = next((m for m in state["mounts"] if m["name"] == name), None)
            return m is not None and predicate(m)

        self.wait(check, f"{name}: {what}")

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def kspeedfs_mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + os.sep
    return [
        e.mountpoint for e in mount_entries() if e.is_kspeedfs and e.mountpoint.startswith(prefix)
    ]


def unmount_all_under(root: Path) -> None:
    """Teardown: whatever a failed test left mounted under `root` goes, stale or not."""
    for mountpoint in reversed(kspeedfs_mounts_under(root)):
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait long for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
