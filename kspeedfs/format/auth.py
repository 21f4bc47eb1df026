"""Cluster tokens and the HMAC challenge-response that proves a client holds one.

The token file holds the admin secret. The read secret is derived from it, so a read-only
token can be handed out (`kspeedfs token new --role read`) without revealing the admin one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from kspeedfs.format.errors import AuthError, InvalidArgument

ROLES = ("admin", "read")
_PREFIX = {"admin": "ksa1-", "read": "ksr1-"}


def new_admin_token() -> str:
    return _PREFIX["admin"] + secrets.token_hex(32)


def derive_read_token(admin_token: str) -> str:
    digest = hmac.new(admin_token.encode(), b"kspeedfs read role", hashlib.sha256).hexdigest()
    return _PREFIX["read"] + digest


def token_role(token: str) -> str:
    for role, prefix in _PREFIX.items():
        if token.startswith(prefix):
            return role
    raise AuthError("the token file does not hold a kspeedfs token")


def write_token(path: Path, token: str, overwrite: bool = False) -> None:
    """Create the token file with mode 0600 from the start (never world-readable, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise InvalidArgument(
            f"token file already exists: {path} (use --force to replace)"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise AuthError(
            f"no cluster token at {path}: copy the cluster's token there or set --token-file"
        ) from None
    except OSError as e:
        raise AuthError(f"cannot read the token file {path}: {e.strerror}") from None
    token_role(token)
    return token


def ensure_token(path: Path) -> str:
    """The node's token: created on first start for a one-machine setup."""
    if not path.exists():
        try:
            write_token(path, new_admin_token())
        except InvalidArgument:
            pass  # another process created it first
    token = read_token(path)
    if token_role(token) != "admin":
        raise AuthError(f"a node needs the admin token, but {path} holds a read token")
    return token


def respond(token: str, nonce: bytes) -> str:
    return hmac.new(token.encode(), b"kspeedfs auth v1" + nonce, hashlib.sha256).hexdigest()


def verify(admin_token: str, nonce: bytes, role: str, mac: str) -> bool:
    if role not in ROLES or not isinstance(mac, str):
        return False
    key = admin_token if role == "admin" else derive_read_token(admin_token)
    return hmac.compare_digest(respond(key, nonce), mac)
