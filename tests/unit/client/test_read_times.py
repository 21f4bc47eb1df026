"""The workers' time by cause: reads timed only when watched, their shares of the fetches."""

import os

import pytest

from kspeedfs.client import read_times


def test_off_unless_watched_and_the_shares(monkeypatch):
    monkeypatch.setattr(read_times, "enabled", False)
    monkeypatch.setattr(read_times, "seconds", dict.fromkeys(read_times.PATHS, 0.0))
    started = read_times.start()
    assert started == 0.0
    read_times.done(started, "remote")
    assert read_times.seconds["remote"] == 0.0
    monkeypatch.delenv(read_times.ENV, raising=False)
    read_times.enable()
    assert os.environ[read_times.ENV] == "1"  # spawned workers time their reads too
    read_times.done(read_times.start(), "remote")
    assert read_times.seconds["remote"] > 0.0
    shares = read_times.cause({"remote": 3.0, "source": 1.0}, 8.0)
    assert shares == pytest.approx({"local": 0.0, "remote": 0.375, "source": 0.125, "cpu": 0.5})
    assert read_times.cause({}, 0.0) == {}


def test_a_forked_worker_starts_from_zero():
    read_times.seconds["local"] += 1.0
    pid = os.fork()
    if pid == 0:
        os._exit(0 if read_times.seconds["local"] == 0.0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
