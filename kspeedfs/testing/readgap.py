"""Readers that read a mount's files in a loop and time the longest gap between good reads:
on the host (a thread), or in a container (a busybox shell loop whose lines the host times).

Each read must reach the mount process, not the page cache: the host drops the files' cached
pages (POSIX_FADV_DONTNEED) before each of its reads, and all the time while a container reads
(the container's bind shows the same inodes, so the same pages)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path


def container_loop(files: list[str], seconds: int) -> list[str]:
    """A container's loop over `files` (relative to /data, no blanks) for `seconds`: each one's
    sha256 line, a failed read said as "FAIL"."""
    script = (
        f'cd /data && F="{" ".join("./" + f for f in files)}" && '
        f"end=$(( $(date +%s) + {seconds} )) && "
        'while [ "$(date +%s)" -lt "$end" ]; do for f in $F; do '
        'sha256sum "$f" 2>&1 || echo "FAIL $f"; done; done'
    )
    return ["/bin/sh", "-c", script]


@dataclasses.dataclass
class Reads:
    """What a reader saw: good reads, failed ones (why, first few), and the longest gap."""

    good: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)
    longest_gap: float = 0.0
    gap_ended: float = 0.0  # when the longest gap ended (time.time())
    _last: float = dataclasses.field(default_factory=time.monotonic)

    def ok(self) -> None:
        now = time.monotonic()
        if self.good and now - self._last > self.longest_gap:  # a container takes a while to start
            self.longest_gap = now - self._last
            self.gap_ended = time.time()
        self._last = now
        self.good += 1

    def fail(self, why: str) -> None:
        self.failed.append(why)

    def line(self, what: str) -> str:
        return (
            f"{what}: {self.good} good reads, {len(self.failed)} failed, longest gap"
            f" {self.longest_gap:.2f} s"
            + (f" (first failure: {self.failed[0]})" if self.failed else "")
        )


def drop_cached(path: Path) -> None:
    """Drop the file's cached pages, so that its next read asks the mount."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class HostReader:
    """Reads `files` (path -> the bytes it must hold) in turn in a thread until stopped."""

    def __init__(self, files: dict[Path, bytes]):
        self.files = files
        self.reads = Reads()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> HostReader:
        self.reads = Reads()
        self._thread.start()
        return self

    def stop(self) -> Reads:
        self._stop.set()
        self._thread.join(60)
        return self.reads

    def _run(self) -> None:
        while not self._stop.is_set():
            for path, want in self.files.items():
                drop_cached(path)
                try:
                    got = path.read_bytes()
                except OSError as e:
                    self.reads.fail(f"{path.name}: {e.strerror}")
                    time.sleep(0.05)
                    continue
                if got != want:
                    self.reads.fail(f"{path.name}: wrong bytes")
                else:
                    self.reads.ok()


class ContainerReader:
    """A container (`command`, which runs container_loop) whose output lines are timed here,
    checked against `files` (its path relative to /data -> bytes), while a thread keeps the
    files' pages out of the cache through `host_root` (the target on the host)."""

    def __init__(self, command: list[str], files: dict[str, bytes], host_root: Path):
        self.command = command
        self.sums = {f"./{rel}": hashlib.sha256(data).hexdigest() for rel, data in files.items()}
        self.host_root = host_root
        self.reads = Reads()
        self.proc: subprocess.Popen[bytes] | None = None
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._read_lines, daemon=True),
            threading.Thread(target=self._evict, daemon=True),
        ]

    def start(self) -> ContainerReader:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for t in self._threads:
            t.start()
        return self

    def wait(self, timeout: float) -> Reads:
        """Once the container's loop has ended."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        finally:
            self._done.set()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for t in self._threads:
                t.join(10)
        if self.proc.returncode != 0:
            self.reads.fail(f"the container exited with {self.proc.returncode}")
        return self.reads

    def first_read(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.reads.good == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.reads.good > 0

    def _read_lines(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        self.reads._last = time.monotonic()
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            digest, _, rel = line.partition("  ")
            if self.sums.get(rel) == digest:
                self.reads.ok()
            elif rel in self.sums:
                self.reads.fail(f"{rel}: wrong bytes")
            else:
                self.reads.fail(line)

    def _evict(self) -> None:
        paths = [self.host_root / rel[2:] for rel in self.sums]
        while not self._done.wait(0.02):
            for path in paths:
                drop_cached(path)
