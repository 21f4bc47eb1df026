"""Authentication on a three-node cluster: wrong token, no token and a read-role client trying
admin operations are each refused with a clear error, and nothing changes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, held_on_disk, running, staging_left
from conftest import make_tree, run_cli

from kspeedfs.format import auth, protocol
from kspeedfs.format.errors import AuthError
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("auth")
    token_file = tmp / "token"
    auth.write_token(token_file, auth.new_admin_token())
    with running(Cluster(token_file, tmp)) as c:
        c.preload(make_tree(tmp / "src", segment_size=64 * 1024), "kept", replicas=2)
        yield c


@pytest.fixture(scope="module")
def read_token(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("read") / "read-token"
    done = run_cli("token", "new", "--role", "read", "--output", str(path), env=cluster.env())
    assert done.returncode == 0, done.stderr
    assert auth.token_role(auth.read_token(path)) == "read"
    return path


def snapshot(cluster: Cluster) -> list[object]:
    """What an admin operation would change: datasets, their uuids and segments, staging."""
    return [
        (
            {n: d.get("uuid") for n, d in cluster.listing(node).items()},
            held_on_disk(node, "kept"),
            staging_left(node),
            node.request("status")["used"],
        )
        for node in cluster.nodes
    ]


def cli(cluster: Cluster, token_file: Path, *args: str, first: int = 0) -> tuple[int, str]:
    env = {**cluster.env(first=cluster.nodes[first]), "KSPEEDFS_TOKEN_FILE": str(token_file)}
    done = run_cli(*args, env=env)
    return done.returncode, done.stdout + done.stderr


def secrets_of(cluster: Cluster) -> list[str]:
    admin = auth.read_token(cluster.token_file)
    return [admin, admin.split("-", 1)[1], auth.derive_read_token(admin)]


def assert_no_secret_in(cluster: Cluster, text: str) -> None:
    for secret in secrets_of(cluster):
        assert secret not in text


def test_wrong_token_is_refused_and_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    before = snapshot(cluster)
    wrong = tmp_path / "wrong"
    auth.write_token(wrong, auth.new_admin_token())
    refused = [cluster.nodes[i].request("status")["stats"]["refused"] for i in range(3)]
    # Each node refuses on its own (a CLI goes to the first node of its list).
    commands = [("ls",), ("unload", "kept"), ("shutdown",), ("status",), ("ls",), ("ls",)]
    for i, args in enumerate(commands):
        code, out = cli(cluster, wrong, *args, first=i % 3)
        assert code == 9, out
        assert "authentication refused: wrong cluster token" in out
        assert "Traceback" not in out
        assert auth.read_token(wrong) not in out
    code, out = cli(cluster, wrong, "preload", str(tmp_path), "--name", "intruder", "-q")
    assert code == 9, out
    # A read token of another cluster is no better.
    other_read = tmp_path / "other-read"
    auth.write_token(other_read, auth.derive_read_token(auth.read_token(wrong)))
    code, out = cli(cluster, other_read, "ls")
    assert code == 9 and "wrong cluster token" in out
    after_refused = [cluster.nodes[i].request("status")["stats"]["refused"] for i in range(3)]
    assert all(a > b for a, b in zip(after_refused, refused, strict=True))
    assert snapshot(cluster) == before
    for node in cluster.nodes:
        assert_no_secret_in(cluster, node.log())
        assert "intruder" not in node.log()


def test_no_token_file_is_refused_with_a_clear_error(cluster: Cluster, tmp_path: Path) -> None:
    before = snapshot(cluster)
    missing = tmp_path / "nowhere" / "token"
    for args in (("ls",), ("status",), ("unload", "kept")):
        code, out = cli(cluster, missing, *args)
        assert code == 9, (args, out)
        assert f"no cluster token at {missing}" in out
    assert not missing.exists(), "a client must not invent a token"
    garbage = tmp_path / "garbage"
    garbage.write_text("not a token\n")
    garbage.chmod(0o600)  # its mode is not what is refused here
    code, out = cli(cluster, garbage, "ls")
    assert code == 9 and "does not hold a kspeedfs token" in out
    assert "not a token" not in out
    assert snapshot(cluster) == before


def raw_connect(port: int) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    header = recv_exact(sock, protocol.HEADER_SIZE)
    msg_type, _rid, length = protocol.parse_header(header)
    assert msg_type == MsgType.HELLO
    hello = protocol.decode_json(recv_exact(sock, length))
    return sock, bytes.fromhex(hello["nonce"])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def answer(sock: socket.socket) -> tuple[MsgType, dict[str, object]]:
    msg_type, _rid, length = protocol.parse_header(recv_exact(sock, protocol.HEADER_SIZE))
    return msg_type, protocol.decode_json(recv_exact(sock, length))


def assert_closed(sock: socket.socket) -> None:
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def test_unauthenticated_requests_are_refused(cluster: Cluster) -> None:
    port = cluster.nodes[1].port
    sock, _nonce = raw_connect(port)
    with sock:
        sock.sendall(protocol.encode_json(MsgType.REQUEST, 1, {"op": "unload", "name": "kept"}))
        kind, err = answer(sock)
        assert kind == MsgType.ERROR and err["kind"] == "AuthError"
        assert err["message"] == "authenticate first"
        assert_closed(sock)
    sock, _nonce = raw_connect(port)
    with sock:
        sock.sendall(
            protocol.encode_frame(
                MsgType.READ, 1, protocol.encode_read("kept", "0" * 32, [(0, 0, 10)])
            )
        )
        kind, err = answer(sock)
        assert kind == MsgType.ERROR and err["kind"] == "AuthError"
        assert_closed(sock)
    # A read-token holder claiming the admin role: its MAC is checked with the admin key.
    read = auth.derive_read_token(auth.read_token(cluster.token_file))
    sock, nonce = raw_connect(port)
    with sock:
        claim, _ = auth.client_answer(read, auth.TCP, nonce)
        sock.sendall(protocol.encode_json(MsgType.AUTH, 0, {**claim, "role": "admin"}))
        kind, err = answer(sock)
        assert kind == MsgType.ERROR and "wrong cluster token" in str(err["message"])
        assert_closed(sock)
    # A MAC replayed from another connection is worthless: every nonce is fresh.
    admin = auth.read_token(cluster.token_file)
    sock1, nonce1 = raw_connect(port)
    sock2, nonce2 = raw_connect(port)
    with sock1, sock2:
        assert nonce1 != nonce2
        replayed, _ = auth.client_answer(admin, auth.TCP, nonce1)
        sock2.sendall(protocol.encode_json(MsgType.AUTH, 0, replayed))
        kind, _err = answer(sock2)
        assert kind == MsgType.ERROR
    assert "kept" in cluster.listing(cluster.nodes[1])


def test_read_role_reads_but_cannot_change_anything(
    cluster: Cluster, read_token: Path, tmp_path: Path
) -> None:
    before = snapshot(cluster)
    code, out = cli(cluster, read_token, "ls")
    assert code == 0 and "kept" in out
    node = cluster.nodes[0]
    seg = held_on_disk(node, "kept")[0]
    expected = (node.shm_dir / "datasets" / "kept" / "seg" / f"{seg:08d}").read_bytes()[:1000]
    with NodeClient(Address("127.0.0.1", node.port), read_token) as c:
        assert c.role == "read"
        uuid = cluster.listing(node)["kept"]["uuid"]
        assert bytes(c.read("kept", uuid, [(seg, 0, 1000)])) == expected

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    admin_commands = [
        ("unload", "kept"),
        ("shutdown",),
        ("preload", str(tmp_path / "src"), "--name", "sneaky", "-q"),
    ]
    for first, args in enumerate(admin_commands):  # a different node for each
        code, out = cli(cluster, read_token, *args, first=first)
        assert code == 9, (args, out)
        needed = "job" if args[0] == "preload" else "admin"
        assert f"{args[0]} needs the {needed} role; this client has read" in out
        assert "Traceback" not in out
    # The node-to-node operations are admin-only too: a reader cannot drive a member directly.
    uuid = cluster.listing(node)["kept"]["uuid"]
    direct = {
        "unload_local": {"name": "kept", "uuid": uuid},
        "stage": {"name": "sneaky", "uuid": "u", "source": str(tmp_path / "src"), "segments": []},
        "stage_put": {"name": "kept", "uuid": uuid, "segment": 0, "offset": 0, "data": ""},
        "commit": {"name": "kept", "uuid": uuid, "meta": {}},
        "abort": {"name": "kept", "uuid": uuid},
    }
    for target in cluster.nodes:
        with NodeClient(Address("127.0.0.1", target.port), read_token) as c:
            for op, op_args in direct.items():
                with pytest.raises(AuthError, match=f"{op} needs the admin role"):
                    c.request(op, **op_args)
                assert c.request("ping")["node"] == target.address
    assert snapshot(cluster) == before
    for target in cluster.nodes:
        assert target.proc is not None and target.proc.poll() is None
        assert_no_secret_in(cluster, target.log())
