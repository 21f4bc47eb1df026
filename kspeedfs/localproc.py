"""Local processes for the demo, tests and benches: nodes on 127.0.0.1, mounts, an S3 server.

Each helper starts a real subprocess, waits until it answers and stops it in order (SIGTERM,
then SIGKILL; a mount is lazily unmounted first), so a run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

from kspeedfs.client import admin
from kspeedfs.format import auth
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError, MountError, NodeUnreachable
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.system.mountinfo import lazy_unmount

log = logging.getLogger(__name__)

KSPEEDFS = [sys.executable, "-m", "kspeedfs.cli"]
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (the kernel may hand the same one out twice in a row)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` until it is true; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ensure_token(path: Path) -> Path:
    """An admin token at `path`, made when there is none yet."""
    if not path.exists():
        auth.write_token(path, auth.new_admin_token())
    return path


def private_env(config_file: Path) -> dict[str, str]:
    """This environment without KSPEEDFS_* variables and with `config_file` (write it empty)
    as the config: the children read nothing of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
    env["KSPEEDFS_CONFIG"] = str(config_file)
    return env


def _env_path(env: Mapping[str, str], name: str) -> Path | None:
    return Path(env[name]) if env.get(name) else None


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-3:])


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for a process that was asked to stop; kill it when it does not."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
                f"{_log_tail(self.log_path)}"
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
            _stop(self.proc, timeout)
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
                f"{_log_tail(self.log_path)}"
            )
        return os.path.ismount(self.mountpoint)

    def stop(self, timeout: float = 10.0) -> None:
        try:
            lazy_unmount(self.mountpoint)  # live or stale
        finally:
            if self.proc is not None and self.proc.poll() is None:
                _stop(self.proc, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class LocalCluster:
    """`size` nodes on 127.0.0.1 that know each other, one token, a shm folder each."""

    def __init__(
        self,
        token_file: Path,
        log_dir: Path,
        size: int = 3,
        segment_size: str = "64KiB",
        memory: str = "1GiB",
        base_env: Mapping[str, str] | None = None,
        own_session: bool = False,
        tag: str = "test",
    ):
        self.root = Path("/dev/shm") / f"kspeedfs-{tag}-{uuid.uuid4().hex[:10]}"
        self.token_file = token_file
        self.base_env = base_env
        ports = free_ports(size)
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        self.nodes = [
            NodeProcess(
                self.root / f"node{i}",
                token_file,
                log_dir,
                memory=memory,
                segment_size=segment_size,
                port=p,
                extra=("--nodes", ",".join(self.addresses)),
                base_env=base_env,
                own_session=own_session,
            )
            for i, p in enumerate(ports)
        ]

    def start(self) -> Self:
        for n in self.nodes:
            n.start()
        return self

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def env(
        self, local: NodeProcess | None = None, first: NodeProcess | None = None
    ) -> dict[str, str]:
        """Client environment: every node listed (`first` first: it coordinates a preload);
        with `local`, the process counts as running on that node (it maps its segments)."""
        order = sorted(self.addresses, key=lambda a: first is None or a != first.address)
        env = {
            **(os.environ if self.base_env is None else self.base_env),
            "KSPEEDFS_TOKEN_FILE": str(self.token_file),
            "KSPEEDFS_NODES": ",".join(order),
        }
        env.pop("KSPEEDFS_LISTEN", None)
        if local is not None:
            env["KSPEEDFS_LISTEN"] = local.address
        return env


class LocalCache:
    """A private node (own port, shm folder, token, empty config) and the mounts made on it.

    Nothing of the user's is read or touched: KSPEEDFS_* variables are dropped from the
    children's environment and the config file is an empty one in the work folder.
    """

    def __init__(
        self,
        workdir: Path,
        memory: int,
        segment_size: str = "64MiB",
        extra: tuple[str, ...] = (),
    ):
        self.workdir = workdir
        self.token_file = workdir / "token"
        self.config_file = workdir / "empty.toml"
        self.node = NodeProcess(
            Path("/dev/shm") / f"kspeedfs-demo-{uuid.uuid4().hex[:10]}",
            self.token_file,
            workdir,
            memory=str(memory),
            segment_size=segment_size,
            extra=extra,  # more flags of `kspeedfs node`
            base_env=private_env(self.config_file),
            own_session=True,
            client_timeout=30.0,
        )
        self.address = Address("127.0.0.1", self.node.port)
        self.shm_dir = self.node.shm_dir
        self.settings = self.node.settings()
        self.mounts: dict[Path, MountProcess] = {}

    def env(self) -> dict[str, str]:
        return self.node.env()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ensure_token(self.token_file)
        self.config_file.write_text("")
        self.node.start()

    def preload(self, source: Path, name: str, show_progress: bool = True) -> dict[str, Any]:
        return admin.preload(self.settings, str(source), name, show_progress=show_progress)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        return self.node.request(op, **args)

    def mount(self, mountpoint: Path, *extra: str) -> MountProcess:
        """`kspeedfs mount` of this node at `mountpoint`; returns once it is up."""
        self.unmount(mountpoint)  # a mount left by a killed earlier run makes it busy
        m = MountProcess(mountpoint, self.env(), self.workdir, args=extra, own_session=True)
        self.mounts[mountpoint] = m
        return m.start()

    def mount_pid(self, mountpoint: Path) -> int | None:
        """The pid of the process serving this mount (for CPU accounting)."""
        m = self.mounts.get(mountpoint)
        return None if m is None or m.proc is None else m.proc.pid

    def unmount(self, mountpoint: Path) -> None:
        m = self.mounts.pop(mountpoint, None)
        if m is not None:
            m.stop()
        else:
            lazy_unmount(mountpoint)

    def close(self) -> None:
        """Unmount everything, stop the node, free its memory; safe to call more than once."""
        for mountpoint in list(self.mounts):
            try:
                self.unmount(mountpoint)
            except Exception as e:  # keep cleaning up the rest
                log.error("cannot unmount %s: %s", mountpoint, e)
        self.node.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def __enter__(self) -> LocalCache:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            raise KSpeedError(f"the S3 server exited: {_log_tail(self.log_path)}")
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
            _stop(self.proc, 10.0)
