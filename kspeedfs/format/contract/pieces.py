"""Chunked transfer: a blob larger than one control frame crosses the wire as pieces.

One piece is `{"offset", "total", "data"}` (data in base64), checked once when it comes off
the wire: the offset and the data lie inside `total`, and `total` under the receiver's limit.
A sender splits a blob with `pieces_of` (or serves `read_piece` of a file); a receiver puts
the pieces together with `Assembly`, in order, or fetches them all with `fetch_all`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Self

from kspeedfs.format.contract import Wire, at_least
from kspeedfs.format.errors import DataError, InvalidArgument

if TYPE_CHECKING:  # numpy is imported where a column is decoded: the CLI's calls need none
    import numpy as np

# Raw bytes in one piece: about 1.4 MiB once in base64 and JSON, well inside a control frame.
PIECE = 1 << 20


def to_base64(data: bytes | memoryview) -> str:
    """Bytes as text for a JSON frame or an etcd gateway call (this module is the one codec)."""
    return base64.b64encode(data).decode()


def from_base64(text: str | bytes, what: str) -> bytes:
    """The bytes `text` encodes; InvalidArgument naming `what` when it is not base64 (strict:
    a non-alphabet character is refused, in C; validate= would be a regex)."""
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{what} is not base64") from None


@dataclasses.dataclass(frozen=True)
class BlobPiece(Wire):
    """`data` is bytes [offset, offset + len(data)) of a blob of `total` bytes."""

    offset: int = at_least(0)
    total: int = at_least(0)
    data: str = ""  # base64

    @classmethod
    def from_wire(cls, msg: Any) -> Self:
        piece = super().from_wire(msg)
        size = piece.size  # decodes, so bad base64 is refused here, once
        if piece.offset + size > piece.total:
            raise InvalidArgument(
                f"piece [{piece.offset}, {piece.offset + size}) is past its total {piece.total}"
            )
        return piece

    @classmethod
    def of(cls, offset: int, total: int, data: bytes | memoryview) -> BlobPiece:
        return cls(offset, total, to_base64(data))

    @functools.cached_property
    def raw(self) -> bytes:  # decoded once (cached_property writes past the frozen fields)
        return from_base64(self.data, "piece data")

    @property
    def size(self) -> int:
        return len(self.raw)

    @property
    def end(self) -> int:
        return self.offset + self.size


def pieces_of(blob: bytes | memoryview, size: int = PIECE) -> Iterator[BlobPiece]:
    """`blob` in pieces of `size` bytes (one empty piece for an empty blob)."""
    view = memoryview(blob)
    total = len(view)
    for offset in range(0, max(total, 1), size):
        yield BlobPiece.of(offset, total, view[offset : offset + size])


def read_piece(path: os.PathLike[str] | str, offset: int, size: int = PIECE) -> BlobPiece:
    """The piece of file `path` at `offset` (FileNotFoundError passes through)."""
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        if offset > total:
            raise InvalidArgument(f"offset {offset} is past the end ({total} bytes)")
        f.seek(offset)
        return BlobPiece.of(offset, total, f.read(max(0, min(size, PIECE, total - offset))))


class Assembly:
    """Pieces of one blob put together in order, into a buffer of at most `limit` bytes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total: int | None = None
        self.buf = bytearray()

    @property
    def received(self) -> int:
        return len(self.buf)

    @property
    def done(self) -> bool:
        return self.total is not None and len(self.buf) == self.total

    def add(self, piece: BlobPiece) -> int:
        """Takes the next piece; returns the bytes received so far. A piece out of order, a
        total that changed or one over the limit is refused in one line."""
        if piece.total > self.limit:
            raise InvalidArgument(f"a blob of {piece.total} bytes is over the {self.limit} limit")
        if self.total is None:
            self.total = piece.total
        elif piece.total != self.total:
            raise InvalidArgument(f"piece total {piece.total} differs from {self.total}")
        if piece.offset != len(self.buf):
            raise InvalidArgument(f"piece at {piece.offset}, expected {len(self.buf)}")
        self.buf += piece.raw
        return len(self.buf)


def fetch_all(ask: Callable[[int], BlobPiece], write: Callable[[bytes], Any]) -> int:
    """Every piece of a blob, asked for with `ask(offset)` from 0 until its total, each
    passed to `write`; returns the total. A piece that does not follow on is a DataError."""
    offset = 0
    while True:
        piece = ask(offset)
        if piece.offset != offset:
            raise DataError(f"asked for the piece at {offset}, got one at {piece.offset}")
        data = piece.raw
        write(data)
        offset += len(data)
        if offset >= piece.total:
            return piece.total
        if not data:
            raise DataError(f"an empty piece at {offset} of {piece.total}")


def column_to_base64(column: np.ndarray) -> str:
    """A numpy column (a stage's file indexes or checksums) as text for a JSON answer."""
    return to_base64(column.tobytes())


def column_from_base64(text: str, dtype: str, what: str) -> np.ndarray:
    """The column of `dtype` that `text` encodes; InvalidArgument naming `what` when it is not
    base64 or not a whole number of values."""
    import numpy as np

    raw = from_base64(text, what)
    if len(raw) % np.dtype(dtype).itemsize:
        raise InvalidArgument(f"{what} is not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype)
