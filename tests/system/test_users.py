"""Users with passwords: `kspeedfs user add|list|del`, the mutual handshake with a user's key on
TCP, TLS and the fd socket, one line for every refusal."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import KSPEEDFS, NodeProcess, new_cas, run_cli
from uidutil import NOBODY, as_user

from kspeedfs.format import users
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import Address

pytestmark = pytest.mark.slow  # scrypt-hashed logins, a node per test

WRONG = "kspeedfs: authentication refused: wrong user or password\n"


def user_cli(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KSPEEDFS, "user", *args], env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


def add(node: NodeProcess, name: str, role: str, password: str) -> None:
    done = user_cli(
        node.env(), "add", name, "--role", role, "--password-stdin", stdin=password + "\n"
    )
    assert done.returncode == 0, done.stderr


def as_login(node: NodeProcess, user: str, password: str) -> dict[str, str]:
    env = {k: v for k, v in node.env().items() if k != "KSPEEDFS_TOKEN_FILE"}
    return {
        **env,
        "KSPEEDFS_TOKEN_FILE": "/nonexistent/token",
        "KSPEEDFS_USER": user,
        "KSPEEDFS_PASSWORD": password,
    }


def test_users_are_added_listed_and_deleted(node: NodeProcess) -> None:
    env = node.env()
    add(node, "alice", "read", "s3cret")
    add(node, "bob", "admin", "other")
    path = node.token_file.with_name("users")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in path.read_text()  # only scrypt keys are kept
    listed = user_cli(env, "list")
    assert listed.stdout.splitlines() == ["alice  read", "bob  admin"]
    assert user_cli(env, "del", "alice").returncode == 0
    assert user_cli(env, "list").stdout.splitlines() == ["bob  admin"]
    gone = user_cli(env, "del", "alice")
    assert (gone.returncode, gone.stderr) == (4, "kspeedfs: no user 'alice'\n")
    bad = user_cli(env, "add", "no/slash", "--role", "read", "--password-stdin", stdin="x\n")
    assert bad.returncode == 5 and len(bad.stderr.splitlines()) == 1
    os.chmod(path, 0o644)
    loose = user_cli(env, "list")
    assert loose.returncode == 9 and "chmod 600" in loose.stderr


def test_a_user_logs_in_and_a_wrong_password_names_no_part(
    node: NodeProcess, tmp_path: Path
) -> None:
    add(node, "alice", "read", "s3cret")
    add(node, "root", "admin", "rootpw")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(5000))
    listed = run_cli("ls", env=as_login(node, "alice", "s3cret"))
    assert listed.returncode == 0, listed.stderr
    for user, password in (("alice", "wrong"), ("nobody", "s3cret"), ("alice", "")):
        done = run_cli("ls", env=as_login(node, user, password or "x"))
        assert (done.returncode, done.stderr) == (9, WRONG)
    refused = run_cli(
        "preload", str(src), "--name", "d", "-q", env=as_login(node, "alice", "s3cret")
    )
    assert refused.returncode == 9 and len(refused.stderr.splitlines()) == 1
    assert "needs the job role" in refused.stderr
    loaded = run_cli("preload", str(src), "--name", "d", "-q", env=as_login(node, "root", "rootpw"))
    assert loaded.returncode == 0, loaded.stderr
    assert node.request("status")["stats"]["refused"] >= 3


def test_without_any_user_a_login_is_the_same_refusal(node: NodeProcess) -> None:
    done = run_cli("ls", env=as_login(node, "admin", "admin"))
    assert (done.returncode, done.stderr) == (9, WRONG)


def test_a_user_logs_in_over_tls(shm_dir: Path, token_file: Path, tmp_path: Path) -> None:
    new_cas(tmp_path / "pki", "ca")
    ca = tmp_path / "pki" / "ca"
    tls = {
        "KSPEEDFS_TLS_CERT": str(ca / "127.0.0.1.crt"),
        "KSPEEDFS_TLS_KEY": str(ca / "127.0.0.1.key"),
        "KSPEEDFS_TLS_CA": str(ca / "ca.crt"),
    }
    node = NodeProcess(shm_dir, token_file, tmp_path, base_env={**os.environ, **tls}).start()
    try:
        add(node, "alice", "read", "s3cret")
        assert run_cli("ls", env=as_login(node, "alice", "s3cret")).returncode == 0
        wrong = run_cli("ls", env=as_login(node, "alice", "nope"))
        assert (wrong.returncode, wrong.stderr) == (9, WRONG)
    finally:
        node.stop()


def test_a_user_gets_passed_descriptors_on_the_fd_socket(
    node: NodeProcess, tmp_path: Path, public_dir: Path
) -> None:
    """uid 65534 cannot open the segments: the fd socket hands them over to a user's login."""
    src = public_dir / "src"
    src.mkdir()
    data = os.urandom(4000)
    (src / "f.bin").write_bytes(data)
    os.chmod(src / "f.bin", 0o644)
    node.request("preload", name="pub", source=str(src))
    from conftest import wait_for

    wait_for(lambda: node.request("progress", name="pub")["state"] == "ready")
    add(node, "reader", "read", "pw")

    def read_as(password: str) -> object:
        from kspeedfs.client.reader import ClusterReader
        from kspeedfs.format.errors import KSpeedError

        addr = Address("127.0.0.1", node.port)
        s = Settings(
            listen=addr,
            nodes=[addr],
            shm_dir=node.shm_dir,
            token_file=Path("/none"),
            user="reader",
            password=password,
        )
        try:
            reader = ClusterReader(s, str(addr))
            ds = reader.open_dataset("pub")
            i = next(k for k in ds.manifest.iter_files() if ds.manifest.path(k) == b"f.bin")
            return [type(ds.local).__name__, reader.read(ds, i, 0, 1 << 20).hex()]
        except KSpeedError as e:
            return [type(e).__name__, str(e)]

    import kspeedfs.client.reader  # noqa: F401  (loaded before the fork)

    assert as_user(NOBODY, [], lambda: read_as("pw")) == ["PassedDataset", data.hex()]
    refused = as_user(NOBODY, [], lambda: read_as("bad"))
    assert refused == ["AuthError", WRONG.removeprefix("kspeedfs: ").strip()]
    assert node.request("status")["local_socket"]["attached"] == 1


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "-lead"])
def test_bad_user_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidArgument):
        users.validate_user(name)
