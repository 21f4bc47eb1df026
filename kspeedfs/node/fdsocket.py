"""The node's local Unix socket: bound where nobody else can, connections bounded per uid.

One thread waits on every connection with a selector (an idle connection costs a descriptor,
no thread: 300 idle connections made 304 threads with a thread each), sends each its nonce,
and closes the ones that stay silent past the timeout; a connection that has sent its answer
goes to a small fixed pool of threads that decide and pass descriptors. A uid holds at most
MAX_PER_UID connections and everyone together MAX_CONNECTIONS, so one local user cannot shut
the others out.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kspeedfs.format import auth
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NodeUnreachable
from kspeedfs.net import fdpass
from kspeedfs.node import safedir

log = logging.getLogger(__name__)

MAX_PER_UID = 128  # above a node's DataLoader workers (8 ranks x 8 workers) attaching at once
MAX_CONNECTIONS = 1024
ANSWERING = 4  # threads that answer authenticated requests


@dataclasses.dataclass
class Peer:
    """A connection waiting for its answer to the nonce it was sent."""

    sock: socket.socket
    uid: int
    gid: int
    nonce: bytes
    deadline: float


# What answers a peer's first message (its role, MAC and request); runs in the pool.
Answer = Callable[[Peer, dict[str, Any]], None]


def check_path(path: Path) -> None:
    """Refuse (one line) a socket path in a folder that someone but the node's uid (or root)
    could change, or that holds anything but a stale socket of this uid."""
    safedir.check_socket_dir(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            what = "a socket" if stat.S_ISSOCK(st.st_mode) else "a file that is no socket"
            raise InvalidArgument(f"refusing socket {path}: it is {what} of uid {st.st_uid}")
        if _served(path):
            raise InvalidArgument(f"refusing socket {path}: another node is serving it")
        os.unlink(path)  # left by a node of ours that crashed


def bind(path: Path) -> socket.socket:
    """A listening socket at `path`, checked first (check_path)."""
    check_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, 0o666)  # anyone may ask; only a token gets an answer
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise InvalidArgument(f"cannot listen on {path}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def _served(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True


class LocalListener:
    """Serves a bound socket: `answer` is called for each peer that sent its first message;
    `greeting()` gives what the first message to a peer carries beside its nonce."""

    def __init__(
        self,
        sock: socket.socket,
        answer: Answer,
        timeout: float,
        greeting: Callable[[], dict[str, Any]] = dict,
    ):
        self.sock = sock
        self._greeting = greeting
        self.timeout = timeout
        self.stats = {"connections": 0, "busy": 0, "idle_closed": 0}
        self._answer = answer
        self._lock = threading.Lock()
        self._per_uid: collections.Counter[int] = collections.Counter()
        self._waiting: dict[int, Peer] = {}
        self._work: queue.Queue[tuple[Peer, dict[str, Any]] | None] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._threads = [threading.Thread(target=self._loop, name="fdsocket", daemon=True)]
        self._threads += [
            threading.Thread(target=self._answering, name=f"fdsocket-{k}", daemon=True)
            for k in range(ANSWERING)
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        for _ in range(ANSWERING):
            self._work.put(None)
        self._threads[0].join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                wait = min((p.deadline for p in self._waiting.values()), default=None)
                for key, _ in sel.select(None if wait is None else max(0, wait - time.monotonic())):
                    if key.fileobj == self._wake_r:
                        return
                    if key.fileobj is self.sock:
                        self._accept(sel)
                    else:
                        self._received(sel, self._waiting.pop(key.fd))
                self._expire(sel)
        except Exception:
            log.exception("the local socket stopped")
        finally:
            for peer in self._waiting.values():
                self._end(peer)
            sel.close()
            self.sock.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the ones waiting still get served
                log.warning("cannot accept on the local socket: %s", e)
                return
            conn.setblocking(False)  # nothing a peer does may stop this loop
            _pid, uid, gid = fdpass.peer_credentials(conn)
            with self._lock:
                busy = self._per_uid[uid] >= MAX_PER_UID or self.stats["connections"] >= (
                    MAX_CONNECTIONS
                )
                if not busy:
                    self._per_uid[uid] += 1
                    self.stats["connections"] += 1
                else:
                    self.stats["busy"] += 1
            if busy:
                self._refuse_now(conn, uid)
                continue
            peer = Peer(conn, uid, gid, auth.new_nonce(), time.monotonic() + self.timeout)
            try:
                fdpass.send(conn, {**self._greeting(), "nonce": peer.nonce.hex()})
            except OSError:
                self._end(peer)
                continue
            self._waiting[conn.fileno()] = peer
            sel.register(conn, selectors.EVENT_READ)

    def _refuse_now(self, conn: socket.socket, uid: int) -> None:
        log.warning("local socket: refused uid %d, which holds too many connections", uid)
        why = NodeUnreachable(
            f"the node's socket is busy: uid {uid} holds {MAX_PER_UID} connections to it,"
            f" or everyone {MAX_CONNECTIONS}"
        )
        with conn:
            try:
                fdpass.refuse(conn, why)
            except OSError:
                pass

    def _received(self, sel: selectors.BaseSelector, peer: Peer) -> None:
        sel.unregister(peer.sock)
        try:
            msg, _ = fdpass.receive(peer.sock)
        except (OSError, KSpeedError) as e:
            log.info("local reader refused: %s", e)
            if isinstance(e, KSpeedError):
                try:
                    fdpass.refuse(peer.sock, e)
                except OSError:
                    pass
            self._end(peer)
            return
        self._work.put((peer, msg))

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for fd, peer in list(self._waiting.items()):
            if peer.deadline <= now:
                del self._waiting[fd]
                sel.unregister(peer.sock)
                self.stats["idle_closed"] += 1
                self._end(peer)

    def _answering(self) -> None:
        while (item := self._work.get()) is not None:
            peer, msg = item
            try:
                peer.sock.setblocking(True)
                peer.sock.settimeout(self.timeout)
                self._answer(peer, msg)
            except Exception:
                log.exception("unexpected error on the local socket")
            finally:
                self._end(peer)

    def _end(self, peer: Peer) -> None:
        peer.sock.close()
        with self._lock:
            self._per_uid[peer.uid] -= 1
            if not self._per_uid[peer.uid]:
                del self._per_uid[peer.uid]
            self.stats["connections"] -= 1
