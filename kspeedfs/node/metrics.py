"""Prometheus exposition of a node (`metrics_listen`): figures read from the node at scrape time,
and the latency histograms the node's parts keep (fills, heal copies)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import Histogram, start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kspeedfs.format.contract.jobs import JobsAnswer
from kspeedfs.format.contract.status import (
    CacheStatus,
    ControlStatus,
    DiskTierStatus,
    IntegrityStatus,
)
from kspeedfs.format.units import parse_address

log = logging.getLogger(__name__)

# Seconds: a segment of tens of MiB filled or copied from tmpfs, a disk, NFS or S3.
FILL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def segment_seconds(name: str, doc: str, origins: Sequence[str]) -> Histogram:
    """Seconds to get one segment, by where it came from: kept by the part that times it and
    registered by this module's exposition; every origin is shown (at 0) before the first."""
    histogram = Histogram(name, doc, ["origin"], buckets=FILL_BUCKETS, registry=None)
    for origin in origins:
        histogram.labels(origin)
    return histogram


class NodeCollector(Collector):
    """Reads `snapshot()` (the node's status fields) on each scrape: nothing on the data path."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.snapshot()
        stats = s["stats"]
        yield CounterMetricFamily(
            "kspeedfs_node_reads", "read requests served to other nodes and clients", stats["reads"]
        )
        yield CounterMetricFamily(
            "kspeedfs_node_read_bytes", "bytes served by read requests", stats["read_bytes"]
        )
        yield CounterMetricFamily(
            "kspeedfs_node_connections", "connections accepted", stats["connections"]
        )
        yield CounterMetricFamily("kspeedfs_node_refused", "requests refused", stats["refused"])
        yield GaugeMetricFamily(
            "kspeedfs_node_memory_used_bytes", "memory the datasets take", s["used"]
        )
        yield GaugeMetricFamily("kspeedfs_node_memory_budget_bytes", "memory budget", s["budget"])
        yield GaugeMetricFamily("kspeedfs_node_leases", "dataset leases held by jobs", s["leases"])
        tier = s.get("disk_tier") or DiskTierStatus(dir="", budget=0, used=0, promoted={})
        yield GaugeMetricFamily(
            "kspeedfs_node_disk_tier_used_bytes", "disk-tier bytes preloads take", tier.used
        )
        yield GaugeMetricFamily(
            "kspeedfs_node_disk_tier_budget_bytes", "disk tier budget (0: none)", tier.budget
        )
        yield CounterMetricFamily(
            "kspeedfs_node_promoted_bytes",
            "bytes moved from the disk tier to memory",
            tier.promoted.get("bytes", 0),
        )
        yield from _integrity(s.get("integrity") or IntegrityStatus())
        resident = GaugeMetricFamily(
            "kspeedfs_dataset_resident_bytes",
            "memory a dataset takes on this node",
            labels=["dataset"],
        )
        segments = GaugeMetricFamily(
            "kspeedfs_dataset_segments_held", "segments of a dataset held here", labels=["dataset"]
        )
        on_disk = GaugeMetricFamily(
            "kspeedfs_dataset_disk_bytes",
            "disk-tier bytes a dataset takes on this node",
            labels=["dataset"],
        )
        for name, (stored, held, disk) in sorted(s["datasets"].items()):
            resident.add_metric([name], stored)
            segments.add_metric([name], held)
            on_disk.add_metric([name], disk)
        yield resident
        yield segments
        yield on_disk
        leases = GaugeMetricFamily(
            "kspeedfs_dataset_leases",
            "leases held on a dataset (on its lease home)",
            labels=["dataset"],
        )
        for name, n in sorted(s.get("dataset_leases", {}).items()):
            leases.add_metric([name], n)
        yield leases
        yield from _readthrough(s["cache"])
        control: ControlStatus | None = s.get("control")
        if control:
            heal = control.heal
            yield CounterMetricFamily(
                "kspeedfs_heal_segments",
                "segments copied by healing or rebalance",
                heal.segments,
            )
            yield CounterMetricFamily(
                "kspeedfs_heal_bytes", "bytes copied by healing or rebalance", heal.bytes
            )
            yield CounterMetricFamily(
                "kspeedfs_heal_failed", "segment copies that failed", heal.failed
            )
            yield GaugeMetricFamily(
                "kspeedfs_heal_pending", "segments this node still has to copy", heal.pending
            )
            yield CounterMetricFamily(
                "kspeedfs_heal_seconds", "time spent copying segments", heal.seconds
            )
            yield CounterMetricFamily(
                "kspeedfs_rebalance_dropped_segments",
                "segments dropped after a rebalance gave them to new owners",
                heal.dropped,
            )
            yield CounterMetricFamily(
                "kspeedfs_rebalance_dropped_bytes",
                "bytes freed by those drops",
                heal.dropped_bytes,
            )
            yield GaugeMetricFamily(
                "kspeedfs_members_live", "live members in etcd", len(control.live)
            )
            under = GaugeMetricFamily(
                "kspeedfs_dataset_under_replicated_segments",
                "segments with an owner that is down",
                labels=["dataset"],
            )
            for name, n in sorted(control.under_replicated.items()):
                under.add_metric([name], n)
            yield under


# Read-through datasets: (metric, the cache status field, help).
READTHROUGH = (
    ("kspeedfs_readthrough_hits", "hits", "segment requests found in memory"),
    ("kspeedfs_readthrough_misses", "misses", "segment requests that needed a fill"),
    ("kspeedfs_readthrough_fills_source", "fills_source", "segments filled from the source"),
    ("kspeedfs_readthrough_fills_spill", "fills_spill", "segments filled from the spill folder"),
    ("kspeedfs_readthrough_fills_disk", "fills_disk", "segments filled onto the disk tier"),
    ("kspeedfs_readthrough_evictions", "evictions", "segments evicted from memory"),
    ("kspeedfs_readthrough_spilled", "spilled", "segments written to the spill folder"),
    (
        "kspeedfs_readthrough_source_bytes",
        "source_bytes",
        "bytes read from the source (fills, and misses not kept that readers read)",
    ),
    (
        "kspeedfs_readthrough_bypassed",
        "bypassed",
        "misses not kept by the eviction policy: read from the source by the reader",
    ),
)
# Hits and misses by tier: (tier, the hits field, the misses field).
TIERS = (
    ("memory", "memory_hits", "memory_misses"),
    ("disk", "disk_hits", "disk_misses"),
    ("spill", "spill_hits", "spill_misses"),
)


def _readthrough(cache: CacheStatus) -> Iterator[CounterMetricFamily]:
    """Each read-through instance's figures (`counted`: none of another dataset)."""
    datasets = {name: d for name, d in cache.datasets.items() if d.counted}
    for metric, key, text in READTHROUGH:
        family = CounterMetricFamily(metric, text, labels=["dataset"])
        for name, d in sorted(datasets.items()):
            family.add_metric([name], getattr(d, key))
        yield family
    for kind in ("hits", "misses"):
        family = CounterMetricFamily(
            f"kspeedfs_readthrough_tier_{kind}",
            f"segment requests by tier: {kind} (memory: reads through maps and fills; disk: "
            "reads through maps and fills onto it; spill: fills it served or not)",
            labels=["dataset", "tier"],
        )
        for name, d in sorted(datasets.items()):
            for tier, hits, misses in TIERS:
                field = hits if kind == "hits" else misses
                family.add_metric([name, tier], getattr(d, field))
        yield family
    evictions = CounterMetricFamily(
        "kspeedfs_readthrough_evictions_by_policy",
        "read-through segments evicted, by the policy that chose them (preload: room for one)",
        labels=["policy"],
    )
    for policy, n in sorted(cache.evictions_by_policy.items()):
        evictions.add_metric([policy], n)
    yield evictions


def serve_metrics(
    listen: str, snapshot: Callable[[], dict[str, Any]], histograms: Sequence[Collector] = ()
) -> int:
    """Start the /metrics HTTP server in its own thread; returns its port."""
    address = parse_address(listen)
    registry = CollectorRegistry()
    registry.register(NodeCollector(snapshot))
    for histogram in histograms:
        registry.register(histogram)
    server, _thread = start_http_server(address.port, addr=address.host, registry=registry)
    port = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", address.host, port)
    return port


def _integrity(i: IntegrityStatus) -> Iterator[CounterMetricFamily]:
    """Damaged segments found (readers, promotion, start, scrub) and made again; the scrub."""
    for key, name, doc in (
        ("damaged", "damaged_segments", "segments found damaged, quarantined and fetched again"),
        ("repaired", "repaired_segments", "damaged segments fetched again and sound"),
        ("repair_failed", "repair_failed_segments", "damaged segments no copy could replace"),
        ("scrubbed_bytes", "scrubbed_bytes", "disk-tier bytes the scrubber re-read and checked"),
        ("scrub_cpu_seconds", "scrub_cpu_seconds", "CPU time of the scrubber's reads and hashes"),
    ):
        yield CounterMetricFamily(f"kspeedfs_node_{name}", doc, getattr(i, key))


