"""The one typed settings object; precedence CLI > environment > TOML file > default."""

from __future__ import annotations

import dataclasses
import os
import pwd
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.units import Address, parse_address, parse_address_list, parse_size

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
    # preload from, the node's Unix socket for fd passing ("" = in a folder of the node's next
    # to shm_dir), the user a node runs as when not root (clients trust only root, their own
    # uid and it to serve the socket), and mutual TLS on every TCP connection when all three
    # files are set.
    group: str = ""
    access: str = "source"
    source_roots: list[Path] = dataclasses.field(default_factory=list)
    socket: Path | None = None
    node_user: str = ""
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
        """The node's local socket: `socket`, else `SHM_DIR.run/fd.sock`, in a folder of the
        node's beside the shm folder (the shm folder itself is closed to the readers who need
        the socket; /dev/shm is open to everyone to bind in)."""
        return self.socket or self.shm_dir.with_name(self.shm_dir.name + ".run") / "fd.sock"

    def tls(self) -> bool:
        """Mutual TLS is on: all three of cert, key and CA are set (some but not all: refused)."""
        given = [p is not None for p in (self.tls_cert, self.tls_key, self.tls_ca)]
        if any(given) and not all(given):
            raise InvalidArgument("tls_cert, tls_key and tls_ca go together")
        return all(given)

    def memory_budget(self) -> int:
        """The budget in bytes; a percentage is taken of the filesystem that holds shm_dir."""
        if self.memory.strip().endswith("%"):
            try:
                pct = float(self.memory.strip()[:-1])
            except ValueError:
                raise InvalidArgument(f"bad memory budget {self.memory!r}") from None
            probe = self.shm_dir
            while not probe.exists():
                probe = probe.parent
            st = os.statvfs(probe)
            return int(st.f_blocks * st.f_frsize * pct / 100)
        return parse_size(self.memory)


# Each setting: how to convert a string (env/CLI) or a TOML value to its type.
def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"not a boolean: {v!r}")


def _to_nodes(v: Any) -> list[Address]:
    if isinstance(v, list):
        return [parse_address(str(x)) for x in v]
    return parse_address_list(str(v))


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise InvalidArgument(f"not a number: {v!r}") from None


def _to_choice(v: Any, choices: tuple[str, ...]) -> str:
    s = str(v).strip().lower()
    if s not in choices:
        raise InvalidArgument(f"{v!r} is not one of {', '.join(choices)}")
    return s


def _to_int(v: Any, minimum: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise InvalidArgument(f"not an integer: {v!r}") from None
    if n < minimum:
        raise InvalidArgument(f"{n} is below the minimum {minimum}")
    return n


def _to_optional_path(v: Any) -> Path | None:
    return Path(os.path.expanduser(str(v))) if str(v) else None


def _to_user(v: Any) -> str:
    """A user name or uid, checked now (a name is resolved where it is used)."""
    s = str(v).strip()
    if s and not s.isdigit():
        try:
            pwd.getpwnam(s)
        except KeyError:
            raise InvalidArgument(f"no user named {s!r} on this machine") from None
    return s


def _to_paths(v: Any) -> list[Path]:
    items = v if isinstance(v, list) else [x for x in str(v).split(",") if x.strip()]
    paths = [Path(os.path.expanduser(str(x).strip())) for x in items]
    for p in paths:
        if not p.is_absolute():
            raise InvalidArgument(f"source root must be an absolute path: {p}")
    return paths


def _to_endpoints(v: Any) -> list[str]:
    """etcd endpoints: a list or a comma-separated string; scheme http:// when none is given."""
    items = v if isinstance(v, list) else [x for x in str(v).split(",") if x.strip()]
    out = []
    for item in (str(x).strip() for x in items):
        url = item if "://" in item else f"http://{item}"
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"etcd endpoint must be http:// or https://: {item!r}")
        out.append(url.rstrip("/"))
    return out


def validate_cluster(name: str) -> str:
    """A cluster prefix is one path-safe word: it becomes part of every etcd key."""
    if not name or not all(c.isalnum() or c in "._-" for c in name) or len(name) > 64:
        raise InvalidArgument(f"bad cluster name {name!r}: letters, digits, '.', '_', '-'")
    return name


def _to_memory(v: Any) -> str:
    s = str(v)
    if not s.strip().endswith("%"):
        parse_size(s)  # validate now, not at first use
    return s


_CONVERTERS: dict[str, Any] = {
    "listen": lambda v: parse_address(str(v)),
    "nodes": _to_nodes,
    "shm_dir": lambda v: Path(str(v)),
    "memory": _to_memory,
    "segment_size": lambda v: parse_size(v if isinstance(v, int) else str(v)),
    "token_file": lambda v: Path(os.path.expanduser(str(v))),
    "verify_on_start": _to_bool,
    "lease_ttl": _to_float,
    "timeout": _to_float,
    "log_level": lambda v: str(v).upper(),
    "transport": lambda v: _to_choice(v, ("auto", "tcp", "rdma")),
    "rdma_device": str,
    "rdma_gid_index": lambda v: _to_int(v, -1),
    "spill_dir": lambda v: Path(os.path.expanduser(str(v))) if str(v) else None,
    "spill": lambda v: str(parse_size(v if isinstance(v, int) else str(v))),
    "source_check_interval": _to_float,
    "group": str,
    "access": lambda v: _to_choice(v, ("source", "open")),
    "source_roots": _to_paths,
    "socket": _to_optional_path,
    "node_user": _to_user,
    "tls_cert": _to_optional_path,
    "tls_key": _to_optional_path,
    "tls_ca": _to_optional_path,
    "fuse_workers": lambda v: _to_int(v, 0),
    "fuse_read_ahead": lambda v: parse_size(v if isinstance(v, int) else str(v)),
    "decode_workers": lambda v: _to_int(v, 0),
    "etcd": _to_endpoints,
    "cluster": lambda v: validate_cluster(str(v)),
    "member_ttl": _to_float,
    "heal_after": _to_float,
    "metrics_listen": str,
}

ENV_PREFIX = "KSPEEDFS_"


def load_settings(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Build Settings from the TOML file, then the environment, then CLI values (not None)."""
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    settings = Settings()

    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        file_values = _read_toml(Path(path), required=True)
    else:
        file_values = _read_toml(DEFAULT_CONFIG_FILE, required=False)
    layers = [
        ("config file", file_values),
        (
            "environment",
            {
                key: env[ENV_PREFIX + key.upper()]
                for key in _CONVERTERS
                if ENV_PREFIX + key.upper() in env
            },
        ),
        ("command line", cli),
    ]
    for origin, values in layers:
        for key, value in values.items():
            if key not in _CONVERTERS:
                raise InvalidArgument(f"unknown setting {key!r} in {origin}")
            try:
                setattr(settings, key, _CONVERTERS[key](value))
            except InvalidArgument as e:
                raise InvalidArgument(f"{key} from {origin}: {e}") from None
    if settings.segment_size < 4096:
        raise InvalidArgument("segment_size must be at least 4096 bytes")
    return settings


def _read_toml(path: Path, required: bool) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise NotFound(f"config file not found: {path}") from None
        return {}
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"config file {path}: {e}") from None
    # Sections group settings for readers; keys are unique across them.
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat
