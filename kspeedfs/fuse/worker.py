"""One serving process of a mount: a cloned /dev/fuse fd, one thread answering, a control link.

Started by the supervisor (`python -m kspeedfs.fuse.worker`) with three descriptors: its clone
of the mount's fd, its end of a SOCK_SEQPACKET control socket, and the shared counters. Over
the socket come the settings, the datasets with the slots the supervisor gave them, refresh
results and interrupts other workers could not place; back go refresh requests, interrupts for
requests this worker does not hold, and read-through touches. It starts serving only once it
has opened every dataset it was told about, so a restarted worker never answers ESTALE for a
live instance. It ends when the mount goes (exit 0), or with the supervisor (its socket closes;
under mountd, once the next mount process serves: takeover.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from typing import Any

from kspeedfs.client.reader import ClusterReader, local_node_for
from kspeedfs.format.config import Settings
from kspeedfs.fuse.counters import SharedCounters
from kspeedfs.fuse.filesystem import KSpeedFS
from kspeedfs.fuse.kernel import RequestLoop
from kspeedfs.system.logs import setup_logging

log = logging.getLogger(__name__)

MESSAGE_MAX = 1 << 20
REFRESH_INTERVAL = 1.0
TOUCH_INTERVAL = 1.0
DEADLINE_TIMEOUTS = 3  # a read waits at most this many node timeouts, then gets EIO
EXIT_DETACHED = 0  # the mount is gone: not to be restarted


def send(sock: socket.socket, *message: Any) -> None:
    sock.send(pickle.dumps(message))


class SupervisorLink:
    """The worker's side of the control socket (the Supervisor protocol of filesystem.py)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.node_answers = True
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._refreshes = 0  # "refreshed" messages received
        self._asked_at = -1e9  # when this worker last asked for a refresh
        self._asked_count = -1  # self._refreshes when it asked; None pending when equal
        self._invalidations_wanted = 0
        self._invalidations_done = 0

    def post(self, *message: Any) -> None:
        try:
            with self._send_lock:
                send(self.sock, *message)
        except OSError:
            pass  # the supervisor is gone: this process ends with it

    # ---- Supervisor protocol (serving threads)

    def ask_refresh(self, force: bool, wait: float) -> None:
        """One request in flight per worker; a request already slower than `wait` is waited
        for no longer, by anyone: a frozen node must not hold up walks through the root."""
        now = time.monotonic()
        with self._state:
            inflight = self._asked_count == self._refreshes
            if not inflight:
                if not force and now - self._asked_at < REFRESH_INTERVAL:
                    return
                self._asked_at, self._asked_count = now, self._refreshes
                self.post("refresh")
            left = wait - (now - self._asked_at)
            if self.node_answers and left > 0:
                target = self._asked_count
                self._state.wait_for(lambda: self._refreshes > target, left)

    def wait_invalidations(self, timeout: float) -> None:
        with self._state:
            wanted = self._invalidations_wanted
            self._state.wait_for(lambda: self._invalidations_done >= wanted, timeout)

    def forward_interrupt(self, unique: int) -> None:
        self.post("interrupt", unique)

    # ---- messages from the supervisor (control thread)

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The next message; None on timeout; EOFError once the supervisor is gone."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(MESSAGE_MAX)
        except TimeoutError:
            return None
        if not data:
            raise EOFError
        message: tuple[Any, ...] = pickle.loads(data)
        return message

    def apply(self, message: tuple[Any, ...], fs: KSpeedFS, loop: RequestLoop | None) -> None:
        """Apply a message of the supervisor to `fs` (an interrupt: to `loop`, once it serves)."""
        kind = message[0]
        if kind == "add":
            _, slot, name, uuid, info, view = message
            fs.add(slot, name, uuid, info, view)
        elif kind == "drop":
            _, slot, invalidation = message
            with self._state:
                self._invalidations_wanted = max(self._invalidations_wanted, invalidation)
            fs.drop(slot)
        elif kind == "refreshed":
            _, node_answers, mounted_at_ns, change = message
            fs.mounted_at_ns = mounted_at_ns
            with self._state:
                self.node_answers = node_answers
                self._refreshes += 1
                self._state.notify_all()
            self.post("applied", change)  # the kernel may forget the old names once all have
        elif kind == "invalidated":
            with self._state:
                self._invalidations_done = max(self._invalidations_done, message[1])
                self._state.notify_all()
        elif kind == "interrupt" and loop is not None:
            loop.interrupt(message[1])


def serve(fuse_fd: int, control_fd: int, counters_fd: int) -> int:
    sock = socket.socket(fileno=control_fd)
    link = SupervisorLink(sock)
    hello = link.receive(60.0)
    if hello is None or hello[0] != "hello":
        log.error("no settings from the supervisor")
        return 1
    _, settings, dataset, index, rows, linger = hello
    assert isinstance(settings, Settings)
    counters = SharedCounters(counters_fd, rows)
    reader = ClusterReader(settings, local_node_for(settings))
    fs = KSpeedFS(reader, link, dataset, counters, index)
    # The datasets the supervisor knows, up to its first "refreshed": then serve.
    while True:
        message = link.receive(60.0)
        if message is None:
            log.error("the supervisor sent no dataset list")
            return 1
        link.apply(message, fs, None)
        if message[0] == "refreshed":
            break
    loop = RequestLoop(
        fs,
        fuse_fd,
        [counters.row(index)],
        on_stray_interrupt=link.forward_interrupt,
        deadline=DEADLINE_TIMEOUTS * settings.timeout,
        poll_window=settings.fuse_poll_us / 1e6,  # every serving process (BurstPoll)
        use_uring=settings.fuse_uring,  # the supervisor turned it off where it cannot be used
    )
    if settings.fuse_uring and loop.uring_unusable is not None:
        log.warning("fuse_uring: this process serves through /dev/fuse: %s", loop.uring_unusable)
    loop.start()
    link.post("ready")
    last_touch = time.monotonic()
    try:
        while not loop.done.is_set():
            message = link.receive(TOUCH_INTERVAL / 2)
            if message is not None:
                link.apply(message, fs, loop)
            if time.monotonic() - last_touch >= TOUCH_INTERVAL:
                last_touch = time.monotonic()
                for touch in fs.drain_touches():
                    link.post("touch", *touch)
    except (EOFError, OSError):
        # The supervisor is gone. Under mountd a new one takes the connection over: serve on
        # meanwhile (the datasets as they are), until mountd ends us once it serves.
        loop.done.wait(linger)
        return EXIT_DETACHED
    loop.shutdown()
    reader.close()
    return EXIT_DETACHED if loop.detached else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a serving process of a kspeedfs mount (internal)")
    p.add_argument("--fuse-fd", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--counters-fd", type=int, required=True)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    # No PR_SET_PDEATHSIG: it fires when the *thread* that spawned us ends (trio spawns from
    # worker threads it retires after a few idle seconds), which killed healthy workers. We end
    # with the supervisor through the control socket instead: EOF once its process is gone.
    if os.getppid() == 1:
        return EXIT_DETACHED  # the supervisor died before we could ask
    # The supervisor handles SIGINT/SIGTERM for the whole mount; it stops us itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(args.fuse_fd, args.control_fd, args.counters_fd)


if __name__ == "__main__":
    sys.exit(main())
