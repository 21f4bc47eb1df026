"""The typed op contracts and the pieces codec: a request is checked once off the wire (types,
ranges, names, unknown fields) and refused in one line naming the op and the field; a blob
crosses in pieces and comes back whole, and hostile pieces are refused."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format.contract import Request, Wire, at_least, dataset_name
from kspeedfs.format.contract.pieces import Assembly, BlobPiece, fetch_all, pieces_of
from kspeedfs.format.errors import DataError, InvalidArgument


@dataclasses.dataclass(frozen=True)
class Range(Wire):
    start: int = at_least(0)
    length: int = at_least(1)


@dataclasses.dataclass(frozen=True)
class Sample(Request):
    OP = "sample_op"

    name: str = dataset_name()
    segments: list[int] = at_least(0)
    ranges: list[Range] = dataclasses.field(default_factory=list)
    mode: Literal["fast", "safe"] = "safe"
    hint: str | None = None
    weight: float = 1.0
    push: bool = False
    extra: dict[str, int] = dataclasses.field(default_factory=dict)


GOOD = {
    "op": "sample_op",
    "name": "imagenet",
    "segments": [0, 3],
    "ranges": [{"start": 0, "length": 5}],
}


def test_a_request_comes_off_the_wire_typed_and_goes_back_the_same() -> None:
    request = Sample.from_wire(GOOD)
    assert request == Sample("imagenet", [0, 3], [Range(0, 5)])
    assert Sample.from_wire(request.to_wire()) == request
    assert request.to_wire()["op"] == "sample_op"
    assert json.loads(json.dumps(request.to_wire())) == request.to_wire()
    assert Sample.from_wire({**GOOD, "weight": 2}).weight == 2.0  # an int is a number


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": None}, "op sample_op: name must be a string, not None"),
        (
            {"name": "../x"},
            "op sample_op: name: bad dataset name '../x': use 1-64 of a-z 0-9 . _ - "
            "starting with a letter or digit",
        ),
        ({"segments": [0, -1]}, "op sample_op: segments must be at least 0, not -1"),
        ({"segments": [True]}, "op sample_op: segments must be an integer, not True"),
        ({"segments": "0"}, "op sample_op: segments must be a list of an integer, not '0'"),
        ({"ranges": [{"start": 0}]}, "op sample_op: ranges Range: field 'length' is missing"),
        ({"mode": "other"}, "op sample_op: mode must be one of 'fast', 'safe', not 'other'"),
        ({"hint": 3}, "op sample_op: hint must be a string or null, not 3"),
        ({"weight": "1"}, "op sample_op: weight must be a number, not '1'"),
        ({"push": 1}, "op sample_op: push must be a boolean, not 1"),
        ({"extra": {"a": "b"}}, "op sample_op: extra must be an integer, not 'b'"),
        ({"surprise": 1}, "op sample_op: unknown field 'surprise'"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_op_and_the_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        Sample.from_wire({**GOOD, **change})
    assert str(refused.value) == message


def test_a_missing_field_is_named() -> None:
    with pytest.raises(InvalidArgument, match="^op sample_op: field 'segments' is missing$"):
        Sample.from_wire({"name": "imagenet"})


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


# No deadline: on a loaded machine a slow example is not a wrong one.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*GOOD, "mode", "hint", "weight", "x"]), JSON))
def test_any_json_object_is_a_request_or_one_line_refusal(msg: dict[str, Any]) -> None:
    try:
        request = Sample.from_wire(msg)
    except InvalidArgument as e:
        assert str(e).startswith("op sample_op: ") and "\n" not in str(e)
        return
    assert all(s >= 0 for s in request.segments)  # what a handler gets is checked
    assert Sample.from_wire(request.to_wire()) == request


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=5000), st.integers(min_value=1, max_value=700))
def test_a_blob_in_pieces_comes_back_whole(blob: bytes, size: int) -> None:
    pieces = [BlobPiece.from_wire(p.to_wire()) for p in pieces_of(blob, size)]
    whole = Assembly(limit=len(blob))
    for p in pieces:
        whole.add(p)
    assert whole.done and bytes(whole.buf) == blob
    out = io.BytesIO()
    by_offset = {p.offset: p for p in pieces}
    assert fetch_all(by_offset.__getitem__, out.write) == len(blob)
    assert out.getvalue() == blob


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ({"offset": 4, "total": 5, "data": "aGk="}, "piece [4, 6) is past its total 5"),
        ({"offset": -1, "total": 5, "data": ""}, "offset must be at least 0, not -1"),
        ({"offset": 0, "total": 5, "data": "***"}, "piece data is not base64"),
        ({"offset": 0, "data": ""}, "field 'total' is missing"),
    ],
)
def test_a_hostile_piece_is_refused(wire: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace(")", r"\)")):
        BlobPiece.from_wire(wire)


def test_an_assembly_refuses_pieces_out_of_order_changed_or_over_its_limit() -> None:
    whole = Assembly(limit=10)
    whole.add(BlobPiece.of(0, 6, b"abc"))
    with pytest.raises(InvalidArgument, match="expected 3"):
        whole.add(BlobPiece.of(4, 6, b"ef"))
    with pytest.raises(InvalidArgument, match="differs"):
        whole.add(BlobPiece.of(3, 7, b"def"))
    with pytest.raises(InvalidArgument, match="over the 10 limit"):
        Assembly(limit=10).add(BlobPiece.of(0, 11, b""))
    assert not whole.done and whole.received == 3


def test_fetching_stops_on_a_piece_that_does_not_follow_on() -> None:
    with pytest.raises(DataError, match="got one at 2"):
        fetch_all(lambda offset: BlobPiece.of(2, 10, b"xy"), lambda data: None)
    with pytest.raises(DataError, match="empty piece"):
        fetch_all(lambda offset: BlobPiece.of(offset, 10, b""), lambda data: None)
