"""Turns, in-process over a memfd (the shared file) and a pipe (the queue of /dev/fuse): one
holder at a time, kept while nothing else is queued, passed on when something is, and freed by
the kernel when its holder dies."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from kspeedfs.fuse.kernel import Turns


@pytest.fixture
def shared() -> Iterator[tuple[int, int, int]]:
    """(the shared file, the queue's read end, its write end)."""
    memfd = os.memfd_create("turns-test", os.MFD_CLOEXEC)
    r, w = os.pipe()
    yield memfd, r, w
    for fd in (memfd, r, w):
        os.close(fd)


def start_taking(turns: Turns) -> threading.Event:
    """`turns.take()` in a thread; the event is set once it returned."""
    done = threading.Event()
    threading.Thread(target=lambda: (turns.take(), done.set()), daemon=True).start()
    return done


def test_one_holder_at_a_time_and_it_keeps_the_turn_while_nothing_is_queued(
    shared: tuple[int, int, int],
) -> None:
    memfd, r, _ = shared
    first, second = Turns(memfd, r), Turns(memfd, r)
    first.take()
    first.take()  # already held: returns at once
    first.pass_on_if_queued()  # nothing queued behind its request
    assert first.held
    taken = start_taking(second)
    assert not taken.wait(0.3)  # under test: the second waits for the turn
    first.close()
    assert taken.wait(10.0)
    second.close()


def test_a_queued_request_passes_the_turn_on(shared: tuple[int, int, int]) -> None:
    memfd, r, w = shared
    first, second = Turns(memfd, r), Turns(memfd, r)
    first.take()
    taken = start_taking(second)
    assert not taken.wait(0.3)  # under test: the follower waits while nothing is queued
    os.write(w, b"x")  # a request queued behind the one `first` took
    first.pass_on_if_queued()
    assert not first.held
    assert taken.wait(10.0)
    second.close()
    first.close()


def test_a_dead_holders_turn_is_freed_by_the_kernel(shared: tuple[int, int, int]) -> None:
    memfd, r, _ = shared
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: takes the turn and waits to be killed
        try:
            Turns(memfd, r).take()
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    survivor = Turns(memfd, r)
    taken = start_taking(survivor)
    assert not taken.wait(0.3)  # under test: held by the child
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert taken.wait(10.0)
    survivor.close()
