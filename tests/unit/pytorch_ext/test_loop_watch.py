"""pytorch_ext.watch on a plain iterable: the stall it reports against the loop's own timing,
the exit table, and the cost of the hook when KSPEEDFS_WATCH is unset."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import watchloop

from pytorch_ext import loop_watch

REPO = Path(__file__).resolve().parents[3]


def slow_batches(n: int, wait: float):
    for i in range(n):
        time.sleep(wait)
        yield [i] * 4


@pytest.fixture
def fresh_meter(monkeypatch):
    monkeypatch.setenv("KSPEEDFS_WATCH_REPORT", "0")
    monkeypatch.setattr(loop_watch, "_meter", None)
    return loop_watch.meter


@pytest.mark.parametrize("wait,step", [(0.0, 0.01), (0.01, 0.01), (0.02, 0.002)])
def test_reported_stall_is_the_loops_own(fresh_meter, capsys, wait, step):
    blocked, busy, _ = watchloop.timed_loop(loop_watch.watch(slow_batches(30, wait)), step)
    meter = fresh_meter()
    truth = blocked / (blocked + busy)
    reported = meter.blocked / (meter.blocked + meter.busy)
    assert abs(reported - truth) < 0.02, (reported, truth)
    assert meter.batches == 30
    table = capsys.readouterr().err
    assert table.startswith("kspeedfs watch (job ")
    assert f"{reported:.0%} of" in table and "MLPerf Storage" in table


def test_a_watched_loader_keeps_its_length_and_attributes(fresh_meter):
    class Loader(list):
        batch_size = 8

    watched = loop_watch.watch(Loader([1, 2, 3]))
    assert len(watched) == 3 and watched.batch_size == 8  # type: ignore[attr-defined]
    assert list(watched) == [1, 2, 3]
    assert fresh_meter().samples == 24


def test_the_hook_costs_nothing_when_unset():
    """Without KSPEEDFS_WATCH the .pth line imports nothing; with it, not torch either."""
    line = (REPO / "kspeedfs_watch.pth").read_text()
    probe = f"{line}\nimport sys; print('pytorch_ext' in sys.modules, 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "KSPEEDFS_WATCH"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stderr
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "KSPEEDFS_WATCH": "1"},
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["True", "False"], out.stderr
