"""Bytes per tier of each dataset over the cluster: each member's own figures, asked of it.

A node's listing gives the memory and disk-tier bytes of its own part of a dataset; `ls` sums
them over the dataset's members (its current placement where the catalog has one), asking each
member once, all at the same time. A member that does not answer is left out of the sums and
named, so the sum says it is a lower bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import DatasetEntry, DatasetListing, List
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient

MAX_ASKED_AT_ONCE = 16


@dataclasses.dataclass
class ClusterTiers:
    """One dataset's bytes on each tier, summed over the members that answered."""

    memory_bytes: int = 0
    disk_bytes: int = 0
    member_bytes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    unanswered: list[str] = dataclasses.field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def members_of(d: DatasetEntry, asked: str) -> list[str]:
    """Where a listed dataset lies: its current placement, else the members it was loaded
    over, else (a dataset of one node) the node asked."""
    return list(dict.fromkeys(d.placed or d.members or [asked]))


def cluster_tiers(settings: Settings, listing: DatasetListing) -> dict[str, ClusterTiers]:
    """Per ready dataset of the `listing` a node gave: its bytes per tier on its members."""
    asked = listing.node
    ready = listing.ready().values()
    others = sorted({m for d in ready for m in members_of(d, asked)} - {asked})
    listings: dict[str, dict[str, DatasetEntry] | str] = {asked: listing.ready()}
    listings.update(_ask_all(settings, others))
    out = {}
    for d in ready:
        tiers = out[d.name] = ClusterTiers()
        for member in members_of(d, asked):
            listed = listings[member]
            if isinstance(listed, str):  # what went wrong
                tiers.unanswered.append(member)
                tiers.member_bytes[member] = {"error": listed}
                continue
            memory, disk = _held(listed, d.name, d.uuid)
            tiers.memory_bytes += memory
            tiers.disk_bytes += disk
            tiers.member_bytes[member] = {"memory_bytes": memory, "disk_bytes": disk}
    return out


def _held(ready: dict[str, DatasetEntry], name: str, uuid: str) -> tuple[int, int]:
    """A member's memory and disk bytes of one instance (0, 0: it holds none of it)."""
    d = ready.get(name)
    if d is None or d.uuid != uuid:
        return 0, 0
    return d.stored, d.disk_stored


def _ask_all(settings: Settings, nodes: Iterable[str]) -> dict[str, dict[str, DatasetEntry] | str]:
    """Each node's listing, asked at the same time; a node that does not answer: why."""
    nodes = list(nodes)
    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_ASKED_AT_ONCE, len(nodes))) as pool:
        return dict(zip(nodes, pool.map(lambda n: _listing(settings, n), nodes), strict=True))


def _listing(settings: Settings, node: str) -> dict[str, DatasetEntry] | str:
    """The ready datasets of `node`, by name; or why it did not answer."""
    try:
        address = parse_address(node)
        with NodeClient(
            address, settings.credential(), settings.timeout, client_context(settings)
        ) as client:
            return client.call(List()).ready()
    except KSpeedError as e:
        return str(e) or type(e).__name__
