"""Tables that `kspeedfs status` prints: the cache state of every dataset on every node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kspeedfs.format.readthrough_view import READTHROUGH
from kspeedfs.format.units import format_size


def cache_table(nodes: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs status`: every dataset's cache state on every node that is up."""
    rows: list[tuple[str, ...]] = [
        (
            "NODE",
            "DATASET",
            "LIFETIME",
            "RESIDENT",
            "IN MEMORY",
            "ON SPILL",
            "HITS",
            "MISSES",
            "EVICTIONS",
            "SOURCE READS",
            "STATE",
        ),
    ]
    for s in nodes:
        cache = s.get("cache") if s.get("up") else None
        if not cache:
            continue
        for name, d in sorted(cache["datasets"].items()):
            pinned = d["lifetime"] != READTHROUGH
            pct = 100.0 * d["in_memory"] / d["segments"] if d["segments"] else 100.0
            state = f"stale: {d['stale']} files changed" if d["stale"] else "current"
            rows.append(
                (
                    s["node"],
                    name,
                    d["lifetime"] + (" (pinned)" if pinned else ""),
                    f"{pct:.0f}%",
                    format_size(d["memory_bytes"]),
                    "-" if pinned else format_size(d["spill_bytes"]),
                    "-" if pinned else str(d["hits"]),
                    "-" if pinned else str(d["misses"]),
                    "-" if pinned else str(d["evictions"]),
                    "-" if pinned else str(d["source_reads"]),
                    state,
                )
            )
    return rows if len(rows) > 1 else []


def decoded_table(nodes: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Rows for `kspeedfs status`: each decoded variant on each node (resident %, bytes)."""
    rows: list[tuple[str, ...]] = [("NODE", "VARIANT", "DECODED", "UNDECODABLE", "BYTES", "STATE")]
    for s in nodes:
        for name, variants in sorted((s.get("decoded") or {}).items()) if s.get("up") else ():
            for size, v in sorted(variants.items(), key=lambda kv: int(kv[0])):
                total = v["files_total"]
                pct = 100.0 * v["files_done"] / total if total else 100.0
                rows.append(
                    (
                        s["node"],
                        f"{name}@{size}",
                        f"{pct:.0f}% of {total}",
                        str(v["undecodable"]),
                        format_size(v["bytes"]),
                        v["state"] + (f": {v['error']}" if v["error"] else ""),
                    )
                )
    return rows if len(rows) > 1 else []


def spill_lines(nodes: list[dict[str, Any]]) -> list[str]:
    out = []
    for s in nodes:
        spill = (s.get("cache") or {}).get("spill") if s.get("up") else None
        if spill:
            out.append(
                f"spill of {s['node']}: {format_size(spill['used'])} / "
                f"{format_size(spill['budget'])} in {spill['dir']}"
            )
    return out


def print_table(rows: Sequence[tuple[str, ...]]) -> None:
    """Rows as columns padded to their widest cell, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
