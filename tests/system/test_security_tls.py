"""Mutual TLS on every TCP connection: three nodes with TLS on serve FUSE and fast-path reads
equal to the source (node-to-node calls over TLS too); a client without a certificate, with one
from another CA, or without TLS is refused with one line and the node keeps serving; a client
refuses a node it cannot verify; the TLS listener and the node's Unix socket (fd passing) stand
random input (hypothesis)."""

from __future__ import annotations

import json
import os
import random
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
from clusterutil import Cluster
from conftest import MountProcess, NodeProcess, new_cas, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format import auth, protocol, tls
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import AuthError
from kspeedfs.format.protocol import HEADER, MsgType
from kspeedfs.format.units import Address
from kspeedfs.net import fdpass
from kspeedfs.net.connection import NodeClient
from kspeedfs.system.local_dataset import LocalDataset

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # three nodes with TLS

T = TypeVar("T")
NAME = "tlsdata"


@dataclass
class Pki:
    ca: Path  # the cluster's CA folder
    cert: Path  # 127.0.0.1, from the cluster's CA
    key: Path
    other_cert: Path  # 127.0.0.1, from another CA
    other_key: Path
    other_ca: Path  # the other CA's folder

    def env(
        self, cert: Path | None = None, key: Path | None = None, ca: Path | None = None
    ) -> dict[str, str]:
        return {
            "KSPEEDFS_TLS_CERT": str(cert or self.cert),
            "KSPEEDFS_TLS_KEY": str(key or self.key),
            "KSPEEDFS_TLS_CA": str((ca or self.ca) / "ca.crt"),
        }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates made the way a user makes them: `kspeedfs tls new-ca` and `tls issue`."""
    tmp = tmp_path_factory.mktemp("pki")
    new_cas(tmp, "ca", "other-ca")
    return Pki(
        tmp / "ca",
        tmp / "ca" / "127.0.0.1.crt",
        tmp / "ca" / "127.0.0.1.key",
        tmp / "other-ca" / "127.0.0.1.crt",
        tmp / "other-ca" / "127.0.0.1.key",
        tmp / "other-ca",
    )


def _source(root: Path) -> Path:
    """Files of 0 to ~200 KiB in a few folders: ~3 MiB over 64 KiB segments on three nodes."""
    rng = random.Random(12)
    for i in range(36):
        folder = root / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:02d}.bin").write_bytes(
            os.urandom(rng.choice([0, 1, 900, 110_000, 200_000]))
        )
    return root


@dataclass
class TlsCluster:
    cluster: Cluster
    source: Path
    pki: Pki
    uuid: str

    @property
    def node(self) -> NodeProcess:
        return self.cluster.nodes[0]

    def assert_serves(self) -> None:
        """Every node alive and answering over TLS; node 0 serves a read."""
        for n in self.cluster.nodes:
            assert n.proc is not None and n.proc.poll() is None, "a node died"
            assert n.request("ping")["node"] == n.address
            assert "Traceback" not in n.log()
        ds = LocalDataset(self.node.shm_dir / "datasets" / NAME)
        seg = min(ds.held)
        want = (self.node.shm_dir / "datasets" / NAME / "seg" / f"{seg:08d}").read_bytes()[:100]
        with self.node.client() as c:
            assert bytes(c.read(NAME, self.uuid, [(seg, 0, len(want))])) == want


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    tmp = tmp_path_factory.mktemp("tls-cluster")
    token_file = tmp / "token"
    auth.write_token(token_file, auth.new_admin_token())
    source = _source(tmp / "src")
    env = {**os.environ, **pki.env(), "KSPEEDFS_TRANSPORT": "tcp"}
    cluster = Cluster(token_file, tmp, size=3, segment_size="64KiB", base_env=env)
    try:
        cluster.start()
        cluster.preload(source, NAME, replicas=1)  # coordinated over node-to-node TLS
        uuid = cluster.listing(cluster.nodes[0])[NAME]["uuid"]
        yield TlsCluster(cluster, source, pki, uuid)
    finally:
        cluster.stop()


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_fuse_reads_over_tls_equal_the_source(tls_cluster: TlsCluster, tmp_path: Path) -> None:
    c = tls_cluster.cluster
    held = [len(LocalDataset(n.shm_dir / "datasets" / NAME).held) for n in c.nodes]
    assert all(held), f"every node holds some segments: {held}"
    m = MountProcess(tmp_path / "mnt", c.env(local=tls_cluster.node), tmp_path)
    try:
        m.start()
        source = _files(tls_cluster.source)
        assert _files(tmp_path / "mnt" / NAME) == source
        stats = json.loads(os.getxattr(tmp_path / "mnt", "user.kspeedfs.sources"))
        assert stats.get("remote", 0) > 0 and stats.get("source", 0) == 0, stats
    finally:
        m.stop()


def test_fast_path_reads_over_tls_equal_the_source(
    tls_cluster: TlsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.data import DataLoader

    from pytorch_ext import KSpeedFolder

    c = tls_cluster.cluster
    for key, value in c.env().items():
        if key.startswith("KSPEEDFS_"):
            monkeypatch.setenv(key, value)
    # local=False: every read goes over the network to its owner, in each DataLoader worker.
    ds = KSpeedFolder(str(tls_cluster.source), local=False)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    got = {ds.files[i]: bytes(t.numpy()) for i, t in enumerate(loader)}
    assert got == _files(tls_cluster.source)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _refusals(node: NodeProcess) -> list[str]:
    return [line for line in node.log().splitlines() if "refused a connection from" in line]


def _no_cert_context(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca / "ca.crt")
    return ctx


@pytest.mark.parametrize("client", ["no certificate", "certificate from another CA", "plain TCP"])
def test_the_node_refuses_a_client_with_one_line(
    tls_cluster: TlsCluster, client: str, tmp_path: Path
) -> None:
    node, pki = tls_cluster.node, tls_cluster.pki
    before = len(_refusals(node))
    if client == "no certificate":
        no_cert = NodeClient(
            Address("127.0.0.1", node.port), node.token_file, 10, _no_cert_context(pki)
        )
        with pytest.raises(AuthError) as caught:
            no_cert.connect()
        message = _one_line(str(caught.value))
        assert "CERTIFICATE_REQUIRED" in message
    else:
        env = {
            k: v for k, v in tls_cluster.cluster.env().items() if not k.startswith("KSPEEDFS_TLS")
        }
        if client == "certificate from another CA":
            env.update(pki.env(pki.other_cert, pki.other_key))
        done = run_cli("ls", env=env)
        assert done.returncode == AuthError.exit_code, done.stderr
        message = _one_line(done.stderr)
        want = "UNKNOWN_CA" if client == "certificate from another CA" else "TLS connections only"
        assert want in message, message
    wait_for(lambda: len(_refusals(node)) > before, what="the node's log line")
    assert "Traceback" not in node.log()
    tls_cluster.assert_serves()


@pytest.mark.parametrize(
    "case", ["node from an untrusted CA", "name not in the node's certificate"]
)
def test_a_client_refuses_a_node_it_cannot_verify(tls_cluster: TlsCluster, case: str) -> None:
    node, pki = tls_cluster.node, tls_cluster.pki
    env = tls_cluster.cluster.env()
    if case == "node from an untrusted CA":
        # The client's own certificate is good; it trusts only the other CA.
        env.update(pki.env(ca=pki.other_ca))
        want = "CERTIFICATE_VERIFY_FAILED"
    else:
        env["KSPEEDFS_NODES"] = f"localhost:{node.port}"
        want = "Hostname mismatch"
    done = run_cli("ls", env=env)
    assert done.returncode == AuthError.exit_code, done.stderr
    assert want in _one_line(done.stderr)
    tls_cluster.assert_serves()


def test_tls_commands_refuse_with_one_line(pki: Pki, tmp_path: Path) -> None:
    for args, code in (
        (("tls", "issue", "127.0.0.1", "--ca", str(pki.ca), "--out", str(pki.ca)), 6),
        (("tls", "issue", "no/slash", "--ca", str(pki.ca), "--out", str(tmp_path)), 5),
        (("tls", "issue", "h1", "--ca", str(tmp_path / "none"), "--out", str(tmp_path)), 4),
        (("tls", "new-ca", str(pki.ca)), 6),
    ):
        done = run_cli(*args, env=dict(os.environ))
        assert done.returncode == code, (args, done.stderr)
        assert _one_line(done.stderr).startswith("kspeedfs: ")
    assert os.stat(pki.key).st_mode & 0o777 == 0o600
    assert os.stat(pki.ca / "ca.key").st_mode & 0o777 == 0o600
    # Half the settings is a mistake, not TLS off.
    env = {**os.environ, "KSPEEDFS_TLS_CERT": str(pki.cert), "KSPEEDFS_NODES": "127.0.0.1:1"}
    done = run_cli("ls", env=env)
    assert done.returncode == 5 and "go together" in _one_line(done.stderr)


def test_settings_make_contexts_that_verify_both_ways(pki: Pki) -> None:
    s = Settings(tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca / "ca.crt")
    client, server = tls.client_context(s), tls.server_context(s)
    assert client is not None and server is not None
    assert client.verify_mode == server.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname
    assert tls.client_context(s) is client  # built once per files
    assert tls.client_context(Settings()) is None


# The wire, fuzzed: random bytes on the TLS listener, random frames inside TLS.


class TlsRaw:
    """A TLS connection over memory BIOs, so that it can half-close (close_notify) and read on."""

    def __init__(self, port: int, ctx: ssl.SSLContext, timeout: float = 10):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self._step(self.tls.do_handshake)
        self.buf = bytearray()

    def __enter__(self) -> TlsRaw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.sock.sendall(data)

    def _step(self, fn: Callable[..., T], *args: object) -> T:
        while True:
            try:
                result = fn(*args)
                self._flush()
                return result
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(1 << 16)
                if data:
                    self.incoming.write(data)
                else:
                    self.incoming.write_eof()

    def send(self, data: bytes) -> bool:
        try:
            self.tls.write(data)
            self._flush()
            return True
        except (OSError, ssl.SSLError):
            return False

    def close_write(self) -> None:
        try:
            self.tls.unwrap()
        except ssl.SSLError:
            pass  # sent our close_notify; the node's comes when it is done
        try:
            self._flush()
        except OSError:
            pass

    def _exact(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            try:
                chunk = self._step(self.tls.read, 1 << 16)
            except (OSError, ssl.SSLError):
                return None
            if not chunk:
                return None
            self.buf += chunk
        out, self.buf = bytes(self.buf[:n]), self.buf[n:]
        return out

    def reply(self) -> tuple[MsgType, bytes] | None:
        header = self._exact(protocol.HEADER_SIZE)
        if header is None:
            return None
        kind, _rid, length = protocol.parse_header(header)
        payload = self._exact(length)
        assert payload is not None, "the node closed the connection inside a frame"
        return kind, payload


def _frame(kind: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return HEADER.pack(b"KS", protocol.VERSION, kind, 1, n) + payload


headers = st.builds(
    lambda magic, kind, length: HEADER.pack(magic, protocol.VERSION, kind, 1, length),
    st.sampled_from([b"KS", b"KS", b"SK"]),
    st.integers(0, 9),
    st.integers(0, 64) | st.integers(0, 2**32 - 1),
)
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(["ping", "status", "list", "manifest", "lease_renew", "stage"])},
    optional={"name": st.sampled_from([NAME, "../x", ""]) | st.text(max_size=8)},
).map(lambda d: _frame(MsgType.REQUEST, json.dumps(d).encode()))
reads = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 2**20)),
    max_size=3,
).map(
    lambda rs: _frame(
        MsgType.READ, protocol.encode_read(NAME, "0" * 32, [(s % 8, o, n) for s, o, n in rs])
    )
)
chunks = st.one_of(
    st.binary(max_size=64),
    st.builds(bytes.__add__, headers, st.binary(max_size=32)),
    requests,
    reads,
)
# Bytes a stranger sends where a ClientHello belongs: random, or a TLS record header first.
not_tls = st.one_of(
    st.binary(max_size=200),
    st.builds(
        bytes.__add__,
        st.sampled_from([b"\x16\x03\x01", b"\x16\x03\x03\xff\xff"]),
        st.binary(max_size=200),
    ),
    chunks,
)

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(data=not_tls)
def test_random_bytes_on_the_tls_listener(tls_cluster: TlsCluster, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", tls_cluster.node.port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the node already answered and closed
        try:
            while s.recv(1 << 16):  # the node answers (a plain refusal or a TLS alert), then closes
                pass
        except ConnectionResetError:
            pass
    tls_cluster.assert_serves()


@FUZZ
@given(authenticated=st.booleans(), parts=st.lists(chunks, max_size=5))
def test_random_frames_inside_tls(
    tls_cluster: TlsCluster, authenticated: bool, parts: list[bytes]
) -> None:
    node = tls_cluster.node
    ctx = tls.client_context(node.settings())
    assert ctx is not None
    with TlsRaw(node.port, ctx) as raw:
        hello = raw.reply()
        assert hello is not None and hello[0] == MsgType.HELLO
        if authenticated:  # the read role: a random but valid admin op would be no finding
            token = auth.derive_read_token(auth.read_token(node.token_file))
            nonce = bytes.fromhex(protocol.decode_json(hello[1])["nonce"])
            binding = raw.tls.get_channel_binding("tls-unique")
            assert binding is not None
            answer, _ = auth.client_answer(token, auth.tls_channel(binding), nonce)
            raw.send(protocol.encode_json(MsgType.AUTH, 0, answer))
            got = raw.reply()
            assert got is not None and got[0] == MsgType.RESPONSE
        for part in parts:
            if not raw.send(part):
                break
        raw.close_write()
        while (got := raw.reply()) is not None:
            assert got[0] in (MsgType.RESPONSE, MsgType.ERROR, MsgType.DATA)
    tls_cluster.assert_serves()


# The node's Unix socket (fd passing), fuzzed.


def _node_fds(node: NodeProcess) -> int:
    assert node.proc is not None
    return int(psutil.Process(node.proc.pid).num_fds())


def _attach_works(tls_cluster: TlsCluster) -> None:
    node = tls_cluster.node
    token = auth.derive_read_token(auth.read_token(node.token_file))
    got = fdpass.attach(Path(_socket_path(node)), token, NAME, tls_cluster.uuid)
    got.close()
    assert got.segments


def _socket_path(node: NodeProcess) -> str:
    return os.fspath(Settings(shm_dir=node.shm_dir).socket_path())


messages = st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["read", "admin", "job", ""]) | st.integers(),
            "mac": st.sampled_from(["00", "zz", "é"]) | st.text(max_size=70) | st.none(),
            "name": st.sampled_from([NAME, "../x", ""]) | st.integers(),
            "uuid": st.text(max_size=40),
        },
    ).map(lambda d: json.dumps(d).encode()),
    st.sampled_from([b"[]", b"null", b'"x"', b"{", b"\xff\xfe"]),
)


@FUZZ
@given(packets=st.lists(st.tuples(messages, st.integers(0, 3)), max_size=4), answer=st.booleans())
def test_random_packets_on_the_fd_socket(
    tls_cluster: TlsCluster, packets: list[tuple[bytes, int]], answer: bool
) -> None:
    node = tls_cluster.node
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(_socket_path(node))
        hello = s.recv(4096)
        if answer:  # a right MAC for the nonce, then the random rest
            token = auth.derive_read_token(auth.read_token(node.token_file))
            nonce = bytes.fromhex(json.loads(hello)["nonce"])
            answer, _ = auth.client_answer(token, auth.FD_SOCKET, nonce)
            packets = [(json.dumps(answer).encode(), 0), *packets]
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            for data, nfds in packets:
                try:
                    if nfds:  # descriptors the node never asked for: closed, not kept
                        socket.send_fds(s, [data or b"x"], [devnull] * nfds)
                    else:
                        s.send(data or b"x")
                except (BrokenPipeError, ConnectionResetError):
                    break
        finally:
            os.close(devnull)
        try:
            s.shutdown(socket.SHUT_WR)  # the node sees the end now, not after its timeout
        except OSError:
            pass
        try:
            while True:
                msg, fds, _flags, _ = socket.recv_fds(s, 1 << 16, 250)
                for fd in fds:
                    os.close(fd)
                if not msg:
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    _attach_works(tls_cluster)


def test_the_fd_socket_keeps_no_descriptor_it_was_sent(tls_cluster: TlsCluster) -> None:
    node = tls_cluster.node
    _attach_works(tls_cluster)
    base = _node_fds(node)
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        for _ in range(20):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(10)
                s.connect(_socket_path(node))
                s.recv(4096)
                socket.send_fds(s, [b'{"role": "read", "mac": "00"}'], [devnull] * 3)
                s.recv(4096)
    finally:
        os.close(devnull)
    wait_for(lambda: _node_fds(node) <= base, what="the node's descriptors back to where they were")
    _attach_works(tls_cluster)


def test_the_cluster_really_speaks_tls(tls_cluster: TlsCluster) -> None:
    """openssl's own client completes a mutual handshake with the node and reads its HELLO."""
    pki, node = tls_cluster.pki, tls_cluster.node
    done = subprocess.run(
        [
            "openssl", "s_client", "-connect", f"127.0.0.1:{node.port}", "-CAfile",
            str(pki.ca / "ca.crt"), "-cert", str(pki.cert), "-key", str(pki.key),
            "-verify_return_error", "-verify_ip", "127.0.0.1", "-quiet",
        ],
        input=b"", capture_output=True, timeout=30,
    )  # fmt: skip
    assert done.stdout.startswith(b"KS"), (done.stdout[:40], done.stderr[-300:])
