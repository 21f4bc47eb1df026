"""The async (trio) client for control requests from trio processes (FUSE mount, mountd).

Same codec and handshake as the blocking client. Data reads of a mount go through the cluster
reader's transports in worker threads instead: one read path (failover, RDMA) for every
process, and no read waits on the event loop.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import trio

from . import auth, protocol
from .errors import AuthError, NodeUnreachable, ProtocolError, error_from_wire
from .protocol import Frame, MsgType
from .units import Address


class AsyncNodeClient:
    """One connection, one request at a time (a lock keeps answers paired with questions)."""

    def __init__(self, address: Address, token_file: Path, timeout: float = 10.0):
        self.address = address
        self.token_file = token_file
        self.timeout = timeout
        self._stream: trio.SocketStream | None = None
        self._decoder = protocol.FrameDecoder()
        self._ids = itertools.count(1)
        self._lock = trio.Lock()

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    async def _connect(self) -> trio.SocketStream:
        if self._stream is not None:
            return self._stream
        token = auth.read_token(self.token_file)
        try:
            with trio.fail_after(self.timeout):
                stream = await trio.open_tcp_stream(self.address.host, self.address.port)
        except (OSError, trio.TooSlowError) as e:
            raise NodeUnreachable(f"no kspeedfs node at {self.address} ({e})") from None
        self._stream = stream
        self._decoder = protocol.FrameDecoder()
        try:
            hello = (await self._receive()).json()
            nonce = bytes.fromhex(str(hello.get("nonce", "")))
            mac = auth.respond(token, nonce)
            role = auth.token_role(token)
            await stream.send_all(protocol.encode_json(MsgType.AUTH, 0, {"role": role, "mac": mac}))
            self._check(await self._receive(), MsgType.RESPONSE)
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
            data = await self._stream.receive_some(256 * 1024)
            if not data:
                raise NodeUnreachable(f"node {self.address} closed the connection")
            self._decoder.feed(data)

    def _check(self, frame: Frame, expected: MsgType) -> Frame:
        if frame.type == MsgType.ERROR:
            err = frame.json()
            exc = error_from_wire(str(err.get("kind")), str(err.get("message")))
            if isinstance(exc, AuthError):
                self._stream = None
            raise exc
        if frame.type != expected:
            raise ProtocolError(f"unexpected {frame.type.name} from {self.address}")
        return frame

    async def _exchange(self, frame_bytes: bytes, expected: MsgType) -> Frame:
        async with self._lock:
            try:
                with trio.fail_after(self.timeout):
                    stream = await self._connect()
                    await stream.send_all(frame_bytes)
                    return self._check(await self._receive(), expected)
            except (trio.TooSlowError, trio.BrokenResourceError, OSError) as e:
                await self.aclose()
                raise NodeUnreachable(f"node {self.address} did not answer: {e!r}") from None
            except (NodeUnreachable, ProtocolError):
                await self.aclose()
                raise

    async def request(self, op: str, **args: Any) -> dict[str, Any]:
        rid = next(self._ids)
        frame = await self._exchange(
            protocol.encode_json(MsgType.REQUEST, rid, {"op": op, **args}), MsgType.RESPONSE
        )
        return frame.json()
