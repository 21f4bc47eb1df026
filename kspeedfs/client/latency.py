"""Latency histograms kept as integer counts in a plain Counter (one fixed set of buckets), so
that processes can share them as integers (a mount's workers copy them into shared memory) and
a collector can expose them as Prometheus histograms."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, MutableMapping

# Seconds: a loopback read of a few KiB takes ~0.1 ms, one of 64 MiB over 10 GbE ~50 ms.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REMOTE_READ = "remote_read"  # one vectored read from one node (ClusterReader)


def keys(name: str) -> list[str]:
    """The Counter keys of histogram `name`: one per bucket (the last one past every bound),
    then the sum in microseconds."""
    return [f"{name}_bucket_{i}" for i in range(len(BUCKETS) + 1)] + [f"{name}_sum_us"]


def observe(counts: MutableMapping[str, int], name: str, seconds: float) -> None:
    counts[f"{name}_bucket_{bisect_left(BUCKETS, seconds)}"] += 1
    counts[f"{name}_sum_us"] += round(seconds * 1e6)


def cumulative(counts: Mapping[str, int], name: str) -> tuple[list[tuple[str, float]], float]:
    """Prometheus buckets of histogram `name` ((le, observations <= le), ending with +Inf) and
    the sum of the observations in seconds."""
    out: list[tuple[str, float]] = []
    total = 0
    for i, bound in enumerate((*BUCKETS, float("inf"))):
        total += int(counts.get(f"{name}_bucket_{i}", 0))
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
    return out, int(counts.get(f"{name}_sum_us", 0)) / 1e6
