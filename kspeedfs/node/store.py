"""The node's shared-memory folder: published datasets, staging, the budget, recovery.

Layout under shm_dir:
    datasets/NAME/   published datasets (meta.json, manifest.ksm, seg/NNNNNNNN)
    staging/NAME.ID/ preloads in progress; renamed into datasets/ when complete (atomic publish)
    trash/           unloaded or broken datasets, removed right away (mapped pages live on)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kspeedfs.format.errors import AlreadyExists, DataError, KSpeedError, NoSpace, NotFound
from kspeedfs.format.localdata import (
    MANIFEST_FILE,
    META_FILE,
    LocalDataset,
    read_meta,
    segment_path,
)
from kspeedfs.format.names import validate_name
from kspeedfs.format.readthrough_view import open_local
from kspeedfs.format.units import format_size

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DatasetRecord:
    name: str
    uuid: str
    source: str
    lifetime: str  # "offline" (until unload) or "leased" (until the last lease ends)
    replicas: int
    files: int
    bytes: int  # file bytes in the dataset
    stored: int  # bytes of memory it takes (segments + manifest)
    created: float
    path: Path
    segments: int = 0  # segments in the whole dataset
    held: list[int] = dataclasses.field(default_factory=list)  # the ones this node holds
    members: list[str] = dataclasses.field(default_factory=list)  # nodes it was placed over

    def to_wire(self) -> dict[str, Any]:
        """The one shape of a published dataset on the wire (list, progress): its record, and
        the fields of a finished load's progress."""
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        d.update(
            state="ready",
            files_total=self.files,
            bytes_total=self.bytes,
            files_done=self.files,
            bytes_done=self.bytes,
            elapsed=0.0,
            error="",
        )
        return d


