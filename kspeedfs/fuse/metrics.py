"""Prometheus exposition of a mount (`kspeedfs mount --metrics-listen`): its shared counters,
read at scrape time by the mount process (FUSE requests by kind, cluster reads by path, the
latency of remote reads). The reads happen in the worker processes: a prometheus_client
Histogram there would need its multiprocess mode (files per process); the read policy keeps
the buckets as integers instead, each worker copies them into its row of the shared counters,
and this collector adds them up into one histogram."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kspeedfs.client import latency
from kspeedfs.format.units import parse_address
from kspeedfs.fuse.counters import SharedCounters
from kspeedfs.fuse.kernel import OPCODE_NAMES

log = logging.getLogger(__name__)

PATHS = ("local", "remote", "source")


class MountCollector(Collector):
    """Reads every serving process's row of the shared counters on each scrape."""

    def __init__(self, counters: SharedCounters):
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        requests = CounterMetricFamily(
            "kspeedfs_mount_requests", "FUSE requests answered, by kind", labels=["op"]
        )
        for op, n in sorted(self.counters.totals(OPCODE_NAMES).items()):
            requests.add_metric([op.lower()], n)
        yield requests
        sources = self.counters.sources()
        reads = CounterMetricFamily(
            "kspeedfs_mount_reads",
            "cluster reads by the path that served them: local (mapped), remote (a node, one "
            "per vectored request), source",
            labels=["path"],
        )
        read_bytes = CounterMetricFamily(
            "kspeedfs_mount_read_bytes", "bytes read by path", labels=["path"]
        )
        for path in PATHS:
            reads.add_metric([path], sources.get(path, 0))
            read_bytes.add_metric([path], sources.get(f"{path}_bytes", 0))
        yield reads
        yield read_bytes
        buckets, total = latency.cumulative(sources, latency.REMOTE_READ)
        yield HistogramMetricFamily(
            "kspeedfs_mount_remote_read_seconds",
            "time of each read from another node (all the pieces one read asked of it)",
            buckets=buckets,
            sum_value=total,
        )


def serve_mount_metrics(listen: str, counters: SharedCounters) -> int | None:
    """Start /metrics in its own thread; a port that cannot be had is logged, not fatal (the
    mount serves on). Returns the port."""
    address = parse_address(listen)
    registry = CollectorRegistry()
    registry.register(MountCollector(counters))
    try:
        server, _thread = start_http_server(address.port, addr=address.host, registry=registry)
    except OSError as e:
        log.error("metrics: cannot listen on %s: %s; the mount serves without them", listen, e)
        return None
    port = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", address.host, port)
    return port
