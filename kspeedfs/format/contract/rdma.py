"""The RDMA control ops (kspeedfs.rdma.server): one queue pair per control connection, and a
dataset's registered segment table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from kspeedfs.format.contract import Request, Wire, dataset_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaConnect(Request["RdmaConnected | RdmaRefused"]):
    """Tie a responder queue pair to this connection; `endpoint` is the client's (its fields
    are checked by kspeedfs.rdma.wire.Endpoint, which this layer does not import)."""

    OP = "rdma_connect"
    endpoint: dict[str, Any]

    def answer(self, msg: Mapping[str, Any]) -> RdmaConnected | RdmaRefused:
        return RdmaConnected.from_wire(msg) if msg.get("available") else RdmaRefused.from_wire(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaSegments(Request["RdmaSegmentTable | RdmaRefused"]):
    """The registered segment table of dataset `name`, for one-sided reads."""

    OP = "rdma_segments"
    name: str = dataset_name()

    def answer(self, msg: Mapping[str, Any]) -> RdmaSegmentTable | RdmaRefused:
        if msg.get("available"):
            return RdmaSegmentTable.from_wire(msg)
        return RdmaRefused.from_wire(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaRefused(Wire):
    """No RDMA for this connection or dataset, and why (the client reads over TCP)."""

    available: Literal[False] = False
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaProbe(Wire):
    """A small registered region of random bytes (`data`, in hex) that the client reads back
    to prove the path works before it reads any segment."""

    addr: int
    rkey: int
    length: int
    data: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaConnected(Wire):
    """The responder queue pair tied to this connection (`endpoint`, checked by
    kspeedfs.rdma.wire.Endpoint) and the probe region to read first."""

    available: Literal[True] = True
    endpoint: dict[str, Any]
    probe: RdmaProbe


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaSegmentTable(Wire):
    """A dataset's registered segment table (kspeedfs.rdma.wire.table_to_wire's text) for
    instance `uuid`."""

    available: Literal[True] = True
    uuid: str
    table: str
