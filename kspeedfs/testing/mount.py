"""A foreground `kspeedfs mount` subprocess that always unmounts when stopped."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from kspeedfs.format.errors import MountError
from kspeedfs.system.mountinfo import lazy_unmount
from kspeedfs.testing.process import (
    KSPEEDFS,
    START_TIMEOUT,
    STARTED,
    log_tail,
    stop_process,
    wait_until,
)


class MountProcess:
    """A foreground `kspeedfs mount` subprocess; `stop` always unmounts (lazily) and reaps it."""

    def __init__(
        self,
        mountpoint: Path,
        env: Mapping[str, str],
        log_dir: Path,
        args: tuple[str, ...] = (),
        own_session: bool = False,
    ):
        self.mountpoint = mountpoint
        self.env = dict(env)
        self.args = args
        self.own_session = own_session
        self.log_path = log_dir / f"mount-{mountpoint.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the mount; returns once the mountpoint is a mount."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [*KSPEEDFS, "mount", str(self.mountpoint), "--foreground", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=self.own_session,
            )
        STARTED.append((self.log_path, self.proc))
        try:
            wait_until(self._mounted, timeout, f"mount at {self.mountpoint}")
        except TimeoutError:
            raise MountError(f"{self.mountpoint} was not mounted within {timeout:.0f}s") from None
        return self

    def _mounted(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise MountError(
                f"mount at {self.mountpoint} exited with {self.proc.returncode}: "
                f"{log_tail(self.log_path)}"
            )
        return os.path.ismount(self.mountpoint)

    def stop(self, timeout: float = 10.0) -> None:
        try:
            lazy_unmount(self.mountpoint)  # live or stale
        finally:
            if self.proc is not None and self.proc.poll() is None:
                stop_process(self.proc, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
