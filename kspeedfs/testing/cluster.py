"""Several node subprocesses on 127.0.0.1 that know each other."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from kspeedfs.testing.node import NodeProcess, remove_tree
from kspeedfs.testing.process import free_ports


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
        remove_tree(self.root)

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
