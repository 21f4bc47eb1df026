"""What a client says when it dials http:// to an endpoint that speaks only TLS, whichever way
that endpoint hangs up on the plain request: a close (what etcd mostly does) or a reset (what
the kernel sends when the request is still unread, a CI failure once). Either is one line that
says to use https://; an endpoint that hangs up and does not speak TLS stays "does not answer".
The endpoint is a small loopback server with a real TLS handshake, so each way is provoked on
every run rather than by chance."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Iterator

import pytest

from kspeedfs.cli.tlsca import issue, new_ca
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.errors import AuthError, NodeUnreachable

TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS client hello


class HangsUpOnPlain:
    """A loopback listener that completes TLS handshakes (nothing after) and hangs up on any
    other first byte: with a reset (`reset`) or a close, after reading the request."""

    def __init__(self, context: ssl.SSLContext | None, reset: bool):
        self.context, self.reset = context, reset
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by stop()
                return
            with conn:
                first = conn.recv(1, socket.MSG_PEEK)
                if first and first[0] == TLS_RECORD_HANDSHAKE and self.context is not None:
                    try:
                        self.context.wrap_socket(conn, server_side=True).close()
                    except (ssl.SSLError, OSError):
                        pass
                elif self.reset:  # the request left unread: the close sends a reset
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    conn.recv(65536)

    def stop(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.listener.close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def tls_server_context(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    folder = tmp_path_factory.mktemp("ca")
    new_ca(folder)
    cert, key = issue("127.0.0.1", folder, folder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.fixture
def server(request: pytest.FixtureRequest, tls_server_context: ssl.SSLContext) -> Iterator[int]:
    speaks_tls, reset = request.param
    s = HangsUpOnPlain(tls_server_context if speaks_tls else None, reset)
    yield s.port
    s.stop()


def _members_over_http(port: int) -> None:
    ClusterState([f"http://127.0.0.1:{port}"], "c", timeout=5.0).live_members()


@pytest.mark.parametrize(
    "server", [(True, True), (True, False)], ids=["reset", "close"], indirect=True
)
def test_http_to_a_tls_endpoint_says_use_https_however_it_hangs_up(server: int) -> None:
    with pytest.raises(AuthError) as raised:
        _members_over_http(server)
    line = str(raised.value)
    assert "use https://" in line and f"127.0.0.1:{server}" in line and "\n" not in line


@pytest.mark.parametrize(
    "server", [(False, True), (False, False)], ids=["reset", "close"], indirect=True
)
def test_an_endpoint_that_hangs_up_without_tls_does_not_answer(server: int) -> None:
    with pytest.raises(NodeUnreachable) as raised:
        _members_over_http(server)
    assert "does not answer" in str(raised.value) and "https" not in str(raised.value)
