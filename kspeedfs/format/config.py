"""The one typed settings object, and the one place that loads and checks every setting.

Precedence CLI > environment > TOML file > default. Every value is checked once, at load, by
its setting's rule (kspeedfs/format/setting_rules.py); a bad one is a one-line InvalidArgument
naming the setting and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kspeedfs.format.auth import UserLogin
from kspeedfs.format.discovery import pod_host_node
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.setting_rules import RULES, TOGETHER, memory_share
from kspeedfs.format.units import Address, parse_size

DEFAULT_PORT = 7420
DEFAULT_CONFIG_FILE = Path("/etc/kspeedfs/kspeedfs.toml")


def default_token_file() -> Path:
    """`$XDG_CONFIG_HOME/kspeedfs/token`, else `~/.config/kspeedfs/token`."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kspeedfs" / "token"


@dataclasses.dataclass
class Settings:
    """Every setting, by group (docs/settings.md is generated from these lines, the fields and
    their rules: `python -m kspeedfs.docgen --write`).

    Node:
        listen: where `kspeedfs node` serves.
        shm_dir: the tmpfs folder that holds the segments; the node's own (see security.md).
        memory: the budget for cached data: a size, or a share of the filesystem that holds
            `shm_dir`; a preload that does not fit is refused before anything is copied.
        segment_size: the unit of placement, replication, transfer and eviction.
        verify_on_start: checksum every segment when a node starts again (off: `kspeedfs node
            --no-verify`); a damaged one is quarantined and fetched again, its dataset kept.
        scrub_rate: bytes per second the node re-reads its disk-tier segments at, checking
            each against the manifest's checksum (0: no scrubbing; tiers.md).
        lease_ttl: seconds before the lease of a job that stopped renewing it (a crash)
            expires; a dataset the job loaded is unloaded with its last lease.
        log_level: the node's log level (`kspeedfs -v node`: debug).
    Clients:
        nodes: the cluster's nodes (with etcd: the live members, unless given): HOST:PORT, or
            dns:NAME:PORT for every address NAME resolves to (a headless Service); in a
            Kubernetes pod, unset: the node on the pod's host (HOST_IP).
        dns_refresh: seconds between lookups of the dns: names of `nodes` by nodes and
            long-lived clients, so that peers added or gone are followed (0: at start only).
        health_table: the file in which every reader of this machine shares what it saw of
            the nodes (down, late, how fast; client/health.py); unset: the user's own
            /dev/shm/kspeedfs-health.UID. Readers that should not share it (two clusters
            reusing addresses, a test) each name their own.
        timeout: seconds to wait for a node.
        token_file: the token a client proves (and the admin token a node derives every
            role's token from); a one-machine node creates it on first start.
        user: log in as this user (`kspeedfs user add`) instead of with the token.
        password: that user's password ("": asked at a prompt).
    Security (security.md):
        users_file: the node's users and their scrypt keys ("": `users` beside `token_file`).
        group: the group that may map segments directly ("": the node's own group).
        access: who reads what: `source` (the source's modes and owners, on the mount and
            for fd passing) or `open` (every token holder, everyone on the machine).
        source_roots: the folders a `job` token may preload from.
        socket: the node's Unix socket for fd passing ("": `SHM_DIR.run/fd.sock`).
        node_user: the user a node runs as when not root: clients trust only root, their
            own uid and this one to serve the socket.
        tls_cert: this end's certificate for mutual TLS on every TCP connection (and etcd).
        tls_key: its private key.
        tls_ca: the cluster's CA certificate, which the other end's certificate must come from.
    Mounts (mounts.md):
        fuse_workers: processes serving a mount (0: one per CPU, at most 8; `kspeedfs mount
            --workers`).
        fuse_read_ahead: the read-ahead set on a mount, so that a typical file is one READ
            (0: the kernel's default, 128 KiB; needs root).
        fuse_poll_us: how long (microseconds) each serving process of a mount polls for the
            next request of a reader that asks again within it, yielding its CPU between
            polls (0: never): on a VM whose idle CPUs halt, a tight loop of opens through the
            mount gets faster, and computing work on the polling CPUs slower (mounts.md).
        fuse_uring: serve a mount's requests through FUSE over io_uring (Linux 6.14+), a
            ring per CPU in each serving process, where the kernel allows it; else through
            /dev/fuse, saying why in the log (mounts.md: who sets enable_uring, and what a
            killed serving process means).
    Read-through datasets (readthrough.md):
        spill_dir: a disk folder for read-through segments evicted from memory and for the
            disk tier of preloads (tiers.md) ("": none); a folder of the node's own, checked as
            the shm folder is (security.md).
        spill: the spill folder's budget, the disk tier's and the spill's together.
        source_check_interval: seconds between checks of sources for changes (0: off).
        eviction: which read-through segment leaves memory: `stable` (a dataset keeps what it
            admitted; a miss over its share lands on the disk tier where it has room, else it
            is read from the source, not kept), `plan` (as stable, but where a sampler sent
            the readers' order, its segment with the fewest uses ahead gives way to a miss
            with more) or `lru`.
    Decoded variants (decoded.md):
        decode_workers: processes a variant's fill decodes with (0: one per CPU); fewer
            leaves CPUs to the training jobs on the node.
    Transport (rdma.md):
        transport: `auto` (RDMA where both ends can, else TCP), `tcp` or `rdma`.
        rdma_device: the RDMA device ("": the first with an active port).
        rdma_gid_index: the GID index (-1: RoCE v2 with an IPv4 address first).
    Cluster with etcd (cluster.md):
        etcd: etcd endpoints for membership and the catalog ([]: the static `nodes` list).
        cluster: this cluster's key prefix in etcd.
        member_ttl: seconds of the membership lease a node renews.
        heal_after: seconds a member stays down before its copies are made elsewhere.
        metrics_listen: HOST:PORT of the node's Prometheus `/metrics` ("": off); a mount serves
            its own only with `kspeedfs mount --metrics-listen`, whatever this setting says.
    """

    listen: Address = Address("127.0.0.1", DEFAULT_PORT)
    nodes: list[Address] = dataclasses.field(
        default_factory=lambda: [Address("127.0.0.1", DEFAULT_PORT)]
    )
    dns_refresh: float = 10.0
    health_table: Path | None = None
    shm_dir: Path = Path("/dev/shm/kspeedfs")
    # Budget for cached data: a size, or a percentage of the shm filesystem.
    memory: str = "50%"
    segment_size: int = 64 * 1024 * 1024
    token_file: Path = dataclasses.field(default_factory=default_token_file)
    # Users with passwords (`kspeedfs user add`): the node's file of scrypt keys (None: `users`
    # beside the token file), and a client's user and password, used instead of the token.
    users_file: Path | None = None
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)
    verify_on_start: bool = True
    scrub_rate: str = "64MiB"  # bytes/s of disk-tier segments re-read and checked; "0": off
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
    eviction: str = "stable"  # "stable", "plan" or "lru" (node/readthrough/policy.py)
    # Who may read what (docs/security.md): the group that may map segments directly ("" =
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
    # After a request that came within this many microseconds of the one before, the first
    # serving process polls this long for the next before it sleeps (0 = never).
    fuse_poll_us: int = 0
    # FUSE over io_uring where the kernel allows it (off: /dev/fuse only; mounts.md).
    fuse_uring: bool = False
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

    def users_path(self) -> Path:
        return self.users_file or self.token_file.with_name("users")

    def credential(self) -> Path | UserLogin:
        """What a client proves to nodes: its user and password when `user` is set, else the
        token in `token_file`."""
        if self.user:
            return UserLogin(self.user, self.password)
        return self.token_file

    def socket_path(self) -> Path:
        """The node's local socket: `socket`, else `SHM_DIR.run/fd.sock`, in a folder of the
        node's beside the shm folder (the shm folder itself is closed to the readers who need
        the socket; /dev/shm is open to everyone to bind in)."""
        return self.socket or self.shm_dir.with_name(self.shm_dir.name + ".run") / "fd.sock"

    def tls(self) -> bool:
        """Mutual TLS is on: all three of cert, key and CA are set (some but not all: refused
        at load; here too, for Settings built in code)."""
        given = [p is not None for p in (self.tls_cert, self.tls_key, self.tls_ca)]
        if any(given) and not all(given):
            raise InvalidArgument("tls_cert, tls_key and tls_ca go together")
        return all(given)

    def memory_budget(self) -> int:
        """The budget in bytes; a share is taken of the filesystem that holds shm_dir."""
        share = memory_share(self.memory)
        if share is None:
            return parse_size(self.memory)
        probe = self.shm_dir
        while not probe.exists():
            probe = probe.parent
        st = os.statvfs(probe)
        return int(st.f_blocks * st.f_frsize * share)


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
                for key in RULES
                if ENV_PREFIX + key.upper() in env
            },
        ),
        (
            lambda key: f"{cli_origin} ({names.get(key) or '--' + key.replace('_', '-')})",
            cli,
        ),
    ]
    origins: dict[str, str] = {}
    for i, (where, values) in enumerate(layers):
        for key, value in values.items():
            if key not in RULES:
                raise InvalidArgument(f"unknown setting {key!r} in the {where(key)}")
            if key == "nodes" and any(key in later for _, later in layers[i + 1 :]):
                continue  # overridden: its dns: names are not looked up (they may not resolve)
            try:
                setattr(settings, key, RULES[key](value))
            except InvalidArgument as e:
                raise InvalidArgument(f"{key} from the {where(key)}: {e}") from None
            origins[key] = where(key)
    if "nodes" not in origins:  # in a pod, no nodes setting: the node on the pod's host
        host_node = pod_host_node(env)
        if host_node is not None:
            settings.nodes = [host_node]
    for group in TOGETHER:
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
