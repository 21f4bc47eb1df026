"""A private node and the mounts made on it: what the demo and the benches run on."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from kspeedfs.client import admin
from kspeedfs.format.contract.preload import PreloadStarted, Progressing, Published
from kspeedfs.format.units import Address
from kspeedfs.system.mountinfo import lazy_unmount
from kspeedfs.testing.mount import MountProcess
from kspeedfs.testing.node import NodeProcess, remove_tree
from kspeedfs.testing.process import ensure_token, private_env

log = logging.getLogger(__name__)


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

    def preload(
        self, source: Path, name: str, show_progress: bool = True
    ) -> PreloadStarted | Progressing | Published:
        return admin.preload(self.settings, str(source), name, show_progress=show_progress)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        return self.node.request(op, **args)

    def mount(
        self, mountpoint: Path, *extra: str, env: dict[str, str] | None = None
    ) -> MountProcess:
        """`kspeedfs mount` of this node at `mountpoint` (settings in `env` over the node's);
        returns once it is up."""
        self.unmount(mountpoint)  # a mount left by a killed earlier run makes it busy
        m = MountProcess(
            mountpoint, {**self.env(), **(env or {})}, self.workdir, args=extra, own_session=True
        )
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
        remove_tree(self.shm_dir)

    def __enter__(self) -> LocalCache:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
