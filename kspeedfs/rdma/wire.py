"""What the RDMA control ops carry, sans-IO: segment tables and queue-pair endpoints."""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
import uuid as uuid_mod
from typing import Any

from kspeedfs.format.contract.pieces import from_base64, to_base64
from kspeedfs.format.errors import DataError, InvalidArgument, ProtocolError

TABLE_MAGIC = b"KSRT"
TABLE_VERSION = 1
MAX_TABLE_SEGMENTS = 1 << 22
_TABLE_HEAD = struct.Struct("!4sB3xQ16sI")  # magic, version, generation, dataset uuid, count
_TABLE_ENTRY = struct.Struct("!QQI")  # address, length, rkey


@dataclasses.dataclass(frozen=True)
class SegmentKey:
    """Where one registered segment lies in the node's memory; length 0: not readable here."""

    addr: int
    length: int
    rkey: int


@dataclasses.dataclass(frozen=True)
class SegmentTable:
    """The node's registration of one dataset: one key per segment of the dataset."""

    dataset: str
    uuid: str  # the dataset's uuid (hex), so a reloaded dataset never matches an old table
    generation: int  # changes with every registration, so a client can tell tables apart
    keys: tuple[SegmentKey, ...]

    def locate(self, seg: int, offset: int, length: int) -> tuple[int, int]:
        """(remote address, rkey) of a range, checked against the registered segment."""
        if not 0 <= seg < len(self.keys):
            raise DataError(f"segment {seg} out of range for {self.dataset}")
        key = self.keys[seg]
        if key.length == 0 and length > 0:
            raise DataError(f"segment {seg} of {self.dataset} is not registered on this node")
        if offset < 0 or length < 0 or offset + length > key.length:
            raise DataError(f"range {offset}+{length} past the end of segment {seg}")
        return key.addr + offset, key.rkey


def encode_table(table: SegmentTable) -> bytes:
    try:
        raw_uuid = uuid_mod.UUID(hex=table.uuid).bytes
    except ValueError:
        raise ProtocolError(f"bad dataset uuid {table.uuid!r}") from None
    parts = [
        _TABLE_HEAD.pack(TABLE_MAGIC, TABLE_VERSION, table.generation, raw_uuid, len(table.keys))
    ]
    parts.extend(_TABLE_ENTRY.pack(k.addr, k.length, k.rkey) for k in table.keys)
    return b"".join(parts)


def decode_table(dataset: str, data: bytes) -> SegmentTable:
    if len(data) < _TABLE_HEAD.size:
        raise ProtocolError("truncated segment table")
    magic, version, generation, raw_uuid, count = _TABLE_HEAD.unpack_from(data)
    if magic != TABLE_MAGIC:
        raise ProtocolError("not a kspeedfs segment table")
    if version != TABLE_VERSION:
        raise ProtocolError(f"unsupported segment table version {version}")
    if count > MAX_TABLE_SEGMENTS:
        raise ProtocolError(f"segment table of {count} segments exceeds the maximum")
    if len(data) != _TABLE_HEAD.size + count * _TABLE_ENTRY.size:
        raise ProtocolError("segment table length does not match its segment count")
    keys = []
    for k in range(count):
        addr, length, rkey = _TABLE_ENTRY.unpack_from(
            data, _TABLE_HEAD.size + k * _TABLE_ENTRY.size
        )
        if addr + length >= 1 << 64:
            raise ProtocolError(f"segment {k} wraps the address space")
        keys.append(SegmentKey(addr, length, rkey))
    return SegmentTable(dataset, uuid_mod.UUID(bytes=raw_uuid).hex, generation, tuple(keys))


def table_to_wire(table: SegmentTable) -> str:
    return to_base64(encode_table(table))


def table_from_wire(dataset: str, text: Any) -> SegmentTable:
    if not isinstance(text, str):
        raise ProtocolError("segment table is not a string")
    try:
        data = from_base64(text, "segment table")
    except InvalidArgument as e:
        raise ProtocolError(str(e)) from None
    return decode_table(dataset, data)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One side of a reliable connection: what the other side needs to reach its queue pair."""

    qpn: int  # queue pair number, 24 bits
    psn: int  # first packet sequence number, 24 bits
    lid: int  # InfiniBand local id (0 on RoCE)
    gid: str  # global id, an IPv6 address ("::" when the port has none)
    mtu: int  # path MTU enum (1 = 256 ... 5 = 4096)
    rd_atomic: int  # RDMA reads this side can have in flight (initiator) or answer (responder)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> Endpoint:
        if not isinstance(obj, dict):
            raise ProtocolError("RDMA endpoint is not an object")
        try:
            ep = cls(
                qpn=_bounded(obj["qpn"], 1 << 24),
                psn=_bounded(obj["psn"], 1 << 24),
                lid=_bounded(obj["lid"], 1 << 16),
                gid=str(ipaddress.IPv6Address(str(obj["gid"]))),
                mtu=_bounded(obj["mtu"], 6),
                rd_atomic=_bounded(obj["rd_atomic"], 256),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"bad RDMA endpoint: {e}") from None
        if ep.mtu < 1 or ep.rd_atomic < 1:
            raise ProtocolError("bad RDMA endpoint: mtu and rd_atomic must be at least 1")
        return ep

    @property
    def has_gid(self) -> bool:
        return ipaddress.IPv6Address(self.gid) != ipaddress.IPv6Address(0)


def _bounded(value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise ValueError(f"{value!r} is not an integer in [0, {limit})")
    return value


def gid_to_verbs(gid: str) -> str:
    """pyverbs spells a GID as eight groups of four hex digits."""
    return ":".join(f"{g:04x}" for g in struct.unpack("!8H", ipaddress.IPv6Address(gid).packed))
