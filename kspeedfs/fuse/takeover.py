"""A mount's FUSE connection kept by mountd across a death of its mount process, and handed over.

The kernel keeps a FUSE connection alive while any fd of it (/dev/fuse or a clone) is open,
and ends the requests a closing fd had read (ECONNABORTED) unless another holder of the same
open file keeps it. So mountd (the keeper) holds a dup of the session's fd and of every
worker's clone: when the mount process dies (an OOM kill), its workers end with it, the
requests they had read stay parked on the kept fds, new ones queue, and nothing fails. mountd
starts a new mount process and hands it the kept fds instead of mounting again: it asks the
kernel to resend what was parked (FUSE_NOTIFY_RESEND) and serves the SAME connection, so a
container that bound the mountpoint never sees ENOTCONN. The kernel sends INIT once per
connection; our INIT answer is fixed (kernel.py) except FUSE over io_uring, whose rings die
with their process: a mount with fuse_uring (or auto_unmount, whose fusermount3 unmounts when
the process dies) records that it cannot be taken over and is mounted again instead. The
kernel also keeps the inodes it was given, `slot << 32 | entry + 1`: the record carries the
slot of every instance, so the new process numbers them the same (datasets.py).

The dead process's workers serve on meanwhile (for at most LINGER seconds, with the datasets
they knew), so readers need not wait for the new process's start; mountd ends them once the new
process serves, then has the kernel resend what they had read.

mountd gives each mount process one end of a SOCK_SEQPACKET socket (its fd in KEEPER_ENV):
    keeper -> mount: {"take_over": RECORD or null} + the kept fds (session first)
    mount  -> keeper: {"kept": RECORD} + its fds, once mounted (or taken over)
    mount  -> keeper: {"serving": true} once every worker serves
    mount  -> keeper: {"slots": SLOTS, "next_slot": N} after each dataset change, sent
                      before any worker hears of it
RECORD: {"device", "workers", "can_take_over", "max_write", "slots", "next_slot"}; SLOTS:
[[slot, name, uuid], ...].
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
from collections.abc import Callable
from typing import Any

import trio

from kspeedfs.format.errors import ProtocolError
from kspeedfs.fuse.kernel import NOTIFY_RESEND, OUT_HEADER
from kspeedfs.net import fdpass

log = logging.getLogger(__name__)

KEEPER_ENV = "KSPEEDFS_KEEPER_FD"
KEEPER_SOCKET_ENV = "KSPEEDFS_KEEPER_SOCKET"  # where a restarted mountd listens
RECONNECT_INTERVAL = 0.2  # seconds between a keeperless mount's tries to reach mountd again
MAX_FDS = 64  # the session's fd and a clone per worker (at most 8 by default)
HANDOFF_WAIT = 10.0  # seconds a mount process waits for the keeper's first message
# Seconds the workers of a dead mount process serve on, so that readers wait only for the next
# process's start to be ended, not for it to be served: mountd ends them once it serves.
LINGER = 60.0

Slots = dict[tuple[str, str], int]  # (name, instance uuid) -> slot


@dataclasses.dataclass
class Kept:
    """A live connection's fds (the session's first, then each worker's clone) and its record."""

    record: dict[str, Any]
    fds: list[int]

    @property
    def workers(self) -> int:
        return len(self.fds) - 1

    def slots(self) -> Slots:
        return {(str(name), str(uuid)): int(slot) for slot, name, uuid in self.record["slots"]}

    def connected(self) -> bool:
        """Whether the kernel still serves this connection (not unmounted, not aborted)."""
        events = select.poll()
        events.register(self.fds[0], select.POLLIN)
        bad = select.POLLERR | select.POLLHUP | select.POLLNVAL
        return not any(ev & bad for _, ev in events.poll(0))

    def usable(self) -> bool:
        return bool(self.record.get("can_take_over")) and self.workers > 0 and self.connected()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def resend(fd: int) -> None:
    """Have the kernel queue again the requests read and not answered on the connection (those
    of workers just ended), for the serving ones."""
    try:
        os.writev(fd, [OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0)])
    except OSError as e:
        log.warning("the kernel cannot resend the requests of ended workers: %s", e)


def slot_list(slots: Slots) -> list[list[Any]]:
    return [[slot, name, uuid] for (name, uuid), slot in sorted(slots.items())]


