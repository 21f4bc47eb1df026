"""How a process's heap gives memory back (glibc's mallopt; a no-op elsewhere).

Two opposite needs, one module: the node daemon buffers untrusted frames of up to 16 MiB and
must return that memory once a connection drops, while a decoding pool worker allocates and
frees image-sized buffers thousands of times a second and must not hand them back and fault
them in again each time (PIL decode ran 1.4 vs 2.5 ms per image on this alone).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

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
    """Freed memory stays in the process (64 MiB kept at the heap top, never trimmed)."""
    _mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    _mallopt(_M_TOP_PAD, 64 << 20)
