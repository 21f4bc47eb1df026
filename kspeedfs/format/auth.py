"""Cluster tokens and the mutual HMAC challenge-response that proves each side holds one.

The token file holds the admin secret. The job and read secrets are derived from it, so a
token with less power can be handed out (`kspeedfs token new --role job|read`) without
revealing the admin one; the node derives them too, and so proves to a client that it holds
the client's token. Roles, from most to least: admin (everything), job (preloads under
`source_roots` with a lease, its own leases, reads), read (reads, listing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import AuthError, InvalidArgument
from kspeedfs.format.private import make_private_folder

ROLES = ("admin", "job", "read")
_PREFIX = {"admin": "ksa1-", "job": "ksj1-", "read": "ksr1-"}
# What each role may do includes what the roles ranked below it may.
RANK = {"read": 0, "job": 1, "admin": 2}
_MAX_TOKEN_BYTES = 4096  # a token is 69 characters

# Challenge-response: each side sends a nonce, and each MAC covers both nonces, the role and the
# channel it is given on (so an answer relayed to another channel is refused), and which side
# made it (so the node's proof is never a client's answer reflected back).
NONCE_BYTES = 32
_LABEL = b"kspeedfs auth v2"
FD_SOCKET = "fd-socket"  # the node's local Unix socket
TCP = "tcp"  # plain TCP (TLS connections use tls_channel)


def new_admin_token() -> str:
    return _PREFIX["admin"] + secrets.token_hex(32)


def derive_token(admin_token: str, role: str) -> str:
    """The token of `role` that belongs to this admin token."""
    if role == "admin":
        return admin_token
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    label = f"kspeedfs {role} role".encode()
    return _PREFIX[role] + hmac.new(admin_token.encode(), label, hashlib.sha256).hexdigest()


def derive_read_token(admin_token: str) -> str:
    return derive_token(admin_token, "read")


def allows(role: str, needed: str) -> bool:
    """Whether a client with `role` may call what needs `needed`."""
    return RANK.get(role, -1) >= RANK[needed]


def token_role(token: str) -> str:
    for role, prefix in _PREFIX.items():
        if token.startswith(prefix):
            return role
    raise AuthError("the token file does not hold a kspeedfs token")


def write_token(path: Path, token: str, overwrite: bool = False) -> None:
    """Create the token file with mode 0600 from the start (never world-readable, even briefly),
    in a folder made 0700 when it is missing."""
    make_private_folder(path.parent)
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


def read_private_file(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a secret file (a token, the users file): a regular file that only its owner
    may read or write (as ssh wants of keys), at most `limit` bytes; AuthError (one line)
    otherwise. FileNotFoundError passes through: what a missing file means is the caller's."""
    # O_NONBLOCK: a FIFO put where the file was must not hang the reader.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise AuthError(f"cannot read the {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise AuthError(f"the {what} {path} is a folder: name the file in it")
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"the {what} {path} is not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(
                f"the {what} {path} is open to group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}"
            )
        # Read off the descriptor: os.fdopen would refuse a folder (a traceback) unchecked.
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise AuthError(f"cannot read the {what} {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise AuthError(f"the {what} {path} is too large")
    return data


def read_token(path: Path) -> str:
    """The token in `path`, the one way every client and the node read one: a private file
    (read_private_file) holding one UTF-8 token."""
    try:
        data = read_private_file(path, "token file", _MAX_TOKEN_BYTES)
    except FileNotFoundError:
        raise AuthError(
            f"no cluster token at {path}: copy the cluster's token there or set --token-file"
        ) from None
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise AuthError(f"the token file {path} is not UTF-8 text (byte {e.start})") from None
    token_role(token)
    return token


def ensure_token(path: Path) -> str:
    """The node's token: created on first start for a one-machine setup."""
    if not path.exists():
        try:
            write_token(path, new_admin_token())
        except InvalidArgument:
            if not path.exists():
                raise  # not made by another process first: its folder could not be made
    token = read_token(path)
    if token_role(token) != "admin":
        raise AuthError(f"a node needs the admin token, but {path} holds a read token")
    return token


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def tls_channel(binding: bytes) -> str:
    """The label of a TLS connection: its tls-unique binding, which both ends see alike and a
    relay that runs TLS with each end separately cannot make equal."""
    return "tls-unique:" + binding.hex()


def _mac(token: str, side: bytes, channel: str, role: str, node_nonce: bytes, nonce: bytes) -> str:
    # Length-prefixed parts: no two different transcripts give the same bytes.
    parts = (_LABEL, side, channel.encode(), role.encode(), node_nonce, nonce)
    data = b"".join(struct.pack(">I", len(p)) + p for p in parts)
    return hmac.new(token.encode(), data, hashlib.sha256).hexdigest()


def client_answer(token: str, channel: str, node_nonce: bytes) -> tuple[dict[str, str], bytes]:
    """The fields that prove `token` to the node on `channel` (role, the client's own nonce,
    MAC), and that nonce, which the node's proof must then cover."""
    role = token_role(token)
    nonce = new_nonce()
    mac = _mac(token, b"client", channel, role, node_nonce, nonce)
    return {"role": role, "nonce": nonce.hex(), "mac": mac}, nonce


def verify_client(
    admin_token: str, channel: str, node_nonce: bytes, msg: dict[str, Any]
) -> tuple[str, str] | None:
    """(role, the node's proof for the client) when msg proves the token of its role on this
    channel for this node nonce; None for anything else, malformed fields included (never
    raises: compare_digest refuses a str that is not ASCII)."""
    role, mac, nonce = msg.get("role"), msg.get("mac"), _nonce(msg.get("nonce"))
    if not isinstance(role, str) or role not in ROLES or nonce is None:
        return None
    if not isinstance(mac, str) or not mac.isascii():
        return None
    token = derive_token(admin_token, role)
    if not hmac.compare_digest(_mac(token, b"client", channel, role, node_nonce, nonce), mac):
        return None
    return role, _mac(token, b"node", channel, role, node_nonce, nonce)


def verify_node(token: str, channel: str, node_nonce: bytes, nonce: bytes, mac: object) -> bool:
    """Whether the node's mac proves that it holds the token too (the side label keeps a
    client's own answer from passing for it)."""
    if not isinstance(mac, str) or not mac.isascii():
        return False
    expected = _mac(token, b"node", channel, token_role(token), node_nonce, nonce)
    return hmac.compare_digest(expected, mac)


def parse_nonce(value: object) -> bytes:
    """A nonce sent as hex; AuthError when it is not one."""
    nonce = _nonce(value)
    if nonce is None:
        raise AuthError("the peer sent no valid nonce")
    return nonce


def _nonce(value: object) -> bytes | None:
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


# Users with passwords (format/users.py): the user's scrypt key stands where a token stands,
# and the MAC names the user instead of a role; the node grants the user's role.
WRONG_LOGIN = "authentication refused: wrong user or password"


@dataclasses.dataclass(frozen=True)
class UserLogin:
    """A client's user and password (in place of a token file)."""

    user: str
    password: str = dataclasses.field(repr=False)


def secret(credential: Path | UserLogin) -> str | UserLogin:
    """What a client proves: the token in a token file, or a user's login as it is."""
    return credential if isinstance(credential, UserLogin) else read_token(credential)


def _user_label(user: str) -> str:
    return "user:" + user


def user_answer(
    key: str, user: str, channel: str, node_nonce: bytes
) -> tuple[dict[str, str], bytes]:
    """The fields that prove user's key (hex) to the node on `channel`, and the client's nonce."""
    nonce = new_nonce()
    mac = _mac(key, b"client", channel, _user_label(user), node_nonce, nonce)
    return {"user": user, "nonce": nonce.hex(), "mac": mac}, nonce


def verify_user(
    key_of: Callable[[str], tuple[str, str] | None],
    channel: str,
    node_nonce: bytes,
    msg: dict[str, Any],
) -> tuple[str, str] | None:
    """(role, the node's proof) when msg proves the key of its user; `key_of(user)` gives that
    user's (role, key hex), or None for no such user. None for anything else."""
    user, mac, nonce = msg.get("user"), msg.get("mac"), _nonce(msg.get("nonce"))
    if not isinstance(user, str) or nonce is None or not isinstance(mac, str) or not mac.isascii():
        return None
    known = key_of(user)
    if known is None:
        return None
    role, key = known
    label = _user_label(user)
    if not hmac.compare_digest(_mac(key, b"client", channel, label, node_nonce, nonce), mac):
        return None
    return role, _mac(key, b"node", channel, label, node_nonce, nonce)


def verify_node_user(
    key: str, user: str, channel: str, node_nonce: bytes, nonce: bytes, mac: object
) -> bool:
    """Whether the node's mac proves that it holds the user's key too."""
    if not isinstance(mac, str) or not mac.isascii():
        return False
    expected = _mac(key, b"node", channel, _user_label(user), node_nonce, nonce)
    return hmac.compare_digest(expected, mac)
