"""The node's RDMA side: segment memory registered for remote reads, and the control ops.

Registered when a dataset is published or found at start, deregistered before its files are
unlinked. A client connects one RC queue pair per control connection ("rdma_connect"), fetches
a dataset's segment table ("rdma_segments") and then reads with no work on this side.
"""

from __future__ import annotations

import contextvars
import logging
import math
import mmap
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Request, Wire
from kspeedfs.format.contract.rdma import (
    RdmaConnect,
    RdmaConnected,
    RdmaProbe,
    RdmaRefused,
    RdmaSegments,
    RdmaSegmentTable,
)
from kspeedfs.format.contract.status import RdmaStatus
from kspeedfs.format.errors import InvalidArgument, KSpeedError
from kspeedfs.rdma.registry import SegmentRegistry
from kspeedfs.rdma.verbs import Device, MemoryRegion, ResponderQP, VerbsError, open_device, probe
from kspeedfs.rdma.wire import Endpoint, table_to_wire
from kspeedfs.system.local_dataset import LocalDataset


class PublishedDatasets(Protocol):
    """What the service needs of the node's store: its datasets."""

    def open(self, name: str) -> LocalDataset: ...


class DatasetNews(Protocol):
    """What the service needs of the node's dataset events (node/events.py, DatasetEvents):
    to follow them, told `published(name)` and `unloading(name)`."""

    def follow(self, follower: RdmaService) -> None: ...


class OpTable(Protocol):
    """Where the node's ops are registered, each with the role it needs."""

    def add(
        self,
        op: type[Request],
        handler: Callable[[Any], Awaitable[Wire]],
        role: str,
    ) -> None: ...


log = logging.getLogger(__name__)

MAX_PEERS = 4096  # queue pairs this node keeps for clients, all connections together
PROBE_BYTES = 64


class PeerSet:
    """The queue pairs made for one control connection; they go when it closes."""

    def __init__(self, service: RdmaService):
        self.service = service
        self.qps: list[ResponderQP] = []

    def close(self) -> None:
        self.service._drop(self)


_current_peers: contextvars.ContextVar[PeerSet | None] = contextvars.ContextVar(
    "kspeedfs_rdma_peers", default=None
)


