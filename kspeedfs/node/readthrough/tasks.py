"""Background tasks that ops start, run in the nursery their owner opens."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

Task = Callable[[], Awaitable[object]]


class Background:
    """An owner's ops hand tasks to `start_soon`; the owner's `run` (started with
    `nursery.start`) runs them in its own nursery, so they live and end with the owner and no
    op needs a nursery lent to it. A task handed over before `run` starts waits for it."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[Task](math.inf)

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        self._send.send_nowait(functools.partial(fn, *args))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for task in self._receive:
                nursery.start_soon(task)
