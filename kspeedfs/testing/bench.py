"""What the bench scripts share: memory warmed before each side of a comparison, and the idle
setting of a VM's CPUs that decides what a FUSE round trip costs."""

from __future__ import annotations

import mmap
from pathlib import Path

HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def warm_memory(nbytes: int) -> None:
    """Touch every page of a buffer and free it. On a VM, memory the guest never touched costs
    a host fault per page on first use: the side that runs next finds it faulted in once, not
    paying its own first-touch cost (which the side before it would not have paid)."""
    buf = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, mmap.PAGESIZE):
        buf[off] = 1
    buf.close()


def halt_polling() -> str:
    """How long an idle virtual CPU polls before it halts (the guest's cpuidle-haltpoll), as a
    line for a bench's header. At 0 a CPU halts at once, and each FUSE request then wakes a
    halted CPU twice (the serving process's, then the reader's): tens of microseconds a request
    on a VM, more than the request itself (docs/mounts.md)."""
    try:
        ns = int(HALT_POLL.read_text())
    except (OSError, ValueError):
        return "guest halt polling: not a cpuidle-haltpoll guest"
    return f"guest halt polling: {ns:,} ns" + (" (idle CPUs halt at once)" if ns == 0 else "")
