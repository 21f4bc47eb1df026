"""The blocking client (CLI, DataLoader workers): one authenticated connection to one node.

Requests can be pipelined: `send_*` queue a request and return its id, `receive_*` collect the
answers in order. Read answers land in caller-provided buffers (recv_into, no extra copy).
With a TLS context (`format.tls.client_context`) the connection is mutual TLS, the node's
certificate checked against the host dialled, and the token handshake runs inside it.
"""

from __future__ import annotations

import itertools
import select
import socket
import ssl
from pathlib import Path
from typing import Any, Protocol

from kspeedfs.format import auth, protocol
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.errors import AuthError, NodeUnreachable, ProtocolError, error_from_wire
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.units import Address
from kspeedfs.net import secure
from kspeedfs.net.handshake import HANDSHAKE_ID, ClientHandshake

# Ops that scan a whole source before answering (1.28 M files take minutes on NFS).
SCAN_TIMEOUT = 3600.0

# The least time TCP waits before it sends a lost segment again (Linux's TCP_RTO_MIN_US,
# 6.15 and later; the kernel's own floor is 200 ms). A request is one segment and nothing
# follows it until its answer, so a lost one is found only by that timer (a tail loss probe
# waits the floor too when one segment is in flight): 200 ms per lost request on a link
# whose round trip is 0.1 ms. The timer stays SRTT + 4 RTTVAR above this floor, as always.
RTO_MIN_S = 0.005
TCP_RTO_MIN_US = 45  # <linux/tcp.h>


