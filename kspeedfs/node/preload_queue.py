"""Preloads that wait for room (`preload --queue`) instead of being refused: first come,
first served.

A queued preload has been scanned and planned; only its admission (every member's claim on
its budget) did not fit. It waits here, and the one at the head tries its admission again as
soon as memory is freed on this node (an unload, an eviction, a claim given back: the
budgets' `when_memory_freed`) and every RETRY_S anyway (room on another member is not seen
here). Only the head tries, so a large preload is not passed for ever by smaller ones behind
it. An unload of the name cancels its wait.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from kspeedfs.format.contract.status import QueuedPreload
from kspeedfs.format.errors import KSpeedError, NoSpace
from kspeedfs.node.budget import Budgets
from kspeedfs.sources.loader import Progress

log = logging.getLogger(__name__)

RETRY_S = 2.0  # the head's admission is tried again this often without a wake-up
T = TypeVar("T")


@dataclasses.dataclass
class Waiting:
    name: str
    source: str
    bytes: int  # what its admission asks of this node's budget (its whole size elsewhere)
    progress: Progress
    since: float = dataclasses.field(default_factory=time.time)  # wall clock, for people
    reason: str = ""  # the last refusal
    tries: int = 0
    wake: trio.Event = dataclasses.field(default_factory=trio.Event)  # room may have freed up


class PreloadQueue:
    """The preloads waiting for room on this node's coordinator, in order."""

    def __init__(self, budgets: Budgets):
        self.budgets = budgets
        self.waiting: list[Waiting] = []
        self._token: trio.lowlevel.TrioToken | None = None
        budgets.when_memory_freed(self._wake)

    def _wake(self) -> None:
        """Memory may have freed up (from any thread): the head looks now."""
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(self._wake_all)
        except trio.RunFinishedError:
            pass

    def _wake_all(self) -> None:
        for entry in self.waiting:
            entry.wake.set()

    async def admit(self, entry: Waiting, attempt: Callable[[], Awaitable[T]]) -> T:
        """Wait for `entry`'s turn and room, then return what `attempt` (its admission)
        returns; NoSpace from `attempt` keeps it waiting, any other error ends the wait.
        Raises KSpeedError when the load is cancelled (an unload) meanwhile."""
        self._token = trio.lowlevel.current_trio_token()
        self.waiting.append(entry)
        log.info("preload of %s queued: %s", entry.name, entry.reason)
        try:
            while True:
                entry.wake = trio.Event()
                if entry.progress.cancel.is_set():
                    raise KSpeedError(f"preload of {entry.name} cancelled while queued")
                if self.waiting[0] is entry:
                    entry.tries += 1
                    try:
                        return await attempt()
                    except NoSpace as e:
                        entry.reason = str(e)
                with trio.move_on_after(RETRY_S):
                    await entry.wake.wait()
        finally:
            self.waiting.remove(entry)
            self._wake_all()  # the next head looks at once

    def status(self) -> list[QueuedPreload]:
        """The queue as `status --json` shows it: position, name, bytes, since, how much
        more memory this node needs free before the head fits (its estimate of the wait)."""
        free = self.budgets.memory_free()
        return [
            QueuedPreload(
                position=position,
                name=entry.name,
                source=entry.source,
                bytes=entry.bytes,
                waiting_since=entry.since,
                short_by=max(0, entry.bytes - free) if position == 1 else None,
                reason=entry.reason,
            )
            for position, entry in enumerate(self.waiting, 1)
        ]
