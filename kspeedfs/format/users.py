"""Users with passwords: the node keeps each user's role and scrypt key in one 0600 file.

There is no built-in user: the file exists only once an operator adds one (`kspeedfs user
add`). A user's key is `scrypt(password, salt)`, with the salt made of the file's random
realm and the user's name, so a client derives the key from the node's HELLO (which carries
the realm) without another round trip, and the same password gives different keys for
different users and clusters. The key then stands where a token's secret stands in the
handshake: the node never sees the password, and a stolen file gives no password (only what a
stolen token file gives, so it is kept like one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from kspeedfs.format.auth import (
    ROLES,
    WRONG_LOGIN,
    UserLogin,
    read_private_file,
    verify_client,
    verify_user,
)
from kspeedfs.format.errors import AuthError, InvalidArgument, NotFound
from kspeedfs.format.setting_rules import USER_RE

# scrypt's cost: 16 MiB and about 50 ms a derivation here; a guess at a stolen file costs that.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
MAX_USERS_BYTES = 1 << 20


def validate_user(name: str) -> str:
    if not isinstance(name, str) or not USER_RE.fullmatch(name):
        raise InvalidArgument(f"bad user name {name!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return name


def user_key(password: str, realm: str, name: str) -> bytes:
    """The secret that proves `password` for user `name` in the cluster of `realm`."""
    salt = hashlib.sha256(f"kspeedfs user\0{realm}\0{name}".encode()).digest()
    return hashlib.scrypt(
        password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=64 << 20, dklen=32
    )


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    role: str
    key: bytes = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Users:
    """The users file: its realm and its users by name."""

    realm: str
    users: dict[str, User]

    def get(self, name: str) -> User | None:
        return self.users.get(name)


def new_users() -> Users:
    return Users(secrets.token_hex(16), {})


def load_users(path: Path) -> Users | None:
    """The users file, or None when there is none (no user exists)."""
    try:
        raw = read_private_file(path, "users file", MAX_USERS_BYTES)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode())
        users = {
            name: User(validate_user(name), _role(u["role"]), bytes.fromhex(u["key"]))
            for name, u in doc["users"].items()
        }
        return Users(str(doc["realm"]), users)
    except (ValueError, KeyError, TypeError, AttributeError, InvalidArgument):
        raise AuthError(f"the users file {path} is damaged") from None


def save_users(path: Path, users: Users) -> None:
    """Write the file 0600 from the start, atomically (a node reading it sees old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    doc = {
        "realm": users.realm,
        "users": {u.name: {"role": u.role, "key": u.key.hex()} for u in users.users.values()},
    }
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_user(path: Path, name: str, role: str, password: str) -> None:
    validate_user(name)
    if not password:
        raise InvalidArgument("the password is empty")
    current = load_users(path) or new_users()
    user = User(name, _role(role), user_key(password, current.realm, name))
    save_users(path, Users(current.realm, {**current.users, name: user}))


def delete_user(path: Path, name: str) -> None:
    current = load_users(path)
    if current is None or name not in current.users:
        raise NotFound(f"no user {name!r}")
    save_users(path, Users(current.realm, {k: v for k, v in current.users.items() if k != name}))


def _role(role: object) -> str:
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return str(role)


class UsersFile:
    """The node's view of its users file, read again whenever the file changes (an operator
    adds a user while the node runs). Thread-safe enough: a reload swaps one reference."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._users: Users | None = None

    def current(self) -> Users | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._users = None, None
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._users, self._seen = load_users(self.path), seen
        return self._users

    def realm(self) -> str | None:
        """What a HELLO carries for clients to derive their keys (None: no user exists)."""
        users = self.current()
        return users.realm if users is not None and users.users else None

    def key_of(self, name: str) -> tuple[str, str] | None:
        users = self.current()
        user = users.get(name) if users is not None else None
        return (user.role, user.key.hex()) if user is not None else None


def login_key(login: UserLogin, realm: object) -> str:
    """The key (hex) a client proves for its login, from the realm the node's HELLO sent; a
    node with no users sends none, which is the same one-line refusal as a wrong password."""
    if not isinstance(realm, str) or not realm:
        raise AuthError(WRONG_LOGIN)
    return user_key(login.password, realm, login.user).hex()


def authenticate(
    admin_token: str, known: UsersFile, channel: str, node_nonce: bytes, msg: dict[str, Any]
) -> tuple[str, str]:
    """The role a client's AUTH proves on `channel` (with a token, or a user's password) and
    the node's proof for it; AuthError (one line, naming no part) when it proves none."""
    if "user" in msg:
        proved = verify_user(known.key_of, channel, node_nonce, msg)
        if proved is None:
            raise AuthError(WRONG_LOGIN)
        return proved
    proved = verify_client(admin_token, channel, node_nonce, msg)
    if proved is None:
        raise AuthError("authentication refused: wrong cluster token")
    return proved
