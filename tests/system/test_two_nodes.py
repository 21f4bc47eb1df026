"""Two node daemons side by side on one machine, each with its own --listen and --shm-dir."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, run_cli


class EnvNode(NodeProcess):
    """A node whose environment also names other settings, which its CLI flags must beat."""

    def __init__(self, *args: object, env_extra: dict[str, str], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.env_extra = env_extra

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.env_extra}


@pytest.fixture
def two_nodes(token_file: Path, tmp_path: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    import shutil

    shm = [Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    decoy = shm[2]
    nodes = [
        EnvNode(
            shm[i],
            token_file,
            tmp_path,
            env_extra={"KSPEEDFS_SHM_DIR": str(decoy), "KSPEEDFS_LISTEN": "127.0.0.1:1"},
        )
        for i in range(2)
    ]
    try:
        for n in nodes:
            n.start()
        yield nodes[0], nodes[1]
    finally:
        for n in nodes:
            n.stop()
        for p in shm:
            shutil.rmtree(p, ignore_errors=True)
    assert not decoy.exists(), "a node used the environment's shm dir over its --shm-dir flag"


def names(node: NodeProcess) -> dict[str, str]:
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    return {d["name"]: d["source"] for d in json.loads(done.stdout)}


@pytest.mark.fuse
def test_two_nodes_side_by_side(
    two_nodes: tuple[NodeProcess, NodeProcess], tmp_path: Path, mounts: list[MountProcess]
) -> None:
    a, b = two_nodes
    assert a.port != b.port
    sources = {}
    for n, tag in ((a, "A"), (b, "B")):
        src = tmp_path / f"src-{tag}"
        src.mkdir()
        (src / "who.txt").write_text(tag)
        sources[tag] = src
        # The same dataset name on both: they are separate caches.
        done = run_cli("preload", str(src), "--name", "data", "-q", env=n.env())
        assert done.returncode == 0, done.stderr
        status = n.request("status")
        assert status["shm_dir"] == str(n.shm_dir)
        assert status["node"] == n.address
        assert (n.shm_dir / "datasets" / "data").is_dir()
    assert names(a) == {"data": str(sources["A"])}
    assert names(b) == {"data": str(sources["B"])}
    # --nodes on the command line beats KSPEEDFS_NODES in the environment.
    done = run_cli("ls", "--json", "--nodes", b.address, env=a.env())
    assert {d["source"] for d in json.loads(done.stdout)} == {str(sources["B"])}
    ma = MountProcess(tmp_path / "mnt-a", a.env(), tmp_path)
    mb = MountProcess(tmp_path / "mnt-b", a.env(), tmp_path, args=("--nodes", b.address))
    mounts.extend([ma, mb])
    ma.start()
    mb.start()
    assert (ma.mountpoint / "data" / "who.txt").read_text() == "A"
    assert (mb.mountpoint / "data" / "who.txt").read_text() == "B"
    # Unloading on one leaves the other alone.
    done = run_cli("unload", "data", env=a.env())
    assert done.returncode == 0, done.stderr
    assert names(a) == {}
    assert names(b) == {"data": str(sources["B"])}
    assert (mb.mountpoint / "data" / "who.txt").read_text() == "B"
