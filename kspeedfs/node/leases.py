"""Leases on datasets: jobs that use an actively loaded dataset hold one; the last to end unloads it.

A lease lives `ttl` seconds unless renewed. The table only keeps time and counts; the lease
owner (LeaseOwner) answers the lease ops and decides what ending a lease means (unloading a
dataset whose lifetime is "leased").
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from kspeedfs.format.contract.leases import (
    LeaseAcquire,
    LeaseHeld,
    LeaseRelease,
    LeaseReleased,
    LeaseRenew,
)
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.node.ops import JOB, OpRegistry
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Lease:
    id: str
    name: str
    instance: str  # the uuid of the instance it keeps loaded: a reload is not kept by it
    holder: str  # who holds it, for logs and listings ("host:pid")
    expires: float

    def held(self, now: float, ttl: float = 0.0, leases: int = 0) -> LeaseHeld:
        """The answer that names this lease (`ttl` and `leases` when it was just taken)."""
        return LeaseHeld(
            lease=self.id,
            name=self.name,
            uuid=self.instance,
            holder=self.holder,
            expires_in=max(0.0, self.expires - now),
            ttl=ttl,
            leases=leases,
        )


class LeaseTable:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        if ttl <= 0:
            raise InvalidArgument(f"lease_ttl must be positive, not {ttl}")
        self.ttl = ttl
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._by_name: dict[str, set[str]] = {}
        # name -> when it was first seen without a lease (grace for datasets never leased).
        self._idle_since: dict[str, float] = {}
        self._closing: set[str] = set()

    def acquire(self, name: str, instance: str, holder: str) -> Lease:
        if name in self._closing:
            raise NotFound(f"dataset {name!r} is being unloaded")
        lease = Lease(secrets.token_hex(16), name, instance, holder[:200], self.clock() + self.ttl)
        self._leases[lease.id] = lease
        self._by_name.setdefault(name, set()).add(lease.id)
        self._idle_since.pop(name, None)
        return lease

    def renew(self, lease_id: str) -> Lease:
        lease = self._live(lease_id)
        lease.expires = self.clock() + self.ttl
        return lease

    def release(self, lease_id: str) -> Lease:
        lease = self._live(lease_id)
        self._drop(lease)
        return lease

    def _live(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None or lease.expires <= self.clock():
            raise NotFound("unknown or expired lease")
        return lease

    def _drop(self, lease: Lease) -> None:
        del self._leases[lease.id]
        ids = self._by_name[lease.name]
        ids.discard(lease.id)
        if not ids:
            del self._by_name[lease.name]
            self._idle_since[lease.name] = self.clock()

    def expire(self) -> list[Lease]:
        """Drop the leases that were not renewed in time; returns them."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.expires <= now]
        for lease in gone:
            self._drop(lease)
        return gone

    def count(self, name: str) -> int:
        return len(self._by_name.get(name, ()))

    def total(self) -> int:
        return len(self._leases)

    def holders(self, name: str) -> list[str]:
        return sorted(self._leases[i].holder for i in self._by_name.get(name, ()))

    def idle(self, names: Iterable[str]) -> list[str]:
        """Of `names`, those that have had no lease for at least one ttl.

        The clock of a name starts when its last lease ends or when it is first seen here
        without one, so a dataset whose job died before taking a lease is caught too.
        """
        now = self.clock()
        out = []
        for name in names:
            if self.count(name):
                continue
            since = self._idle_since.setdefault(name, now)
            if now - since >= self.ttl:
                out.append(name)
        return out

    def begin_close(self, name: str) -> bool:
        """Claim the unloading of an unleased dataset; False when another task already did."""
        if self.count(name) or name in self._closing:
            return False
        self._closing.add(name)
        return True

    def forget(self, name: str) -> None:
        """The dataset is gone: drop what is known about it."""
        self._closing.discard(name)
        self._idle_since.pop(name, None)
        for lease_id in list(self._by_name.get(name, ())):
            self._drop(self._leases[lease_id])
        self._idle_since.pop(name, None)


class LeaseOwner:
    """The lease ops and the expiry of leases (a crashed job's) and of leased datasets no one
    holds. Leases are the job role's: a lease can unload a dataset when it ends."""

    def __init__(
        self,
        table: LeaseTable,
        store: SegmentStore,
        address: Callable[[], str],
        unload: Callable[[str], Awaitable[Any]],
    ):
        self.table = table
        self.store = store
        self.address = address
        self.unload = unload  # everywhere: on every member that holds part of it

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(LeaseAcquire, self.op_lease_acquire, JOB)
        ops.add(LeaseRenew, self.op_lease_renew, JOB)
        ops.add(LeaseRelease, self.op_lease_release, JOB)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self._expire_leases()

    async def op_lease_acquire(self, request: LeaseAcquire) -> LeaseHeld:
        record = self.store.instance(request.name, request.uuid)
        lease = self.table.acquire(record.name, record.uuid, request.holder)
        count = self.table.count(record.name)
        log.info("lease on %s taken by %s (%d held)", record.name, lease.holder, count)
        return lease.held(self.table.clock(), ttl=self.table.ttl, leases=count)

    async def op_lease_renew(self, request: LeaseRenew) -> LeaseHeld:
        lease = self.table.renew(request.lease)
        record = self.store.datasets.get(lease.name)
        if record is None or record.uuid != lease.instance:
            self.table.release(lease.id)
            raise NotFound(f"the instance of {lease.name!r} this lease kept is gone")
        return lease.held(self.table.clock())

    async def op_lease_release(self, request: LeaseRelease) -> LeaseReleased:
        lease = self.table.release(request.lease)
        left = self.table.count(lease.name)
        log.info("lease on %s released by %s (%d left)", lease.name, lease.holder, left)
        unloaded = False
        if not left:
            unloaded = await self._unload_unleased(lease.name, "its last lease was released")
        return LeaseReleased(name=lease.name, leases=left, unloaded=unloaded)

    def _lease_home(self, name: str) -> bool:
        # One node keeps a dataset's leases (the first it was placed over), so that only
        # that node decides to unload it.
        record = self.store.datasets.get(name)
        return record is None or not record.members or record.members[0] == self.address()

    async def _expire_leases(self) -> None:
        """End leases that were not renewed (a crashed job) and leased datasets no one holds."""
        while True:
            await trio.sleep(min(1.0, self.table.ttl / 4))
            try:
                reasons: dict[str, str] = {}
                for lease in self.table.expire():
                    log.warning("lease on %s held by %s expired", lease.name, lease.holder)
                    reasons[lease.name] = "its last lease expired"
                leased = [
                    r.name
                    for r in self.store.datasets.values()
                    if r.lifetime == "leased" and self._lease_home(r.name)
                ]
                for name in self.table.idle(leased):
                    reasons.setdefault(name, f"no lease on it for {self.table.ttl:g}s")
                for name, why in sorted(reasons.items()):
                    await self._unload_unleased(name, why)
            except Exception:
                log.exception("lease expiry failed; trying again")

    async def _unload_unleased(self, name: str, why: str) -> bool:
        """Unload a leased dataset no lease holds any more; an offline one is never touched."""
        record = self.store.datasets.get(name)
        if record is None or record.lifetime != "leased" or not self.table.begin_close(name):
            return False
        try:
            log.info("unloading %s: %s", name, why)
            await self.unload(name)
        except KSpeedError as e:
            log.warning("could not unload %s: %s", name, e)
            return False
        finally:
            self.table.forget(name)
        return True
