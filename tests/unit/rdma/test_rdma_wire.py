"""The RDMA control messages: segment tables and queue-pair endpoints, hostile input included."""

from __future__ import annotations

import base64
import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.format.errors import DataError, ProtocolError
from kspeedfs.rdma.wire import (
    Endpoint,
    SegmentKey,
    SegmentTable,
    decode_table,
    encode_table,
    gid_to_verbs,
    table_from_wire,
    table_to_wire,
)

keys = st.builds(
    SegmentKey,
    addr=st.integers(0, 2**62),
    length=st.integers(0, 2**40),
    rkey=st.integers(0, 2**32 - 1),
)


@given(
    keys=st.lists(keys, max_size=50),
    generation=st.integers(0, 2**64 - 1),
    raw=st.binary(min_size=16, max_size=16),
)
def test_table_round_trip(keys: list[SegmentKey], generation: int, raw: bytes) -> None:
    table = SegmentTable("imagenet", uuid.UUID(bytes=raw).hex, generation, tuple(keys))
    assert decode_table("imagenet", encode_table(table)) == table
    assert table_from_wire("imagenet", table_to_wire(table)) == table


def sample_table() -> SegmentTable:
    return SegmentTable(
        "ds",
        uuid.uuid4().hex,
        7,
        (SegmentKey(0x1000, 4096, 11), SegmentKey(0, 0, 0), SegmentKey(0x9000, 100, 12)),
    )


def test_locate_checks_every_range_against_the_registration() -> None:
    t = sample_table()
    assert t.locate(0, 0, 4096) == (0x1000, 11)
    assert t.locate(2, 40, 60) == (0x9000 + 40, 12)
    assert t.locate(1, 0, 0) == (0, 0)  # nothing to read from an unregistered segment: fine
    with pytest.raises(DataError, match="past the end"):
        t.locate(0, 1, 4096)
    with pytest.raises(DataError, match="not registered"):
        t.locate(1, 0, 1)
    with pytest.raises(DataError, match="out of range"):
        t.locate(3, 0, 1)
    with pytest.raises(DataError, match="out of range"):
        t.locate(-1, 0, 1)
    with pytest.raises(DataError):
        t.locate(0, -1, 2)


def test_hostile_tables_are_refused() -> None:
    good = encode_table(sample_table())
    with pytest.raises(ProtocolError, match="truncated"):
        decode_table("ds", good[:10])
    with pytest.raises(ProtocolError, match="not a kspeedfs"):
        decode_table("ds", b"XXXX" + good[4:])
    with pytest.raises(ProtocolError, match="version"):
        decode_table("ds", good[:4] + b"\x09" + good[5:])
    with pytest.raises(ProtocolError, match="does not match"):
        decode_table("ds", good[:-1])
    with pytest.raises(ProtocolError, match="does not match"):
        decode_table("ds", good + b"\0")
    head = struct.Struct("!4sB3xQ16sI")
    huge = head.pack(b"KSRT", 1, 1, bytes(16), 1 << 30)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_table("ds", huge)
    wrap = head.pack(b"KSRT", 1, 1, bytes(16), 1) + struct.pack("!QQI", 2**64 - 10, 20, 1)
    with pytest.raises(ProtocolError, match="wraps"):
        decode_table("ds", wrap)
    with pytest.raises(ProtocolError, match="base64"):
        table_from_wire("ds", "not base64 !!")
    with pytest.raises(ProtocolError, match="not a string"):
        table_from_wire("ds", 12)
    with pytest.raises(ProtocolError, match="truncated"):
        table_from_wire("ds", base64.b64encode(b"KSRT").decode())


def test_endpoint_round_trip_and_validation() -> None:
    ep = Endpoint(qpn=0x1234, psn=0xABCDE, lid=0, gid="fe80::1:2", mtu=3, rd_atomic=16)
    assert Endpoint.from_wire(ep.to_wire()) == ep
    # Any spelling of a GID arrives as the same one.
    long = {**ep.to_wire(), "gid": "fe80:0000:0000:0000:0000:0000:0001:0002"}
    assert Endpoint.from_wire(long) == ep
    assert ep.has_gid
    assert not Endpoint(1, 1, 5, "::", 5, 1).has_gid
    bad: object
    for bad in (
        None,
        [],
        {},
        {**ep.to_wire(), "qpn": 1 << 24},
        {**ep.to_wire(), "psn": -1},
        {**ep.to_wire(), "lid": "7"},
        {**ep.to_wire(), "mtu": 0},
        {**ep.to_wire(), "rd_atomic": 0},
        {**ep.to_wire(), "qpn": True},
        {**ep.to_wire(), "gid": "not-a-gid"},
    ):
        with pytest.raises(ProtocolError):
            Endpoint.from_wire(bad)


def test_gid_spelled_the_way_pyverbs_reads_it() -> None:
    assert gid_to_verbs("fe80::1") == "fe80:0000:0000:0000:0000:0000:0000:0001"
    assert gid_to_verbs("::ffff:10.0.0.1") == "0000:0000:0000:0000:0000:ffff:0a00:0001"