# ---- the mount process's side


class KeeperLink:
    """The mount process's end of its keeper's socket (None where it runs without mountd)."""

    def __init__(self, sock: socket.socket, address: str = ""):
        self.sock = sock
        self.sock.settimeout(HANDOFF_WAIT)
        self.address = address  # mountd's listening socket, to be kept again after its restart
        self._failed = False

    @classmethod
    def from_env(cls) -> KeeperLink | None:
        value = os.environ.pop(KEEPER_ENV, "")  # not for the workers or fusermount3
        address = os.environ.pop(KEEPER_SOCKET_ENV, "")
        if not value.isdigit():
            return None
        try:
            sock = socket.socket(fileno=int(value))
        except OSError as e:
            log.warning("no keeper for this mount (%s=%s: %s)", KEEPER_ENV, value, e)
            return None
        sock.set_inheritable(False)
        return cls(sock, address)

    async def stay_kept(
        self, mountpoint: str, kept: Callable[[], tuple[dict[str, Any], list[int]]]
    ) -> None:
        """When mountd dies, the mount serves on (its own fds keep the connection); once a
        new mountd listens at `address`, give it the connection again (`kept()`: the record
        and the fds) so that it can take over when this process dies."""
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                if self.sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                    self.sock.recv(fdpass.MAX_MESSAGE)  # nothing is expected: drop it
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            self.sock.close()
            if not self.address:
                log.warning("mountd is gone: a crash of this process would remount")
                return
            log.warning("mountd is gone: serving on, waiting for a new one at %s", self.address)
            self.sock = await self._reconnect()
            record, fds = kept()
            self._failed = False
            self._send(
                {"adopt": {"mountpoint": mountpoint, "pid": os.getpid()}, "kept": record}, fds
            )
            log.info("a new mountd keeps this mount's connection")

    async def _reconnect(self) -> socket.socket:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                await trio.sleep(RECONNECT_INTERVAL)
                continue
            sock.settimeout(HANDOFF_WAIT)
            return sock

    def handoff(self) -> Kept | None:
        """The connection the keeper hands over, or None: mount anew."""
        try:
            msg, fds = fdpass.receive(self.sock, MAX_FDS)
        except (OSError, ProtocolError) as e:
            log.warning("the keeper sent nothing to take over (%s): mounting anew", e)
            return None
        record = msg.get("take_over")
        if not isinstance(record, dict) or not fds:
            for fd in fds:
                os.close(fd)
            return None
        for fd in fds:
            os.set_inheritable(fd, False)
        return Kept(record, fds)

    def keep(self, record: dict[str, Any], fds: list[int]) -> None:
        self._send({"kept": record}, fds)

    def serving(self) -> None:
        """Every worker serves: the workers of the process before may be ended."""
        self._send({"serving": True})

    def slots_changed(self, slots: Slots, next_slot: int) -> None:
        self._send({"slots": slot_list(slots), "next_slot": next_slot})

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            fdpass.send(self.sock, msg, fds)
        except OSError as e:
            if not self._failed:  # the mount serves on; only a takeover is lost
                log.warning("cannot tell the keeper (a crash would remount): %s", e)
            self._failed = True

    def close(self) -> None:
        self.sock.close()


# ---- the keeper's side (mountd)


def keeper_pair() -> tuple[socket.socket, socket.socket]:
    """(the keeper's end, the mount process's end: inheritable, its fd goes in KEEPER_ENV)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    return ours, theirs


def offer(sock: socket.socket, kept: Kept | None) -> None:
    """The keeper's first message: the connection to take over, or none."""
    if kept is None:
        fdpass.send(sock, {"take_over": None})
    else:
        fdpass.send(sock, {"take_over": kept.record}, kept.fds)


def apply(kept: Kept | None, msg: dict[str, Any], fds: list[int]) -> Kept | None:
    """A message of the mount process applied to what the keeper holds; returns what it holds
    now (a newly kept connection replaces the old one: the same or a new mount)."""
    if "kept" in msg and isinstance(msg["kept"], dict) and fds:
        if kept is not None:
            kept.close()
        return Kept(dict(msg["kept"]), fds)
    for fd in fds:
        os.close(fd)
    if "slots" in msg and kept is not None:
        kept.record["slots"] = msg["slots"]
        kept.record["next_slot"] = msg["next_slot"]
    return kept
