"""Source I/O from the node's event loop: in threads that never keep the node from stopping.

A source can hang (a hung NFS server blocks read() with no timeout). Such a call is abandoned
when its task is cancelled, a SIGTERM included: trio's worker threads are daemon threads, so
the blocked one ends with the process, and the staging it wrote into is removed by the next
start's recovery. `bound_the_stop` is the backstop for whatever else blocks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")
# After SIGTERM the node ends within this; systemd and tests wait 5 s before a SIGKILL.
STOP_GRACE = 4.0


async def run_sync(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a worker thread, abandoned (left to finish or hang alone) on cancel."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


def bound_the_stop(grace: float = STOP_GRACE) -> None:
    """End the process in `grace` seconds if its orderly stop has not (a thread still blocked
    in a source call that nothing abandoned, or a non-daemon thread held at exit)."""

    def force() -> None:
        log.error("stopping took over %.0fs (a source read is blocked?): exiting now", grace)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(grace, force)
    timer.daemon = True
    timer.start()
