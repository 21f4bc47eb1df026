"""The read-through instances a node holds: each one's state, opened from its folder, and
the table of them by name."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import logging
import mmap
import os
from collections import Counter
from pathlib import Path

import numpy as np
import trio
import xxhash

from kspeedfs.format.contract.readthrough import LIMITS
from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import EPOCH_FILE, MANIFEST_FILE, SEGSUMS_FILE
from kspeedfs.format.manifest import Manifest
from kspeedfs.node.budget import Budgets
from kspeedfs.node.readthrough.places import InstancePlaces
from kspeedfs.node.readthrough.policy import EvictionPolicy
from kspeedfs.node.records import DatasetRecord
from kspeedfs.node.safedir import unlink_file
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

BASE_FILES = (MANIFEST_FILE, SEGSUMS_FILE, EPOCH_FILE)  # what an instance holds besides segments


@dataclasses.dataclass
class CachedDataset:
    """The node's state of one read-through dataset instance."""

    record: DatasetRecord
    manifest: Manifest
    layout: Layout
    sums: np.ndarray  # writable map of SEGSUMS_FILE
    epoch: np.ndarray  # writable map of EPOCH_FILE
    base_bytes: int  # manifest and side files
    places: InstancePlaces  # where its segments lie: the only writer of that
    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    lock: trio.Lock = dataclasses.field(default_factory=trio.Lock)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def uuid(self) -> str:
        return self.record.uuid

    @property
    def endpoint(self) -> str:
        return str(self.manifest.header.get("endpoint") or "")

    @property
    def max_memory(self) -> int:
        """Bytes of segments it may hold in memory (0: no cap; set when it was registered)."""
        return int(self.manifest.header.get("max_memory") or 0)

    @property
    def max_disk(self) -> int:
        """Bytes it may hold on the disk tier, segments and spilled copies (0: no cap)."""
        return int(self.manifest.header.get("max_disk") or 0)

    @property
    def min_memory(self) -> int:
        """Its floor: bytes in memory no other dataset's miss and no preload takes (0: none)."""
        return int(self.manifest.header.get("min_memory") or 0)

    @property
    def weight(self) -> int:
        """Its weight in the shares of the memory the uncapped datasets share (default 1)."""
        return int(self.manifest.header.get("weight") or 1)

    def limits(self) -> dict[str, int]:
        """Its caps, floor and weight as its manifest header keeps them (a refresh keeps them)."""
        return {k: int(self.manifest.header[k]) for k in LIMITS if self.manifest.header.get(k)}

    @property
    def segment_bytes(self) -> int:
        """Bytes of its segments in memory (what its cap counts)."""
        return self.record.stored - self.base_bytes

    @property
    def resident(self) -> collections.abc.Set[int]:
        """Its segments in memory (read-only: `places` changes them)."""
        return self.places.memory

    @property
    def on_disk(self) -> collections.abc.Set[int]:
        """Its segments on the disk tier (read-only: `places` changes them)."""
        return self.places.disk

    @property
    def disk_bytes(self) -> int:
        """Bytes of its segments on the disk tier."""
        return self.places.disk_bytes()

    def seg_len(self, seg: int) -> int:
        return int(self.manifest.seg_len[seg])

    @functools.cached_property
    def size(self) -> int:
        """Bytes of all its segments: what it would hold all in memory (its share's limit)."""
        return int(self.manifest.seg_len.sum())

    def holds(self, seg: int) -> bool:
        """Whether segment `seg` is on this node, in memory or on the disk tier."""
        return self.places.holds(seg)


def base_bytes(folder: Path) -> int:
    return sum((folder / f).stat().st_size for f in BASE_FILES)


