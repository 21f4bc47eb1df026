"""The rule of each setting: from what a layer gives (a string from the environment or the
command line, a typed TOML value) to the setting's value, checked (type, finite, range).

A rule raises InvalidArgument with the reason; config.load_settings names the setting and
where the value came from. A new setting is a field of config.Settings and one row in RULES,
built from the converters here (tests/unit/format/test_config.py fails for a field without one).
"""

from __future__ import annotations

import math
import os
import pwd
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kspeedfs.format.discovery import DNS_PREFIX, resolve_nodes
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import Address, parse_address, parse_size

MAX_SECONDS = 365 * 86400.0  # a year: longer is a typo (and sockets refuse timeouts past ~1e9 s)
MAX_PROCESSES = 1024
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_PERCENT_RE = re.compile(r"^\s*(\d{1,32}(?:\.\d{1,32})?)\s*%\s*$", re.ASCII)
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def _string(v: Any) -> str:
    """A TOML value that must be a string (the environment and the command line give only
    strings)."""
    if not isinstance(v, str):
        raise InvalidArgument(f"expected a string, not {type(v).__name__} {v!r}")
    return v


def _text(v: Any) -> str:
    s = _string(v)
    if not s.isprintable():
        raise InvalidArgument(f"{s!r} holds control characters")
    return s


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = _string(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"not a boolean: {v!r}")


def _to_float(
    v: Any, minimum: float = 0.0, above: bool = False, maximum: float = MAX_SECONDS
) -> float:
    """A finite number from `minimum` (excluded when `above`) to `maximum`: seconds, mostly."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise InvalidArgument(f"not a number: {v!r}")
    try:
        x = float(v)
    except (ValueError, OverflowError):
        raise InvalidArgument(f"not a number: {v!r}") from None
    if not math.isfinite(x):
        raise InvalidArgument(f"{v!r} is not a finite number")
    if x < minimum or (above and x == minimum):
        raise InvalidArgument(f"{v!r} must be {'above' if above else 'at least'} {minimum:g}")
    if x > maximum:
        raise InvalidArgument(f"{v!r} is more than {maximum:g}")
    return x


def _to_int(v: Any, minimum: int, maximum: int = 2**31 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise InvalidArgument(f"not an integer: {v!r}")
    try:
        n = int(v)
    except ValueError:
        raise InvalidArgument(f"not an integer: {v!r}") from None
    if n < minimum:
        raise InvalidArgument(f"{n} is below the minimum {minimum}")
    if n > maximum:
        raise InvalidArgument(f"{n} is above the maximum {maximum}")
    return n


def _to_size(v: Any, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise InvalidArgument(f"not a size: {v!r} (examples: 8GiB, 512MiB, 1073741824)")
    n = parse_size(v)
    if n < minimum:
        raise InvalidArgument(f"{v!r} is below the minimum of {minimum} bytes")
    return n


def _to_choice(v: Any, choices: tuple[str, ...]) -> str:
    s = _string(v).strip().lower()
    if s not in choices:
        raise InvalidArgument(f"{v!r} is not one of {', '.join(choices)}")
    return s


def _to_address(v: Any, min_port: int = 1) -> Address:
    """HOST:PORT; port 0 (any free port) only where one listens."""
    address = parse_address(_string(v))
    if address.port < min_port:
        raise InvalidArgument(f"port {address.port} in {v!r} is below {min_port}")
    return address


def _to_nodes(v: Any) -> list[Address]:
    """HOST:PORT entries, and dns:NAME:PORT entries that stand for every address of NAME."""
    items = v if isinstance(v, list) else [x for x in _string(v).split(",") if x.strip()]
    if not items:
        raise InvalidArgument("empty node list")
    if any(isinstance(x, str) and x.strip().startswith(DNS_PREFIX) for x in items):
        # Looked up again every dns_refresh seconds by nodes and long-lived clients.
        return resolve_nodes([x.strip() if isinstance(x, str) else x for x in items], _to_address)
    return [_to_address(x) for x in items]


def _to_listen_text(v: Any) -> str:
    """ "" (off) or HOST:PORT to listen on, kept as given."""
    s = _string(v)
    if s.strip():
        _to_address(s, min_port=0)
    return s


def _to_path(v: Any, absolute: bool = False) -> Path:
    s = _string(v)
    if not s.strip() or "\x00" in s:
        raise InvalidArgument(f"not a path: {s!r}")
    path = Path(os.path.expanduser(s))
    if absolute and not path.is_absolute():
        raise InvalidArgument(f"must be an absolute path: {s!r}")
    return path


def _to_optional_path(v: Any, absolute: bool = False) -> Path | None:
    return _to_path(v, absolute) if _string(v) else None


def _to_socket(v: Any) -> Path | None:
    path = _to_optional_path(v, absolute=True)
    if path is not None and len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise InvalidArgument(f"a Unix socket path has at most {_UNIX_PATH_MAX} bytes: {v!r}")
    return path


def _to_paths(v: Any) -> list[Path]:
    items = v if isinstance(v, list) else [x for x in _string(v).split(",") if x.strip()]
    return [_to_path(_string(x).strip(), absolute=True) for x in items]


def _to_endpoints(v: Any) -> list[str]:
    """etcd endpoints: a list or a comma-separated string; scheme http:// when none is given."""
    items = v if isinstance(v, list) else [x for x in _string(v).split(",") if x.strip()]
    out = []
    for item in (_text(x).strip() for x in items):
        url = item if "://" in item else f"http://{item}"
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"etcd endpoint must be http:// or https://: {item!r}")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port out of range)
        except ValueError:
            raise InvalidArgument(f"bad etcd endpoint {item!r}") from None
        if not parts.hostname or " " in url:
            raise InvalidArgument(f"bad etcd endpoint {item!r}")
        out.append(url.rstrip("/"))
    return out