class JobCollector(Collector):
    """The jobs reporting their training loops to this node (kspeedfs.node.jobs), read from
    its table on each scrape: labels job and tenant (empty until tenants exist), and dataset
    for what the job's datasets did while it read them."""

    def __init__(self, answer: Callable[[], JobsAnswer]):
        self.answer = answer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        jobs = self.answer().jobs
        labels = ["job", "tenant"]
        blocked = CounterMetricFamily(
            "kspeedfs_job_loop_blocked_seconds",
            "seconds the job's training loops waited in next(loader), summed over its ranks",
            labels=labels,
        )
        busy = CounterMetricFamily(
            "kspeedfs_job_loop_busy_seconds",
            "seconds the job's training loops spent between batches (computing)",
            labels=labels,
        )
        samples = CounterMetricFamily(
            "kspeedfs_job_samples", "samples the job's loops drew", labels=labels
        )
        ranks = GaugeMetricFamily("kspeedfs_job_ranks", "processes reporting", labels=labels)
        per_dataset = labels + ["dataset"]
        source = CounterMetricFamily(
            "kspeedfs_job_source_bytes",
            "bytes the dataset read from its source while the job read it",
            labels=per_dataset,
        )
        hits = CounterMetricFamily(
            "kspeedfs_job_dataset_hits",
            "segment hits of the dataset while the job read it",
            labels=per_dataset,
        )
        misses = CounterMetricFamily(
            "kspeedfs_job_dataset_misses",
            "segment misses of the dataset while the job read it",
            labels=per_dataset,
        )
        resident = GaugeMetricFamily(
            "kspeedfs_job_resident_bytes",
            "memory the job's dataset holds on this node",
            labels=per_dataset,
        )
        fetch = CounterMetricFamily(
            "kspeedfs_job_worker_fetch_seconds",
            "seconds the job's DataLoader workers spent fetching batches (__getitem__ and collate)",
            labels=labels,
        )
        read_wait = CounterMetricFamily(
            "kspeedfs_job_read_wait_seconds",
            "of those, seconds in kspeedfs reads by path (local, remote, source)",
            labels=[*labels, "path"],
        )
        for job in jobs:
            names = [job.job, job.tenant]
            fetch.add_metric(names, job.fetch_seconds)
            for path, spent in sorted(job.read_seconds.items()):
                read_wait.add_metric([*names, path], spent)
            blocked.add_metric(names, job.blocked)
            busy.add_metric(names, job.busy)
            samples.add_metric(names, job.samples)
            ranks.add_metric(names, job.ranks)
            for ds in job.datasets:
                source.add_metric([*names, ds.name], ds.source_bytes)
                hits.add_metric([*names, ds.name], ds.hits)
                misses.add_metric([*names, ds.name], ds.misses)
                resident.add_metric([*names, ds.name], ds.resident_bytes)
        yield from (blocked, busy, samples, ranks, fetch, read_wait, source, hits, misses, resident)
