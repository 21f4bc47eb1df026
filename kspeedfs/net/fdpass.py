"""Segment descriptors over the node's local Unix socket (SCM_RIGHTS), after a mutual handshake.

Segments are readable by the node's uid and group only. A local reader outside that group
asks the node instead: it checks that the socket is served by the node's uid (SO_PEERCRED:
root, its own uid or `node_user`), proves a token (the challenge-response of TCP, bound to this
channel), names a dataset instance, and gets the manifest's and the segments' open descriptors,
which it maps as if it had opened them, once the node has proved that it holds the token too.
SOCK_SEQPACKET keeps each message and its descriptors together.

Messages are JSON objects, one per packet:
    node   -> {"nonce": HEX}
    client -> {"role": ROLE, "nonce": HEX, "mac": HEX, "name": NAME, "uuid": UUID}
    node   -> {"error": KIND, "message": TEXT}
              or {"segments": N, "mac": HEX} + the manifest's fd
    node   -> {"segs": [K, ...]} + their fds, until N segments were sent
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import struct
from pathlib import Path
from typing import Any, NamedTuple

from kspeedfs.format import auth, users
from kspeedfs.format.errors import (
    AuthError,
    DataError,
    KSpeedError,
    NodeUnreachable,
    ProtocolError,
    error_from_wire,
)

MAX_MESSAGE = 64 * 1024
FDS_PER_MESSAGE = 200  # under the kernel's SCM_MAX_FD (253)


def send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def receive(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (closed here if it is malformed)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, max(maxfds, 1))
    try:
        if not data:
            raise ProtocolError("the peer closed the connection")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError("message or descriptors truncated")
        if len(fds) > maxfds:
            raise ProtocolError("descriptors sent where none were expected")
        msg = json.loads(data)
        if not isinstance(msg, dict):
            raise ProtocolError("a message must be a JSON object")
    except (ValueError, ProtocolError) as e:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"bad message on the local socket: {e}") from None
    return msg, list(fds)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


def node_uids(node_user: str) -> set[int]:
    """The uids a client trusts to serve the node's socket: root, its own, and `node_user`'s."""
    uids = {0, os.geteuid()}
    if node_user.isdigit():
        uids.add(int(node_user))
    elif node_user:
        try:
            uids.add(pwd.getpwnam(node_user).pw_uid)
        except KeyError:
            raise AuthError(f"node_user {node_user!r} is no user on this machine") from None
    return uids


def check_server(sock: socket.socket, path: Path, node_user: str) -> None:
    """Refuse a socket that is not served by the node's uid: anyone could have bound it."""
    _pid, uid, _gid = peer_credentials(sock)
    if uid not in node_uids(node_user):
        raise AuthError(
            f"refusing the node socket {path}: it is served by uid {uid}, not by the node's"
            " (root, this uid or node_user)"
        )


class Attached(NamedTuple):
    """What the node passed: its manifest's descriptor, each segment's, and its damage
    news table's (-1: none)."""

    manifest_fd: int
    segments: dict[int, int]
    damage_fd: int = -1

    def close(self) -> None:
        for fd in [self.manifest_fd, self.damage_fd, *self.segments.values()]:
            if fd >= 0:
                os.close(fd)


def attach(
    path: Path,
    token: str | auth.UserLogin,
    name: str,
    uuid: str,
    timeout: float = 10.0,
    node_user: str = "",
) -> Attached:
    """The descriptors of a dataset instance, from the node's socket at path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(os.fspath(path))
        except OSError as e:
            raise NodeUnreachable(f"no node socket at {path} ({e.strerror or e})") from None
        check_server(sock, path, node_user)  # before any answer: a squatter learns nothing
        hello, _ = receive(sock)
        if "error" in hello:  # the node's socket is busy
            raise error_from_wire(str(hello["error"]), str(hello.get("message", "")))
        node_nonce = auth.parse_nonce(hello.get("nonce"))
        if isinstance(token, auth.UserLogin):
            key = users.login_key(token, hello.get("realm"))
            answer, nonce = auth.user_answer(key, token.user, auth.FD_SOCKET, node_nonce)

            def proved(mac: object) -> bool:
                return auth.verify_node_user(
                    key, token.user, auth.FD_SOCKET, node_nonce, nonce, mac
                )
        else:
            answer, nonce = auth.client_answer(token, auth.FD_SOCKET, node_nonce)

            def proved(mac: object) -> bool:
                return auth.verify_node(token, auth.FD_SOCKET, node_nonce, nonce, mac)

        send(sock, {**answer, "name": name, "uuid": uuid})
        head, fds = receive(sock, 2)
        if "error" in head:
            raise error_from_wire(str(head["error"]), str(head.get("message", "")))
        sound, wanted = proved(head.get("mac")), 1 + bool(head.get("damage"))
        if not sound or len(fds) != wanted:
            for fd in fds:
                os.close(fd)
            if not sound:
                raise AuthError(f"the node socket {path} did not prove that it holds the token")
            raise ProtocolError("the node sent no manifest descriptor")
        manifest_fd, damage_fd, segments = fds[0], fds[1] if len(fds) > 1 else -1, dict[int, int]()
        try:
            while len(segments) < int(head["segments"]):
                msg, fds = receive(sock, FDS_PER_MESSAGE)
                segs = [int(k) for k in msg.get("segs", [])]
                if len(segs) != len(fds):
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError("segment numbers and descriptors do not match")
                segments.update(zip(segs, fds, strict=True))
        except BaseException:
            Attached(manifest_fd, segments, damage_fd).close()
            raise
        return Attached(manifest_fd, segments, damage_fd)
    except (TimeoutError, OSError) as e:
        raise DataError(f"attaching to {name} over {path} failed: {e}") from None
    finally:
        sock.close()


def refuse(sock: socket.socket, exc: KSpeedError) -> None:
    send(sock, {"error": type(exc).__name__, "message": str(exc)})
