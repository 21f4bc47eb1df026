"""The node's table of datasets being loaded: each one's progress, from scanning to ready or failed.

Published datasets live in the store; this table holds the ones not published yet, so that
`list`, `progress` and a second preload of the same name all see one state. A failed load is
kept for FAILED_KEPT_S so that whoever waits on it can read why, then forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import trio

from kspeedfs.format.contract.preload import MAX_WAIT_S, Progressing, state_version
from kspeedfs.format.errors import AlreadyExists, KSpeedError
from kspeedfs.sources.loader import Progress

FAILED_KEPT_S = 600.0
# How often a long-polled answer looks at the state it waits on: a look is a read of an
# attribute in this process, not a request.
WATCH_TICK_S = 0.02


class LoadTable:
    def __init__(self) -> None:
        self._loads: dict[str, Progress] = {}
        self._failed_at: dict[str, float] = {}

    def start(self, name: str, source: str) -> Progress:
        """A new load of `name`; AlreadyExists while another one is under way."""
        current = self._loads.get(name)
        if current is not None and current.state != "failed":
            raise AlreadyExists(f"dataset {name!r} is already loading {current.source}".rstrip())
        progress = Progress(state="scanning", source=source)
        self._loads[name] = progress
        self._failed_at.pop(name, None)
        return progress

    def get(self, name: str) -> Progress | None:
        return self._loads.get(name)

    def finish(self, name: str) -> None:
        """The load published its dataset (or was given up before it started)."""
        self._loads.pop(name, None)
        self._failed_at.pop(name, None)

    def fail(self, name: str, error: BaseException) -> str:
        """Record why a load failed; returns the one-line reason."""
        progress = self._loads.get(name)
        reason = failure_reason(error)
        if progress is not None:
            progress.state = "failed"
            progress.error = reason
            self._failed_at[name] = time.monotonic()
        return reason

    def items(self) -> Iterator[tuple[str, Progress]]:
        self._expire()
        return iter(list(self._loads.items()))

    def to_wire(self) -> list[dict[str, Any]]:
        """Each load as `list` shows it: its name and progress."""
        return [{"name": name, **p.to_wire()} for name, p in self.items()]

    def cancel_all(self) -> None:
        for progress in self._loads.values():
            progress.cancel.set()

    def _expire(self) -> None:
        now = time.monotonic()
        for name, when in list(self._failed_at.items()):
            if now - when > FAILED_KEPT_S:
                self.finish(name)


def failure_reason(error: BaseException) -> str:
    """The one-line reason a load failed with `error`."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(str(x) for x in error.exceptions)
    if isinstance(error, KSpeedError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def progressing(progress: Progress) -> Progressing:
    """A load's progress as `progress` and `stage_status` answer it, with its state's version."""
    return Progressing(**progress.to_wire(), version=state_version(progress.state))


class Versioned(Protocol):
    """A long-polled answer: the version of the state it carries."""

    @property
    def version(self) -> int: ...


Answer = TypeVar("Answer", bound=Versioned)


async def answer_on_change(read: Callable[[], Answer], after: int, wait_s: float) -> Answer:
    """`read()` once its `version` is not `after` (at once for -1) or after `wait_s` seconds
    (at most MAX_WAIT_S), whichever is first: a caller long-polls instead of asking again and
    again."""
    with trio.move_on_after(min(wait_s, MAX_WAIT_S)):
        while True:
            answer = read()
            if after < 0 or answer.version != after:
                return answer
            await trio.sleep(WATCH_TICK_S)
    return read()
