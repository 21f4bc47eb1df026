"""An open `kspeedfs://` file: random access to one file of one dataset instance.

The file keeps the `Reader` (so the instance) it was opened on: after an unload and a reload
under the same name it reads the old instance's bytes (its maps, its verified source) or fails
with StaleDataset, never the new instance's. Where the bytes are mapped here, `readinto` copies
straight from the segment into the caller's buffer and `read_buffer` (what pyarrow asks for)
hands out a view of the segment itself: no copy at all.
"""

from __future__ import annotations

import io
import os
from typing import Any

from kspeedfs.client.dataset_reader import Reader
from kspeedfs.format.errors import InvalidArgument, ReadOnlyFileSystem

# Lines are looked for in chunks of this size, each read once.
PEEK_BYTES = 64 * 1024


class KSpeedFile(io.RawIOBase):
    """Read-only, seekable; thread-compatible (one position, like any file object)."""

    def __init__(
        self,
        fs: Any,
        path: str,
        reader: Reader,
        entry: int,
        details: dict[str, Any],
        span: tuple[int, int] | None = None,
    ):
        """`span`: (offset, size) of this file's bytes inside the entry's (a tar's member);
        the whole entry by default."""
        super().__init__()
        self.fs = fs
        self.path = path
        self.reader = reader
        self.entry = entry
        self.details = details
        self.base, self.size = span if span is not None else (0, int(reader.manifest.size[entry]))
        self.mode = "rb"
        self.loc = 0
        self._peeked: tuple[int, bytes] | None = None  # (offset, bytes) of the last remote peek

    def __repr__(self) -> str:
        return f"<KSpeedFile kspeedfs://{self.path}>"

    @property
    def name(self) -> str:  # io declares none; callers read one
        return self.path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        raise ReadOnlyFileSystem(f"kspeedfs://{self.path} is read-only")

    def info(self) -> dict[str, Any]:
        return self.details

    def tell(self) -> int:
        self._checkClosed()
        return self.loc

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        if whence == os.SEEK_SET:
            loc = offset
        elif whence == os.SEEK_CUR:
            loc = self.loc + offset
        elif whence == os.SEEK_END:
            loc = self.size + offset
        else:
            raise InvalidArgument(f"bad whence {whence!r} in seek")
        if loc < 0:
            raise InvalidArgument(f"seek to {loc}, before the start of {self.path}")
        self.loc = loc
        return loc

    def _span(self, n: int | None) -> int:
        left = max(0, self.size - self.loc)
        return left if n is None or n < 0 else min(n, left)

    def _view(self, offset: int, n: int) -> memoryview | bytearray:
        """Bytes [offset, offset+n): a view of a mapped segment where they lie in one held
        here, else read by the one read policy into a buffer of their own."""
        peeked = self._peeked
        if peeked is not None and peeked[0] <= offset and offset + n <= peeked[0] + len(peeked[1]):
            at = offset - peeked[0]
            return memoryview(peeked[1])[at : at + n]
        view = self.reader.range_view(self.entry, self.base + offset, n)
        if view is not None:
            return view
        out = bytearray(n)
        self.reader.gather([(self.entry, self.base + offset, n)], memoryview(out))
        return out

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        n = self._span(size)
        if n == 0:
            return b""
        data = bytes(self._view(self.loc, n))
        self.loc += n
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def read_buffer(self, size: int = -1) -> memoryview:
        """Up to `size` bytes as a buffer (pyarrow's zero-copy read): a view of the mapped
        segment where local (it keeps the mapping alive while it is referenced)."""
        self._checkClosed()
        n = self._span(size)
        if n == 0:
            return memoryview(b"")
        data = self._view(self.loc, n)
        self.loc += n
        return data if isinstance(data, memoryview) else memoryview(data)

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        out = memoryview(buffer).cast("B")
        n = self._span(len(out))
        if n == 0:
            return 0
        view = self.reader.range_view(self.entry, self.base + self.loc, n)
        if view is not None:
            out[:n] = view
        else:
            self.reader.gather([(self.entry, self.base + self.loc, n)], out[:n])
        self.loc += n
        return n

    def readline(self, size: int | None = -1) -> bytes:
        """One line (to b"\\n" included), through a chunk of PEEK_BYTES copied once and served
        to the lines and reads that follow: line iteration costs no read per line."""
        self._checkClosed()
        n = self._span(size)
        parts: list[bytes] = []
        while n > 0:
            start, chunk = self._chunk_at(self.loc)
            at = self.loc - start
            end = chunk.find(b"\n", at, at + n)
            take = (end + 1 - at) if end >= 0 else min(n, len(chunk) - at)
            parts.append(chunk[at : at + take])
            self.loc += take
            n -= take
            if end >= 0:
                break
        return b"".join(parts)

    def _chunk_at(self, offset: int) -> tuple[int, bytes]:
        peeked = self._peeked
        if peeked is None or not peeked[0] <= offset < peeked[0] + len(peeked[1]):
            n = min(PEEK_BYTES, self.size - offset)
            self._peeked = peeked = (offset, bytes(self._view(offset, n)))
        return peeked
