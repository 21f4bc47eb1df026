"""The node owns its shm folder: a planted folder is refused and nothing outside it is touched."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import KSPEEDFS, NodeProcess, free_port, wait_for

pytestmark = pytest.mark.slow  # a node start per case

NOBODY = 65534


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "important").mkdir(parents=True)
    (victim / "important" / "data.txt").write_text("keep me\n")
    return victim


def _start_node(shm: Path, token_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KSPEEDFS_TOKEN_FILE": str(token_file)}
    cmd = [*KSPEEDFS, "node", "--listen", f"127.0.0.1:{free_port()}", "--shm-dir", str(shm)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _assert_refused(result: subprocess.CompletedProcess[str], victim: Path) -> None:
    assert result.returncode != 0
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("kspeedfs:")]
    assert len(errors) == 1 and "refusing shm folder" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert (victim / "important" / "data.txt").read_text() == "keep me\n"


@pytest.mark.parametrize("how", ["wrong-owner", "world-writable", "group-writable"])
def test_planted_shm_folder_is_refused(
    how: str, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    shm_dir.mkdir()
    os.symlink(victim, shm_dir / "staging")
    os.symlink(victim, shm_dir / "trash")
    if how == "wrong-owner":
        os.chown(shm_dir, NOBODY, NOBODY)
    else:
        os.chmod(shm_dir, 0o777 if how == "world-writable" else 0o770)
    _assert_refused(_start_node(shm_dir, token_file), victim)


def test_shm_folder_as_symlink_is_refused(shm_dir: Path, token_file: Path, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    os.symlink(victim, shm_dir)
    try:
        _assert_refused(_start_node(shm_dir, token_file), victim)
    finally:
        os.unlink(shm_dir)


def test_symlinked_subfolder_is_refused(shm_dir: Path, token_file: Path, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    shm_dir.mkdir(mode=0o700)
    os.symlink(victim, shm_dir / "staging")
    _assert_refused(_start_node(shm_dir, token_file), victim)


def test_planted_parent_is_refused(token_file: Path, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)  # its owner could swap the shm folder under the node
    _assert_refused(_start_node(parent / "shm", token_file), victim)


def test_symlinked_dataset_is_dropped_not_followed(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    (shm_dir / "datasets").mkdir(parents=True, mode=0o700)
    os.symlink(victim, shm_dir / "datasets" / "evil")
    os.symlink(victim / "important", shm_dir / "datasets" / "important")
    node = NodeProcess(shm_dir, token_file, tmp_path).start()
    try:
        assert node.request("list")["datasets"] == []
    finally:
        node.stop()
    assert (victim / "important" / "data.txt").read_text() == "keep me\n"
    assert not os.path.lexists(shm_dir / "datasets" / "evil")


def test_shm_modes_and_group(shm_dir: Path, token_file: Path, tmp_path: Path, tree: Path) -> None:
    env = {**os.environ, "KSPEEDFS_GROUP": str(NOBODY)}
    node = NodeProcess(shm_dir, token_file, tmp_path, base_env=env).start()
    try:
        node.request("preload", name="t", source=str(tree))
        wait_for(lambda: node.request("progress", name="t")["state"] == "ready")
    finally:
        node.stop()
    st = os.lstat(shm_dir)
    assert stat.S_IMODE(st.st_mode) == 0o2750 and st.st_gid == NOBODY
    for dirpath, dirnames, filenames in os.walk(shm_dir):
        for d in dirnames:
            m = os.lstat(os.path.join(dirpath, d))
            assert m.st_mode & 0o027 == 0 and m.st_gid == NOBODY, (dirpath, d)
        for f in filenames:
            m = os.lstat(os.path.join(dirpath, f))
            assert stat.S_IMODE(m.st_mode) == 0o640 and m.st_gid == NOBODY, (dirpath, f)
