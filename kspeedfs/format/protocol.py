"""The wire protocol, sans-IO: bytes in, frames out; shared by the async and blocking clients.

Frame = 12-byte header (magic "KS", version, type, request id, payload length) + payload.
Control messages carry JSON; reads carry a compact binary range list, and their answers the
raw bytes of the ranges back to back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from typing import Any

from kspeedfs.format.errors import ProtocolError

MAGIC = b"KS"
VERSION = 4  # 2: READ frames name the dataset instance; 3: the mutual, channel-bound
# handshake; 4: typed ops (pieces as nested objects, stage_push, long-polled progress)
HEADER = struct.Struct("!2sBBII")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 128 * 1024 * 1024
MAX_CONTROL_PAYLOAD = 16 * 1024 * 1024
MAX_RANGES = 65536
MAX_HANDSHAKE_PAYLOAD = 4096

_RANGE = struct.Struct("!IQI")  # segment, offset in segment, length
_READ_HEAD = struct.Struct("!B16sI")  # dataset name length, instance id, range count


class MsgType(enum.IntEnum):
    HELLO = 1  # server -> client: version, node, nonce
    AUTH = 2  # client -> server: role, HMAC of the nonce
    REQUEST = 3  # client -> server: JSON {"op": ..., ...}
    RESPONSE = 4  # server -> client: JSON
    ERROR = 5  # server -> client: JSON {"kind": ..., "message": ...}
    READ = 6  # client -> server: binary range list
    DATA = 7  # server -> client: the ranges' bytes


_VALID_TYPES = frozenset(int(t) for t in MsgType)


@dataclasses.dataclass
class Frame:
    type: MsgType
    request_id: int
    payload: bytes

    def json(self) -> dict[str, Any]:
        return decode_json(self.payload)


def encode_header(msg_type: MsgType, request_id: int, length: int) -> bytes:
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes exceeds the maximum {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, VERSION, int(msg_type), request_id & 0xFFFFFFFF, length)


def parse_header(data: bytes | bytearray | memoryview) -> tuple[MsgType, int, int]:
    """Validate a 12-byte header; returns (type, request id, payload length)."""
    magic, version, msg_type, request_id, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not a kspeedfs peer")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if msg_type not in _VALID_TYPES:
        raise ProtocolError(f"unknown message type {msg_type}")
    limit = MAX_PAYLOAD if msg_type == MsgType.DATA else MAX_CONTROL_PAYLOAD
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the maximum {limit}")
    return MsgType(msg_type), request_id, length


def encode_frame(msg_type: MsgType, request_id: int, payload: bytes = b"") -> bytes:
    return encode_header(msg_type, request_id, len(payload)) + payload


def encode_json(msg_type: MsgType, request_id: int, obj: dict[str, Any]) -> bytes:
    return encode_frame(msg_type, request_id, json.dumps(obj, separators=(",", ":")).encode())


def decode_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"malformed JSON payload: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON payload is not an object")
    return obj


def encode_read(dataset: str, instance: str, ranges: list[tuple[int, int, int]]) -> bytes:
    """A READ payload: ranges of the segments of one instance (`instance`: its 32 hex digits)."""
    name = dataset.encode()
    if len(ranges) > MAX_RANGES:
        raise ProtocolError(f"too many ranges in one read ({len(ranges)} > {MAX_RANGES})")
    try:
        instance_id = bytes.fromhex(instance)
    except ValueError:
        instance_id = b""
    if len(instance_id) != 16:
        raise ProtocolError(f"a dataset instance id is 32 hex digits, not {instance!r}")
    parts = [_READ_HEAD.pack(len(name), instance_id, len(ranges)), name]
    parts.extend(_RANGE.pack(*r) for r in ranges)
    return b"".join(parts)


def decode_read(payload: bytes) -> tuple[str, str, list[tuple[int, int, int]]]:
    """(dataset name, instance id as hex, ranges) of a READ payload."""
    if len(payload) < _READ_HEAD.size:
        raise ProtocolError("truncated read request")
    name_len, instance_id, count = _READ_HEAD.unpack_from(payload)
    if count > MAX_RANGES:
        raise ProtocolError(f"too many ranges in one read ({count})")
    start = _READ_HEAD.size + name_len
    if len(payload) != start + count * _RANGE.size:
        raise ProtocolError("read request length does not match its range count")
    try:
        dataset = payload[_READ_HEAD.size : start].decode()
    except UnicodeDecodeError:
        raise ProtocolError("dataset name is not UTF-8") from None
    ranges = [_RANGE.unpack_from(payload, start + k * _RANGE.size) for k in range(count)]
    total = sum(r[2] for r in ranges)
    if total > MAX_PAYLOAD:
        raise ProtocolError(f"read of {total} bytes exceeds the maximum {MAX_PAYLOAD}")
    return dataset, instance_id.hex(), ranges


class FrameDecoder:
    """Accumulates received bytes and yields whole frames; raises ProtocolError on bad input."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._header: tuple[MsgType, int, int] | None = None
        # A server lowers this until the peer has authenticated, so that a stranger
        # cannot make it buffer large frames.
        self.max_payload = max_payload

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_frame(self) -> Frame | None:
        if self._header is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._header = parse_header(bytes(self._buf[:HEADER_SIZE]))
            if self._header[2] > self.max_payload:
                raise ProtocolError(
                    f"frame of {self._header[2]} bytes exceeds {self.max_payload} here"
                )
            del self._buf[:HEADER_SIZE]
        msg_type, request_id, length = self._header
        if len(self._buf) < length:
            return None
        payload = bytes(self._buf[:length])
        del self._buf[:length]
        self._header = None
        return Frame(msg_type, request_id, payload)

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame (for the caller's memory checks)."""
        return len(self._buf)
