"""Parsing and printing of sizes, durations and HOST:PORT addresses."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

from kspeedfs.format.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)?\s*$", re.IGNORECASE | re.ASCII)
_FACTORS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
# Sizes travel as signed 64-bit offsets (manifests, wire frames); anything larger is a typo.
MAX_SIZE = (1 << 63) - 1


def parse_size(text: str | int) -> int:
    """'8GiB', '512M', '1048576' -> bytes. Binary multiples either way: memory is sized in GiB."""
    if isinstance(text, int):
        size = text
        if size < 0:
            raise InvalidArgument(f"size must not be negative: {text}")
    else:
        m = _SIZE_RE.match(text)
        if not m:
            raise InvalidArgument(f"not a size: {text!r} (examples: 8GiB, 512MiB, 1073741824)")
        digits, factor = m.group(1), 1024 ** _FACTORS[m.group(2).upper()]
        # Exact arithmetic (a float makes a long digit string inf, or rounds it), on at most
        # 32 digits: 2**63 has 19, and int() refuses thousands.
        size = int(Fraction(digits) * factor) if len(digits) <= 32 else MAX_SIZE + 1
    if size > MAX_SIZE:
        raise InvalidArgument(f"size too large: {text!r} (at most {MAX_SIZE} bytes)")
    return size


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Address(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, default_port: int = 7420) -> Address:
    text = text.strip()
    if not text:
        raise InvalidArgument("empty address")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise InvalidArgument(f"bad address {text!r} (expected [IPv6]:PORT)")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise InvalidArgument(f"bad port in address {text!r}") from None
    if not host or not 0 <= port < 65536:
        raise InvalidArgument(f"bad address {text!r} (expected HOST:PORT)")
    if not host.isprintable() or any(c.isspace() for c in host):
        raise InvalidArgument(f"bad host in address {text!r}")
    return Address(host, port)


def parse_address_list(text: str) -> list[Address]:
    addrs = [parse_address(part) for part in text.split(",") if part.strip()]
    if not addrs:
        raise InvalidArgument("empty node list")
    return addrs
