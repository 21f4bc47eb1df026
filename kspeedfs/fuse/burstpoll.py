"""A serving thread's poll for the next request during one reader's burst (`fuse_poll_us`)."""

from __future__ import annotations

import os
import select
import time


class BurstPoll:
    """Keeps the CPUs from halting through one reader's burst of requests (off by default).

    A thread blocked in read(2) of /dev/fuse is woken by the kernel for each request; when its
    CPU went idle meanwhile, on a VM whose idle CPUs halt that wake-up is a halted virtual CPU
    brought back (tens of us, more than the request itself: docs/mounts.md), and so is the
    reader's when the reply wakes it. So after answering a request of a thread that asked
    before within `window` seconds (a burst: one reader opening file after file), the thread
    polls the fd for up to `window` before it blocks again, yielding its CPU between polls.
    Every serving process polls, so no CPU the reader may wait on halts. Readers that compute
    between their files for longer than the window (DataLoader workers decoding) start no
    burst, however many of them ask together. The cost, measured: a polling virtual CPU slows
    computing work on the other one (docs/mounts.md), hence off unless `fuse_poll_us` is set."""

    def __init__(self, fd: int, window: float):
        self.window = window
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._answered = 0.0  # when the last request was answered
        self._reader = 0  # the thread that made it
        self._in_burst = False  # it came within `window` of that thread's one before
        self._until = 0.0  # poll until then before blocking

    def wait(self) -> None:
        """Returns when a request is there, or the window has passed (read(2) then blocks)."""
        clock, poll, until, give_way = (
            time.perf_counter,
            self._poller.poll,
            self._until,
            os.sched_yield,
        )
        while clock() < until and not poll(0):
            give_way()

    def arrived(self, reader: int) -> None:
        """A request from thread `reader` (the pid in its header)."""
        self._in_burst = (
            reader == self._reader and time.perf_counter() - self._answered < self.window
        )
        self._reader = reader

    def answered(self) -> None:
        self._answered = now = time.perf_counter()
        self._until = now + self.window if self._in_burst else 0.0
