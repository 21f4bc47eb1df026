"""TLS contexts from the settings: mutual TLS on every TCP connection when cert, key and CA are set.

Both ends present a certificate signed by the cluster's CA and require one from the peer
(CERT_REQUIRED both ways); a client also checks that the node's certificate names the host it
dialled. TLS 1.3 only: both ends are kspeedfs, and it saves a round trip per connection.
A context is built once per files and their modification times (a DataLoader worker opens a
connection per node), so certificates replaced on disk are used by the next connection.
"""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path

from kspeedfs.format.config import Settings
from kspeedfs.format.errors import InvalidArgument


def client_context(settings: Settings) -> ssl.SSLContext | None:
    """The context a client (CLI, reader, mount, node-to-node call) dials with; None: TLS off."""
    return _from_settings(settings, server_side=False)


def server_context(settings: Settings) -> ssl.SSLContext | None:
    """The context the node's listener accepts with; None: TLS off."""
    return _from_settings(settings, server_side=True)


def _from_settings(settings: Settings, server_side: bool) -> ssl.SSLContext | None:
    if not settings.tls():
        return None
    assert settings.tls_cert and settings.tls_key and settings.tls_ca
    files = (settings.tls_cert, settings.tls_key, settings.tls_ca)
    try:
        stamps = tuple(os.stat(f).st_mtime_ns for f in files)
    except OSError as e:
        raise InvalidArgument(f"TLS file {e.filename}: {e.strerror}") from None
    return _context(server_side, *files, stamps)


@functools.lru_cache(maxsize=8)
def _context(
    server_side: bool, cert: Path, key: Path, ca: Path, _stamps: tuple[int, ...]
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED  # the client's default; the node's on purpose
    try:
        ctx.load_verify_locations(cafile=os.fspath(ca))
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgument(f"tls_ca {ca}: {reason(e)}") from None
    try:
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgument(f"tls_cert {cert} with tls_key {key}: {reason(e)}") from None
    return ctx


def reason(e: BaseException) -> str:
    """One line for an ssl or OS error: OpenSSL's reason where it gives one."""
    if isinstance(e, ssl.SSLError) and e.reason:
        verify = getattr(e, "verify_message", None)
        return f"{e.reason} ({verify})" if verify else str(e.reason)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__
