"""The control plane of a node without etcd: a static node list (or one that DNS keeps).

It answers what the etcd one (`ControlPlane`) answers, so the preload coordinator, the unloader,
the server and the status ops ask one interface and never test for an etcd: there is no catalog
to claim a name in or publish to (a preload's name is this node's alone), the members are the
configured list, which a `dns:` entry keeps current (`follow_dns`), and there is nothing to heal.
"""

from __future__ import annotations

from typing import Any

import trio

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.format.config import Settings
from kspeedfs.node.discovery import follow_dns
from kspeedfs.node.ops import OpRegistry
from kspeedfs.node.preload import Plan


class StaticControl:
    """Membership from the settings; claims, publishes and forgets that have no one to tell."""

    def __init__(self, settings: Settings, members: list[str]):
        self.settings = settings
        self._members = members  # the node's list: follow_dns updates it in place
        # No catalog without etcd: listings show no placement beyond the record's members.
        self.catalog: dict[str, CatalogEntry] = {}
        self.histograms: list[Any] = []  # the metrics it adds (etcd's: its copies' durations)

    def register_ops(self, ops: OpRegistry) -> None:
        """None: rebalance and adopt need a catalog."""

    async def run(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Follows a `dns:` node list until cancelled (peers added to the Service join, gone
        ones leave); with a plain list, returns at once."""
        task_status.started()
        await follow_dns(self.settings, self._members, address)

    def members(self) -> list[str]:
        return self._members

    async def members_now(self) -> list[str]:
        return self._members

    async def claim_preload(self, plan: Plan, coordinator: str) -> None:
        """Nothing to claim: no other coordinator shares the name."""

    async def publish(self, name: str, uuid: str, listed: ListedInstance | None = None) -> None:
        """Nothing to publish to: this node's list is the catalog."""

    async def forget(self, name: str, uuid: str) -> bool:
        return False

    async def forget_failed(self, name: str, uuid: str) -> None:
        """No claim was made."""

    def status(self) -> None:
        """No control plane to report (status shows "control": null)."""
        return None
