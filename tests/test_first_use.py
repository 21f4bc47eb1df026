"""What new users ran into: messages that name the role a refusal is about, paths inside a
mount given to the fast path and `preload`, folder sizes on the mount, the node's shm folder
after it stops."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import NodeProcess, kw, make_tree, run_cli

from kspeedfs.format import auth
from kspeedfs.format.errors import AuthError
from pytorch_ext import KSpeedFolder


def test_a_read_roles_active_preload_names_the_role_it_needs_and_has(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    read_token = tmp_path / "read.token"
    auth.write_token(read_token, auth.derive_read_token(auth.read_token(node.token_file)))
    with pytest.raises(AuthError) as refused:
        KSpeedFolder(str(src), nodes=node.address, token=str(read_token))
    message = str(refused.value)
    assert "preload needs the job role; this client has read" in message, message
    assert "admin token" not in message
    assert node.request("list")["datasets"] == []
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(read_token)}
    done = run_cli("preload", str(src), "--name", "x", env=env)
    assert done.returncode == 9, done.stderr
    assert "preload needs the job role; this client has read" in done.stderr
    KSpeedFolder(str(src), **kw(node))  # the admin token may


def test_a_clean_stop_leaves_no_socket_folder(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    run = shm_dir.with_name(shm_dir.name + ".run")  # the socket's folder by default
    node = NodeProcess(shm_dir, token_file, tmp_path).start()
    try:
        assert (run / "fd.sock").is_socket()
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)  # not node.stop(): it tidies up after a kill
        assert node.proc.wait(timeout=30) == 0, node.log()
        assert not run.exists()
        assert shm_dir.is_dir()  # what the node holds stays for its next start
    finally:
        node.stop()
