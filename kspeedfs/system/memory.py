"""How a process's memory meets the kernel: when the heap gives memory back (glibc's mallopt;
a no-op elsewhere), and mapping a buffer's pages ahead of a kernel copy.

Two opposite needs for the heap: the node daemon buffers untrusted frames of up to 16 MiB and
must return that memory once a connection drops, while a decoding pool worker allocates and
frees image-sized buffers thousands of times a second and must not hand them back and fault
them in again each time (PIL decode ran 1.4 vs 2.5 ms per image on this alone).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def _mallopt(param: int, value: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(param, value)
    except (OSError, AttributeError):
        log.debug("mallopt is not available: the heap keeps its default policy")


def return_large_buffers() -> None:
    """Large buffers are mapped on their own and unmapped when freed. glibc would otherwise
    raise its mmap threshold after the first big free and put the next big buffers on the
    heap, where a dropped connection's frame can stay resident for good."""
    _mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def keep_freed_memory() -> None:
    """Freed memory stays in the process (64 MiB kept at the heap top, never trimmed), and
    buffers up to 32 MiB (glibc's most) come from the heap. Setting any of these fixes the
    mmap threshold where it stands: in a fresh forkserver child that is 128 KiB, so every
    decoded image's buffers were mapped and unmapped each time (~370 page faults and 1 ms of
    system time per 110 KB JPEG, a third more CPU than the decode), where a process that had
    freed a big buffer before (glibc then raises the threshold) did not."""
    _mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    _mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    _mallopt(_M_TOP_PAD, 64 << 20)


def trim_heap() -> None:
    """Give the heap's free pages back to the machine now (glibc's malloc_trim), after a
    one-off build whose scratch was several times what it keeps: the merged tar view's table
    holds ~60 bytes per member in a serving process, its build ~3x that, which glibc would
    otherwise keep in the heap for good."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        log.debug("malloc_trim is not available: freed memory stays in the heap")


def map_pages(view: memoryview) -> None:
    """Map a mapped buffer's pages into this process now, by reading a byte of each (0.7 us
    for 300 KB already mapped; a page not mapped yet costs the fault the kernel would take).

    A FUSE reply is copied from the server's memory by the kernel, which maps each page it
    finds unmapped; when the server is being killed meanwhile (SIGKILL pending), mapping fails,
    the kernel ends the request with EIO, and the reader gets EIO, or SIGBUS through mmap. With
    the pages mapped first, the copy never waits on a fault, so it completes or never starts,
    and a request that never got its reply is sent again to another serving process.
    (madvise(MADV_POPULATE_READ) does the same in one call but costs 15 us even when mapped.)
    """
    if view.nbytes:
        view[::_PAGE].tobytes()  # a byte of each page the view starts in, then every page on
        view[-1]  # and of the last, which the stride can miss when the view is not aligned
