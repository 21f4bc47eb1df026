"""Which transport reads a node's segments: TCP, or RDMA where the setting and both ends allow it.

The choice is the client's: `kspeedfs.rdma` offers only its RDMA transport. A `tcp` setting
never imports the RDMA package, so a plain TCP read never loads or probes the verbs layer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kspeedfs.format.config import Settings
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import Address
from kspeedfs.net.transport import TcpTransport, Transport

if TYPE_CHECKING:
    from kspeedfs.rdma.client import ChannelFactory
    from kspeedfs.rdma.verbs import DeviceProbe

log = logging.getLogger(__name__)

# Per process: why RDMA is unusable here, logged once (the reason is the same for every node).
_logged_local: set[tuple[int, str]] = set()


def open_transport(
    address: Address,
    settings: Settings,
    probe: Callable[[str], DeviceProbe] | None = None,
    channel_factory: ChannelFactory | None = None,
) -> Transport:
    """The transport to one node: RDMA where the `transport` setting, this process's device and
    the node allow it, else TCP. `probe` and `channel_factory` stand in for the device in tests."""
    if settings.transport == "tcp":
        return TcpTransport(address, settings)
    from kspeedfs.rdma import verbs
    from kspeedfs.rdma.client import RdmaTransport, device_channel_factory

    found = (probe or verbs.probe)(settings.rdma_device)
    if not found.usable:
        if settings.transport == "rdma":
            raise InvalidArgument(f"transport is rdma, but RDMA is unusable here: {found.reason}")
        key = (os.getpid(), found.reason)
        if key not in _logged_local:
            _logged_local.add(key)
            log.info("using TCP: %s", found.reason)
        return TcpTransport(address, settings)
    return RdmaTransport(
        address, settings, channel_factory or device_channel_factory(found, settings)
    )
