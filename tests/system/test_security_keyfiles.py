"""Token files and key folders: a token file only its owner may read, in UTF-8, read the one
way by clients and the node; folders made for keys are 0700 whatever the umask."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import KSPEEDFS, NodeProcess, free_port, run_cli

from kspeedfs.format import auth
from kspeedfs.format.errors import AuthError

pytestmark = pytest.mark.slow  # a node start per case


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the client cases (each case brings its own token file)."""
    tmp = tmp_path_factory.mktemp("keyfiles")
    auth.write_token(tmp / "token", auth.new_admin_token())
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    n = NodeProcess(shm, tmp / "token", tmp).start()
    yield n
    n.stop()
    shutil.rmtree(shm, ignore_errors=True)


def one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kspeedfs: "), done.stderr
    return lines[0]


def token_with(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def node_env(token: Path) -> dict[str, str]:
    return {**os.environ, "KSPEEDFS_TOKEN_FILE": str(token)}


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602], ids=lambda m: f"{m:04o}")
def test_a_token_open_to_others_is_refused_naming_chmod_600(
    node: NodeProcess, tmp_path: Path, mode: int
) -> None:
    token = token_with(tmp_path / "shared.token", node.token_file.read_bytes(), mode)
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(token)}
    line = one_line(run_cli("ls", env=env), 9)
    assert f"(mode {mode:04o}): chmod 600 {token}" in line, line
    os.chmod(token, 0o600)  # the remedy it names
    assert run_cli("ls", env=env).returncode == 0


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"ksa1-\xff\xfe" + b"0" * 60 + b"\n", "is not UTF-8 text (byte 5)"),
        (b"\x80", "is not UTF-8 text (byte 0)"),
        (b"k" * 10_000, "too large"),
    ],
    ids=["latin-1", "binary", "huge"],
)
def test_a_token_that_is_not_utf8_text_is_one_line(
    node: NodeProcess, tmp_path: Path, data: bytes, fragment: str
) -> None:
    token = token_with(tmp_path / "bad.token", data)
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(token)}
    assert fragment in one_line(run_cli("ls", env=env), 9)


def test_a_fifo_in_place_of_the_token_does_not_hang(node: NodeProcess, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.token"
    os.mkfifo(fifo, 0o600)  # nobody writes it: a blocking open would wait forever
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(fifo)}
    assert "is not a regular file" in one_line(run_cli("ls", env=env, timeout=30), 9)


def test_a_folder_in_place_of_the_token_is_one_line(node: NodeProcess, tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o700)
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(folder)}
    line = one_line(run_cli("ls", env=env), 9)
    assert f"the token file {folder} is a folder" in line, line
    with pytest.raises(AuthError, match="is a folder"):  # the node reads it the same way
        auth.ensure_token(folder)


@pytest.mark.parametrize(
    ("data", "mode", "fragment"),
    [
        (None, 0o644, "chmod 600"),
        (b"ksa1-\xff" + b"0" * 63, 0o600, "is not UTF-8 text"),
    ],
    ids=["readable by others", "not UTF-8"],
)
def test_a_node_refuses_its_token_file_and_starts_nothing(
    tmp_path: Path, data: bytes | None, mode: int, fragment: str
) -> None:
    token = token_with(tmp_path / "node.token", data or auth.new_admin_token().encode(), mode)
    port, shm = free_port(), Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    argv = ["node", "--listen", f"127.0.0.1:{port}", "--shm-dir", str(shm)]
    done = run_cli(*argv, env=node_env(token), timeout=60)
    assert fragment in one_line(done, 9)
    assert not shm.exists() and not Path(f"{shm}.sock").exists()
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_token_new_from_an_open_admin_token_writes_nothing(tmp_path: Path) -> None:
    admin = token_with(tmp_path / "admin.token", auth.new_admin_token().encode(), 0o644)
    out = tmp_path / "jobs" / "read.token"
    argv = ["token", "new", "--role", "read", "--token-file", str(admin), "--output", str(out)]
    assert "chmod 600" in one_line(run_cli(*argv, env=dict(os.environ)), 9)
    assert not out.parent.exists()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_key_folders_are_0700_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 000: the folders the CLI makes for keys are 0700, those it makes on the way
    0755 (never writable by others); a folder that was there keeps its mode."""
    here = tmp_path / "here"
    here.mkdir(mode=0o755)
    os.chmod(here, 0o755)
    for argv in (
        ["tls", "new-ca", str(tmp_path / "a" / "ca")],
        ["tls", "issue", "127.0.0.1", "--ca", str(tmp_path / "a" / "ca"), "--out", "b/out"],
        ["tls", "issue", "h2", "--ca", str(tmp_path / "a" / "ca"), "--out", "."],
        ["token", "new", "--token-file", str(tmp_path / "c" / "kspeedfs" / "token")],
        ["token", "new", "--role", "job", "--token-file", str(tmp_path / "c" / "kspeedfs" / "token"),
         "--output", str(tmp_path / "d" / "job" / "job.token")],
    ):  # fmt: skip
        done = subprocess.run(
            [*KSPEEDFS, *argv], cwd=here, umask=0, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, (argv, done.stderr)
    assert _mode(tmp_path / "a" / "ca") == 0o700 and _mode(tmp_path / "a") == 0o755
    assert _mode(here / "b" / "out") == 0o700 and _mode(here / "b") == 0o755
    assert _mode(here) == 0o755  # --out . : the user's folder, left as it was
    assert _mode(tmp_path / "c" / "kspeedfs") == 0o700 and _mode(tmp_path / "c") == 0o755
    assert _mode(tmp_path / "d" / "job") == 0o700 and _mode(tmp_path / "d") == 0o755
    for key in (tmp_path / "a" / "ca" / "ca.key", here / "b" / "out" / "127.0.0.1.key"):
        assert _mode(key) == 0o600
    assert _mode(tmp_path / "d" / "job" / "job.token") == 0o600
