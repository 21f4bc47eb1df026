"""Progress of a load on stderr: files, bytes and rate; a tqdm bar on a terminal, log lines else."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

# In a log, a line every few seconds is plenty.
LOG_EVERY_S = 5.0


class ProgressBar:
    """On a terminal a tqdm bar redrawn in place; otherwise a line at most every LOG_EVERY_S
    seconds (and when done), and only when something moved."""

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.stream = stream or sys.stderr
        self.clock = clock
        self.started = clock()
        self._last_line = -math.inf
        self._last_bytes = -1
        self._bar: tqdm | None = None
        if self.stream.isatty():
            self._bar = tqdm(
                desc=label,
                total=0,
                unit="B",
                unit_scale=True,
                file=self.stream,
                dynamic_ncols=True,
            )

    def update(self, files_done: int, files_total: int, bytes_done: int, bytes_total: int) -> None:
        files = f"{files_done}/{files_total} files"
        if self._bar is not None:
            self._bar.total = bytes_total
            self._bar.set_postfix_str(files, refresh=False)
            self._bar.update(bytes_done - self._bar.n)
            return
        now = self.clock()
        if bytes_done == self._last_bytes or (
            now - self._last_line < LOG_EVERY_S and bytes_done < bytes_total
        ):
            return
        self._last_bytes = bytes_done
        self._last_line = now
        line = tqdm.format_meter(
            bytes_done,
            bytes_total,
            now - self.started,
            prefix=self.label,
            unit="B",
            unit_scale=True,
            ascii=True,
            postfix=files,
        )
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
