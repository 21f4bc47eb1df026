"""What `status` shows of the datasets in memory: lifetimes, residency, staleness, and the
read-through counters, caps, disk-tier and spill use of each instance, with hits and misses
by tier."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kspeedfs.format.contract.status import CacheStatus, DatasetCacheStatus, SpillStatus
from kspeedfs.node.readthrough.dataset import Instances
from kspeedfs.node.readthrough.disktier import DiskTier
from kspeedfs.node.store import SegmentStore

COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "fills_source",
    "fills_spill",
    "fills_disk",
    "promoted",
    "disk_evictions",
    "spilled",
    "source_reads",
    "source_bytes",
    "bypassed",
)


def cache_status(
    store: SegmentStore, instances: Instances, disk: DiskTier, shares: Mapping[str, int]
) -> CacheStatus:
    datasets: dict[str, DatasetCacheStatus] = {}
    for record in store.datasets.values():
        uid, changed = instances.changed.get(record.name, ("", 0))
        d = DatasetCacheStatus(
            lifetime=record.lifetime,
            segments=record.segments,
            in_memory=len(record.held),
            memory_bytes=record.stored,
            disk_bytes=record.disk_stored,  # a preload's disk tier (a read-through one's below)
            stale=changed if uid == record.uuid else 0,
            max_memory=record.max_memory,  # a preload's caps (a read-through one's below)
            max_disk=record.max_disk,
        )
        ds = instances.by_name.get(record.name)
        if ds is not None and ds.uuid == record.uuid:
            plan = instances.policy.plan_position(ds.name)
            figures: dict[str, Any] = {k: ds.stats[k] for k in COUNTERS} | tiers(ds.stats)
            d = dataclasses.replace(
                d,
                counted=True,
                resident_bytes=ds.segment_bytes,
                on_disk=len(ds.on_disk),
                disk_bytes=ds.disk_bytes,
                on_spill=len(ds.places.spilled),
                spill_bytes=ds.places.spilled_bytes(),
                plan=None if plan is None else {k: list(v) for k, v in plan.items()},
                max_memory=ds.max_memory,
                max_disk=ds.max_disk,
                min_memory=ds.min_memory,
                weight=ds.weight,
                share=shares.get(ds.name, ds.max_memory),  # a capped one's share is its cap
                **figures,
            )
        datasets[record.name] = d
    spill = None
    if disk.root is not None:
        spill = SpillStatus(dir=str(disk.root), used=disk.spilled_bytes(), budget=disk.spill_room())
    return CacheStatus(
        datasets=datasets,
        spill=spill,
        stats=dict(instances.stats),
        policy=instances.policy.name,
        evictions_by_policy=dict(instances.evictions_by),
    )


def tiers(stats: Counter[str]) -> dict[str, int]:
    """Hits and misses by tier: memory hits are reads readers report (through maps) of
    segments in memory; its misses are the fills and the misses not kept; the disk tier hits
    on the reported reads of its segments and misses on the fills it takes (a miss memory
    does not keep); the spill tier is asked on every fill and hits when it holds the segment;
    a miss of all is read from the source."""
    memory_misses = stats["misses"] + stats["bypassed"]
    return {
        "memory_hits": stats["hits"],
        "memory_misses": memory_misses,
        "disk_hits": stats["disk_hits"],
        "disk_misses": stats["fills_disk"],
        "spill_hits": stats["fills_spill"],
        "spill_misses": memory_misses - stats["fills_spill"],
    }
