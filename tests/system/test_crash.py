"""kill -9 of the node: a half-loaded dataset vanishes with its memory; a loaded one survives."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import MountProcess, NodeProcess, run_cli
from treeutil import walk

from kspeedfs.format.sealing import unseal_tree

pytestmark = pytest.mark.slow  # kill -9 and restarts mid-preload


def shm_bytes(path: Path) -> int:
    """Memory the files under path take (tmpfs pages, not apparent sizes)."""
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def listing(node: NodeProcess) -> list[dict[str, Any]]:
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    datasets: list[dict[str, Any]] = json.loads(done.stdout)
    return datasets


def restart(node: NodeProcess) -> str:
    """Start the node again on the same port and shm folder; returns the new log lines."""
    seen = len(node.log())
    node.start()
    return node.log()[seen:]


def test_kill_during_preload_leaves_nothing(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    # 400 sparse 1 MiB files: no disk, but a load of a second or so to catch in the middle
    # (asked of the node directly, so that no CLI start or exit comes between the start of
    # the load and the poll for its first staged bytes).
    src = tmp_path / "big"
    src.mkdir()
    for i in range(400):
        with open(src / f"f{i:04d}.bin", "wb") as f:
            f.write(b"%d" % i)
            f.truncate(1 << 20)
    node = NodeProcess(shm_dir, token_file, tmp_path, memory="1GiB").start()
    try:
        assert listing(node) == []
        assert node.request("preload", source=str(src), name="half")["files_total"] == 400
        staging = shm_dir / "staging"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            # A segment counts once its fallocate has returned (its size is set at the end):
            # tmpfs gives back every page of a fallocate that a SIGKILL interrupts, so pages
            # seen mid-fallocate may be gone after the kill.
            if any(p.stat().st_size > 0 for p in staging.glob("half.*/seg/*")):
                break
            time.sleep(0.002)
        node.kill9()
        assert not (shm_dir / "datasets" / "half").exists(), "the load finished before the kill"
        assert shm_bytes(staging) > 0, "no staged data to clean up"

        log = restart(node)
        assert "half" not in [d["name"] for d in listing(node)]
        assert shm_bytes(shm_dir) == 0
        assert list(staging.iterdir()) == []
        status = node.request("status")
        assert status["used"] == 0
        assert status["datasets"] == 0
        assert "removing unfinished" in log
        # The name is free again and a full load works.
        done = run_cli("preload", str(src), "--name", "half", "-q", env=node.env())
        assert done.returncode == 0, done.stderr
        assert [d["state"] for d in listing(node)] == ["ready"]
    finally:
        node.stop()


@pytest.mark.fuse
def test_kill_after_preload_serves_without_reloading(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    done = run_cli("preload", str(tree), "--name", "kept", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    (before,) = listing(node)
    stored_before = shm_bytes(node.shm_dir / "datasets")
    node.kill9()
    log = restart(node)
    (after,) = listing(node)
    assert after["uuid"] == before["uuid"]
    assert after["created"] == before["created"]
    assert after["state"] == "ready"
    assert "found dataset kept" in log
    assert "preloading" not in log
    assert shm_bytes(node.shm_dir / "datasets") == stored_before
    assert list((node.shm_dir / "staging").iterdir()) == []
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    assert walk(m.mountpoint / "kept") == walk(tree)


def test_restart_keeps_a_dataset_with_a_corrupted_segment(node: NodeProcess, tree: Path) -> None:
    """A segment changed behind the node's back fails its checksum at start: that segment is
    quarantined and fetched again from the source, the dataset kept and never served wrong."""
    for name in ("good", "bad"):
        done = run_cli("preload", str(tree), "--name", name, "-q", env=node.env())
        assert done.returncode == 0, done.stderr
    seg = node.shm_dir / "datasets" / "bad" / "seg" / "00000000"
    original = seg.read_bytes()
    unseal_tree(None, str(seg))  # (a node run as root sealed it: a failing disk ignores that)
    with open(seg, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    node.stop()
    log = restart(node)
    assert sorted(d["name"] for d in listing(node)) == ["bad", "good"]
    assert "segment 0 of bad fails its checksum: quarantined" in log
    deadline = time.monotonic() + 20
    while not (seg.exists() and seg.read_bytes() == original):
        assert time.monotonic() < deadline, "segment 0 of bad was not fetched again"
        time.sleep(0.1)
    assert node.request("status")["integrity"]["repaired"] == 1
    assert os.listdir(node.shm_dir / "trash") == []
