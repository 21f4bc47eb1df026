"""The read interface every data transport implements (TCP now, RDMA where both ends can).

A transport reads ranges of one node's segments into caller-provided memory. The cluster
client picks one per node (`kspeedfs.client.transport`); callers never see which.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kspeedfs.format.config import Settings
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient

log = logging.getLogger(__name__)

Range = tuple[int, int, int]  # (segment, offset in segment, length)


class Transport(Protocol):
    name: str
    address: Address

    def read_into(self, dataset: str, instance: str, ranges: list[Range], out: memoryview) -> None:
        """Fill `out` (exactly the ranges' total length) with the ranges' bytes, in order."""
        ...

    def close(self) -> None: ...


class TcpTransport:
    """Vectored reads over the node's TCP protocol (TLS when set): one round trip per call."""

    name = "tcp"

    def __init__(self, address: Address, settings: Settings):
        self.address = address
        self.client = NodeClient(
            address, settings.credential(), settings.timeout, tls=client_context(settings)
        )

    def read_into(self, dataset: str, instance: str, ranges: list[Range], out: memoryview) -> None:
        self.client.receive_read(self.client.send_read(dataset, instance, ranges), out)

    def close(self) -> None:
        self.client.close()
