"""moto's S3 server on 127.0.0.1, for sources and read-through mounts over s3://."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from kspeedfs.format.errors import KSpeedError
from kspeedfs.testing.process import START_TIMEOUT, free_port, log_tail, stop_process, wait_until


class S3Server:
    """moto's S3 server (`python -m moto.server`) on 127.0.0.1, logging every request it answers.

    `env_extra` configures it, e.g. INITIAL_NO_AUTH_ACTION_COUNT to turn IAM checks on.
    """

    def __init__(self, log_dir: Path, env_extra: Mapping[str, str] | None = None):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "moto.log"
        self.server_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.server_env,
            )
        wait_until(self._answers, timeout, "the S3 server")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise KSpeedError(f"the S3 server exited: {log_tail(self.log_path)}")
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.5).close()
            return True
        except OSError:
            return False

    def object_gets(self, bucket: str, prefix: str = "") -> int:
        """GETs of objects in bucket (under prefix) that the server answered, from its log."""
        under = re.escape(prefix.strip("/") + "/") if prefix else ""
        pattern = re.compile(rf"GET /{re.escape(bucket)}/{under}[^ ?]+ HTTP")
        return sum(
            1
            for line in self.log_path.read_text(errors="replace").splitlines()
            if pattern.search(line)
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            stop_process(self.proc, 10.0)
