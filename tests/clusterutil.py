"""Helpers for multi-node tests: a few node daemons on 127.0.0.1 that know each other."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conftest import NodeProcess, run_cli

from kspeedfs.format import placement
from kspeedfs.format.localdata import MANIFEST_FILE, SEGMENT_DIR
from kspeedfs.format.manifest import Manifest
from kspeedfs.testing.cluster import LocalCluster


class Cluster(LocalCluster):
    """`size` node daemons sharing one token, each with its own shm folder."""

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


def remote_only_files(cluster: Cluster, name: str) -> list[str]:
    """Files of dataset `name` all of whose segments only the cluster's second node holds."""
    local, remote = cluster.nodes
    m = Manifest(local.shm_dir / "datasets" / name / MANIFEST_FILE)
    where = placement.Placement(name, m.segments, m.header["members"], int(m.header["replicas"]))
    out = []
    for i in m.iter_files():
        owners = {o for seg, _, _ in m.ranges(i) for o in where.owners(seg)}
        if owners == {remote.address}:
            out.append(os.fsdecode(m.path(i)))
    return out
