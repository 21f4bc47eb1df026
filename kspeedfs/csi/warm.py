"""Warm volumes: the dataset of a volume is resident before its pod starts, and leased to it.

A volume that names a `source` the node does not hold is preloaded at publish (KSpeed's active
preload: lifetime `leased`, or `offline` for lifetime=persistent) and publish answers once the
load is ready, or fails in one line after the publish timeout while the load goes on (kubelet
calls again, and the next call waits for the same load). Each volume of a leased dataset holds
a lease of its own (holder `csi:NODE:VOLUME`), kept in its record and renewed by the plugin;
its unpublish releases it, and the node unloads the dataset with its last lease. A dataset
loaded offline (by `kspeedfs preload`, a preload Job, or a persistent volume) is never
unloaded by a volume.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from kspeedfs.client import admin
from kspeedfs.client.reader import local_node_for
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.leases import (
    LeaseAcquire,
    LeaseRelease,
    LeaseRenew,
)
from kspeedfs.format.contract.node import DatasetEntry, List, LoadingEntry
from kspeedfs.format.discovery import NodeWatch
from kspeedfs.format.errors import AlreadyExists, KSpeedError, NotFound
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient
from kspeedfs.sources.naming import normalize_source

from .policy import NotAllowed
from .volumes import Volume, VolumeRecords

log = logging.getLogger(__name__)


class NotResident(KSpeedError):
    """The volume's dataset was not ready within the publish timeout (its load goes on)."""


