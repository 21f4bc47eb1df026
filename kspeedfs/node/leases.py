"""Leases on datasets: jobs that use an actively loaded dataset hold one; the last to end unloads it.

A lease lives `ttl` seconds unless renewed. The table only keeps time and counts; the node
decides what ending a lease means (unloading a dataset whose lifetime is "leased").
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Iterable

from kspeedfs.format.errors import InvalidArgument, NotFound


@dataclasses.dataclass
class Lease:
    id: str
    name: str
    instance: str  # the uuid of the instance it keeps loaded: a reload is not kept by it
    holder: str  # who holds it, for logs and listings ("host:pid")
    expires: float

    def to_wire(self, now: float) -> dict[str, object]:
        return {
            "lease": self.id,
            "name": self.name,
            "uuid": self.instance,
            "holder": self.holder,
            "expires_in": max(0.0, self.expires - now),
        }


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
