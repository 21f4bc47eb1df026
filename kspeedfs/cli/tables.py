"""Tables that `kspeedfs status` and `kspeedfs ls` print: the datasets, and the cache state
of every dataset on every node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kspeedfs.client.tier_bytes import ClusterTiers
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.decoded import VariantSummary
from kspeedfs.format.contract.node import DatasetEntry, DatasetListing, NodeStatus
from kspeedfs.format.contract.status import DatasetCacheStatus
from kspeedfs.format.units import format_size

LS_COLUMNS = (
    "MEMORY and DISK are the bytes of each dataset on each tier, summed over its members "
    "(each one asked); a `?` after them: a member did not answer, and the sums are of those "
    "that did. With --json: memory_bytes, disk_bytes, member_bytes (each member's bytes, or "
    "its error) and unanswered (the members that did not answer)."
)


def ls_table(
    listing: DatasetListing,
    tiers: dict[str, ClusterTiers],
    variants: dict[str, dict[str, VariantSummary]],
) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs ls`: MEMORY and DISK are the bytes on each tier summed over the
    dataset's members, with a `?` where a member did not answer (then they are a lower bound).
    `tiers` and `variants` by dataset name (cluster_tiers, decoded.status)."""
    rows: list[tuple[str, ...]] = [
        ("NAME", "FILES", "BYTES", "STATE", "LIFETIME", "MEMORY", "DISK", "SOURCE")
    ]
    for d in listing.datasets:
        if isinstance(d, DatasetEntry):
            files, size, lifetime = d.files, d.bytes, d.lifetime
            memory, disk = d.stored, d.disk_stored
        else:  # a load under way, or failed
            files, size, lifetime, memory, disk = d.files_total, d.bytes_total, "-", 0, 0
        state: str = d.state
        if state == "loading" and d.bytes_total:
            state = f"loading {100 * d.bytes_done / d.bytes_total:.0f}%"
        if state == "failed":
            state = f"failed: {d.error}"
        unsure = ""
        over = tiers.get(d.name)
        if over is not None:
            memory, disk = over.memory_bytes, over.disk_bytes
            unsure = "?" if over.unanswered else ""
        rows.append(
            (
                d.name,
                str(files),
                format_size(size),
                state,
                lifetime,
                format_size(memory) + unsure,
                format_size(disk) + unsure,
                d.source,
            )
        )
        if variants.get(d.name):
            from kspeedfs.client.decoded import describe

            rows[-1] += (", ".join(describe(v) for v in variants[d.name].values()),)
    if any(len(r) > len(rows[0]) for r in rows):
        cols = len(rows[0])
        rows = [rows[0] + ("DECODED",)] + [r + ("-",) * (cols + 1 - len(r)) for r in rows[1:]]
    return rows


class Answered(Protocol):
    """A node of `kspeedfs status` (cli/node.py's NodeView): its answer, None when it gave
    none."""

    @property
    def node(self) -> str: ...

    @property
    def status(self) -> NodeStatus | None: ...


def cache_table(nodes: Sequence[Answered]) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs status`: every dataset's cache state on every node that is up."""
    rows: list[tuple[str, ...]] = [
        (
            "NODE",
            "DATASET",
            "LIFETIME",
            "RESIDENT",
            "IN MEMORY",
            "ON DISK TIER",
            "ON SPILL",
            "HITS",
            "MISSES",
            "EVICTIONS",
            "NOT KEPT",
            "SOURCE BYTES",
            "CAP",
            "STATE",
        ),
    ]
    for n in nodes:
        cache = n.status.cache if n.status is not None else None
        if not cache:
            continue
        for name, d in sorted(cache.datasets.items()):
            pinned = d.lifetime != READTHROUGH
            pct = 100.0 * d.in_memory / d.segments if d.segments else 100.0
            state = f"stale: {d.stale} files changed" if d.stale else "current"
            rows.append(
                (
                    n.node,
                    name,
                    d.lifetime + (" (pinned)" if pinned else ""),
                    f"{pct:.0f}%",
                    format_size(d.memory_bytes),
                    format_size(d.disk_bytes),
                    "-" if pinned else format_size(d.spill_bytes),
                    "-" if pinned else str(d.hits),
                    "-" if pinned else str(d.misses),
                    "-" if pinned else str(d.evictions),
                    "-" if pinned else str(d.bypassed),
                    "-" if pinned else format_size(d.source_bytes),
                    _caps(d),
                    state,
                )
            )
    return rows if len(rows) > 1 else []


def _caps(d: DatasetCacheStatus) -> str:
    """A dataset's caps: memory / spill ("-" for none)."""
    memory, disk = d.max_memory, d.max_disk
    if not memory and not disk:
        return "-"
    return " / ".join(format_size(n) if n else "-" for n in (memory, disk))


def decoded_table(nodes: Sequence[Answered]) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs status`: each decoded variant on each node (resident %, bytes)."""
    rows: list[tuple[str, ...]] = [("NODE", "VARIANT", "DECODED", "UNDECODABLE", "BYTES", "STATE")]
    for n in nodes:
        decoded = n.status.decoded if n.status is not None else {}
        for name, variants in sorted(decoded.items()):
            for size, v in sorted(variants.items(), key=lambda kv: int(kv[0])):
                total = v.files_total
                pct = 100.0 * v.files_done / total if total else 100.0
                rows.append(
                    (
                        n.node,
                        f"{name}@{size}",
                        f"{pct:.0f}% of {total}",
                        str(v.undecodable),
                        format_size(v.bytes),
                        v.state + (f": {v.error}" if v.error else ""),
                    )
                )
    return rows if len(rows) > 1 else []


def spill_lines(nodes: Sequence[Answered]) -> list[str]:
    """Each node's eviction policy and evictions by policy, and its spill folder's use."""
    out = []
    for n in nodes:
        cache = n.status.cache if n.status is not None else None
        if cache and cache.policy:
            by = cache.evictions_by_policy
            counts = ", ".join(f"{p} {c}" for p, c in sorted(by.items())) or "none"
            out.append(f"eviction on {n.node}: {cache.policy}; evictions: {counts}")
        spill = cache.spill if cache else None
        if spill:
            out.append(
                f"spill of {n.node}: {format_size(spill.used)} / "
                f"{format_size(spill.budget)} in {spill.dir}"
            )
    return out


def print_table(rows: Sequence[tuple[str, ...]]) -> None:
    """Rows as columns padded to their widest cell, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
