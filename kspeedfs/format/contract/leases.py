"""The lease ops (node.leases.LeaseOwner): a job keeps a dataset loaded while it holds one.

A lease's id is a secret handed to the job that took it, so a job renews or ends only its own.
"""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, at_least, dataset_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseAcquire(Request["LeaseHeld"]):
    OP = "lease_acquire"
    name: str = dataset_name()
    uuid: str = ""  # when set: that instance, else StaleDataset
    holder: str = ""  # who holds it, for logs and listings ("host:pid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseRenew(Request["LeaseHeld"]):
    OP = "lease_renew"
    lease: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseRelease(Request["LeaseReleased"]):
    OP = "lease_release"
    lease: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseHeld(Wire):
    """A lease taken (lease_acquire: with the node's ttl and the leases now held on the
    dataset) or renewed (lease_renew): its id, the instance it keeps, and when it ends."""

    lease: str
    name: str
    uuid: str
    holder: str
    expires_in: float = at_least(0)
    ttl: float = at_least(0, default=0.0)
    leases: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseReleased(Wire):
    """A lease ended: the leases left on the dataset, and whether that unloaded it."""

    name: str
    leases: int = at_least(0)
    unloaded: bool