class RdmaService:
    """Enabled with a device; otherwise a stand-in that says why and answers "not available".
    Serves the datasets `store` publishes: follows `events` (when enabled), registers each
    one published, deregisters it before it goes."""

    def __init__(
        self,
        store: PublishedDatasets,
        events: DatasetNews,
        reason: str = "",
        device: Device | None = None,
        registry: SegmentRegistry | None = None,
    ):
        self.device = device
        self.reason = reason
        self.registry = registry
        self._lock = threading.Lock()
        self._peer_count = 0
        self._store = store
        # Datasets published on the event loop, registered in worker threads by `run`.
        self._published, self._to_register = trio.open_memory_channel[str](math.inf)
        if self.enabled:
            events.follow(self)
        self._cq: Any = None
        self._probe_map: mmap.mmap | None = None
        self._probe: MemoryRegion | None = None
        if device is not None:
            self._cq = device.make_cq(16)
            # A small region of random bytes the client reads back to prove the path works.
            self._probe_map = mmap.mmap(-1, PROBE_BYTES)
            self._probe_map.write(os.urandom(PROBE_BYTES))
            self._probe = device.register(self._probe_map, PROBE_BYTES)

    @classmethod
    def start(
        cls, settings: Settings, store: PublishedDatasets, events: DatasetNews
    ) -> RdmaService:
        """Open the device the settings allow; without one, TCP only (an error if forced)."""
        if settings.transport == "tcp":
            return cls(store, events, "RDMA disabled by the transport setting")
        found = probe(settings.rdma_device)
        device: Device | None = None
        reason = found.reason
        if found.usable:
            try:
                device = open_device(found.device, found.port, settings.rdma_gid_index)
                return cls(store, events, device=device, registry=SegmentRegistry(device))
            except VerbsError as e:
                reason = str(e)
        if settings.transport == "rdma":
            raise InvalidArgument(f"transport is rdma, but this node cannot use RDMA: {reason}")
        log.info("RDMA off (%s): serving over TCP only", reason)
        return cls(store, events, reason)

    @property
    def enabled(self) -> bool:
        return self.device is not None

    @property
    def label(self) -> str:
        """What `kspeedfs status` shows in the TRANSPORT column."""
        return f"rdma ({self.device.label})" if self.device is not None else "tcp"

    def register_ops(self, ops: OpTable) -> None:
        """Add the control ops RDMA clients use; readers use them, so the read role may."""
        ops.add(RdmaConnect, self.op_connect, "read")
        ops.add(RdmaSegments, self.op_segments, "read")

    # Memory registration.

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register each dataset published on the event loop, each in a worker thread, in
        the nursery this opens, until cancelled (started by the node with `nursery.start`)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for name in self._to_register:
                nursery.start_soon(trio.to_thread.run_sync, self._register_logged, name)

    def published(self, name: str) -> None:
        """Register a dataset that became visible: now when off the event loop (start-up
        recovery runs in a worker thread), else in a worker thread started by `run` (one not
        registered yet is registered by the first `rdma_segments` that asks for it)."""
        if not self.enabled:
            return
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            self._register_logged(name)
            return
        self._published.send_nowait(name)

    def unloading(self, name: str) -> None:
        """Before the files go: no remote read reaches the segments once this returns."""
        if self.registry is not None and self.registry.deregister(name):
            log.info("deregistered the RDMA memory of %s", name)

    def _register_logged(self, name: str) -> None:
        try:
            self.register(name)
        except Exception as e:  # runs unattended: an escaped error would stop the node
            log.error("dataset %s is served over TCP only: %s", name, e)

    def register(self, name: str) -> Any:
        """Register a dataset's held segments (idempotent); its table, or None if it is gone."""
        assert self.registry is not None
        # Read before the lookup: an unload in between then makes the registration undo itself.
        epoch = self.registry.epoch(name)
        try:
            ds = self._store.open(name)
        except KSpeedError:
            return None
        # Memory segments only: disk-tier ones are never mapped (disk_copies), their reads go
        # over TCP, by pread, checked.
        segments = {k: ds.segment(k) for k in sorted(ds.held) if k not in ds.on_disk}
        table = self.registry.register(name, ds.uuid, ds.manifest.segments, segments, epoch=epoch)
        if table is not None:
            log.info(
                "registered %d segments of %s for RDMA reads (generation %d)",
                len(segments),
                name,
                table.generation,
            )
        return table

    # Control ops.

    def bind_connection(self) -> PeerSet:
        """Called by the node for each control connection; close the result when it ends."""
        peers = PeerSet(self)
        _current_peers.set(peers)
        return peers

    async def op_connect(self, request: RdmaConnect) -> RdmaConnected | RdmaRefused:
        if self.device is None:
            return RdmaRefused(reason=self.reason)
        peers = _current_peers.get()
        if peers is None:
            return RdmaRefused(reason="this node cannot tie RDMA to connections")
        client = Endpoint.from_wire(request.endpoint)
        # One queue pair per connection: a reconnect (after an error) replaces the old one.
        self._drop(peers)
        with self._lock:
            if self._peer_count >= MAX_PEERS:
                return RdmaRefused(reason=f"node has {MAX_PEERS} RDMA peers already")
            self._peer_count += 1
        try:
            qp = ResponderQP(self.device, self._cq, client)
        except KSpeedError as e:
            with self._lock:
                self._peer_count -= 1
            return RdmaRefused(reason=str(e))
        peers.qps.append(qp)
        assert self._probe is not None and self._probe_map is not None
        probe = RdmaProbe(
            addr=self._probe.addr,
            rkey=self._probe.rkey,
            length=PROBE_BYTES,
            data=bytes(self._probe_map[:PROBE_BYTES]).hex(),
        )
        return RdmaConnected(endpoint=qp.endpoint.to_wire(), probe=probe)

    async def op_segments(self, request: RdmaSegments) -> RdmaSegmentTable | RdmaRefused:
        name = request.name
        self._store.open(name)  # NotFound for a dataset this node does not have
        if self.registry is None:
            return RdmaRefused(reason=self.reason)
        table = self.registry.table(name)
        if table is None:
            try:
                table = await trio.to_thread.run_sync(self.register, name)
            except KSpeedError as e:
                return RdmaRefused(reason=str(e))
        if table is None:
            return RdmaRefused(reason=f"dataset {name} is being unloaded")
        return RdmaSegmentTable(uuid=table.uuid, table=table_to_wire(table))

    def _drop(self, peers: PeerSet) -> None:
        qps, peers.qps = peers.qps, []
        for qp in qps:
            try:
                qp.close()
            except Exception as e:
                log.warning("could not destroy an RDMA queue pair: %s", e)
        with self._lock:
            self._peer_count -= len(qps)

    def status(self) -> RdmaStatus:
        if self.device is None:
            return RdmaStatus(enabled=False, reason=self.reason)
        assert self.registry is not None
        registered = self.registry.statistics()
        return RdmaStatus(
            enabled=True,
            device=self.device.name,
            port=self.device.port,
            gid=self.device.gid,
            gid_index=self.device.gid_index,
            peers=self._peer_count,
            datasets=registered["datasets"],
            regions=registered["regions"],
            bytes=registered["bytes"],
        )
