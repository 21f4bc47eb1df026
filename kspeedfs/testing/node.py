"""A `kspeedfs node` subprocess on 127.0.0.1 with its own port and shm folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError, NodeUnreachable
from kspeedfs.format.sealing import set_sealed, unseal_tree
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.testing.process import (
    KSPEEDFS,
    START_TIMEOUT,
    STARTED,
    STOP_TIMEOUT,
    free_port,
    log_tail,
    stop_process,
    wait_until,
)

# A wrapper that starts the node without CAP_LINUX_IMMUTABLE (as root): it cannot seal its
# segments (the immutable flag), so readers take the unsealed paths (pread, size checks).
# (Not root: nothing to drop, and setpriv could not.)
NO_IMMUTABLE = (
    ("setpriv", "--inh-caps=-linux_immutable", "--bounding-set=-linux_immutable", "--")
    if os.geteuid() == 0
    else ()
)


def can_seal(folder: Path) -> bool:
    """Whether this process may set the immutable flag in `folder` and /dev/shm (root with
    CAP_LINUX_IMMUTABLE, on a filesystem that has the flag): what a node it starts can seal."""
    for where in (folder, Path("/dev/shm")):
        probe = where / f".seal-probe-{os.getpid()}"
        probe.write_bytes(b"")
        fd = os.open(probe, os.O_RDONLY)
        try:
            set_sealed(fd, True)
            set_sealed(fd, False)
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink()
    return True


def remove_tree(path: str | os.PathLike[str]) -> None:
    """shutil.rmtree of a node's folder (shm, spill), also when it holds sealed segments (the
    immutable flag: a node stopped, or killed with -9, leaves its published ones sealed)."""
    with contextlib.suppress(OSError):
        unseal_tree(None, os.fspath(path))
    shutil.rmtree(path, ignore_errors=True)


def _env_path(env: Mapping[str, str], name: str) -> Path | None:
    return Path(env[name]) if env.get(name) else None


class NodeProcess:
    """One `kspeedfs node` subprocess on 127.0.0.1 with its own port and shm folder.

    `base_env` is the environment the node and its clients start from (default: this one);
    `own_session` keeps a Ctrl-C at the terminal away from the node, which is then stopped in
    order by `stop`.
    """

    def __init__(
        self,
        shm_dir: Path,
        token_file: Path,
        log_dir: Path,
        memory: str = "1GiB",
        segment_size: str = "1MiB",
        port: int | None = None,
        extra: tuple[str, ...] = (),
        base_env: Mapping[str, str] | None = None,
        own_session: bool = False,
        client_timeout: float = 10.0,
        wrapper: tuple[str, ...] = (),
    ):
        self.shm_dir = shm_dir
        self.token_file = token_file
        self.memory = memory
        self.segment_size = segment_size
        self.port = port or free_port()
        self.extra = extra
        self.base_env = base_env
        self.own_session = own_session
        self.client_timeout = client_timeout
        self.wrapper = wrapper  # a command the node runs under (NO_IMMUTABLE)
        self.log_path = log_dir / f"node-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment of the node and of a client that talks to it."""
        return {
            **(os.environ if self.base_env is None else self.base_env),
            "KSPEEDFS_TOKEN_FILE": str(self.token_file),
            "KSPEEDFS_NODES": self.address,
        }

    def settings(self) -> Settings:
        """Client settings for this node alone (with the TLS files of its environment)."""
        address = Address("127.0.0.1", self.port)
        env = self.env()
        return Settings(
            listen=address,
            nodes=[address],
            token_file=self.token_file,
            timeout=self.client_timeout,
            tls_cert=_env_path(env, "KSPEEDFS_TLS_CERT"),
            tls_key=_env_path(env, "KSPEEDFS_TLS_KEY"),
            tls_ca=_env_path(env, "KSPEEDFS_TLS_CA"),
        )

    def command(self) -> list[str]:
        return [
            *self.wrapper,
            *KSPEEDFS,
            "node",
            "--listen",
            self.address,
            "--shm-dir",
            str(self.shm_dir),
            "--memory",
            self.memory,
            "--segment-size",
            self.segment_size,
            *self.extra,
        ]

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the node; returns once it answers a ping."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=self.own_session,
            )
        STARTED.append((self.log_path, self.proc))
        try:
            wait_until(self._answers, timeout, f"node on {self.address}")
        except TimeoutError:
            raise NodeUnreachable(
                f"node on {self.address} did not answer within {timeout:.0f}s"
            ) from None
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise NodeUnreachable(
                f"node on {self.address} exited with {self.proc.returncode}: "
                f"{log_tail(self.log_path)}"
            )
        try:
            self.request("ping")
            return True
        except KSpeedError:
            return False

    def client(self) -> NodeClient:
        settings = self.settings()
        return NodeClient(
            settings.listen, self.token_file, self.client_timeout, client_context(settings)
        )

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        with self.client() as c:
            return c.request(op, **args)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL when it has not exited within `timeout` seconds; the socket
        of a node killed earlier goes too (a node that stops removes its own), and its
        folder when it is the default one and empty."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            stop_process(self.proc, timeout)
        configured = self.env().get("KSPEEDFS_SOCKET")
        socket_file = Path(configured or Settings(shm_dir=self.shm_dir).socket_path())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_file)
        if not configured:
            with contextlib.suppress(OSError):
                os.rmdir(socket_file.parent)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
