"""Unit tests of the sans-IO wire codec: frames, JSON payloads, read requests, the decoder."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.format import protocol
from kspeedfs.format.errors import ProtocolError
from kspeedfs.format.protocol import (
    HEADER,
    MAX_CONTROL_PAYLOAD,
    MAX_PAYLOAD,
    MAX_RANGES,
    Frame,
    FrameDecoder,
    MsgType,
)

INSTANCE = "ab" * 16


def decode_all(data: bytes, chunk: int | None = None) -> list[Frame]:
    d = FrameDecoder()
    out = []
    step = chunk or max(len(data), 1)
    for i in range(0, len(data), step):
        d.feed(data[i : i + step])
        while (f := d.next_frame()) is not None:
            out.append(f)
    assert d.pending == 0
    return out


def test_json_frame_round_trip() -> None:
    wire = protocol.encode_json(MsgType.REQUEST, 42, {"op": "list", "n": [1, "ü"]})
    (frame,) = decode_all(wire)
    assert frame.type is MsgType.REQUEST and frame.request_id == 42
    assert frame.json() == {"op": "list", "n": [1, "ü"]}


def test_frames_arrive_in_any_split() -> None:
    frames = [
        protocol.encode_json(MsgType.REQUEST, 1, {"op": "ping"}),
        protocol.encode_frame(MsgType.DATA, 2, b""),
        protocol.encode_frame(MsgType.DATA, 3, bytes(range(256)) * 40),
        protocol.encode_frame(
            MsgType.READ, 2**32 - 1, protocol.encode_read("ds", INSTANCE, [(1, 2, 3)])
        ),
    ]
    wire = b"".join(frames)
    whole = decode_all(wire)
    assert [f.request_id for f in whole] == [1, 2, 3, 2**32 - 1]
    assert whole[2].payload == bytes(range(256)) * 40
    for chunk in (1, 5, 12, 13, 1000):
        assert decode_all(wire, chunk) == whole


def test_request_ids_wrap_to_32_bits() -> None:
    (frame,) = decode_all(protocol.encode_frame(MsgType.RESPONSE, 2**32 + 5, b"{}"))
    assert frame.request_id == 5


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (HEADER.pack(b"XX", protocol.VERSION, MsgType.REQUEST, 1, 0), "bad magic"),
        (HEADER.pack(b"KS", protocol.VERSION + 1, MsgType.REQUEST, 1, 0), "version"),
        (HEADER.pack(b"KS", protocol.VERSION, 0, 1, 0), "unknown message type"),
        (HEADER.pack(b"KS", protocol.VERSION, 99, 1, 0), "unknown message type"),
        (
            HEADER.pack(b"KS", protocol.VERSION, MsgType.REQUEST, 1, MAX_CONTROL_PAYLOAD + 1),
            "exceeds",
        ),
        (HEADER.pack(b"KS", protocol.VERSION, MsgType.DATA, 1, MAX_PAYLOAD + 1), "exceeds"),
        (b"GET / HTTP/1.1\r\n", "bad magic"),
    ],
)
def test_bad_headers(header: bytes, message: str) -> None:
    d = FrameDecoder()
    d.feed(header)
    with pytest.raises(ProtocolError, match=message):
        d.next_frame()


def test_a_large_data_frame_is_allowed_but_not_a_large_control_frame() -> None:
    assert protocol.parse_header(
        HEADER.pack(b"KS", protocol.VERSION, MsgType.DATA, 1, MAX_CONTROL_PAYLOAD + 1)
    ) == (MsgType.DATA, 1, MAX_CONTROL_PAYLOAD + 1)
    with pytest.raises(ProtocolError):
        protocol.encode_header(MsgType.DATA, 1, MAX_PAYLOAD + 1)


@pytest.mark.parametrize("payload", [b"", b"not json", b"[1, 2]", b'"str"', b"\xff\xfe", b"{"])
def test_bad_json_payloads(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_json(payload)


def test_read_request_round_trip() -> None:
    ranges = [(0, 0, 1), (7, 2**40, 4096), (2**32 - 1, 5, 0)]
    instance = "0123456789abcdef" * 2
    assert protocol.decode_read(protocol.encode_read("imagenet", instance, ranges)) == (
        "imagenet",
        instance,
        ranges,
    )
    assert protocol.decode_read(protocol.encode_read("x", instance, [])) == ("x", instance, [])


def test_a_read_must_name_its_instance() -> None:
    for bad in ("", "abc", "g" * 32, "0" * 30, "0" * 34):
        with pytest.raises(ProtocolError, match="instance id"):
            protocol.encode_read("ds", bad, [(0, 0, 1)])


def test_bad_read_requests() -> None:
    good = protocol.encode_read("ds", INSTANCE, [(1, 2, 3), (4, 5, 6)])
    with pytest.raises(ProtocolError, match="truncated"):
        protocol.decode_read(good[:3])
    with pytest.raises(ProtocolError, match="length"):
        protocol.decode_read(good[:-1])
    with pytest.raises(ProtocolError, match="length"):
        protocol.decode_read(good + b"\0")
    with pytest.raises(ProtocolError, match="UTF-8"):
        protocol.decode_read(struct.pack("!B16sI", 2, bytes(16), 0) + b"\xff\xfe")
    with pytest.raises(ProtocolError, match="too many"):
        protocol.decode_read(struct.pack("!B16sI", 0, bytes(16), MAX_RANGES + 1))
    with pytest.raises(ProtocolError, match="too many"):
        protocol.encode_read("ds", INSTANCE, [(0, 0, 1)] * (MAX_RANGES + 1))
    too_big = [(0, 0, 2**31), (1, 0, 2**31)]
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode_read(protocol.encode_read("ds", INSTANCE, too_big))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=64))
def test_random_bytes_give_frames_or_protocol_error(data: bytes, chunk: int) -> None:
    d = FrameDecoder()
    try:
        for i in range(0, len(data), chunk):
            d.feed(data[i : i + chunk])
            while (f := d.next_frame()) is not None:
                assert isinstance(f.type, MsgType)
                # Decoding what the frame carries fails only with ProtocolError too.
                if f.type is MsgType.READ:
                    protocol.decode_read(f.payload)
                else:
                    f.json()
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(MsgType)),
            st.integers(min_value=0, max_value=2**32 - 1),
            st.binary(max_size=300),
        ),
        max_size=8,
    ),
    st.integers(min_value=1, max_value=50),
)
def test_any_valid_frames_decode_back_in_any_split(
    frames: list[tuple[MsgType, int, bytes]], chunk: int
) -> None:
    wire = b"".join(protocol.encode_frame(t, rid, p) for t, rid, p in frames)
    got = decode_all(wire, chunk)
    assert [(f.type, f.request_id, f.payload) for f in got] == frames
