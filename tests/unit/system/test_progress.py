"""The load progress display: log lines only when something moved, a tqdm bar on a terminal."""

from __future__ import annotations

import io

from kspeedfs.system.progress import LOG_EVERY_S, ProgressBar


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_only_when_something_moved() -> None:
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressBar("preload ds", out, clock=clock)
    bar.update(0, 10, 0, 10_000)
    bar.update(0, 10, 0, 10_000)  # nothing moved
    clock.now += 1
    bar.update(3, 10, 3_000, 10_000)  # moved, but too soon for another line
    clock.now += LOG_EVERY_S
    bar.update(5, 10, 5_000, 10_000)
    clock.now += LOG_EVERY_S * 3
    bar.update(5, 10, 5_000, 10_000)  # stalled: no line however long it waits
    bar.update(10, 10, 10_000, 10_000)  # done: at once
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith("preload ds:") for line in lines)
    assert [line.split("files")[0].rsplit(" ", 2)[-2] for line in lines] == [
        "0/10",
        "5/10",
        "10/10",
    ]
    assert "100%" in lines[-1] and "\r" not in out.getvalue()


def test_terminal_gets_a_bar_redrawn_in_place() -> None:
    out = Terminal()
    bar = ProgressBar("preload ds", out)
    for done in range(0, 10_001, 2_500):
        bar.update(done // 1000, 10, done, 10_000)
    bar.close()
    text = out.getvalue()
    assert "\r" in text and "preload ds" in text
    assert "10/10 files" in text and "100%" in text
