"""The async (trio) client for control requests from trio processes (FUSE mount, mountd, nodes).

Same codec and handshake as the blocking client. Data reads of a mount go through the cluster
reader's transports in worker threads instead: one read path (failover, RDMA) for every
process, and no read waits on the event loop. With a TLS context the connection is mutual TLS
(see the blocking client), the token handshake inside it.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from pathlib import Path
from typing import Any

import trio

from kspeedfs.format import auth, protocol
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.errors import AuthError, NodeUnreachable, ProtocolError, error_from_wire
from kspeedfs.format.protocol import Frame, MsgType
from kspeedfs.format.units import Address
from kspeedfs.net import secure
from kspeedfs.net.handshake import ClientHandshake

log = logging.getLogger(__name__)


class _ConnectionLost(Exception):
    """The node closed or reset the connection: worth one fresh try when it was an old one."""


class AsyncNodeClient:
    """One connection, one request at a time (a lock keeps answers paired with questions).

    A connection that the node closed while it sat idle (a restart) is found out on the next
    request, which is sent once more over a new connection; a timeout is never retried.
    """

    def __init__(
        self,
        address: Address,
        credential: Path | auth.UserLogin,  # a token file, or a user and password
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ):
        self.address = address
        self.credential = credential
        self.timeout = timeout
        self.tls = tls
        self.role = ""
        self._stream: trio.abc.Stream | None = None
        self._decoder = protocol.FrameDecoder()
        self._ids = itertools.count(1)
        self._lock = trio.Lock()
        self.stats = {"connects": 0, "requests": 0, "retries": 0}

    @property
    def connected(self) -> bool:
        return self._stream is not None

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _connect(self) -> trio.abc.Stream:
        if self._stream is not None:
            return self._stream
        token = auth.secret(self.credential)
        self.role = ""
        try:
            with trio.fail_after(self.timeout):
                tcp = await trio.open_tcp_stream(self.address.host, self.address.port)
        except (OSError, trio.TooSlowError) as e:
            raise NodeUnreachable(f"no kspeedfs node at {self.address} ({e})") from None
        stream: trio.abc.Stream = tcp
        if self.tls is not None:
            try:
                with trio.fail_after(self.timeout):
                    stream = await secure.wrap_stream(tcp, self.tls, self.address)
            except trio.TooSlowError:
                await tcp.aclose()
                raise NodeUnreachable(f"node {self.address} did not finish TLS in time") from None
        self._stream = stream
        self._decoder = protocol.FrameDecoder()
        self.stats["connects"] += 1
        try:
            handshake = ClientHandshake(token, str(self.address), secure.channel(stream))
            with trio.fail_after(self.timeout):
                hello = self._check(await self._receive(), MsgType.HELLO).json()
                await stream.send_all(handshake.answer(hello))
                self.role = handshake.check(
                    self._check(await self._receive(), MsgType.RESPONSE).json()
                )
        except (trio.TooSlowError, _ConnectionLost, trio.BrokenResourceError, OSError) as e:
            await self.aclose()
            raise NodeUnreachable(
                f"node {self.address} did not complete the handshake: {e}"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        return stream

    async def _receive(self) -> Frame:
        assert self._stream is not None
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                return frame
            try:
                data = await self._stream.receive_some(256 * 1024)
            except trio.BrokenResourceError as e:
                error = secure.client_error(self.address, e, bool(self.role))
                if isinstance(error, AuthError):
                    raise error from None  # the node refused this client's certificate
                raise _ConnectionLost(f"node {self.address} reset the connection: {e}") from None
            if not data:
                raise _ConnectionLost(f"node {self.address} closed the connection")
            self._decoder.feed(data)

    def _check(self, frame: Frame, expected: MsgType, rid: int | None = None) -> Frame:
        if frame.type == MsgType.ERROR:
            # The connection stays usable: the node refused this request, not the client.
            err = frame.json()
            raise error_from_wire(str(err.get("kind")), str(err.get("message")))
        if frame.type != expected or (rid is not None and frame.request_id != rid):
            raise ProtocolError(f"unexpected {frame.type.name} from {self.address}")
        return frame

    async def _send_and_receive(
        self, frame_bytes: bytes, rid: int, expected: MsgType, within: float
    ) -> Frame:
        stream = await self._connect()
        with trio.fail_after(within):
            try:
                await stream.send_all(frame_bytes)
            except trio.BrokenResourceError as e:
                raise _ConnectionLost(f"lost the connection to {self.address}: {e}") from None
            return self._check(await self._receive(), expected, rid)

    async def _exchange(
        self, frame_bytes: bytes, rid: int, expected: MsgType, within: float
    ) -> Frame:
        async with self._lock:
            self.stats["requests"] += 1
            reused = self._stream is not None
            try:
                try:
                    return await self._send_and_receive(frame_bytes, rid, expected, within)
                except _ConnectionLost as e:
                    await self.aclose()
                    if not reused:
                        raise
                    log.info("%s; sending the request again on a new connection", e)
                    self.stats["retries"] += 1
                    return await self._send_and_receive(frame_bytes, rid, expected, within)
            except (_ConnectionLost, trio.TooSlowError, OSError) as e:
                await self.aclose()
                raise NodeUnreachable(f"node {self.address} did not answer: {e}") from None
            except (NodeUnreachable, ProtocolError):
                await self.aclose()
                raise
            except BaseException as e:
                # A request abandoned half way (cancelled) would leave its answer to be read
                # as the next one's: the connection goes with it.
                if not isinstance(e, Exception):
                    await self.aclose()
                raise

    async def call(self, request: Request[Answer], *, answer_within: float | None = None) -> Answer:
        """A typed request (kspeedfs.format.contract) and its answer, of the type it names."""
        fields = request.to_wire()
        del fields["op"]
        return request.answer(await self.request(request.OP, answer_within=answer_within, **fields))

    async def request(
        self, op: str, *, answer_within: float | None = None, **args: Any
    ) -> dict[str, Any]:
        """One request and its answer; `answer_within` overrides the timeout for slow ops."""
        rid = next(self._ids)
        frame = await self._exchange(
            protocol.encode_json(MsgType.REQUEST, rid, {"op": op, **args}),
            rid,
            MsgType.RESPONSE,
            self.timeout if answer_within is None else answer_within,
        )
        return frame.json()
