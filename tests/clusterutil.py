"""Helpers for multi-node tests: a few node daemons on 127.0.0.1 that know each other."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conftest import NodeProcess, free_port, run_cli

from kspeedfs.localdata import SEGMENT_DIR


def distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


class Cluster:
    """`size` node daemons sharing one token, each with its own shm folder."""

    def __init__(
        self,
        token_file: Path,
        log_dir: Path,
        size: int = 3,
        segment_size: str = "64KiB",
        memory: str = "1GiB",
    ):
        self.root = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
        self.token_file = token_file
        ports = distinct_ports(size)
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        node_list = ",".join(self.addresses)
        self.nodes = [
            NodeProcess(
                self.root / f"node{i}",
                token_file,
                log_dir,
                memory=memory,
                segment_size=segment_size,
                port=p,
                extra=("--nodes", node_list),
            )
            for i, p in enumerate(ports)
        ]

    def start(self) -> Cluster:
        for n in self.nodes:
            n.start()
        return self

    def stop(self) -> None:
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
            **os.environ,
            "KSPEEDFS_TOKEN_FILE": str(self.token_file),
            "KSPEEDFS_NODES": ",".join(order),
        }
        env.pop("KSPEEDFS_LISTEN", None)
        if local is not None:
            env["KSPEEDFS_LISTEN"] = local.address
        return env

    def preload(
        self, source: Path, name: str, replicas: int = 1, via: NodeProcess | None = None
    ) -> None:
        done = run_cli(
            "preload",
            str(source),
            "--name",
            name,
            "--replicas",
            str(replicas),
            "-q",
            env=self.env(first=via or self.nodes[0]),
        )
        assert done.returncode == 0, done.stderr

    def listing(self, node: NodeProcess) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in node.request("list")["datasets"]}


def held_on_disk(node: NodeProcess, name: str) -> list[int]:
    """The segment files of a published dataset in a node's shm folder."""
    seg_dir = node.shm_dir / "datasets" / name / SEGMENT_DIR
    return sorted(int(f) for f in os.listdir(seg_dir))


def staging_left(node: NodeProcess) -> list[str]:
    staging = node.shm_dir / "staging"
    return sorted(os.listdir(staging)) if staging.exists() else []


@contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    try:
        yield cluster.start()
    finally:
        cluster.stop()
