"""Helpers for the etcd tests: a real etcd and nodes that find each other there (no node list)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import requests
from clusterutil import held_on_disk
from conftest import NodeProcess, run_cli
from prometheus_client.parser import text_string_to_metric_families

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.testing.etcd import EtcdProcess
from kspeedfs.testing.process import is_users_setting, wait_until


class EtcdCluster:
    """Nodes that find each other in one etcd (no node list anywhere). `tls`: the
    KSPEEDFS_TLS_* variables of nodes and clients (mutual TLS toward each other and etcd)."""

    def __init__(
        self,
        tmp_path: Path,
        token_file: Path,
        etcd: EtcdProcess,
        tls: dict[str, str] | None = None,
    ):
        self.tmp = tmp_path
        self.tls = tls or {}
        self.token_file = token_file
        self.etcd = etcd
        self.root = Path("/dev/shm") / f"kspeedfs-etcd-{uuid.uuid4().hex[:10]}"
        self.nodes: list[NodeProcess] = []
        self.cluster = f"t{uuid.uuid4().hex[:8]}"

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not is_users_setting(k)}
        config = self.tmp / "empty.toml"
        config.touch()
        env.update(
            KSPEEDFS_CONFIG=str(config),
            KSPEEDFS_ETCD=self.etcd.endpoint,
            KSPEEDFS_CLUSTER=self.cluster,
            KSPEEDFS_MEMBER_TTL="2",
            KSPEEDFS_HEAL_AFTER="2",
            KSPEEDFS_TOKEN_FILE=str(self.token_file),
            **self.tls,
        )
        return env

    def add(self, segment_size: str = "64KiB", **env: str) -> NodeProcess:
        node = NodeProcess(
            self.root / f"node{len(self.nodes)}",
            self.token_file,
            self.tmp,
            segment_size=segment_size,
            base_env={**self.base_env(), **env},
        )
        self.nodes.append(node)
        node.start()
        # It answers pings a moment before it has joined: wait, so a preload places on it.
        wait_until(lambda: self.members().get(node.address) == "up", 20, f"{node.address} in etcd")
        return node

    def client_env(self) -> dict[str, str]:
        return self.base_env()

    def settings(self) -> Settings:
        tls = {k.removeprefix("KSPEEDFS_").lower(): Path(v) for k, v in self.tls.items()}
        return Settings(
            etcd=[self.etcd.endpoint], cluster=self.cluster, token_file=self.token_file, **tls
        )

    def state(self) -> ClusterState:
        return ClusterState.of(self.settings())

    def entry(self, name: str) -> CatalogEntry:
        """The dataset's catalog entry (AssertionError when there is none)."""
        found = self.state().dataset(name)
        assert found is not None, f"no catalog entry for {name!r}"
        return found[0]

    def catalog_state(self, name: str) -> str | None:
        """The state of the dataset's catalog entry; None when there is none."""
        found = self.state().dataset(name)
        return found[0].state if found else None

    def lost(self, name: str) -> tuple[str, ...]:
        """The members the dataset's catalog entry declares lost (none without an entry)."""
        found = self.state().dataset(name)
        return found[0].lost_members if found else ()

    def members(self) -> dict[str, str]:
        return {m["node"]: m["state"] for m in self.state().member_table()}

    def preload(self, source: Path, name: str, replicas: int = 1) -> None:
        done = run_cli(
            "preload", str(source), "--name", name, "--replicas", str(replicas), "-q",
            env=self.client_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def copies(name: str, nodes: list[NodeProcess]) -> dict[int, int]:
    """Segment -> how many of `nodes` hold it in their shm folder."""
    counts: dict[int, int] = {}
    for n in nodes:
        try:
            for seg in held_on_disk(n, name):
                counts[seg] = counts.get(seg, 0) + 1
        except FileNotFoundError:
            pass
    return counts


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page parsed by prometheus_client: (name, sorted labels) -> value."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
