"""Background tasks an owner starts from its ops, run in the nursery its own `run` opens.

An op that starts a task (a preload's coordination, a member's load) hands it to its owner's
`Tasks`; the owner's `run`, started by the composition root with `nursery.start`, opens the
nursery they live in, so each task's lifetime is its owner's, in plain sight.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

Task = Callable[..., Awaitable[Any]]


class Tasks:
    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[tuple[Task, tuple[Any, ...]]](math.inf)

    def start_soon(self, task: Task, *args: Any) -> None:
        """Run `task(*args)` in the owner's nursery (once its `run` is under way)."""
        self._send.send_nowait((task, args))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The owner's nursery: every task handed over runs in it until the owner stops."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for task, args in self._receive:
                nursery.start_soon(task, *args)