class _Options(Protocol):
    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def tune(sock: _Options) -> None:
    """The options of every kspeedfs TCP connection, both ends: no Nagle delay, and the
    shorter retransmission floor where the kernel has it (older kernels keep 200 ms; the
    client's hedged reads cover a lost packet there)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if RTO_MIN_S > 0:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, int(RTO_MIN_S * 1e6))
        except OSError:
            pass  # not this kernel, or not TCP


def connect_tcp(address: Address, timeout: float) -> socket.socket:
    """A TCP connection to `address` (each of its addresses in turn, as
    socket.create_connection), tuned before its handshake: the first round trip already
    sets the retransmission timer from RTO_MIN_S."""
    last: OSError | None = None
    for family, kind, proto, _name, where in socket.getaddrinfo(
        address.host, address.port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock)
            sock.settimeout(timeout)
            sock.connect(where)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError(f"no address for {address.host}")


class NodeClient:
    def __init__(
        self,
        address: Address,
        credential: Path | auth.UserLogin,  # a token file, or a user and password
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float | None = None,
    ):
        """`connect_timeout`: how long connecting may take (default `timeout`); a node that is
        cut off is found out by its own, shorter limit, not by a read's."""
        self.address = address
        self.credential = credential
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else min(connect_timeout, timeout)
        self.tls = tls
        self.role = ""
        self.node = ""
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._header = bytearray(protocol.HEADER_SIZE)

    def __enter__(self) -> NodeClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        if self._sock is not None:
            return
        token = auth.secret(self.credential)
        self.role = ""
        try:
            sock = connect_tcp(self.address, self.connect_timeout)
            # The node speaks first (HELLO): when the ACK of its SYN-ACK is lost it sends
            # nothing until it repeats the SYN-ACK, a second later. A short connect limit
            # covers the handshake too, so such a connection fails fast like a lost SYN.
            sock.settimeout(min(self.timeout, 2 * self.connect_timeout))
        except OSError as e:
            raise NodeUnreachable(
                f"no kspeedfs node at {self.address} ({e.strerror or e}): is `kspeedfs node` running?"
            ) from None
        if self.tls is not None:
            sock = secure.wrap_socket(sock, self.tls, self.address)
        self._sock = sock
        try:
            handshake = ClientHandshake(token, str(self.address), secure.channel(sock))
            self._send(handshake.answer(self._receive_json(HANDSHAKE_ID, MsgType.HELLO)))
            self.role = handshake.check(self._receive_json(HANDSHAKE_ID, MsgType.RESPONSE))
            self.node = handshake.node
            sock.settimeout(self.timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, request: Request[Answer], *, answer_within: float | None = None) -> Answer:
        """A typed request (kspeedfs.format.contract) and its answer, of the type it names."""
        fields = request.to_wire()
        del fields["op"]
        return request.answer(self.request(request.OP, answer_within=answer_within, **fields))

    def request(
        self, op: str, *, answer_within: float | None = None, **args: Any
    ) -> dict[str, Any]:
        """One request and its answer; `answer_within` overrides the timeout for slow ops."""
        rid = self.send_request(op, **args)
        if answer_within is None or self._sock is None:
            return self.receive_response(rid)
        self._sock.settimeout(answer_within)
        try:
            return self.receive_response(rid)
        finally:
            if self._sock is not None:
                self._sock.settimeout(self.timeout)

    def send_request(self, op: str, **args: Any) -> int:
        self.connect()
        rid = next(self._ids)
        self._send(protocol.encode_json(MsgType.REQUEST, rid, {"op": op, **args}))
        return rid

    def receive_response(self, rid: int) -> dict[str, Any]:
        return self._receive_json(rid, MsgType.RESPONSE)

    def read(self, dataset: str, instance: str, ranges: list[tuple[int, int, int]]) -> bytearray:
        buf = bytearray(sum(r[2] for r in ranges))
        self.receive_read(self.send_read(dataset, instance, ranges), memoryview(buf))
        return buf

    def send_read(self, dataset: str, instance: str, ranges: list[tuple[int, int, int]]) -> int:
        self.connect()
        rid = next(self._ids)
        self._send(
            protocol.encode_frame(
                MsgType.READ, rid, protocol.encode_read(dataset, instance, ranges)
            )
        )
        return rid

    def wait_readable(self, timeout: float) -> bool:
        """Whether an answer has begun to arrive within `timeout` seconds (True too when the
        connection is closed or failed: receiving says how)."""
        sock = self._sock
        if sock is None:
            return True
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(max(0.0, timeout) * 1000))

    def set_timeout(self, seconds: float) -> None:
        """The limit of each wait on the socket from now on (a read's deadline left)."""
        if self._sock is not None:
            self._sock.settimeout(max(0.001, seconds))

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def receive_read(self, rid: int, out: memoryview) -> None:
        """Receive a DATA answer straight into `out`, which must be exactly its length."""
        msg_type, got_rid, length = self._receive_header()
        if msg_type == MsgType.ERROR:
            self._raise_error(length)
        if msg_type != MsgType.DATA or got_rid != rid or length != len(out):
            self.close()
            raise ProtocolError(f"unexpected answer from {self.address} to read {rid}")
        self._recv_exact(out)

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(data)
        except OSError as e:
            self.close()
            raise secure.client_error(self.address, e, bool(self.role)) from None

    def _recv_exact(self, out: memoryview) -> None:
        assert self._sock is not None
        got = 0
        while got < len(out):
            try:
                n = self._sock.recv_into(out[got:])
            except OSError as e:
                self.close()
                raise secure.client_error(self.address, e, bool(self.role)) from None
            if n == 0:
                self.close()
                raise NodeUnreachable(f"node {self.address} closed the connection")
            got += n

    def _receive_header(self) -> tuple[MsgType, int, int]:
        if self._sock is None:
            raise NodeUnreachable(f"not connected to {self.address}")
        self._recv_exact(memoryview(self._header))
        try:
            return protocol.parse_header(self._header)
        except ProtocolError:
            self.close()
            raise

    def _receive_json(self, rid: int, expected: MsgType) -> dict[str, Any]:
        msg_type, got_rid, length = self._receive_header()
        if msg_type == MsgType.ERROR:
            self._raise_error(length)
        payload = bytearray(length)
        self._recv_exact(memoryview(payload))
        if msg_type != expected or (rid and got_rid != rid):
            self.close()
            raise ProtocolError(f"unexpected {msg_type.name} from {self.address}")
        return protocol.decode_json(bytes(payload))

    def _raise_error(self, length: int) -> None:
        payload = bytearray(length)
        self._recv_exact(memoryview(payload))
        err = protocol.decode_json(bytes(payload))
        exc = error_from_wire(str(err.get("kind")), str(err.get("message")))
        if isinstance(exc, (AuthError, ProtocolError)):
            self.close()
        raise exc
