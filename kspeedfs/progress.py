"""A one-line terminal progress bar: files, bytes and rate."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .units import format_size


class ProgressBar:
    def __init__(self, label: str, stream: TextIO | None = None, width: int = 28):
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._last_line = 0.0
        self._last_bytes = -1
        self.started = time.monotonic()

    def update(self, files_done: int, files_total: int, bytes_done: int, bytes_total: int) -> None:
        now = time.monotonic()
        # On a terminal redraw often; in a log, a line every few seconds is plenty.
        if not self.tty and (
            (now - self._last_line < 5 and bytes_done < bytes_total)
            or bytes_done == self._last_bytes
        ):
            return
        self._last_bytes = bytes_done
        self._last_line = now
        frac = bytes_done / bytes_total if bytes_total else 1.0
        filled = int(frac * self.width)
        rate = bytes_done / max(now - self.started, 1e-9)
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}%  "
            f"{files_done}/{files_total} files  {format_size(bytes_done)}/{format_size(bytes_total)}"
            f"  {format_size(rate)}/s"
        )
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
