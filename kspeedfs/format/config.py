"""The one typed settings object, and the one place that checks every setting.

Precedence CLI > environment > TOML file > default. Every value is checked once, at load, by
its setting's rule in `_CONVERTERS` (type, finite, range); a bad one is a one-line
InvalidArgument naming the setting and where it came from. A new setting is a field of
Settings and one row there (tests/test_config.py checks that every field has one).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.units import Address, parse_address, parse_size

DEFAULT_PORT = 7420
DEFAULT_CONFIG_FILE = Path("/etc/kspeedfs/kspeedfs.toml")


def default_token_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kspeedfs" / "token"


@dataclasses.dataclass
class Settings:
    listen: Address = Address("127.0.0.1", DEFAULT_PORT)
    nodes: list[Address] = dataclasses.field(
        default_factory=lambda: [Address("127.0.0.1", DEFAULT_PORT)]
    )
    shm_dir: Path = Path("/dev/shm/kspeedfs")
    # Budget for cached data: a size, or a percentage of the shm filesystem.
    memory: str = "50%"
    segment_size: int = 64 * 1024 * 1024
    token_file: Path = dataclasses.field(default_factory=default_token_file)
    verify_on_start: bool = True
    lease_ttl: float = 30.0
    timeout: float = 10.0
    log_level: str = "INFO"
    # Data transport between nodes: "auto" (RDMA where both ends can, else TCP), "tcp", "rdma".
    transport: str = "auto"
    rdma_device: str = ""  # "" = the first device with an active port
    rdma_gid_index: int = -1  # -1 = pick one (RoCE v2 with an IPv4 address first)
    # Read-through caching: evicted segments go to spill_dir (a disk folder) within `spill`.
    spill_dir: Path | None = None
    spill: str = "0"
    source_check_interval: float = 300.0  # seconds between checks of sources for changes; 0: off
    # Who may read what (README "Security"): the group that may map segments directly ("" =
    # the node's own group), the mount's permissions ("source": the source's modes and owners,
    # checked by the kernel; "open": everyone on the machine), the folders a job token may
    # preload from, the node's Unix socket for fd passing ("" = next to shm_dir), and mutual
    # TLS on every TCP connection when all three files are set.
    group: str = ""
    access: str = "source"
    source_roots: list[Path] = dataclasses.field(default_factory=list)
    socket: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    # FUSE mounts: serving processes (0 = one per CPU, at most 8), and the read-ahead set on
    # the mount so that a typical file is one READ (0 = the kernel's default, 128 KiB).
    fuse_workers: int = 0
    fuse_read_ahead: int = 256 * 1024
    # Decoded variants: processes a fill may decode with (0 = one per CPU); fewer leaves CPUs
    # to the training jobs on the node while a variant fills.
    decode_workers: int = 0
    # Control plane (README "Cluster with etcd"): etcd endpoints ([] = the static `nodes` list),
    # the key prefix of this cluster, the membership lease's TTL, how long a member stays down
    # before its copies are made again elsewhere, and the Prometheus endpoint ("" = off).
    etcd: list[str] = dataclasses.field(default_factory=list)
    cluster: str = "default"
    member_ttl: float = 10.0
    heal_after: float = 30.0
    metrics_listen: str = ""

    def socket_path(self) -> Path:
        """The node's local socket: `socket`, else `SHM_DIR.sock` beside the shm folder."""
        return self.socket or self.shm_dir.with_name(self.shm_dir.name + ".sock")

    def tls(self) -> bool:
        """Mutual TLS is on: all three of cert, key and CA are set (some but not all: refused
        at load; here too, for Settings built in code)."""
        given = [p is not None for p in (self.tls_cert, self.tls_key, self.tls_ca)]
        if any(given) and not all(given):
            raise InvalidArgument("tls_cert, tls_key and tls_ca go together")
        return all(given)

    def memory_budget(self) -> int:
        """The budget in bytes; a share is taken of the filesystem that holds shm_dir."""
        share = _share(self.memory)
        if share is None:
            return parse_size(self.memory)
        probe = self.shm_dir
        while not probe.exists():
            probe = probe.parent
        st = os.statvfs(probe)
        return int(st.f_blocks * st.f_frsize * share)


# One rule per setting: a function from what a layer gives (a string from the environment or
# the command line, a typed TOML value) to the setting's value; it raises InvalidArgument with
# the reason, and load_settings names the setting and where the value came from.
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
    items = v if isinstance(v, list) else [x for x in _string(v).split(",") if x.strip()]
    if not items:
        raise InvalidArgument("empty node list")
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