class WarmDatasets:
    """The node side of publish and unpublish: find, preload, lease and release datasets."""

    def __init__(self, settings: Settings, node_id: str):
        # This machine's node first (KSPEEDFS_LISTEN): it answers the list and the preloads.
        self.local = local_node_for(settings)
        self.settings = settings
        self.node_id = node_id
        self.nodes = NodeWatch(settings.nodes, settings.dns_refresh)  # dns: looked up again

    def _client(self, address: str | None = None) -> NodeClient:
        if address is None:
            nodes = sorted(self.nodes.current(), key=lambda a: str(a) != self.local)
            return admin.connect(dataclasses.replace(self.settings, nodes=nodes))
        return NodeClient(
            parse_address(address),
            self.settings.credential(),
            self.settings.timeout,
            client_context(self.settings),
        )

    def lookup(self, name: str) -> tuple[str, DatasetEntry | LoadingEntry] | None:
        """The node that answered and its listing of dataset `name` (None: not listed)."""
        with self._client() as client:
            listing = client.call(List())
        for d in listing.datasets:
            if d.name == name:
                return listing.node, d
        return None

    def prepare(self, volume: Volume, timeout: float, may_load: bool = True) -> Volume:
        """The volume with its dataset ready (and its lease, for a leased dataset): NotFound
        for an unknown dataset and no source, NotAllowed for one the policy does not let it
        load (`may_load`), NotResident after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for _ in range(3):  # unloaded between ready and the lease: look again
            found = self.lookup(volume.dataset)
            if found is None or found[1].state == "failed":
                if not volume.source:
                    why = f" (its load failed: {found[1].error})" if found else ""
                    raise NotFound(
                        f"dataset {volume.dataset} is not in the cache{why} and the volume "
                        f"names no source to load it from"
                    )
                if not may_load:
                    raise NotAllowed(
                        f"dataset {volume.dataset} is not in the cache, and the volume policy "
                        f"does not let this namespace load it"
                    )
                self._start(volume)
            node, info = self._wait_ready(volume, deadline)
            if not isinstance(info, DatasetEntry) or info.lifetime != "leased":
                return volume
            try:
                return self._lease(volume, node, info)
            except NotFound:
                continue
        raise NotResident(f"dataset {volume.dataset} kept being unloaded while it was published")

    def _start(self, volume: Volume) -> None:
        lifetime = "offline" if volume.lifetime == "persistent" else "leased"
        with self._client() as client:
            try:
                admin.start_preload(
                    client, volume.dataset, normalize_source(volume.source), lifetime
                )
                log.info(
                    "volume %s: preloading %s as %s (%s)",
                    volume.volume_id, volume.source, volume.dataset, lifetime,
                )  # fmt: skip
            except AlreadyExists:
                pass  # another volume (or job) started it meanwhile: wait for that load

    def _wait_ready(
        self, volume: Volume, deadline: float
    ) -> tuple[str, DatasetEntry | LoadingEntry]:
        name = volume.dataset
        with self._client() as client:
            p = admin.load_status(client, name)
            while not admin.preload_done(p, f"preload of {name} from {volume.source}"):
                left = deadline - time.monotonic()
                if left <= 0:
                    done, total = p.bytes_done, p.bytes_total
                    raise NotResident(
                        f"dataset {name} is not resident yet ({p.state}, {done} of {total} "
                        f"bytes): its load goes on, the next publish waits for it"
                    )
                wait = min(admin.PROGRESS_WAIT_S, max(left, 0.05))
                p = admin.load_status(client, name, wait_for_change_after=p.version, wait_s=wait)
        found = self.lookup(name)
        if found is None:
            raise NotFound(f"dataset {name} was unloaded as soon as it was ready")
        return found

    def _lease(self, volume: Volume, node: str, info: DatasetEntry) -> Volume:
        """`node`: the one that listed `info`, the lease's home when it names no members."""
        if volume.lease:
            return volume
        home = (info.members or [node])[0]
        holder = f"csi:{self.node_id}:{volume.volume_id}"
        acquire = LeaseAcquire(name=volume.dataset, uuid=info.uuid, holder=holder)
        with self._client(home) as client:
            held = client.call(acquire)
        log.info("volume %s: lease on %s at %s", volume.volume_id, volume.dataset, home)
        return dataclasses.replace(volume, lease=held.lease, lease_home=home)

    def release(self, volume: Volume) -> None:
        """End the volume's lease (the last one unloads its dataset); a node that forgot it
        (restarted, or the lease expired) has nothing to release."""
        if not volume.lease:
            return
        try:
            with self._client(volume.lease_home) as client:
                client.call(LeaseRelease(lease=volume.lease))
            log.info("volume %s: released its lease on %s", volume.volume_id, volume.dataset)
        except NotFound:
            pass

    def renew(self, volume: Volume) -> Volume:
        """Renew the volume's lease; a lost one (the node restarted, or the plugin was away
        past the ttl) is taken again. Returns the volume with the lease it holds now."""
        try:
            with self._client(volume.lease_home) as client:
                client.call(LeaseRenew(lease=volume.lease))
            return volume
        except NotFound:
            node, info = self.lookup(volume.dataset) or ("", None)
            if not isinstance(info, DatasetEntry) or info.state != "ready":
                log.warning("volume %s: dataset %s is gone", volume.volume_id, volume.dataset)
                return dataclasses.replace(volume, lease="", lease_home="")
            log.warning("volume %s: lease on %s was lost; taking a new one", volume.volume_id,
                        volume.dataset)  # fmt: skip
            return self._lease(dataclasses.replace(volume, lease=""), node, info)


class LeaseRenewer:
    """A daemon thread renewing the leases of every recorded volume, a third of the ttl apart."""

    def __init__(self, warm: WarmDatasets, records: VolumeRecords, lock: threading.Lock):
        self.warm = warm
        self.records = records
        self.lock = lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kspeedfs-csi-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def renew_all(self) -> None:
        with self.lock:
            volumes = [v for v in self.records.all() if v.lease]
        for volume in volumes:
            try:
                renewed = self.warm.renew(volume)
            except KSpeedError as e:
                log.warning("volume %s: cannot renew its lease: %s", volume.volume_id, e)
                continue
            if renewed != volume:
                with self.lock:
                    if self.records.get(volume.target) == volume:  # not unpublished meanwhile
                        self.records.put(renewed)

    def _run(self) -> None:
        # At once first: the leases of the volumes adopted at start (the plugin listens by
        # now, so a slow node delays no registration).
        self.renew_all()
        while not self._stop.wait(self.warm.settings.lease_ttl / 3):
            self.renew_all()
