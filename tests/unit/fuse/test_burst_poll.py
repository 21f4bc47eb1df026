"""BurstPoll, in-process over a pipe: a serving thread polls for the next request only after
one that came within the window of the one before, returns as soon as a request is there,
gives up (to block in read) once the window has passed, and serves at normal priority again
after polling at idle priority."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from uidutil import NOBODY, as_user

from kspeedfs.fuse.kernel import BurstPoll


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def in_burst(burst: BurstPoll) -> None:
    """Two requests, the second soon after the answer to the first."""
    burst.arrived()
    burst.answered()
    burst.arrived()


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
    in_burst(burst)  # the next wait polls up to 2 ms
    assert answered_and_waited(burst) >= 0.002
    burst.window = 0.0  # any gap is now too long: the burst is over
    burst.arrived()
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


def test_the_thread_serves_at_normal_priority_after_polling(pipe: tuple[int, int]) -> None:
    burst = BurstPoll(pipe[0], window=0.002)
    in_burst(burst)
    policies: list[int] = []
    done = threading.Event()

    def serving_thread() -> None:
        answered_and_waited(burst)  # polls 2 ms as SCHED_IDLE
        policies.append(os.sched_getscheduler(0))
        done.set()

    threading.Thread(target=serving_thread).start()
    assert done.wait(10.0)
    assert policies == [os.SCHED_OTHER]


def test_a_process_that_could_not_leave_idle_priority_does_not_poll(pipe: tuple[int, int]) -> None:
    """Unprivileged (uid 65534, RLIMIT_NICE 0): SCHED_IDLE would be for good, so no polling;
    as root it polls."""
    assert BurstPoll(pipe[0], window=0.001).window == 0.001
    assert as_user(NOBODY, [], lambda: BurstPoll(pipe[0], window=0.001).window) == 0.0
