"""What the bench scripts share: memory warmed before each side of a comparison."""

from __future__ import annotations

import mmap


def warm_memory(nbytes: int) -> None:
    """Touch every page of a buffer and free it. On a VM, memory the guest never touched costs
    a host fault per page on first use: the side that runs next finds it faulted in once, not
    paying its own first-touch cost (which the side before it would not have paid)."""
    buf = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, mmap.PAGESIZE):
        buf[off] = 1
    buf.close()
