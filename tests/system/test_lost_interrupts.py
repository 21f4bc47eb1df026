"""uring.signal_pending, what InterruptWatch asks of a request's reader before it gives the
INTERRUPT the kernel lost over io_uring: a signal the reader would be interrupted for is
seen, one it blocks is not (read from /proc, of real processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from conftest import wait_for

from kspeedfs.fuse.uring import signal_pending


def status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split(":", 1)[1], 16)
    raise KeyError(name)


def test_a_signal_sent_to_a_stopped_reader_is_pending() -> None:
    reader = subprocess.Popen(["sleep", "60"])
    try:
        assert not signal_pending(reader.pid)
        reader.send_signal(signal.SIGSTOP)
        wait_for(lambda: "T (stopped)" in Path(f"/proc/{reader.pid}/status").read_text())
        reader.send_signal(signal.SIGTERM)  # kept pending while it is stopped
        assert signal_pending(reader.pid)
    finally:
        reader.kill()
        reader.wait()


def test_a_signal_the_reader_blocks_is_not_counted() -> None:
    code = (
        "import signal, sys, time\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
        "print('blocked', flush=True)\n"
        "time.sleep(60)\n"
    )
    reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "blocked\n"
        reader.send_signal(signal.SIGUSR1)
        bit = 1 << (signal.SIGUSR1 - 1)
        wait_for(lambda: bool(status_field(reader.pid, "ShdPnd") & bit), what="SIGUSR1 pending")
        assert not signal_pending(reader.pid)
    finally:
        reader.kill()
        reader.wait()


def test_a_reader_that_is_gone_has_nothing_pending() -> None:
    assert not signal_pending(2**22 + 1)  # above the largest pid_max: no such thread
