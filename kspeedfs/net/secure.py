"""TLS on a TCP connection, both ends: the clients' wrap and the node's accept.

The node accepts plain TCP and starts TLS itself, so that a client without TLS gets a one-line
answer in the plain framing it speaks ("this node accepts TLS connections only") instead of a
silent wait: a TLS client speaks first (its ClientHello, a handshake record, byte 0x16) while a
plain kspeedfs client waits for the node's HELLO. The HMAC token handshake runs inside TLS and
is bound to it by the connection's tls-unique value: Python's ssl offers no other channel
binding (no RFC 9266 exporter), and under TLS 1.3 it is the client's Finished message, an HMAC
over the whole handshake transcript, so it differs on every connection and a relay that runs
TLS with each end separately gets two different ones.
"""

from __future__ import annotations

import socket
import ssl

import trio

from kspeedfs.format import auth, protocol
from kspeedfs.format.errors import AuthError, KSpeedError, NodeUnreachable
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.tls import reason
from kspeedfs.format.units import Address

TLS_HANDSHAKE_RECORD = 0x16
# How long the node waits for a ClientHello before it answers as to a plain client: a TLS
# client sends it right after connecting.
CLIENT_HELLO_WAIT = 3.0
PLAIN_REFUSAL = "accepts TLS connections only: set tls_cert, tls_key and tls_ca"


def channel(conn: object) -> str:
    """The label a token handshake on this connection is bound to: its TLS binding, or TCP."""
    if not isinstance(conn, (ssl.SSLSocket, trio.SSLStream)):
        return auth.TCP
    binding = conn.get_channel_binding("tls-unique")
    if not binding:
        raise AuthError("TLS gave no channel binding to authenticate over")
    return auth.tls_channel(binding)


def client_error(address: Address, e: BaseException, authenticated: bool) -> KSpeedError:
    """What a failed send or receive means to a client: the node refusing this client's TLS
    before it authenticated (AuthError: a setup problem, no failover helps), else a lost node."""
    cause = e.__cause__ if isinstance(e, trio.BrokenResourceError) else e
    ended = isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError))
    if isinstance(cause, ssl.SSLError) and not ended and not authenticated:
        return AuthError(f"TLS with node {address} failed: {reason(cause)}")
    return NodeUnreachable(f"lost the connection to {address}: {reason(cause or e)}")


def wrap_socket(sock: socket.socket, context: ssl.SSLContext, address: Address) -> ssl.SSLSocket:
    """TLS over a connected blocking socket, handshake done (the socket is closed on failure)."""
    try:
        return context.wrap_socket(sock, server_hostname=address.host)
    except (OSError, ValueError) as e:
        sock.close()
        if isinstance(e, (ssl.SSLError, ssl.CertificateError, ValueError)):
            raise AuthError(f"TLS with node {address} failed: {reason(e)}") from None
        raise NodeUnreachable(f"TLS with node {address} failed: {reason(e)}") from None


async def wrap_stream(
    stream: trio.SocketStream, context: ssl.SSLContext, address: Address
) -> trio.SSLStream[trio.SocketStream]:
    """TLS over a trio TCP stream, handshake done (the caller bounds it with a timeout)."""
    tls = trio.SSLStream(stream, context, server_hostname=address.host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as e:
        await stream.aclose()
        raise client_error(address, e, authenticated=False) from None
    return tls


async def accept(
    stream: trio.SocketStream, context: ssl.SSLContext, node: str, timeout: float
) -> trio.SSLStream[trio.SocketStream]:
    """The node's side: TLS over a new connection, its client's certificate checked.

    AuthError (one line, for the node's log) when the client does not complete TLS; a client
    that sent no ClientHello is told so in the plain framing first.
    """
    first = b""
    with trio.move_on_after(CLIENT_HELLO_WAIT):
        first = await stream.socket.recv(1, socket.MSG_PEEK)
        if not first:
            raise AuthError("the client closed before starting TLS")
    if first != bytes([TLS_HANDSHAKE_RECORD]):
        error = {"kind": "AuthError", "message": f"node {node} {PLAIN_REFUSAL}"}
        with trio.move_on_after(1):
            await stream.send_all(protocol.encode_json(MsgType.ERROR, 0, error))
        raise AuthError("a client without TLS")
    tls = trio.SSLStream(stream, context, server_side=True)
    try:
        with trio.fail_after(timeout):
            await tls.do_handshake()
    except trio.TooSlowError:
        raise AuthError("the client did not finish the TLS handshake in time") from None
    except trio.BrokenResourceError as e:
        await _send_alert(stream, tls)
        raise AuthError(f"TLS handshake failed: {reason(e.__cause__ or e)}") from None
    return tls


async def _send_alert(stream: trio.SocketStream, tls: trio.SSLStream[trio.SocketStream]) -> None:
    """Send the alert OpenSSL wrote for a failed handshake, which trio drops: the client then
    learns why ("unknown ca", "certificate required") instead of seeing the connection close."""
    outgoing = getattr(tls, "_outgoing", None)  # trio's memory BIO: no public way to it
    if isinstance(outgoing, ssl.MemoryBIO) and outgoing.pending:
        with trio.move_on_after(1):
            try:
                await stream.send_all(outgoing.read())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
