"""Placement: rendezvous (highest-random-weight) hashing of (dataset, segment) over nodes.

Pure functions: every client and node computes the same owners with no metadata server.
Adding or removing a node moves only the segments that node gains or loses.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def _weight(node: str, dataset: str, segment: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{dataset}\0{segment}\0{node}".encode())


def owners(dataset: str, segment: int, nodes: Sequence[str], replicas: int = 1) -> list[str]:
    """The top `replicas` nodes for a segment, best first (the order reads try them in)."""
    ranked = sorted(nodes, key=lambda n: _weight(n, dataset, segment), reverse=True)
    return ranked[: max(1, replicas)]


def assignment(
    dataset: str, segments: int, nodes: Sequence[str], replicas: int = 1
) -> dict[str, list[int]]:
    """node -> the segments it holds (every node appears, possibly with none)."""
    out: dict[str, list[int]] = {n: [] for n in nodes}
    for seg in range(segments):
        for node in owners(dataset, seg, nodes, replicas):
            out[node].append(seg)
    return out
