"""BurstPoll, in-process over a pipe: a serving thread polls for the next request only after
one that came within the window of the one before, returns as soon as a request is there, and
gives up (to block in read) once the window has passed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kspeedfs.fuse.kernel import BurstPoll


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def answered_and_waited(burst: BurstPoll) -> float:
    """A request answered, then the wait for the next: the seconds from the answer on (the
    window starts at the answer)."""
    started = time.perf_counter()
    burst.answered()
    burst.wait()
    return time.perf_counter() - started


def test_a_lone_request_is_not_followed_by_polling(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=10.0)
    burst.arrived()  # the first request: none answered before it, so no burst
    assert answered_and_waited(burst) < 5.0  # nothing to read, and it did not poll the 10 s window


def test_a_request_far_from_the_last_ends_the_burst(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=0.002)
    burst.answered()
    burst.arrived()  # in a burst: the next wait polls up to 2 ms
    assert answered_and_waited(burst) >= 0.002
    burst.window = 0.0  # any gap is now too long: the burst is over
    burst.arrived()
    burst.window = 10.0
    assert answered_and_waited(burst) < 5.0


def test_in_a_burst_it_polls_the_whole_window(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=0.005)
    burst.answered()
    burst.arrived()
    assert answered_and_waited(burst) >= 0.005


def test_a_waiting_request_ends_the_poll_at_once(pipe: tuple[int, int]) -> None:
    r, w = pipe
    burst = BurstPoll(r, window=10.0)
    burst.answered()
    burst.arrived()
    os.write(w, b"x")  # a request is there
    assert answered_and_waited(burst) < 5.0
