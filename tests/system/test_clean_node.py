"""`kspeedfs clean-node` removes a stopped node's folders, sealed segments included (where
`rm -rf` answers "Operation not permitted"); refuses in one line, removing nothing, while the
node runs, and for a folder that is not a node's (no marker, or a symlink to one)."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

from conftest import run_cli

from kspeedfs.format.errors import InUse, InvalidArgument
from kspeedfs.format.sealing import sealed_beneath
from kspeedfs.node.nodefolders import MARKER
from kspeedfs.testing.node import NodeProcess, can_seal


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*"))


def tiered_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> NodeProcess:
    spill = ("--spill-dir", str(tmp_path / "spill"), "--spill", "256MiB")
    return NodeProcess(shm_dir, token_file, tmp_path, extra=spill).start()


def preload_on_both_tiers(node: NodeProcess, tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_files(src, {f"d/{i}.bin": bytes([i]) * 300_000 for i in range(12)})
    for name, tier in (("mem", "memory"), ("disk", "disk")):
        done = run_cli("preload", str(src), "--name", name, "--tier", tier, env=node.env())
        assert done.returncode == 0, done.stderr


def clean(env: dict[str, str], *folders: Path) -> subprocess.CompletedProcess[str]:
    shm, spill = folders
    return run_cli("clean-node", "--shm-dir", str(shm), "--spill-dir", str(spill), env=env)


def test_a_stopped_nodes_folders_are_removed_sealed_segments_too(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    node = tiered_node(shm_dir, token_file, tmp_path)
    spill = tmp_path / "spill"
    try:
        preload_on_both_tiers(node, tmp_path)
        running = clean(node.env(), shm_dir, spill)
        assert running.returncode == InUse.exit_code
        assert running.stderr.count("\n") == 1 and "a node runs on it" in running.stderr
        before = files_under(shm_dir), files_under(spill)
    finally:
        node.stop()
    assert (files_under(shm_dir), files_under(spill)) == before  # nothing removed meanwhile
    assert (shm_dir / MARKER).is_file() and (spill / MARKER).is_file()
    if can_seal(tmp_path):
        sealed = sealed_beneath(shm_dir) + sealed_beneath(spill)
        assert any(s.startswith(str(spill)) for s in sealed) and len(sealed) > 2
        rm = subprocess.run(["rm", "-f", *sealed], capture_output=True, text=True)
        assert rm.returncode != 0 and rm.stderr.count("Operation not permitted") == len(sealed)
    done = clean(node.env(), shm_dir, spill)
    assert done.returncode == 0, done.stderr
    assert not shm_dir.exists() and not spill.exists()
    again = clean(node.env(), shm_dir, spill)  # nothing there: nothing to do
    assert again.returncode == 0 and "absent" in again.stdout


def test_a_folder_that_is_not_a_nodes_is_refused(
    node: NodeProcess, shm_dir: Path, tmp_path: Path
) -> None:
    planted = tmp_path / "planted"
    write_files(planted, {"precious.txt": b"keep me", "sub/more.txt": b"and me"})
    link = tmp_path / "link"
    link.symlink_to(shm_dir)
    node.stop()
    for folder, why in ((planted, f"it has no {MARKER}"), (link, "it is a symlink")):
        done = clean(node.env(), shm_dir, folder)
        assert done.returncode == InvalidArgument.exit_code, done.stderr
        assert done.stderr.count("\n") == 1 and why in done.stderr
        assert (planted / "sub" / "more.txt").read_bytes() == b"and me"
        assert (shm_dir / MARKER).is_file()  # the node's own folder too: all or nothing


def test_a_node_does_not_start_on_a_folder_being_removed(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    """The removal holds the marker's lock: a node started meanwhile refuses the folder."""
    node = NodeProcess(shm_dir, token_file, tmp_path).start()
    node.stop()
    fd = os.open(shm_dir / MARKER, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as clean-node holds it
        started = subprocess.run(
            node.command(), env=node.env(), capture_output=True, text=True, timeout=60
        )
    finally:
        os.close(fd)
    assert started.returncode == InUse.exit_code, started.stderr
    assert "`kspeedfs clean-node` is removing it" in started.stderr.splitlines()[-1]
