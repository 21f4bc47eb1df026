"""Which segment memory is registered for remote reads: registered with a dataset, gone before it.

The bookkeeping lives here; the registration itself is a `Registrar` (pyverbs on a node with a
device, a fake in tests), so that the life cycle can be checked without a device.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kspeedfs.format.errors import DataError
from kspeedfs.rdma.wire import SegmentKey, SegmentTable

log = logging.getLogger(__name__)


class Region(Protocol):
    """Registered memory: readable remotely with `rkey` until `close()`."""

    addr: int
    length: int
    rkey: int

    def close(self) -> None: ...


class Registrar(Protocol):
    def register(self, buffer: Any, length: int) -> Region:
        """Register `length` bytes of `buffer` (an mmap) for remote reads."""
        ...


class SegmentRegistry:
    """Thread-safe: registration runs in worker threads, lookups on the event loop."""

    def __init__(self, registrar: Registrar):
        self.registrar = registrar
        self._lock = threading.Lock()
        self._tables: dict[str, SegmentTable] = {}
        self._regions: dict[str, list[Region]] = {}
        # Bumped by every deregistration, so that a registration that raced with an unload
        # finds out and undoes itself instead of pinning an unloaded dataset forever.
        self._epoch: dict[str, int] = {}
        self._generations = itertools.count(1)
        # One registration per dataset at a time: a second caller waits and gets its table.
        self._registering: dict[str, threading.Lock] = {}

    def epoch(self, name: str) -> int:
        """Changes whenever a dataset is deregistered; read it before looking the dataset up."""
        with self._lock:
            return self._epoch.get(name, 0)

    def register(
        self,
        name: str,
        uuid: str,
        count: int,
        segments: Mapping[int, Any],
        length_of: Callable[[Any], int] = len,
        epoch: int | None = None,
    ) -> SegmentTable | None:
        """Register a dataset's held segments (index -> buffer) out of `count`: the new table,
        or None when the dataset was deregistered after `epoch` was read. Idempotent for the
        same uuid; a table of another uuid (the dataset was reloaded) is replaced."""
        with self._lock:
            name_lock = self._registering.setdefault(name, threading.Lock())
        with name_lock:
            with self._lock:
                current = self._tables.get(name)
                now = self._epoch.get(name, 0)
            if epoch is None:
                epoch = now
            if epoch != now:
                return None
            if current is not None and current.uuid == uuid:
                return current
            if current is not None:
                self.deregister(name)
                epoch += 1
            regions: dict[int, Region] = {}
            try:
                for seg, buffer in sorted(segments.items()):
                    if not 0 <= seg < count:
                        raise DataError(f"segment {seg} of {name} out of range")
                    length = length_of(buffer)
                    if length:
                        regions[seg] = self.registrar.register(buffer, length)
            except BaseException:
                _close_all(regions.values())
                raise
            keys = [SegmentKey(0, 0, 0)] * count
            for seg, r in regions.items():
                keys[seg] = SegmentKey(r.addr, r.length, r.rkey)
            with self._lock:
                if self._epoch.get(name, 0) == epoch:
                    table = SegmentTable(name, uuid, next(self._generations), tuple(keys))
                    self._tables[name] = table
                    self._regions[name] = list(regions.values())
                    return table
            log.info("dataset %s went away while it was being registered; dropping it", name)
            _close_all(regions.values())
            return None

    def deregister(self, name: str) -> bool:
        """Deregister every segment of a dataset; once this returns no remote read reaches it."""
        with self._lock:
            self._epoch[name] = self._epoch.get(name, 0) + 1
            self._tables.pop(name, None)
            regions = self._regions.pop(name, [])
        _close_all(regions)
        return bool(regions)

    def table(self, name: str) -> SegmentTable | None:
        with self._lock:
            return self._tables.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._tables)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            regions = [r for rs in self._regions.values() for r in rs]
            return {
                "datasets": len(self._tables),
                "regions": len(regions),
                "bytes": sum(r.length for r in regions),
            }

    def close(self) -> None:
        for name in self.names():
            self.deregister(name)


def _close_all(regions: Any) -> None:
    # Every region is closed even if one fails: a leaked registration pins memory for good.
    error: BaseException | None = None
    for r in regions:
        try:
            r.close()
        except Exception as e:
            log.error("could not deregister a memory region: %s", e)
            error = e
    if error is not None:
        raise DataError(f"could not deregister a memory region: {error}")