def open_instance(
    record: DatasetRecord, verify: bool, budgets: Budgets
) -> tuple[CachedDataset, dict[int, float]]:
    """State of one instance from its folder: which segments are here (and sound), with
    their mtimes; unsound segment files are removed. Its places count in `budgets`."""
    m = Manifest(record.path / MANIFEST_FILE)
    sums = np.memmap(record.path / SEGSUMS_FILE, dtype="<u8", mode="r+")
    if sums.size != m.segments:
        raise DataError(f"{SEGSUMS_FILE} has the wrong length")
    epoch = np.memmap(record.path / EPOCH_FILE, dtype="<u8", mode="r+", shape=(1,))
    base = base_bytes(record.path)
    ds = CachedDataset(
        record, m, m.layout, sums, epoch, base, InstancePlaces(record, m.seg_len, budgets)
    )
    mtimes: dict[int, float] = {}
    for fname in os.listdir(record.path / "seg"):
        path = record.path / "seg" / fname
        try:
            seg = int(fname)
            st = path.stat()
            ok = (
                fname == f"{seg:08d}"  # the only name readers look for
                and 0 <= seg < m.segments
                and st.st_size == ds.seg_len(seg)
                and int(sums[seg]) != 0
            )
            if ok and verify:
                ok = file_checksum(path) == int(sums[seg])
        except (ValueError, OSError):
            ok = False
        if not ok:
            log.warning("dropping unsound cached segment %s of %s", fname, record.name)
            unlink_file(path)
            continue
        mtimes[seg] = st.st_mtime
    ds.places.found(mtimes, base)
    return ds, mtimes


def file_checksum(path: Path) -> int:
    """xxh3 of a file's bytes, never 0 (0 in SEGSUMS_FILE means "never filled")."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_intdigest(b"") or 1
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return xxhash.xxh3_64_intdigest(m) or 1


class Instances:
    """The read-through instances of this node by name; the eviction policy follows their
    resident segments. Also what the node knows of their sources: which changed, which are
    being listed here."""

    def __init__(self, store: SegmentStore, address: str, policy: EvictionPolicy):
        self.store = store
        self.address = address
        self.policy = policy
        self.by_name: dict[str, CachedDataset] = {}
        self.changed: dict[str, tuple[str, int]] = {}  # name -> (uuid, files changed at source)
        self.busy: set[str] = set()  # names being listed or refreshed here (not converged)
        self.stats: Counter[str] = Counter()  # node-wide: evictions, source reads and bytes
        self.evictions_by: Counter[str] = Counter()  # by the policy that chose them, "preload"

    def open(self, record: DatasetRecord, verify: bool) -> tuple[CachedDataset, dict[int, float]]:
        """The state of published instance `record` from its folder (`open_instance`), its
        places counted in the store's budgets; not in the table yet (`add`). Blocking."""
        return open_instance(record, verify, self.store.budgets)

    def find(self, name: str, uuid: str = "") -> CachedDataset:
        """The current instance of `name` (and of `uuid` when given), else NotFound."""
        ds = self.by_name.get(name)
        record = self.store.datasets.get(name)
        if ds is None or record is None or record.uuid != ds.uuid:
            raise NotFound(f"no read-through dataset named {name!r} on {self.address}")
        if uuid and uuid != ds.uuid:
            raise NotFound(f"dataset {name!r} was refreshed or loaded again")
        return ds

    def current(self, ds: CachedDataset) -> bool:
        """Whether `ds` is still the instance of its name here (not unloaded or refreshed)."""
        return self.by_name.get(ds.name) is ds

    def add(self, ds: CachedDataset, admit: bool = True) -> None:
        """`ds` is the instance of its name now; with `admit`, its resident segments enter the
        eviction policy (in segment order)."""
        self.by_name[ds.name] = ds
        if admit:
            for seg in sorted(ds.resident):
                self.policy.admitted((ds.name, seg))

    def forget(self, ds: CachedDataset) -> None:
        """Drop an instance from the table; its disk-tier claims go (the store removed its
        disk folder, segments and spilled copies, with the instance)."""
        if self.current(ds):
            del self.by_name[ds.name]
        ds.places.forget()
        for seg in ds.resident:
            self.policy.forgotten((ds.name, seg))
        self.policy.dropped_plan(ds.name)

    def mark_changed(self, ds: CachedDataset) -> None:
        """A fill found the source changed: shown stale until the next check counts it."""
        uid, n = self.changed.get(ds.name, ("", 0))
        if uid != ds.uuid or n == 0:
            self.changed[ds.name] = (ds.uuid, 1)
