"""BurstPoll, in-process over a pipe: a serving thread polls for the next request only after
one that came within the window of the one before, returns as soon as a request is there,
gives up (to block in read) once the window has passed or while another serving process polls,
and serves at normal priority again after polling at idle priority on the reader's CPU."""

from __future__ import annotations

import fcntl
import os
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from uidutil import NOBODY, as_user

from kspeedfs.fuse.kernel import BurstPoll, cpu_of

READER = os.getpid()  # the requesting thread in the requests' headers: this test


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def in_burst(burst: BurstPoll) -> None:
    """Two requests, the second soon after the answer to the first."""
    burst.arrived(READER)
    burst.answered()
    burst.arrived(READER)


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


def test_one_poller_per_mount(pipe: tuple[int, int], tmp_path: Path) -> None:
    """While another serving process holds the lock (its own file description of the shared
    file), this one does not poll: it blocks in read, where the kernel can wake it."""
    shared = tmp_path / "counters"
    shared.write_bytes(b"\0")
    other, mine = os.open(shared, os.O_RDONLY), os.open(shared, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        burst = BurstPoll(pipe[0], window=10.0, lock_fd=mine)
        in_burst(burst)
        assert answered_and_waited(burst) < 5.0
        fcntl.flock(other, fcntl.LOCK_UN)
        burst.window = 0.005
        burst.arrived(READER)
        assert answered_and_waited(burst) >= 0.005  # the lock free: it polls the window
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and let it go after
    finally:
        os.close(other)
        os.close(mine)


def test_it_polls_on_the_readers_cpu_and_is_free_to_move_after(pipe: tuple[int, int]) -> None:
    everywhere = os.sched_getaffinity(0)
    burst = BurstPoll(pipe[0], window=0.002)
    in_burst(burst)
    seen: list[set[int]] = []
    poll_once = burst._poller.poll

    def watching_poll(timeout: int) -> list[tuple[int, int]]:
        seen.append(os.sched_getaffinity(0))
        return poll_once(timeout)

    burst._poller = types.SimpleNamespace(poll=watching_poll)  # type: ignore[assignment]
    answered_and_waited(burst)
    reader_cpu = cpu_of(READER)
    assert reader_cpu is not None
    assert {cpu for s in seen[1:] for cpu in s} <= {burst._reader_cpu}  # pinned while polling
    assert os.sched_getaffinity(0) == everywhere  # and free once the window passed


def test_cpu_of() -> None:
    assert cpu_of(os.getpid()) in os.sched_getaffinity(0)
    assert cpu_of(2**22 + 1) is None  # past pid_max: no such thread
