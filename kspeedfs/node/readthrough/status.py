"""What `status` shows of the datasets in memory: lifetimes, residency, staleness, and the
read-through counters and spill use of each instance."""

from __future__ import annotations

from typing import Any

from kspeedfs.node.readthrough.dataset import Instances
from kspeedfs.node.spill import SpillArea
from kspeedfs.node.store import SegmentStore

COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "fills_source",
    "fills_spill",
    "spilled",
    "source_reads",
    "source_bytes",
)


def cache_status(
    store: SegmentStore, instances: Instances, spill: SpillArea | None
) -> dict[str, Any]:
    datasets: dict[str, Any] = {}
    for record in store.datasets.values():
        uid, changed = instances.changed.get(record.name, ("", 0))
        d: dict[str, Any] = {
            "lifetime": record.lifetime,
            "segments": record.segments,
            "in_memory": len(record.held),
            "memory_bytes": record.stored,
            "stale": changed if uid == record.uuid else 0,
        }
        ds = instances.by_name.get(record.name)
        if ds is not None and ds.uuid == record.uuid:
            d.update(
                on_spill=spill.count(ds.spill_key) if spill is not None else 0,
                spill_bytes=spill.bytes_of(ds.spill_key) if spill is not None else 0,
                **{k: ds.stats[k] for k in COUNTERS},
            )
        datasets[record.name] = d
    spill_info: dict[str, Any] | None = None
    if spill is not None:
        spill_info = {"dir": str(spill.root), "used": spill.used, "budget": spill.room()}
    return {"datasets": datasets, "spill": spill_info, "stats": dict(instances.stats)}
