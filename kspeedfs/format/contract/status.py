"""The parts of a node's `status` answer, one per subsystem: each subsystem's own `status()`."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Wire, at_least


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskTierStatus(Wire):
    """The disk tier: its folder, budget and use, and the segments promoted to memory."""

    dir: str
    budget: int = at_least(0)
    used: int = at_least(0)
    promoted: dict[str, int]  # segments and bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntegrityStatus(Wire):
    """Damaged segments found and repaired (node/scrub.py), and the scrubber's work."""

    damaged: int = at_least(0, default=0)  # segments found damaged (and quarantined)
    repaired: int = at_least(0, default=0)  # of those, fetched again and sound
    repair_failed: int = at_least(0, default=0)  # no replica and no source could give them
    from_source: int = at_least(0, default=0)  # repaired from the source (no replica had it)
    reported: int = at_least(0, default=0)  # segments readers reported (checked again here)
    scrubbed_bytes: int = at_least(0, default=0)
    scrub_cpu_seconds: float = at_least(0, default=0.0)  # CPU of the scrubber's reads, hashes
    passes: int = at_least(0, default=0)  # complete passes over the disk tier
    scrub_rate: int = at_least(0, default=0)  # bytes/s (0: no scrubbing)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSocketStatus(Wire):
    """The local socket that passes segments' descriptors (node/fdserver.py)."""

    path: str
    attached: int = at_least(0, default=0)
    refused: int = at_least(0, default=0)
    connections: int = at_least(0, default=0)  # open now
    busy: int = at_least(0, default=0)  # refused at the limit of connections
    idle_closed: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaStatus(Wire):
    """The node's RDMA service: its device, or why it has none, and what is registered."""

    enabled: bool
    reason: str = ""  # why not enabled
    device: str = ""
    port: int = 0
    gid: str = ""
    gid_index: int = 0
    peers: int = at_least(0, default=0)  # queue pairs of connected clients
    datasets: int = at_least(0, default=0)  # registered segment tables
    regions: int = at_least(0, default=0)
    bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetCacheStatus(Wire):
    """One dataset in the node's cache; a read-through one's residency and counters too."""

    lifetime: str
    segments: int = at_least(0)
    in_memory: int = at_least(0)
    memory_bytes: int = at_least(0)
    disk_bytes: int = at_least(0, default=0)
    stale: int = at_least(0, default=0)  # files changed in the source since the load
    max_memory: int = at_least(0, default=0)  # caps (0: none)
    max_disk: int = at_least(0, default=0)
    # A read-through instance's figures, when `counted` (0 for any other dataset):
    counted: bool = False
    resident_bytes: int = at_least(0, default=0)
    on_disk: int = at_least(0, default=0)
    on_spill: int = at_least(0, default=0)
    spill_bytes: int = at_least(0, default=0)
    min_memory: int = at_least(0, default=0)  # its floor in the shares of memory
    weight: int = at_least(0, default=0)  # its weight in them
    share: int = at_least(0, default=0)  # its share of memory now (a capped one's: its cap)
    plan: dict[str, list[int]] | None = None  # per reader, (where it is, uses in all)
    hits: int = at_least(0, default=0)
    misses: int = at_least(0, default=0)
    evictions: int = at_least(0, default=0)
    fills_source: int = at_least(0, default=0)
    fills_spill: int = at_least(0, default=0)
    fills_disk: int = at_least(0, default=0)
    promoted: int = at_least(0, default=0)
    disk_evictions: int = at_least(0, default=0)
    spilled: int = at_least(0, default=0)
    source_reads: int = at_least(0, default=0)
    source_bytes: int = at_least(0, default=0)
    bypassed: int = at_least(0, default=0)
    disk_hits: int = at_least(0, default=0)
    memory_hits: int = at_least(0, default=0)
    memory_misses: int = at_least(0, default=0)
    disk_misses: int = at_least(0, default=0)
    spill_hits: int = at_least(0, default=0)
    spill_misses: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpillStatus(Wire):
    """The spill folder of evicted read-through segments."""

    dir: str
    used: int = at_least(0)
    budget: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheStatus(Wire):
    """The node's cache (node/readthrough): each dataset, the spill folder, the policy."""

    datasets: dict[str, DatasetCacheStatus]
    spill: SpillStatus | None  # None: no disk tier to spill to
    stats: dict[str, int]
    policy: str
    evictions_by_policy: dict[str, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealStatus(Wire):
    """What healing copied (node/control/heal.py)."""

    segments: int = at_least(0, default=0)
    bytes: int = at_least(0, default=0)
    failed: int = at_least(0, default=0)
    pending: int = at_least(0, default=0)
    seconds: float = at_least(0, default=0.0)
    dropped: int = at_least(0, default=0)  # segments given up after a rebalance moved them
    dropped_bytes: int = at_least(0, default=0)
    from_source: int = at_least(0, default=0)  # copies no live member could give


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlStatus(Wire):
    """The etcd control plane as this node sees it."""

    etcd: list[str]
    cluster: str
    reachable: bool
    registered: bool
    live: list[str]
    heal: HealStatus
    under_replicated: dict[str, int]  # dataset -> segments short of their replicas


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueuedPreload(Wire):
    """A preload waiting in the coordinator's queue (node/preload_queue.py) for memory."""

    position: int  # 1: the head
    name: str
    source: str
    bytes: int = at_least(0)
    waiting_since: float
    short_by: int | None  # the head's: memory this node needs free before it fits
    reason: str
