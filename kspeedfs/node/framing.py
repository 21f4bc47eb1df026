"""Framing over one of a node's connections: frames in, answers out."""

from __future__ import annotations

import logging
from typing import Any

import trio

from kspeedfs.format import protocol
from kspeedfs.format.errors import InternalError, KSpeedError, ProtocolError
from kspeedfs.format.protocol import MsgType
from kspeedfs.node.ops import one_line

log = logging.getLogger(__name__)


class Connection:
    """Framing over one trio stream."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self.decoder = protocol.FrameDecoder(protocol.MAX_HANDSHAKE_PAYLOAD)

    async def receive(self) -> protocol.Frame | None:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = await self.stream.receive_some(256 * 1024)
            if not data:
                if self.decoder.pending:
                    raise ProtocolError("connection closed inside a frame")
                return None
            self.decoder.feed(data)

    async def send_json(self, msg_type: MsgType, request_id: int, obj: dict[str, Any]) -> None:
        await self.stream.send_all(protocol.encode_json(msg_type, request_id, obj))

    async def send_error(self, request_id: int, exc: KSpeedError) -> None:
        await self.send_json(
            MsgType.ERROR, request_id, {"kind": type(exc).__name__, "message": str(exc)}
        )


def response(request_id: int, result: dict[str, Any]) -> bytes:
    """The frame of an op's result; one the client could not take (not JSON, over a control
    frame) is an InternalError, answered in its place."""
    try:
        frame = protocol.encode_json(MsgType.RESPONSE, request_id, result)
    except (TypeError, ValueError) as e:  # the handler's fault, not the request's
        log.exception("an answer that is not JSON")
        raise InternalError(one_line(f"internal error: an answer that is not JSON: {e}")) from None
    if len(frame) - protocol.HEADER_SIZE > protocol.MAX_CONTROL_PAYLOAD:
        log.error("an answer of %d bytes is over a control frame", len(frame))
        raise InternalError(f"internal error: an answer of {len(frame)} bytes is over a frame")
    return frame


def peer_of(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "a peer gone already"
    return f"{host}:{port}"