class SegmentStore:
    def __init__(self, root: Path, budget: int):
        self.root = root
        self.budget = budget
        self.datasets_dir = root / "datasets"
        self.staging_dir = root / "staging"
        self.trash_dir = root / "trash"
        self.datasets: dict[str, DatasetRecord] = {}
        self.reserved: dict[str, int] = {}  # name -> bytes reserved by a preload in progress
        self._lock = threading.Lock()
        self._open: dict[str, LocalDataset] = {}
        # Followers of the datasets (the RDMA registration): called with a dataset's name once
        # it is visible (also for each one found at start), and before its files are unlinked.
        self.on_publish: list[Callable[[str], None]] = []
        self.before_unload: list[Callable[[str], None]] = []
        self._reclaimers: list[Callable[[int], int]] = []

    def add_reclaimer(self, reclaim: Callable[[int], int]) -> None:
        """Someone holding evictable (read-through) memory: when a reservation does not fit,
        `reclaim(nbytes)` is asked to free that much and returns the bytes it freed."""
        self._reclaimers.append(reclaim)

    def recover(self, verify: bool) -> None:
        """Find the datasets a previous daemon published; drop staging leftovers and broken ones."""
        for d in (self.datasets_dir, self.staging_dir, self.trash_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for leftover in list(self.staging_dir.iterdir()) + list(self.trash_dir.iterdir()):
            log.info("removing unfinished or unloaded data %s", leftover.name)
            shutil.rmtree(leftover, ignore_errors=True)
        for path in sorted(self.datasets_dir.iterdir()):
            try:
                record = self._check(path, verify)
            except (KSpeedError, OSError, ValueError, KeyError) as e:
                log.error("dropping broken dataset %s: %s", path.name, e)
                self._discard(path)
                continue
            self.datasets[record.name] = record
            log.info(
                "found dataset %s: %d files, %s",
                record.name,
                record.files,
                format_size(record.bytes),
            )
        for name in sorted(self.datasets):
            for hook in self.on_publish:
                hook(name)

    def _check(self, path: Path, verify: bool) -> DatasetRecord:
        meta = read_meta(path)
        validate_name(meta["name"])
        if meta["name"] != path.name:
            raise DataError("meta.json names another dataset")
        ds = LocalDataset(path)
        m = ds.manifest
        if m.uuid != meta["uuid"]:
            raise DataError("manifest and meta.json disagree")
        for seg in meta.get("held", range(m.segments)):
            p = segment_path(path, seg)
            if p.stat().st_size != int(m.seg_len[seg]):
                raise DataError(f"segment {seg} has the wrong size")
            if verify and xxhash.xxh3_64_intdigest(ds.segment(seg)) != int(m.seg_checksum[seg]):
                raise DataError(f"segment {seg} fails its checksum")
        return self._record(path, meta, m.nbytes)

    def _record(self, path: Path, meta: dict[str, Any], manifest_bytes: int) -> DatasetRecord:
        return DatasetRecord(
            name=meta["name"],
            uuid=meta["uuid"],
            source=meta["source"],
            lifetime=meta["lifetime"],
            replicas=int(meta.get("replicas", 1)),
            files=int(meta["files"]),
            bytes=int(meta["bytes"]),
            stored=int(meta["stored"]),
            created=float(meta["created"]),
            path=path,
            segments=int(meta.get("segments", 0)),
            held=[int(k) for k in meta.get("held", [])],
            members=[str(n) for n in meta.get("members", [])],
        )

    def used(self) -> int:
        return sum(r.stored for r in self.datasets.values()) + sum(self.reserved.values())

    def reserve(self, name: str, nbytes: int) -> None:
        """Claim budget for a preload before it starts; refuse what cannot fit."""
        with self._lock:
            if name in self.datasets or name in self.reserved:
                raise AlreadyExists(f"dataset {name!r} is already loaded or loading")
            for reclaim in self._reclaimers:
                if self.budget - self.used() >= nbytes:
                    break
                reclaim(nbytes - (self.budget - self.used()))
            if self.budget - self.used() < nbytes:
                self._raise_no_space(nbytes)
            st = os.statvfs(self.root)
            fs_free = st.f_bavail * st.f_frsize
            if nbytes > fs_free:
                raise NoSpace(
                    f"dataset needs {format_size(nbytes)} but {self.root} has only "
                    f"{format_size(fs_free)} free"
                )
            self.reserved[name] = nbytes

    def _raise_no_space(self, nbytes: int) -> None:
        free = self.budget - self.used()
        raise NoSpace(
            f"dataset needs {format_size(nbytes)} on this node but only "
            f"{format_size(max(free, 0))} of its {format_size(self.budget)} budget is free"
        )

    def release(self, name: str) -> None:
        with self._lock:
            self.reserved.pop(name, None)

    def new_staging(self, name: str) -> Path:
        path = self.staging_dir / f"{name}.{uuid.uuid4().hex[:12]}"
        (path / "seg").mkdir(parents=True)
        return path

    def publish(self, staging: Path, meta: dict[str, Any]) -> DatasetRecord:
        """Make a complete staging folder visible in one rename."""
        name = meta["name"]
        with open(staging / META_FILE, "w") as f:
            json.dump(meta, f)
        final = self.datasets_dir / name
        with self._lock:
            try:
                os.rename(staging, final)
            except OSError as e:
                raise AlreadyExists(f"dataset {name!r} appeared while loading: {e}") from None
            record = self._record(final, meta, (final / MANIFEST_FILE).stat().st_size)
            self.datasets[name] = record
            self.reserved.pop(name, None)
        for hook in self.on_publish:
            hook(name)
        return record

    def unload(self, name: str) -> DatasetRecord:
        with self._lock:
            record = self.datasets.pop(name, None)
            if record is None:
                raise NotFound(f"no dataset named {name!r}")
            self._open.pop(name, None)
        for hook in self.before_unload:
            hook(name)
        self._discard(record.path)
        return record

    def _discard(self, path: Path) -> None:
        # Rename first so the name is free at once; unlink keeps mapped pages valid for readers.
        dest = self.trash_dir / f"{path.name}.{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, dest)
        except OSError:
            dest = path
        shutil.rmtree(dest, ignore_errors=True)

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def open(self, name: str) -> LocalDataset:
        ds = self._open.get(name)
        if ds is None:
            record = self.datasets.get(name)
            if record is None:
                raise NotFound(f"no dataset named {name!r}")
            ds = self._open[name] = open_local(record.path)
        return ds
