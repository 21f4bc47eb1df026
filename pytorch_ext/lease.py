"""The job side of leases: one lease per dataset per process, renewed by a daemon thread."""

from __future__ import annotations

import logging
import os
import socket
import threading

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.leases import (
    LeaseAcquire,
    LeaseRelease,
    LeaseRenew,
)
from kspeedfs.format.errors import KSpeedError, NotFound
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Holds one lease on a dataset at its home node until released (or this process dies)."""

    def __init__(self, settings: Settings, home: str, name: str, instance: str):
        self.home = home
        self.name = name
        self.instance = instance
        self.pid = os.getpid()
        self.lease_id = ""
        self.ttl = settings.lease_ttl
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._acquire = LeaseAcquire(name=name, uuid=instance, holder=self.holder)
        self._client = NodeClient(
            parse_address(home), settings.credential(), settings.timeout, client_context(settings)
        )
        self._lock = threading.Lock()  # the renewal thread and release share one connection
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease; raises NotFound when the dataset is gone (or being unloaded)."""
        with self._lock:
            held = self._client.call(self._acquire)
        self.lease_id = held.lease
        self.ttl = held.ttl or self.ttl
        log.debug("lease on %s at %s: %s (ttl %.1fs)", self.name, self.home, held, self.ttl)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._renew_loop, name=f"kspeedfs-lease-{self.name}", daemon=True
            )
            self._thread.start()

    def _renew_loop(self) -> None:
        failing = False
        # A third of the ttl: two renewals can be lost before the lease expires.
        while not self._stop.wait(self.ttl / 3):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        self._client.call(LeaseRenew(lease=self.lease_id))
                    except NotFound:
                        # The node restarted or we stalled past the ttl: take a new one.
                        held = self._client.call(self._acquire)
                        self.lease_id = held.lease
                        log.warning("lease on %s was lost; took a new one", self.name)
                if failing:
                    log.warning("lease on %s renewed again", self.name)
                failing = False
            except NotFound:
                log.warning("dataset %s is gone from the cache; no lease held", self.name)
                return
            except KSpeedError as e:
                if not failing:
                    log.warning("cannot renew the lease on %s: %s", self.name, e)
                failing = True

    def release(self) -> None:
        """End the lease; the node unloads the dataset when it was the last one."""
        if os.getpid() != self.pid or self._stop.is_set():
            return  # a forked child holds a copy of this object, not the lease
        self._stop.set()
        try:
            with self._lock:
                released = self._client.call(LeaseRelease(lease=self.lease_id))
            log.debug("released the lease on %s: %s", self.name, released)
        except KSpeedError as e:
            log.warning(
                "could not release the lease on %s (it expires by itself): %s", self.name, e
            )
        finally:
            self._client.close()


_held: dict[tuple[str, str, str], tuple[LeaseKeeper, int]] = {}
_held_lock = threading.Lock()


def hold(settings: Settings, home: str, name: str, instance: str) -> tuple[str, str, str]:
    """Count one more user of the process's lease on an instance, taking it if it is the first."""
    key = (home, name, instance)
    with _held_lock:
        keeper, users = _held.get(key, (None, 0))
        if keeper is None or keeper.pid != os.getpid():
            keeper, users = LeaseKeeper(settings, home, name, instance), 0
            keeper.acquire()
        _held[key] = (keeper, users + 1)
    return key


def unhold(key: tuple[str, str, str], pid: int) -> None:
    """One user fewer; the last one releases the lease (only in the process that took it)."""
    if os.getpid() != pid:
        return
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        keeper, users = entry
        if users > 1:
            _held[key] = (keeper, users - 1)
            return
        del _held[key]
    keeper.release()


def release_all() -> None:
    """Release every lease this process holds (datasets stay usable until the node unloads)."""
    with _held_lock:
        keepers = [k for k, _ in _held.values() if k.pid == os.getpid()]
        _held.clear()
    for keeper in keepers:
        keeper.release()
