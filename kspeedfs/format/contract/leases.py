"""The lease ops (node.leases.LeaseOwner): a job keeps a dataset loaded while it holds one.

A lease's id is a secret handed to the job that took it, so a job renews or ends only its own.
"""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, dataset_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseAcquire(Request):
    OP = "lease_acquire"
    name: str = dataset_name()
    uuid: str = ""  # when set: that instance, else StaleDataset
    holder: str = ""  # who holds it, for logs and listings ("host:pid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseRenew(Request):
    OP = "lease_renew"
    lease: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseRelease(Request):
    OP = "lease_release"
    lease: str
