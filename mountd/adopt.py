"""Mount processes an earlier mountd started, adopted by a restarted one with their FUSE fds.

A mount process outlives its mountd (a session of its own, its own fds keep the connection).
mountd listens on a Unix socket beside its state file; a mount process whose mountd died
connects there and sends its connection again (takeover.py: {"adopt": {"mountpoint", "pid"},
"kept": RECORD} + its fds). The supervisor of that mountpoint then watches that process
through a pidfd (it is not our child) instead of mounting again, and takes its connection over
as for a child when it dies."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import trio

from kspeedfs.format.errors import ProtocolError
from kspeedfs.fuse import takeover
from kspeedfs.net import fdpass

log = logging.getLogger(__name__)

ADOPT_WAIT = 5.0  # seconds a supervisor waits for the live mount at its mountpoint to call


def keeper_address(state_file: Path) -> Path:
    return state_file.with_suffix(".sock")


class AdoptedProcess:
    """The part of trio.Process a supervisor uses, for a process that is not our child: its
    exit is seen through a pidfd, its exit code is not ours to read (None until it ends, then
    0)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        self.returncode: int | None = None
        self.stdout = None

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._fd):
            self._ended()
        return self.returncode

    async def wait(self) -> int:
        if self.returncode is None:
            await trio.lowlevel.wait_readable(self._fd)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self._fd, signum)

    def _ended(self) -> None:
        self.returncode = 0
        os.close(self._fd)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


Adopt = Callable[[str, socket.socket, takeover.Kept, int], bool]


async def listen(path: Path, adopt: Adopt) -> None:
    """Accept mount processes at `path`; `adopt(mountpoint, sock, kept, pid)` says whether a
    supervisor took the process (else its fds are closed: it serves on, unsupervised)."""
    path.unlink(missing_ok=True)
    server = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    await server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(64)
    try:
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await server.accept()
                nursery.start_soon(_first_message, conn.detach(), adopt)
    finally:
        server.close()
        path.unlink(missing_ok=True)


async def _first_message(fileno: int, adopt: Adopt) -> None:
    sock = socket.socket(fileno=fileno)
    sock.setblocking(False)
    with trio.move_on_after(takeover.HANDOFF_WAIT):
        await trio.lowlevel.wait_readable(sock)
    try:
        msg, fds = fdpass.receive(sock, takeover.MAX_FDS)
    except (OSError, ProtocolError) as e:
        log.warning("a mount process that called sent nothing usable: %s", e)
        sock.close()
        return
    who = msg.get("adopt")
    kept = takeover.apply(None, msg, fds)
    if not isinstance(who, dict) or kept is None:
        if kept is not None:
            kept.close()
        sock.close()
        return
    mountpoint, pid = str(who.get("mountpoint")), int(who.get("pid", 0))
    if not adopt(mountpoint, sock, kept, pid):
        log.warning("mount process %d at %s: no declaration of that mountpoint", pid, mountpoint)
        kept.close()
        sock.close()
