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


class HedgeableTransport(Transport, Protocol):
    """A transport whose read can be sent, waited for with a limit, and received apart: what
    a hedged read needs (the reader waits on several nodes' answers in one thread)."""

    def send_read(self, dataset: str, instance: str, ranges: list[Range]) -> int: ...

    def wait_readable(self, timeout: float) -> bool: ...

    def receive_read(self, rid: int, out: memoryview) -> None: ...

    def set_timeout(self, seconds: float) -> None: ...

    def fileno(self) -> int: ...


# Connecting has its own limit, far shorter than a read's: a SYN to a cut-off node gets no
# answer, and a lost SYN is sent again only after 1 s; past this the read asks another owner.
CONNECT_TIMEOUT = 0.25


class TcpTransport:
    """Vectored reads over the node's TCP protocol (TLS when set): one round trip per call."""

    name = "tcp"

    def __init__(self, address: Address, settings: Settings):
        self.address = address
        self.client = NodeClient(
            address,
            settings.credential(),
            settings.timeout,
            tls=client_context(settings),
            connect_timeout=CONNECT_TIMEOUT,
        )

    def read_into(self, dataset: str, instance: str, ranges: list[Range], out: memoryview) -> None:
        self.client.receive_read(self.client.send_read(dataset, instance, ranges), out)

    def send_read(self, dataset: str, instance: str, ranges: list[Range]) -> int:
        return self.client.send_read(dataset, instance, ranges)

    def wait_readable(self, timeout: float) -> bool:
        return self.client.wait_readable(timeout)

    def receive_read(self, rid: int, out: memoryview) -> None:
        self.client.receive_read(rid, out)

    def set_timeout(self, seconds: float) -> None:
        self.client.set_timeout(seconds)

    def fileno(self) -> int:
        return self.client.fileno()

    def close(self) -> None:
        self.client.close()
