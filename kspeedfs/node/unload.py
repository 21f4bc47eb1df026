"""Unloading a dataset: everywhere (the `unload` op: here, on every member that holds part of
it, and from the catalog), or this member's part (`unload_local`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from kspeedfs.format.contract.node import Unload, Unloaded, UnloadLocal
from kspeedfs.format.errors import KSpeedError, NotFound
from kspeedfs.node.leases import LeaseTable
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import ADMIN, OpRegistry
from kspeedfs.node.peers import Ask
from kspeedfs.node.readthrough.catalog import ClusterCatalog
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class Unloader:
    def __init__(
        self,
        store: SegmentStore,
        loads: LoadTable,
        leases: LeaseTable,
        address: Callable[[], str],
        ask: Ask,
        catalog: ClusterCatalog,
    ):
        self.store = store
        self.loads = loads
        self.leases = leases
        self.address = address
        self.ask = ask
        self.catalog = catalog  # with etcd: gone for everyone, even nodes now down

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(Unload, self.op_unload, ADMIN)
        ops.add(UnloadLocal, self.op_unload_local, ADMIN)

    async def op_unload(self, request: Unload) -> Unloaded:
        return await self.unload(request.name)

    async def unload(self, name: str) -> Unloaded:
        """Unload everywhere (a load under way is cancelled, a failed one forgotten)."""
        progress = self.loads.get(name)
        if progress is not None and progress.state == "failed":
            self.loads.finish(name)
            return Unloaded(name=name, state="forgotten")
        if progress is not None:
            progress.cancel.set()
            return Unloaded(name=name, state="cancelled")
        record = self.store.instance(name)
        await self.catalog.forget(name, record.uuid)
        for member in record.members:
            if member != self.address():
                try:
                    await self.ask(member, UnloadLocal(name, record.uuid))
                except KSpeedError as e:
                    log.warning("could not unload %s on %s: %s", name, member, e)
        await self.unload_local(name, record.uuid)
        return Unloaded(name=name, state="unloaded", bytes=record.stored)

    async def op_unload_local(self, request: UnloadLocal) -> Unloaded:
        unloaded = await self.unload_local(request.name, request.uuid)
        return Unloaded(name=request.name, state="unloaded" if unloaded else "absent")

    async def unload_local(self, name: str, uuid: str = "") -> bool:
        """Unload this member's part of `name` (of instance `uuid` only, when given); False
        when it is not here. The store looks and unloads in one step: another caller (the
        converger, the read-through watch, an op) may unload it at any time."""
        try:
            await trio.to_thread.run_sync(self.store.unload, name, uuid)
        except NotFound:
            return False
        self.leases.forget(name)  # they kept that instance; a reload must not count them
        log.info("unloaded %s", name)
        return True
