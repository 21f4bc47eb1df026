"""The RDMA control ops (kspeedfs.rdma.server): one queue pair per control connection, and a
dataset's registered segment table."""

from __future__ import annotations

import dataclasses
from typing import Any

from kspeedfs.format.contract import Request, dataset_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaConnect(Request):
    """Tie a responder queue pair to this connection; `endpoint` is the client's (its fields
    are checked by kspeedfs.rdma.wire.Endpoint, which this layer does not import)."""

    OP = "rdma_connect"
    endpoint: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaSegments(Request):
    """The registered segment table of dataset `name`, for one-sided reads."""

    OP = "rdma_segments"
    name: str = dataset_name()
