"""The cluster's TLS certificates: a CA, and the node and client certificates it signs.

`kspeedfs tls new-ca DIR` writes ca.crt and ca.key (0600); `kspeedfs tls issue HOST --ca DIR`
writes HOST.crt and HOST.key (0600), valid for both ends of a connection (server and client
auth), naming HOST as an IP address or DNS name so that clients dialling it can check it.
A folder either command makes is 0700 whatever the umask.
ECDSA P-256 keys: every handshake signs with them, and they are small and quick to sign with.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kspeedfs.format.errors import AlreadyExists, InvalidArgument, NotFound
from kspeedfs.format.private import make_private_folder

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_DAYS = 3650
CERT_DAYS = 825
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*")
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # a peer whose clock is a little behind


def new_ca(folder: Path, days: int = CA_DAYS, overwrite: bool = False) -> tuple[Path, Path]:
    """Make a CA in `folder` (created 0700): (its certificate, its key)."""
    _check_days(days)
    make_private_folder(folder)
    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kspeedfs cluster CA")])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_pair(cert_path, cert, key_path, key, overwrite)
    return cert_path, key_path


def _key_usage(ca: bool) -> x509.KeyUsage:
    """ECDSA signatures; a CA also signs certificates and revocation lists."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue(
    host: str,
    ca_folder: Path,
    out: Path,
    alt_names: Sequence[str] = (),
    days: int = CERT_DAYS,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """A certificate for `host` (and `alt_names`) signed by the CA in `ca_folder`, written to
    `out` as HOST.crt and HOST.key: (certificate, key)."""
    _check_days(days)
    names = [_general_name(n) for n in dict.fromkeys([host, *alt_names])]
    ca_cert, ca_key = _load_ca(ca_folder)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    make_private_folder(out)
    cert_path, key_path = out / f"{host}.crt", out / f"{host}.key"
    _write_pair(cert_path, cert, key_path, key, overwrite)
    return cert_path, key_path


def _general_name(name: str) -> x509.GeneralName:
    """An IP address or a DNS name, as a client would dial it."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    if len(name) > 253 or not _HOSTNAME.fullmatch(name):
        raise InvalidArgument(f"not a host name or IP address: {name!r}")
    return x509.DNSName(name)


def _check_days(days: int) -> None:
    if days < 1:
        raise InvalidArgument(f"--days must be at least 1, not {days}")


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as e:
        raise NotFound(f"no CA in {folder}: {e.filename} is missing") from None
    except (OSError, ValueError, TypeError) as e:
        raise InvalidArgument(f"the CA in {folder} cannot be read: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"the CA key in {folder} is not the ECDSA key kspeedfs made")
    return cert, key


def _write_pair(
    cert_path: Path,
    cert: x509.Certificate,
    key_path: Path,
    key: ec.EllipticCurvePrivateKey,
    overwrite: bool,
) -> None:
    if not overwrite:
        for p in (cert_path, key_path):
            if p.exists():
                raise AlreadyExists(f"{p} exists (--force replaces it)")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(key_path, key_pem, 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write through a new file renamed into place: a key is never readable by others, even
    for a moment, and a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # against a umask that took bits away from 0644
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
