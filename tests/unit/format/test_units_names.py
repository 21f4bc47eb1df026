"""Unit tests of size/address parsing and dataset-name validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.names import validate_name
from kspeedfs.format.units import (
    MAX_SIZE,
    Address,
    format_size,
    parse_address,
    parse_address_list,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("4096B", 4096),
        ("1K", 1024),
        ("1.5K", 1536),
        ("10 kb", 10240),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("8g", 8 << 30),
        (" 2TiB ", 2 << 40),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "5X", "1e3", "GiB", "1..5M", "8 GiB extra", -3])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(text)


@given(st.integers(min_value=0, max_value=MAX_SIZE))
def test_parse_size_of_plain_bytes_round_trips(n: int) -> None:
    assert parse_size(str(n)) == n


@pytest.mark.parametrize(
    "text", [str(MAX_SIZE + 1), "9" * 400, "1" * 5000, "8EiB", "9000000PiB", 1 << 63, "\u0661"]
)
def test_parse_size_refuses_what_no_budget_can_be(text: str | int) -> None:
    """Past 2**63 - 1 bytes (a float made 400 digits inf, and int() refuses 5000), and
    digits other than 0-9."""
    with pytest.raises(InvalidArgument):
        parse_size(text)


@given(st.text(max_size=40) | st.from_regex(r"\A\d{1,40}(\.\d{1,40})?[KMGTP]?(iB)?\Z"))
def test_parse_size_is_a_size_or_one_error(text: str) -> None:
    try:
        n = parse_size(text)
    except InvalidArgument:
        return
    assert 0 <= n <= MAX_SIZE


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1024) == "1.0 KiB"
    assert format_size(1.5 * 1024**3) == "1.5 GiB"
    assert format_size(5 * 1024**5) == "5120.0 TiB"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7421", Address("127.0.0.1", 7421)),
        ("node1", Address("node1", 7420)),
        (" node1:0 ", Address("node1", 0)),
        ("[::1]:80", Address("::1", 80)),
        ("[fe80::1]", Address("fe80::1", 7420)),
    ],
)
def test_parse_address(text: str, expected: Address) -> None:
    assert parse_address(text) == expected


def test_address_prints_back_to_what_parses() -> None:
    for addr in (Address("10.0.0.1", 7420), Address("::1", 9000)):
        assert parse_address(str(addr)) == addr
    assert str(Address("::1", 9000)) == "[::1]:9000"


@pytest.mark.parametrize(
    "text", ["", " ", "h:x", "h:70000", "h:-1", ":80", "[::1]:x", "a b:80", "h\x00:1", "[a\tb]:1"]
)
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_address(text)


def test_parse_address_list() -> None:
    assert parse_address_list("a:1, b:2,") == [Address("a", 1), Address("b", 2)]
    with pytest.raises(InvalidArgument):
        parse_address_list(" , ")


@pytest.mark.parametrize("name", ["imagenet", "a", "0", "coco-2017.train_v2", "a" * 64, "9.-_"])
def test_good_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        ".hidden",
        "-dash",
        "_under",
        "ImageNet",
        "a b",
        "a/b",
        "../etc",
        "a" * 65,
        "ünï",
        "name\n",
        "nul\x00",
    ],
)
def test_bad_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="bad dataset name"):
        validate_name(name)


@given(st.text(max_size=80))
def test_a_valid_name_is_a_safe_single_path_component(name: str) -> None:
    try:
        validate_name(name)
    except InvalidArgument:
        return
    assert "/" not in name and "\x00" not in name and name not in (".", "..")
    assert name.isascii() and name == name.lower() and 1 <= len(name) <= 64


def test_unclosed_or_garbled_ipv6_address_is_refused() -> None:
    for text in ("[::1", "[::1]x", "[::1]7420"):
        with pytest.raises(InvalidArgument):
            parse_address(text)
    assert parse_address("[::1]:7000") == ("::1", 7000)
