"""The ops NodeServer itself answers: liveness and what the node holds."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.contract.decoded import VariantProgress
from kspeedfs.format.contract.pieces import PIECE, BlobPiece
from kspeedfs.format.contract.status import (
    CacheStatus,
    ControlStatus,
    DiskTierStatus,
    IntegrityStatus,
    LocalSocketStatus,
    QueuedPreload,
    RdmaStatus,
)
from kspeedfs.format.names import validate_name


@dataclasses.dataclass(frozen=True)
class Ping(Request["Pong"]):
    OP = "ping"


@dataclasses.dataclass(frozen=True)
class Pong(Wire):
    node: str
    version: int


@dataclasses.dataclass(frozen=True)
class ManifestReq(Request["ManifestPiece"]):
    """A piece of a published dataset's manifest (a client or member that holds none of it
    fetches the whole file piece by piece, with kspeedfs.format.contract.pieces.fetch_all)."""

    OP = "manifest"
    name: str = dataset_name()
    offset: int = at_least(0, default=0)
    length: int = at_least(0, default=PIECE)  # at most this many bytes (and PIECE)
    uuid: str = ""  # when set: that instance, else StaleDataset


@dataclasses.dataclass(frozen=True)
class ManifestPiece(Wire):
    name: str
    uuid: str
    piece: BlobPiece


@dataclasses.dataclass(frozen=True)
class Status(Request["NodeStatus"]):
    """What the node holds and does: budget, datasets, connections, subsystems."""

    OP = "status"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldSegments(Wire):
    """The segments of a dataset this node holds, of the `segments` in the whole dataset."""

    held: list[int] = at_least(0)
    segments: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeStatus(Wire):
    """What a node holds and does. The figures of each subsystem (disk tier, integrity, local
    socket, RDMA, read-through cache, control plane, peers) are that subsystem's own
    `status()` (contract/status.py)."""

    node: str
    pid: int
    shm_dir: str
    budget: int
    used: int
    disk_tier: DiskTierStatus | None  # None: the node has no disk tier
    integrity: IntegrityStatus
    datasets: int = at_least(0)
    loading: list[str]  # the names being loaded
    # The preloads waiting for room (`preload --queue`), first first: position, name, source,
    # bytes, waiting_since, short_by (the head's: memory still to free), reason.
    queue: list[QueuedPreload] = dataclasses.field(default_factory=list)
    segments: int = at_least(0)  # segment files on this node, both tiers
    uptime: float
    stats: dict[str, int]
    local_socket: LocalSocketStatus
    transport: str
    rdma: RdmaStatus
    leases: int = at_least(0)
    cache: CacheStatus
    loaded: dict[str, int]  # what this node loaded from sources
    decoded: dict[str, dict[str, VariantProgress]]  # dataset -> size -> its variant here
    members: list[str]
    control: ControlStatus | None  # None: no control plane (a static node list)
    peers: dict[str, int]
    held: dict[str, HeldSegments]


@dataclasses.dataclass(frozen=True)
class List(Request["DatasetListing"]):
    """Every dataset the node holds or is loading."""

    OP = "list"


# The states of a dataset's load, in the order they come (node.loads.STATES); a published
# dataset is "ready".
DatasetState = Literal["scanning", "receiving", "loading", "staged", "ready", "failed"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetEntry(Wire):
    """A published dataset in `list`: its record on this node (node.store.DatasetRecord), a
    finished load's progress, its leases and decoded variants here, and, when the catalog
    says, where its segments are placed now (`placed`, `lost`: absent otherwise)."""

    name: str
    uuid: str
    source: str
    lifetime: str
    replicas: int
    files: int = at_least(0)
    bytes: int = at_least(0)
    stored: int = at_least(0)  # bytes of memory it takes here
    created: float
    path: str
    segments: int = at_least(0)
    held: list[int] = at_least(0)
    members: list[str]  # the nodes it was placed over at its load
    # Absent from the listings of nodes older than the disk tier and the caps:
    disk: list[int] = at_least(0, factory=list)  # held segments on the disk tier
    disk_stored: int = at_least(0, default=0)
    max_memory: int = at_least(0, default=0)
    max_disk: int = at_least(0, default=0)
    state: DatasetState = "ready"
    files_total: int = at_least(0)
    bytes_total: int = at_least(0)
    files_done: int = at_least(0)
    bytes_done: int = at_least(0)
    elapsed: float = 0.0
    error: str = ""
    leases: int = at_least(0)
    # size -> its variant here (absent from the listings of nodes older than the variants)
    decoded: dict[str, VariantProgress] = dataclasses.field(default_factory=dict)
    placed: list[str] | None = None
    lost: list[str] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if self.placed is None:
            del wire["placed"]
        if self.lost is None:
            del wire["lost"]
        return wire


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadingEntry(Wire):
    """A dataset in `list` that is not published yet: its load's progress (a failed one is
    listed for a while, with why; `error_kind` is the error's class)."""

    name: str
    state: DatasetState
    source: str
    files_total: int = at_least(0)
    bytes_total: int = at_least(0)
    files_done: int = at_least(0)
    bytes_done: int = at_least(0)
    elapsed: float
    error: str = ""
    error_kind: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetListing(Wire):
    """Every dataset a node holds or is loading, by name."""

    node: str
    datasets: list[DatasetEntry | LoadingEntry]

    def ready(self) -> dict[str, DatasetEntry]:
        """The published datasets, by name."""
        return {
            d.name: d for d in self.datasets if isinstance(d, DatasetEntry) and d.state == "ready"
        }


@dataclasses.dataclass(frozen=True)
class Unload(Request["Unloaded"]):
    """Unload a dataset on every member (or cancel its load, or forget its failure)."""

    OP = "unload"
    name: str = dataset_name()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unloaded(Wire):
    """What an unload did: "unloaded" (`bytes` freed, on this member for unload_local),
    "absent" (unload_local: this member held no part of that instance), "cancelled" (a load
    under way was stopped) or "forgotten" (a failed load's record dropped)."""

    name: str
    state: Literal["unloaded", "absent", "cancelled", "forgotten"]
    bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True)
class UnloadLocal(Request["Unloaded"]):
    """Unload this member's part of a dataset (of instance `uuid` only, when given)."""

    OP = "unload_local"
    name: str = dataset_name()
    uuid: str = ""


@dataclasses.dataclass(frozen=True)
class Shutdown(Request["Stopping"]):
    OP = "shutdown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stopping(Wire):
    """The node that was asked to shut down, stopping."""

    node: str
    state: Literal["stopping"] = "stopping"


def _name_or_all(value: str) -> str:
    return validate_name(value) if value else value


@dataclasses.dataclass(frozen=True)
class Rebalance(Request["Rebalanced"]):
    """Control plane: place one dataset (or every one, with no name) over the live members."""

    OP = "rebalance"
    name: str = checked(_name_or_all, default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rebalanced(Wire):
    """The datasets placed again, and the members they were placed over."""

    datasets: list[str]
    members: list[str]
