"""BurstPoll, in-process over a pipe: a serving thread polls for the next request only after one
of a reader that asked before within the window, returns as soon as a request is there, and
gives up (to block in read) once the window has passed; readers asking in turn start no burst."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kspeedfs.fuse.burstpoll import BurstPoll

READER = 4242  # the requesting thread in the requests' headers


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def in_burst(burst: BurstPoll, reader: int = READER) -> None:
    """Two requests of `reader`, the second soon after the answer to the first."""
    burst.arrived(reader)
    burst.answered()
    burst.arrived(reader)


def answered_and_waited(burst: BurstPoll) -> float:
    """A request answered, then the wait for the next: the seconds from the answer on (the
    window starts at the answer)."""
    started = time.perf_counter()
    burst.answered()
    burst.wait()
    return time.perf_counter() - started


def test_a_lone_request_is_not_followed_by_polling(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=10.0)
    burst.arrived(READER)  # the first request: none answered before it, so no burst
    assert answered_and_waited(burst) < 5.0  # nothing to read, and it did not poll the 10 s window


def test_a_request_far_from_the_last_ends_the_burst(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=0.002)
    in_burst(burst)  # the next wait polls up to 2 ms
    assert answered_and_waited(burst) >= 0.002
    burst.window = 0.0  # any gap is now too long: the burst is over
    burst.arrived(READER)
    burst.window = 10.0
    assert answered_and_waited(burst) < 5.0


def test_in_a_burst_it_polls_the_whole_window(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=0.005)
    in_burst(burst)
    assert answered_and_waited(burst) >= 0.005


def test_a_waiting_request_ends_the_poll_at_once(pipe: tuple[int, int]) -> None:
    r, w = pipe
    burst = BurstPoll(r, window=10.0)
    in_burst(burst)
    os.write(w, b"x")  # a request is there
    assert answered_and_waited(burst) < 5.0


def test_readers_asking_in_turn_start_no_burst(pipe: tuple[int, int]) -> None:
    """Two DataLoader workers, each computing between its files: their requests come close
    together, but each worker's own come far apart: no polling."""
    burst = BurstPoll(pipe[0], window=10.0)
    for reader in (READER, READER + 1, READER, READER + 1):
        burst.arrived(reader)
        assert answered_and_waited(burst) < 5.0
    in_burst(burst, READER + 1)  # one of them asking again at once: a burst
    burst.window = 0.002
    assert answered_and_waited(burst) >= 0.002
