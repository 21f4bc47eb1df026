"""Local channels that cannot be squatted or relayed, with a real node and a real uid 65534: the
fd socket lives where only the node's uid can bind it (the node refuses a squatted path in one
line), clients check who serves it before answering, an answer given on one channel (fd socket,
TCP) is refused on the other, the node proves the token back, and idle connections to the fd
socket cost no thread each."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, node_in, public_folder, wait_for
from uidutil import NOBODY, in_child

from kspeedfs.client import passed
from kspeedfs.format import auth, protocol
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import AuthError, KSpeedError
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.units import Address
from kspeedfs.net import fdpass
from kspeedfs.net.connection import NodeClient
from kspeedfs.node import fdsocket

NAME = "priv"
SECRET = os.urandom(5000)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    """A node holding a root-owned 0600 file, and a read token that uid 65534 can use: one for
    the module (each test's files in the drop folder have names of their own)."""
    # The node's timeout is how long a silent connection may wait: long, so that none of the
    # idle ones is closed before the test has counted them.
    env = {**os.environ, "KSPEEDFS_TIMEOUT": "300"}
    with public_folder() as public_dir:
        src = public_dir / "src"
        src.mkdir(mode=0o755)
        (src / "secret.bin").write_bytes(SECRET)
        os.chmod(src / "secret.bin", 0o600)
        with node_in(tmp_path_factory.mktemp("channels"), base_env=env) as node:
            node.request("preload", name=NAME, source=str(src))
            wait_for(lambda: node.request("progress", name=NAME)["state"] == "ready")
            held = next(d["uuid"] for d in node.request("list")["datasets"] if d["name"] == NAME)
            drop = public_dir / "nobody"  # where uid 65534 may make files
            drop.mkdir()
            os.chown(drop, NOBODY, NOBODY)
            read_token = drop / "read.token"
            admin = auth.read_token(node.token_file)
            auth.write_token(read_token, auth.derive_read_token(admin))
            os.chown(read_token, NOBODY, NOBODY)
            yield Loaded(node, held, read_token, drop)


class Loaded:
    def __init__(self, node: NodeProcess, uuid: str, read_token: Path, drop: Path):
        self.node, self.uuid, self.read_token, self.drop = node, uuid, read_token, drop

    @property
    def fd_socket(self) -> Path:
        return Settings(shm_dir=self.node.shm_dir).socket_path()


def _one_line_error(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text
    return text


def _in_background(work: Callable[[], Any], uid: int | None = NOBODY) -> Callable[[], Any]:
    """work() in a child as uid (uidutil.in_child) while the test goes on; call the result for
    the child's JSON result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = in_child(work, uid)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()

    def result() -> Any:
        thread.join(60)
        assert not thread.is_alive(), "the background child did not finish"
        if "error" in out:
            raise out["error"]
        return out["result"]

    return result


def _read_frame(sock: socket.socket) -> tuple[MsgType, dict[str, Any]]:
    header = _recv_exact(sock, protocol.HEADER.size)
    msg_type, _rid, length = protocol.parse_header(header)
    return msg_type, protocol.decode_json(_recv_exact(sock, length))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _serve_unix(path: Path) -> socket.socket:
    """A listening socket at `path`, put there only once it listens: the tests wait for the
    path to appear, and a connect between bind and listen is refused."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bound = path.with_name(path.name + ".binding")
    server.bind(os.fspath(bound))
    os.chmod(bound, 0o666)
    server.listen(8)
    server.settimeout(30)
    os.rename(bound, path)
    return server


def _relay_fd_to_tcp(path: Path, port: int) -> Callable[[], dict[str, Any]]:
    """A man in the middle as uid 65534: serves a Unix socket at `path`, hands whoever connects
    the nonce of the node's TCP port and forwards their answer there as its own AUTH."""

    def relay() -> dict[str, Any]:
        out: dict[str, Any] = {"received": 0, "node": None}
        with _serve_unix(path) as server:
            conn, _ = server.accept()
        with conn, socket.create_connection(("127.0.0.1", port), timeout=10) as tcp:
            conn.settimeout(10)
            _kind, hello = _read_frame(tcp)
            try:
                conn.send(json.dumps({"nonce": hello["nonce"]}).encode())
                answer = conn.recv(1 << 16)
            except OSError:  # the client hung up already
                answer = b""
            out["received"] = len(answer)
            if answer:
                fields = {
                    k: v for k, v in json.loads(answer).items() if k in ("role", "nonce", "mac")
                }
                tcp.sendall(protocol.encode_json(MsgType.AUTH, 0, fields))
                kind, reply = _read_frame(tcp)
                out["node"] = kind.name
                if kind == MsgType.RESPONSE:  # in: what a reader of the socket could take
                    tcp.sendall(protocol.encode_json(MsgType.REQUEST, 1, {"op": "list"}))
                    out["listed"] = _read_frame(tcp)[1]
        return out

    return relay


EXPECTED = {
    "its folder": f"it is owned by uid {NOBODY}",
    "the socket": f"it is a socket of uid {NOBODY}",
    "a shared folder": "/dev/shm: it is writable by others",
}


@pytest.mark.parametrize("held_by", sorted(EXPECTED))
def test_the_node_refuses_a_squatted_socket_path(
    shm_dir: Path, token_file: Path, tmp_path: Path, held_by: str
) -> None:
    """While the node is down, uid 65534 takes the socket's path: the node does not start, in
    one line, and nothing listens for it at a path somebody else holds."""
    node = NodeProcess(shm_dir, token_file, tmp_path)
    env = node.env()
    default = Settings(shm_dir=shm_dir).socket_path()
    path = default
    if held_by == "its folder":  # the folder was not there yet (a fresh /dev/shm)

        def squat() -> bool:
            os.mkdir(default.parent, 0o755)
            _serve_unix(default).detach()  # the socket file stays, as a squatter's would
            return True

        assert in_child(squat, NOBODY)
    elif held_by == "the socket":  # a socket of another uid inside a folder of the node's
        os.mkdir(default.parent, 0o755)
        _serve_unix(default).close()
        os.chown(default, NOBODY, NOBODY)
    else:  # `socket` set to a path in world-writable /dev/shm, the old default
        path = shm_dir.with_name(shm_dir.name + ".sock")
        in_child(lambda: bool(_serve_unix(path).detach()), NOBODY)
        env["KSPEEDFS_SOCKET"] = str(path)
    try:
        proc = subprocess.Popen(node.command(), env=env, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"the node started over a socket path held by uid {NOBODY}")
        # One line of error after the node's log lines (RDMA off, ...), no traceback.
        errors = [line for line in err.splitlines() if line.startswith("kspeedfs:")]
        assert proc.returncode == 5, err
        assert len(errors) == 1 and "Traceback" not in err, err
        assert errors[0].startswith("kspeedfs: refusing socket"), err
        assert EXPECTED[held_by] in errors[0], err
    finally:
        for p in (path, default):
            if os.path.lexists(p):
                os.unlink(p)
        if default.parent != shm_dir.parent and default.parent.exists():  # never /dev/shm
            os.rmdir(default.parent)


def test_a_client_refuses_a_squatter(loaded: Loaded) -> None:
    """A job configured with a socket uid 65534 serves (the old default path in /dev/shm)
    refuses it before answering: the squatter, which relays to the node's TCP port, reads
    nothing and gets nothing from the node."""
    squatted = loaded.node.shm_dir.with_name(loaded.node.shm_dir.name + ".sock")
    squatter = _relay_fd_to_tcp(squatted, loaded.node.port)
    result = _in_background(squatter)
    wait_for(squatted.exists, what="the squatter's socket")
    settings = Settings(socket=squatted, token_file=loaded.read_token)
    with pytest.raises(AuthError) as refused:
        passed.attach(settings, "", NAME, loaded.uuid)
    assert _one_line_error(refused.value).startswith(f"refusing the node socket {squatted}")
    assert f"uid {NOBODY}" in str(refused.value)
    out = result()
    assert out == {"received": 0, "node": None}
    os.unlink(squatted)


def test_an_fd_socket_answer_relayed_to_tcp_is_refused(loaded: Loaded) -> None:
    """Even a client of the squatter's own uid (whose SO_PEERCRED check it passes) gives an
    answer that is good on the fd socket only: the node refuses it on TCP."""
    path = loaded.drop / "relay.sock"
    result = _in_background(_relay_fd_to_tcp(path, loaded.node.port))
    wait_for(path.exists, what="the relay's socket")
    token = auth.read_token(loaded.read_token)

    def client() -> str:
        try:
            fdpass.attach(path, token, NAME, loaded.uuid, timeout=10)
        except KSpeedError as e:
            return type(e).__name__
        return "attached"

    assert in_child(client, NOBODY) != "attached"
    out = result()
    assert out["received"] > 0  # the client answered its own uid
    assert out["node"] == "ERROR" and "listed" not in out


def test_a_tcp_answer_relayed_to_the_fd_socket_is_refused(loaded: Loaded) -> None:
    """A man in the middle on a TCP port, as uid 65534, hands a client the nonce of the node's
    fd socket and forwards the client's AUTH there: the node passes no descriptor."""
    port_file = loaded.drop / "relay.port"
    fd_socket = loaded.fd_socket

    def relay() -> dict[str, Any]:
        out: dict[str, Any] = {"fds": 0}
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(30)
            port_file.write_text(str(server.getsockname()[1]))
            conn, _ = server.accept()
        with conn, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as local:
            conn.settimeout(10)
            local.settimeout(10)
            local.connect(os.fspath(fd_socket))
            hello = json.loads(local.recv(4096))
            node = {"version": protocol.VERSION, "node": "relay", "nonce": hello["nonce"]}
            conn.sendall(protocol.encode_json(MsgType.HELLO, 0, node))
            _kind, answer = _read_frame(conn)
            local.send(json.dumps({**answer, "name": NAME, "uuid": loaded.uuid}).encode())
            msg, fds, _flags, _ = socket.recv_fds(local, 1 << 16, 10)
            out["fds"] = len(fds)
            out["node"] = json.loads(msg).get("error")
            for fd in fds:
                os.close(fd)
        return out

    result = _in_background(relay)
    wait_for(lambda: port_file.exists() and port_file.read_text() != "", what="the relay")
    client = NodeClient(Address("127.0.0.1", int(port_file.read_text())), loaded.read_token)
    with pytest.raises(KSpeedError):
        client.connect()  # the relay never answers the AUTH: the client gives up
    assert result() == {"fds": 0, "node": "AuthError"}


def test_a_client_refuses_a_node_that_cannot_prove_the_token(loaded: Loaded) -> None:
    """A server that lets any answer in is no node: the client wants the node's own MAC."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def fake_node() -> None:
            conn, _ = server.accept()
            with conn:
                hello = {"version": protocol.VERSION, "node": "fake", "nonce": "ab" * 32}
                conn.sendall(protocol.encode_json(MsgType.HELLO, 0, hello))
                _read_frame(conn)
                conn.sendall(protocol.encode_json(MsgType.RESPONSE, 0, {"role": "read"}))
                conn.recv(1)

        thread = threading.Thread(target=fake_node)
        thread.start()
        with pytest.raises(AuthError) as refused:
            NodeClient(Address("127.0.0.1", port), loaded.read_token).connect()
        thread.join(30)
    assert _one_line_error(refused.value) == (
        f"node 127.0.0.1:{port} did not prove that it holds the cluster token"
    )


def test_a_client_wants_the_fd_socket_to_prove_the_token(loaded: Loaded) -> None:
    """With `node_user` naming uid 65534, a socket it serves passes the uid check, but it is
    still no node: it cannot prove the token, and the descriptor it sends is not taken."""
    path = loaded.drop / "fake.sock"

    def fake_node() -> dict[str, Any]:
        with _serve_unix(path) as server:
            conn, _ = server.accept()
        with conn, open(os.devnull, "rb") as devnull:
            conn.settimeout(10)
            conn.send(json.dumps({"nonce": "cd" * 32}).encode())
            answer = json.loads(conn.recv(1 << 16))
            head = json.dumps({"segments": 0, "mac": answer["mac"]}).encode()  # its own MAC
            socket.send_fds(conn, [head], [devnull.fileno()])
            conn.recv(1)
        return {"answered": True}

    result = _in_background(fake_node)
    wait_for(path.exists, what="the fake node's socket")
    settings = Settings(socket=path, token_file=loaded.read_token, node_user=str(NOBODY))
    with pytest.raises(AuthError) as refused:
        passed.attach(settings, "", NAME, loaded.uuid)
    assert _one_line_error(refused.value) == (
        f"the node socket {path} did not prove that it holds the token"
    )
    assert result() == {"answered": True}


def test_idle_connections_to_the_fd_socket_cost_no_thread(loaded: Loaded) -> None:
    """uid 65534 holds 300 idle connections: the node's threads stay as they were, the uid
    gets at most MAX_PER_UID of them (the rest a one-line refusal), another reader is served."""
    node, fd_socket = loaded.node, loaded.fd_socket
    assert node.proc is not None
    tasks = Path(f"/proc/{node.proc.pid}/task")
    token = auth.read_token(loaded.read_token)
    _attach(fd_socket, token, loaded.uuid)
    threads_before = len(os.listdir(tasks))
    holding, done = loaded.drop / "holding", loaded.drop / "done"

    def hog() -> dict[str, Any]:
        conns, first = [], collections.Counter[str]()
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(30)
            s.connect(os.fspath(fd_socket))
            msg = json.loads(s.recv(4096))
            first["nonce" if "nonce" in msg else msg.get("message", "")] += 1
            conns.append(s)
        holding.touch()
        wait_for(done.exists, timeout=120, what="the test's measurement")
        for s in conns:
            s.close()
        return dict(first)

    result = _in_background(hog)
    wait_for(holding.exists, timeout=120, what="300 connections")
    threads_held = len(os.listdir(tasks))
    served = _attach(fd_socket, token, loaded.uuid)  # root: another uid
    done.touch()
    first = result()
    assert threads_held <= threads_before + 4, (threads_before, threads_held)
    assert served > 0
    assert first.pop("nonce") == fdsocket.MAX_PER_UID
    ((refusal, count),) = first.items()
    assert count == 300 - fdsocket.MAX_PER_UID
    assert refusal.startswith("the node's socket is busy: uid 65534 holds")


def _attach(path: Path, token: str, uuid: str) -> int:
    got = fdpass.attach(path, token, NAME, uuid)
    got.close()
    return 1 + len(got.segments)
