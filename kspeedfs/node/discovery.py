"""A node without etcd follows its dns: node list: looked up again every `dns_refresh` seconds.

The static node list is what a node places new data over (the coordinator's `members`, which
`status` lists too); this task changes that one list in place, so a node added to the headless
Service becomes a member of every node within the interval, and one whose record went leaves
it. Placement changes as it does with etcd when a member joins or leaves: new preloads go over
the members of now, a dataset keeps the members it was loaded over (its manifest says them;
readers go there). There is no catalog without etcd, so nothing is healed or rebalanced: a
gone node's segments are read from the source, as when a node of a static list is down.
"""

from __future__ import annotations

import logging

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.discovery import follows_dns, lookup_again
from kspeedfs.format.errors import KSpeedError

log = logging.getLogger(__name__)


def placement_list(nodes: list[str], me: str) -> list[str]:
    """The node list this node places data over; just itself when it is not in the list."""
    return nodes if me in nodes else [me]


async def follow_dns(settings: Settings, members: list[str], me: str) -> None:
    """Keep `members` (the list the node's parts share) the resolved dns: list, until
    cancelled. Returns at once when `nodes` has no dns: entry or dns_refresh is 0."""
    if not follows_dns(settings.nodes, settings.dns_refresh):
        return
    said = ""
    while True:
        await trio.sleep(settings.dns_refresh)
        try:
            found = await trio.to_thread.run_sync(lookup_again, settings.nodes)
        except KSpeedError as e:
            if str(e) != said:
                log.warning("nodes: %s; placing over %s still", e, ", ".join(members))
            said = str(e)
            continue
        said = ""
        now = placement_list([str(a) for a in found], me)
        if now != members:
            joined = sorted(set(now) - set(members))
            left = sorted(set(members) - set(now))
            log.info(
                "members from DNS: %s (joined: %s; left: %s)",
                ", ".join(now), ", ".join(joined) or "-", ", ".join(left) or "-",
            )  # fmt: skip
            members[:] = now