def _share(memory: str) -> float | None:
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
    if _share(s) is None:
        _to_size(s)
    return s


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "listen": lambda v: _to_address(v, min_port=0),
    "nodes": _to_nodes,
    "shm_dir": lambda v: _to_path(v, absolute=True),
    "memory": _to_memory,
    "segment_size": lambda v: _to_size(v, minimum=4096),
    "token_file": _to_path,
    "verify_on_start": _to_bool,
    "lease_ttl": lambda v: _to_float(v, above=True),
    "timeout": lambda v: _to_float(v, above=True),
    "log_level": lambda v: _to_choice(v, LOG_LEVELS).upper(),
    "transport": lambda v: _to_choice(v, ("auto", "tcp", "rdma")),
    "rdma_device": _text,
    "rdma_gid_index": lambda v: _to_int(v, -1, 65535),
    "spill_dir": lambda v: _to_optional_path(v, absolute=True),
    "spill": lambda v: str(_to_size(v)),
    "source_check_interval": _to_float,
    "group": _text,
    "access": lambda v: _to_choice(v, ("source", "open")),
    "source_roots": _to_paths,
    "socket": _to_socket,
    "tls_cert": _to_optional_path,
    "tls_key": _to_optional_path,
    "tls_ca": _to_optional_path,
    "fuse_workers": lambda v: _to_int(v, 0, MAX_PROCESSES),
    "fuse_read_ahead": _to_size,
    "decode_workers": lambda v: _to_int(v, 0, MAX_PROCESSES),
    "etcd": _to_endpoints,
    "cluster": lambda v: validate_cluster(_string(v)),
    "member_ttl": lambda v: _to_float(v, above=True),
    "heal_after": _to_float,
    "metrics_listen": _to_listen_text,
}
# Settings that only work together: TLS's three files; the spill folder and its budget.
_TOGETHER = (("tls_cert", "tls_key", "tls_ca"), ("spill_dir", "spill"))

ENV_PREFIX = "KSPEEDFS_"
_MAX_CONFIG_BYTES = 1 << 20


def load_settings(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    *,
    cli_origin: str = "command line",
    cli_names: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings from the TOML file, then the environment, then CLI values (not None),
    checking each value once. A bad one is an InvalidArgument naming the setting and where it
    came from: the file, the variable, or the caller's own name for it (`cli_names`, default
    --the-setting; "config" names where `config_file` came from)."""
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    names = cli_names or {}
    settings = Settings()

    if config_file:
        path, named_by = Path(config_file), names.get("config", "--config")
    elif env.get(ENV_PREFIX + "CONFIG"):
        path, named_by = Path(env[ENV_PREFIX + "CONFIG"]), ENV_PREFIX + "CONFIG"
    else:
        path, named_by = DEFAULT_CONFIG_FILE, ""
    file_values = _read_toml(path, named_by)
    layers: list[tuple[Callable[[str], str], Mapping[str, Any]]] = [
        (lambda key: f"config file {path}", file_values),
        (
            lambda key: f"environment ({ENV_PREFIX}{key.upper()})",
            {
                key: env[ENV_PREFIX + key.upper()]
                for key in _CONVERTERS
                if ENV_PREFIX + key.upper() in env
            },
        ),
        (
            lambda key: f"{cli_origin} ({names.get(key) or '--' + key.replace('_', '-')})",
            cli,
        ),
    ]
    origins: dict[str, str] = {}
    for where, values in layers:
        for key, value in values.items():
            if key not in _CONVERTERS:
                raise InvalidArgument(f"unknown setting {key!r} in the {where(key)}")
            try:
                setattr(settings, key, _CONVERTERS[key](value))
            except InvalidArgument as e:
                raise InvalidArgument(f"{key} from the {where(key)}: {e}") from None
            origins[key] = where(key)
    for group in _TOGETHER:
        given = [key for key in group if getattr(settings, key) not in (None, "0")]
        if given and len(given) < len(group):
            which = ", ".join(f"{key} from the {origins[key]}" for key in given)
            raise InvalidArgument(f"{', '.join(group)} go together; given only {which}")
    return settings


def _read_toml(path: Path, named_by: str) -> dict[str, Any]:
    """The file's settings, sections flattened. `named_by`: who named the file ("" for the
    default file, which may be missing)."""
    where = f"config file {path}" + (f" (from {named_by})" if named_by else "")
    try:
        # O_NONBLOCK: a FIFO named as the config file must not hang the command.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if not named_by:
            return {}
        raise NotFound(f"{where} not found") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise InvalidArgument(f"cannot open the {where}: {getattr(e, 'strerror', e)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidArgument(f"the {where} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise InvalidArgument(f"cannot read the {where}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_CONFIG_BYTES:
        raise InvalidArgument(f"the {where} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        values = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"the {where} is not UTF-8 (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"the {where}: {e}") from None
    # Sections group settings for readers; keys are unique across them.
    flat: dict[str, Any] = {}
    for section, value in values.items():
        items = value.items() if isinstance(value, dict) else [(section, value)]
        for key, item in items:
            key = key.replace("-", "_")
            if key in flat:
                raise InvalidArgument(f"setting {key!r} is given twice in the {where}")
            flat[key] = item
    return flat