def validate_cluster(name: str) -> str:
    """A cluster prefix is one path-safe word: it becomes part of every etcd key."""
    if not name or not all(c.isalnum() or c in "._-" for c in name) or len(name) > 64:
        raise InvalidArgument(f"bad cluster name {name!r}: letters, digits, '.', '_', '-'")
    return name


def _to_user(v: Any) -> str:
    """A user name or uid, checked now (a name is resolved where it is used)."""
    s = _text(v).strip()
    if s and not s.isdigit():
        try:
            pwd.getpwnam(s)
        except KeyError:
            raise InvalidArgument(f"no user named {s!r} on this machine") from None
    return s


USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # `kspeedfs user` names


def _to_login_name(v: Any) -> str:
    """A user of the cluster ('' = none: the token), with the name rule of `kspeedfs user`."""
    s = _text(v)
    if s and not USER_RE.fullmatch(s):
        raise InvalidArgument(f"bad user name {s!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return s


def memory_share(memory: str) -> float | None:
    """'50%' -> 0.5 of the shm filesystem; None for a size."""
    if not memory.strip().endswith("%"):
        return None
    m = _PERCENT_RE.match(memory)
    if not m or float(m.group(1)) > 100:
        raise InvalidArgument(
            f"{memory!r} is neither a size (8GiB) nor a share of the shm filesystem (0-100%)"
        )
    return float(m.group(1)) / 100


def _to_memory(v: Any) -> str:
    s = str(_to_size(v)) if isinstance(v, int) else _string(v)
    if memory_share(s) is None:
        _to_size(s)
    return s


EVICTION_POLICIES = ("stable", "plan", "lru")  # node/readthrough/policy.py

RULES: dict[str, Callable[[Any], Any]] = {
    "listen": lambda v: _to_address(v, min_port=0),
    "nodes": _to_nodes,
    "dns_refresh": _to_float,
    "health_table": lambda v: _to_optional_path(v, absolute=True),
    "shm_dir": lambda v: _to_path(v, absolute=True),
    "memory": _to_memory,
    "segment_size": lambda v: _to_size(v, minimum=4096),
    "token_file": _to_path,
    "users_file": lambda v: _to_optional_path(v, absolute=True),
    "user": _to_login_name,
    "password": _text,
    "verify_on_start": _to_bool,
    "lease_ttl": lambda v: _to_float(v, above=True),
    "timeout": lambda v: _to_float(v, above=True),
    "log_level": lambda v: _to_choice(v, LOG_LEVELS).upper(),
    "transport": lambda v: _to_choice(v, ("auto", "tcp", "rdma")),
    "rdma_device": _text,
    "rdma_gid_index": lambda v: _to_int(v, -1, 65535),
    "spill_dir": lambda v: _to_optional_path(v, absolute=True),
    "spill": lambda v: str(_to_size(v)),
    "scrub_rate": lambda v: str(_to_size(v)),
    "source_check_interval": _to_float,
    "eviction": lambda v: _to_choice(v, EVICTION_POLICIES),
    "group": _text,
    "access": lambda v: _to_choice(v, ("source", "open")),
    "source_roots": _to_paths,
    "socket": _to_socket,
    "node_user": _to_user,
    "tls_cert": _to_optional_path,
    "tls_key": _to_optional_path,
    "tls_ca": _to_optional_path,
    "fuse_workers": lambda v: _to_int(v, 0, MAX_PROCESSES),
    "fuse_read_ahead": _to_size,
    "fuse_poll_us": lambda v: _to_int(v, 0, 100_000),
    "fuse_uring": _to_bool,
    "decode_workers": lambda v: _to_int(v, 0, MAX_PROCESSES),
    "etcd": _to_endpoints,
    "cluster": lambda v: validate_cluster(_string(v)),
    "member_ttl": lambda v: _to_float(v, above=True),
    "heal_after": _to_float,
    "metrics_listen": _to_listen_text,
}
# Settings that only work together: TLS's three files; the spill folder and its budget.
TOGETHER = (("tls_cert", "tls_key", "tls_ca"), ("spill_dir", "spill"))
