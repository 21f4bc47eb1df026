"""map_pages: every page a reply's view spans is in this process's page table before the
kernel copies it (a FUSE server killed mid-copy would otherwise fail the reader's request)."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kspeedfs.system.memory import map_pages

PAGE = mmap.PAGESIZE


def present(address: int, pages: int) -> list[bool]:
    """/proc/self/pagemap's present bit (63) of `pages` pages from `address`."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        entries = struct.unpack(f"{pages}Q", f.read(8 * pages))
    return [bool(e >> 63) for e in entries]


@pytest.mark.parametrize(
    ("start", "length"),
    # start -1: two bytes across a 64 KiB boundary of addresses, so that the fault-around the
    # kernel does for the first (16 pages, aligned) does not map the second
    [(0, 1), (0, PAGE), (1, PAGE), (-1, 2), (12_345, 300_000), (3 * PAGE, 16 * PAGE)],
)
def test_every_page_of_the_view_is_mapped(start: int, length: int) -> None:
    path = Path("/dev/shm") / f"kspeedfs-map-pages-{os.getpid()}"
    size = 1 << 20
    path.write_bytes(os.urandom(size))
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        view = memoryview(m)
        address = _address(m)
        if start < 0:
            start = -address % (16 * PAGE) + 16 * PAGE - 1
        first, last = (address + start) // PAGE, (address + start + length - 1) // PAGE
        span = last - first + 1
        assert not any(present(first * PAGE, span))  # a fresh mapping: nothing mapped yet
        map_pages(view[start : start + length])
        assert all(present(first * PAGE, span))
        view.release()
        m.close()
    finally:
        path.unlink()


def _address(m: mmap.mmap) -> int:
    """The address a read-only mapping starts at."""
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
