"""The node's shared-memory folder: published datasets, staging, recovery (its budgets: budget.py).

Layout under shm_dir:
    datasets/NAME/   published datasets (meta.json, manifest.ksm, seg/NNNNNNNN)
    staging/NAME.ID/ preloads in progress; renamed into datasets/ when complete (atomic publish)
    trash/           unloaded or broken datasets, removed right away (mapped pages live on)

The disk tier (a node with `spill_dir`): segments of preloaded datasets that did not fit the
memory budget, under DISK_ROOT/NAME.UUID/seg/NNNNNNNN (staged under DISK_ROOT/.staging/), named
in the dataset's meta.json ("disk", "disk_dir"). They count in the disk budget, not the memory
one, and move to memory (`promote`) when memory frees up. DISK_ROOT is SPILL_DIR/tier; the
spill folder and the tier are checked and owned as the shm folder is (safedir), so that readers
in the group read disk-tier segments (by pread: localdata) as they map memory ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import mmap
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
    StaleDataset,
)
from kspeedfs.format.localdata import (
    HASH_CHUNK,
    MANIFEST_FILE,
    META_FILE,
    DamagedSegment,
    LocalDataset,
    segment_path,
)
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.names import validate_name
from kspeedfs.format.readthrough_view import READTHROUGH, open_local
from kspeedfs.format.units import format_size
from kspeedfs.node.budget import Budgets
from kspeedfs.node.safedir import (
    DIR_FLAGS,
    FILE_MODE,
    claim_dir,
    open_owned_dir,
    open_owned_subdir,
    open_subdir,
    remove_beneath,
    resolve_group,
    restrict_files,
    seal_segment,
    unlink_segment,
    unseal_segment,
)

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
    disk: list[int] = dataclasses.field(default_factory=list)  # held ones on the disk tier
    disk_stored: int = 0  # bytes of the disk tier it takes
    # Caps on this node (0: none): the most bytes of its segments in memory and on the disk
    # tier (a read-through dataset's: its spill folder share, kept by the read-through cache).
    max_memory: int = 0
    max_disk: int = 0

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
    """The shm folder. Owned by the node (checked at start), readable by its uid and `group`;
    everything in it is reached through descriptors of its three folders, never a symlink."""

    def __init__(
        self,
        root: Path,
        budget: int,
        group: str = "",
        disk_root: Path | None = None,
        disk_budget: int = 0,
    ):
        self.root = root
        self.group = group
        # None: no disk tier. Its parent is the spill folder, which the read-through spill
        # shares (and its budget, where the spill gives way).
        self.disk_root = disk_root
        # "datasets", "staging", "trash" (of the shm folder), "tier" and "tier_staging" (of the
        # disk tier) -> open folder
        self._fd: dict[str, int] = {}
        self._gid = -1  # the readers' group, once recover() resolved it
        self.datasets_dir = root / "datasets"
        self.staging_dir = root / "staging"
        self.trash_dir = root / "trash"
        self.datasets: dict[str, DatasetRecord] = {}
        # The memory and disk budgets: they count these datasets, and their lock is the
        # store's (a claim becomes a dataset's bytes under it).
        self.budgets = Budgets(root, budget, self.datasets, disk_root, disk_budget)
        self._lock = self.budgets.lock
        self._open: dict[str, LocalDataset] = {}
        # Followers of the datasets (the RDMA registration): called with a dataset's name once
        # it is visible (also for each one found at start), and before its files are unlinked.
        self.on_publish: list[Callable[[str], None]] = []
        self.before_unload: list[Callable[[str], None]] = []
        # Told (from any thread) the segments the node's own reads found damaged.
        self.on_damage_found: list[Callable[[str, list[int]], None]] = []
        # Segments recover() found damaged and quarantined: (dataset, segment), to fetch again.
        self.damaged_at_start: list[tuple[str, int]] = []

    def recover(self, verify: bool) -> None:
        """Check and open the folders; find the datasets a previous daemon published; drop
        staging leftovers and broken ones. Refuses (InvalidArgument) a folder others could
        change."""
        self._open_folders()
        for folder in ("staging", "trash"):
            for leftover in sorted(os.listdir(self._fd[folder])):
                log.info("removing unfinished or unloaded data %s", leftover)
                remove_beneath(self._fd[folder], leftover)
        datasets_fd = self._fd["datasets"]
        for name in sorted(os.listdir(datasets_fd)):
            path = self.datasets_dir / name
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=datasets_fd, follow_symlinks=False).st_mode):
                    raise DataError("it is a symlink, not a dataset folder")
                record, damaged = self._check(path, verify)
            except (KSpeedError, OSError, ValueError, KeyError) as e:
                log.error("dropping broken dataset %s: %s", name, e)
                self._discard(name)
                continue
            self.datasets[record.name] = record
            for seg, why in damaged:
                # That segment, not the dataset: quarantined, and fetched again (the scrubber
                # takes `damaged_at_start`).
                log.error("segment %d of %s %s: quarantined, to be fetched again", seg, name, why)
                self.drop_segment(name, seg)
                self.damaged_at_start.append((name, seg))
            if record.lifetime != READTHROUGH:  # (one a node before sealing left: sealed now)
                with _closing(os.open(name, DIR_FLAGS, dir_fd=datasets_fd)) as fd:
                    _seal_segments(fd)
            log.info(
                "found dataset %s: %d files, %s",
                record.name,
                record.files,
                format_size(record.bytes),
            )
        self._recover_disk()
        for name in sorted(self.datasets):
            for hook in self.on_publish:
                hook(name)

    def _open_folders(self) -> None:
        """Open the shm folder and, with a disk tier, the spill folder and its tier folder:
        each checked before any is changed (a refusal leaves them all as they were), then
        given the readers' group; then the folders inside them."""
        self._gid = resolve_group(self.group)
        owned = [open_owned_dir(self.root, "shm folder")]
        try:
            if self.disk_root is not None:
                owned.append(open_owned_dir(self.disk_root.parent, "spill folder"))
                tier = self.disk_root.name
                owned.append(open_owned_subdir(owned[1], tier, self.disk_root, "disk tier folder"))
            for fd in owned:
                claim_dir(fd, self._gid)
            for name in ("datasets", "staging", "trash"):
                self._fd[name] = open_subdir(owned[0], name, self.root / name)
            if self.disk_root is not None:
                self._fd["tier"] = os.dup(owned[2])
                shown = self.disk_root / DISK_STAGING
                self._fd["tier_staging"] = open_subdir(
                    owned[2], DISK_STAGING, shown, "disk tier folder"
                )
        finally:
            for fd in owned:
                os.close(fd)

    def _recover_disk(self) -> None:
        """Drop the disk tier's staging leftovers and the folders of datasets that are gone;
        give the kept ones the readers' group and modes (a tier made before they had them)."""
        if self.disk_root is None:
            return
        tier = self._fd["tier"]
        keep = {
            f"{r.name}.{r.uuid}"
            for r in self.datasets.values()
            if r.disk or r.lifetime == READTHROUGH  # read-through: the cache checks its own
        }
        readthrough = {
            f"{r.name}.{r.uuid}" for r in self.datasets.values() if r.lifetime == READTHROUGH
        }
        for name in sorted(os.listdir(tier)):
            if name == DISK_STAGING:
                continue
            if name not in keep:
                log.info("removing disk-tier data of a dataset that is gone: %s", name)
                remove_beneath(tier, name)
                continue
            with _closing(self._open_disk_instance(name)) as fd:
                claim_dir(fd, self._gid)
                restrict_files(fd, self._gid)
                if name not in readthrough:
                    _seal_segments(fd)
        for leftover in sorted(os.listdir(self._fd["tier_staging"])):
            remove_beneath(self._fd["tier_staging"], leftover)

    def _open_disk_instance(self, key: str, create: bool = False) -> int:
        """A descriptor of the disk tier's folder `key` (NAME.UUID), made when `create`; never
        through a symlink (OSError)."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(key, 0o750, dir_fd=self._fd["tier"])
        return os.open(key, DIR_FLAGS, dir_fd=self._fd["tier"])

    def _check(self, path: Path, verify: bool) -> tuple[DatasetRecord, list[tuple[int, str]]]:
        """A published dataset found at start, and its held segments that are damaged (the
        wrong size, or with `verify` the wrong checksum) with why: those cost themselves, not
        the dataset. DataError (and OSError...) for a dataset that cannot be kept at all."""
        meta = self._read_meta(path.name)
        validate_name(meta["name"])
        if meta["name"] != path.name:
            raise DataError("meta.json names another dataset")
        ds = LocalDataset(path)
        m = ds.manifest
        if m.uuid != meta["uuid"]:
            raise DataError("manifest and meta.json disagree")
        on_disk = set(meta.get("disk", []))
        if on_disk and (self.disk_root is None or Path(meta["disk_dir"]) != self._disk_dir(meta)):
            raise DataError("its disk-tier segments are not in this node's disk tier")
        if on_disk:  # a real folder of the tier, not a symlink (OSError: dropped as broken)
            os.close(self._open_disk_instance(self._disk_dir(meta).name))
        damaged = []
        for seg in meta.get("held", range(m.segments)):
            p = segment_path(Path(meta["disk_dir"]) if seg in on_disk else path, seg)
            try:
                why = segment_fault(p, int(m.seg_len[seg]), int(m.seg_checksum[seg]) * verify)
            except FileNotFoundError:
                why = "is missing"
            if why:
                damaged.append((int(seg), why))
        return self._record(path, meta, m.nbytes), damaged

    def _read_meta(self, name: str) -> dict[str, Any]:
        folder = os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])
        try:
            fd = os.open(META_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd) as f:
            meta: dict[str, Any] = json.load(f)
        return meta

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
            disk=[int(k) for k in meta.get("disk", [])],
            disk_stored=int(meta.get("disk_stored", 0)),
            max_memory=int(meta.get("max_memory", 0)),
            max_disk=int(meta.get("max_disk", 0)),
        )

    def memory_cap_room(self, record: DatasetRecord) -> int | None:
        """Bytes of segments a preloaded dataset may still add to memory under its cap (None:
        no cap; a read-through dataset's cap is the read-through cache's to keep)."""
        if not record.max_memory or record.lifetime == READTHROUGH:
            return None
        seg_len = self.open(record.name).manifest.seg_len
        on_disk = set(record.disk)
        return record.max_memory - sum(int(seg_len[k]) for k in record.held if k not in on_disk)

    def _disk_dir(self, meta: dict[str, Any]) -> Path:
        assert self.disk_root is not None
        return self.disk_root / f"{validate_name(meta['name'])}.{meta['uuid']}"

    def new_staging(self, name: str) -> Path:
        return self.staging_dir / _new_staging_folder(self._fd["staging"], name)

    def new_disk_staging(self, name: str) -> Path:
        """A staging folder on the disk tier (with its seg/), for a preload's disk segments."""
        if self.disk_root is None:
            raise NoSpace("this node has no disk tier (spill_dir)")
        folder = _new_staging_folder(self._fd["tier_staging"], name)
        return self.disk_root / DISK_STAGING / folder

    def discard_disk_staging(self, staging: Path) -> None:
        if self.disk_root is not None:
            remove_beneath(self._fd["tier_staging"], self._disk_staged_name(staging))

    def _staged_name(self, staging: Path) -> str:
        if staging.parent != self.staging_dir or staging.name in ("", ".", ".."):
            raise InvalidArgument(f"not a staging folder of this node: {staging}")
        return staging.name

    def _disk_staged_name(self, staging: Path) -> str:
        assert self.disk_root is not None
        if staging.parent != self.disk_root / DISK_STAGING or staging.name in ("", ".", ".."):
            raise InvalidArgument(f"not a disk-tier staging folder of this node: {staging}")
        return staging.name

    def publish(
        self, staging: Path, meta: dict[str, Any], disk_staging: Path | None = None
    ) -> DatasetRecord:
        """Make a complete staging folder visible in one rename, its files FILE_MODE; its
        disk-tier part (`disk_staging`, meta's "disk" segments) is put in place first."""
        name = validate_name(meta["name"])
        folder = self._staged_name(staging)
        meta = _with_caps(meta, staging / MANIFEST_FILE)
        if disk_staging is None and meta.get("lifetime") == READTHROUGH and self.disk_root:
            disk_staging = self.new_disk_staging(name)  # where its fills land when memory is full
        disk_final = None
        seal = meta.get("lifetime") != READTHROUGH  # (a read-through one's come and go)
        if disk_staging is not None:
            staged, disk_final = self._disk_staged_name(disk_staging), self._disk_dir(meta)
            with _closing(os.open(staged, DIR_FLAGS, dir_fd=self._fd["tier_staging"])) as fd:
                claim_dir(fd, self._gid)  # readers in the group map these segments too
                restrict_files(fd, self._gid)
                if seal:
                    _seal_segments(fd)
            os.rename(
                staged,
                disk_final.name,
                src_dir_fd=self._fd["tier_staging"],
                dst_dir_fd=self._fd["tier"],
            )
            meta = dict(meta, disk_dir=str(disk_final))
        staging_fd = os.open(folder, DIR_FLAGS, dir_fd=self._fd["staging"])
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(META_FILE, flags, FILE_MODE, dir_fd=staging_fd), "w") as f:
                json.dump(meta, f)
            restrict_files(staging_fd)
            if seal:
                _seal_segments(staging_fd)
        finally:
            os.close(staging_fd)
        final = self.datasets_dir / name
        with self._lock:
            try:
                os.rename(
                    folder, name, src_dir_fd=self._fd["staging"], dst_dir_fd=self._fd["datasets"]
                )
            except OSError as e:
                if disk_final is not None:
                    remove_beneath(self._fd["tier"], disk_final.name)
                raise AlreadyExists(f"dataset {name!r} appeared while loading: {e}") from None
            record = self._record(final, meta, (final / MANIFEST_FILE).stat().st_size)
            self.datasets[name] = record
            self.budgets.drop_claim(name)
            self.budgets.drop_claim(disk_claim(record.uuid))
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
        self._discard(record.path.name)
        if self.disk_root is not None:  # also a folder whose segments all moved to memory
            # Unlinked: a reader's map of a disk segment keeps its pages, as in memory.
            remove_beneath(self._fd["tier"], f"{record.name}.{record.uuid}")
        self.budgets.memory_freed()
        return record

    def _discard(self, name: str) -> None:
        """Remove datasets/NAME. Renamed first so the name is free at once; unlinking keeps
        mapped pages valid for readers."""
        dest = f"{name}.{uuid.uuid4().hex[:12]}"
        try:
            os.rename(name, dest, src_dir_fd=self._fd["datasets"], dst_dir_fd=self._fd["trash"])
        except OSError:
            remove_beneath(self._fd["datasets"], name)
            return
        remove_beneath(self._fd["trash"], dest)

    def _update_meta(self, folder: int, name: str, stored_delta: int, **changes: Any) -> None:
        """Replace meta.json of a published dataset (its folder `folder`) in one rename: its
        `stored` bytes moved by `stored_delta`, `changes` set. Called under _lock."""
        meta = self._read_meta(name)
        meta.update(changes, stored=int(meta["stored"]) + stored_delta)
        tmp = f".meta.{uuid.uuid4().hex[:12]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, FILE_MODE, dir_fd=folder), "w") as f:
            json.dump(meta, f)
        os.rename(tmp, META_FILE, src_dir_fd=folder, dst_dir_fd=folder)

    # Files added to a published instance (a meta index built after its preload): written under
    # a temporary name in a subfolder, put in place with one rename and counted then.
    def _instance_dir(self, name: str, instance: str) -> int:
        """A descriptor of the folder of dataset `name`, refused (StaleDataset) when it is
        not instance `instance` any more. Called under _lock, so the two agree."""
        record = self.datasets.get(name)
        if record is None or record.uuid != instance:
            raise StaleDataset(
                f"dataset {name!r} was unloaded or loaded again: the instance asked for is gone"
            )
        return os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])

    def write_into(
        self, name: str, instance: str, sub: str, filename: str, offset: int, data: bytes
    ) -> int:
        """Write `data` at `offset` of file `sub/filename` in a published instance (made, with
        its folder, when absent; emptied when offset is 0). Returns the file's size after."""
        with self._lock:
            folder = self._instance_dir(name, instance)
        with _closing(folder):
            try:
                os.mkdir(sub, 0o750, dir_fd=folder)
            except FileExistsError:
                pass
            with _closing(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                flags |= os.O_TRUNC if offset == 0 else 0
                with _closing(os.open(filename, flags, FILE_MODE, dir_fd=sub_fd)) as fd:
                    done = 0
                    while done < len(data):
                        done += os.pwrite(fd, data[done:], offset + done)
                    return os.fstat(fd).st_size

    def add_file(
        self, name: str, instance: str, sub: str, tmp: str, final: str, reservation: str
    ) -> int:
        """Put a complete file written as `sub/tmp` in place as `sub/final` with one rename (a
        reader sees no file or the whole one) and count it in the instance's stored bytes
        (meta.json, then the record) in place of its `reservation`. Returns the bytes added: 0
        when `final` is there already (tmp removed: nothing is counted twice)."""
        with self._lock:
            folder = self._instance_dir(name, instance)
            with _closing(folder), _closing(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                size = os.stat(tmp, dir_fd=sub_fd, follow_symlinks=False).st_size
                if _exists(final, sub_fd):
                    os.unlink(tmp, dir_fd=sub_fd)
                    size = 0
                else:
                    # Counted before the rename: a crash between leaves the budget
                    # over-counted (safe), never a file it does not count.
                    self._update_meta(folder, name, size)
                    os.rename(tmp, final, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            self.datasets[name].stored += size
            self.budgets.drop_claim(reservation)
        return size

    def remove_file(self, name: str, instance: str, sub: str, filename: str, counted: bool) -> int:
        """Remove file `sub/filename` of an instance (unlinked: a reader's map stays valid); a
        `counted` one leaves its stored bytes too. Returns its size (0 when it is absent)."""
        with self._lock:
            folder = self._instance_dir(name, instance)
            with _closing(folder):
                try:
                    with _closing(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                        size = os.stat(filename, dir_fd=sub_fd, follow_symlinks=False).st_size
                        os.unlink(filename, dir_fd=sub_fd)
                except FileNotFoundError:
                    return 0  # no such folder, or no such file in it
                if counted:
                    self._update_meta(folder, name, -size)
                    self.datasets[name].stored -= size
        if counted and size:
            self.budgets.memory_freed()
        return size

    def files_in(self, name: str, instance: str, sub: str) -> list[str]:
        """The names in folder `sub` of an instance ([] when it has none)."""
        with self._lock:
            folder = self._instance_dir(name, instance)
        with _closing(folder):
            try:
                with _closing(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                    return sorted(os.listdir(sub_fd))
            except FileNotFoundError:
                return []

    # Control plane (healing, rebalance): one more segment in a published dataset.
    def add_segment(
        self, name: str, seg: int, length: int, fill: Callable[[memoryview], None]
    ) -> None:
        """Add a segment this node did not hold to a published dataset: `fill` writes its
        `length` bytes straight into the new file's mapping (a heal receives from a peer into
        it: no buffer between the socket and tmpfs) and raises to have it thrown away. Made
        beside the segment folder, then renamed into it, so a reader never sees part of one;
        meta.json and the record learn it; the next open() maps it. When memory has no room
        for it, it goes to the disk tier (where there is one)."""
        record = self.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        # Reserved while it arrives, so that a preload admitted meanwhile does not count on
        # the same bytes; counted in the dataset's bytes once it is in place.
        reservation = f"segment:{name}:{seg}:{uuid.uuid4().hex[:12]}"
        what = f"segment {seg} of {name}"
        try:
            room = self.memory_cap_room(record)
            if room is not None and length > room:
                raise NoSpace(f"{what} would take it past its --max-memory on this node")
            # Called in a thread: no eviction (the read-through cache is the event loop's).
            self.budgets.reserve(reservation, length, what=what, evict=False)
        except NoSpace:
            if self.disk_root is None or record.lifetime == READTHROUGH:
                raise
            if record.max_disk and record.disk_stored + length > record.max_disk:
                raise NoSpace(f"{what} would take it past its --max-disk on this node") from None
            self.budgets.reserve(reservation, length, what=what, tier="disk", evict=False)
            try:
                self._add_disk_segment(record, seg, length, fill, reservation)
            finally:
                self.budgets.release(reservation)
            return
        try:
            self._add_segment(record, seg, length, fill, reservation)
        finally:
            self.budgets.release(reservation)

    def _add_disk_segment(
        self,
        record: DatasetRecord,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        reservation: str,
    ) -> None:
        """add_segment onto the disk tier: made in the instance's disk folder, as in memory."""
        assert self.disk_root is not None
        disk_dir = self.disk_root / f"{record.name}.{record.uuid}"
        with _closing(self._open_disk_instance(disk_dir.name, create=True)) as disk_fd:
            self._put_segment(disk_fd, seg, length, fill, seal=True)
        folder = os.open(record.name, DIR_FLAGS, dir_fd=self._fd["datasets"])
        with _closing(folder), self._lock:
            held = sorted(set(record.held) | {seg})
            disk = sorted(set(record.disk) | {seg})
            stored = record.disk_stored + length
            changes = {"held": held, "disk": disk, "disk_stored": stored}
            self._update_meta(folder, record.name, 0, **changes, disk_dir=str(disk_dir))
            record.held, record.disk, record.disk_stored = held, disk, stored
            self.budgets.drop_claim(reservation)
            self._open.pop(record.name, None)

    def _add_segment(
        self,
        record: DatasetRecord,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        reservation: str,
    ) -> None:
        name = record.name
        folder = os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])
        try:
            self._put_segment(folder, seg, length, fill, seal=record.lifetime != READTHROUGH)
            with self._lock:
                held = sorted(set(record.held) | {seg})
                self._update_meta(folder, name, length, held=held)
                record.held = held
                record.stored += length
                self.budgets.drop_claim(reservation)
                self._open.pop(name, None)
        finally:
            os.close(folder)

    def drop_segment(self, name: str, seg: int) -> int:
        """Remove a segment this node no longer owns (its new owners hold it). Unlinked, so a
        reader that mapped it keeps valid pages; meta.json and the record forget it. Returns
        the bytes freed."""
        folder = os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])
        try:
            with self._lock:
                record = self.datasets.get(name)
                if record is None or seg not in record.held:
                    return 0
                if seg in record.disk:
                    return self._drop_disk_segment(folder, record, seg)
                seg_fd = os.open("seg", DIR_FLAGS, dir_fd=folder)
                # What it counts in the budget (a damaged one may be cut short, grown or gone).
                size = int(self.open(name).manifest.seg_len[seg])
                try:
                    unlink_segment(seg_fd, f"{seg:08d}")
                except FileNotFoundError:
                    pass  # gone already (a damaged one found missing): forgotten only
                finally:
                    os.close(seg_fd)
                held = [k for k in record.held if k != seg]
                self._update_meta(folder, name, -size, held=held)
                record.held = held
                record.stored -= size
                self._open.pop(name, None)
        finally:
            os.close(folder)
        self.budgets.memory_freed()
        return size

    def _drop_disk_segment(self, folder: int, record: DatasetRecord, seg: int) -> int:
        """drop_segment of a disk-tier segment. Called under _lock."""
        assert self.disk_root is not None
        path = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        # What it counts in the disk budget (a damaged one's file may be cut short or gone).
        size = int(self.open(record.name).manifest.seg_len[seg])
        with contextlib.suppress(FileNotFoundError):
            unlink_segment(None, str(path))
        held = [k for k in record.held if k != seg]
        disk = [k for k in record.disk if k != seg]
        self._update_meta(
            folder, record.name, 0, held=held, disk=disk, disk_stored=record.disk_stored - size
        )
        record.held, record.disk, record.disk_stored = held, disk, record.disk_stored - size
        self._open.pop(record.name, None)
        return size

    def segment_file(self, name: str, seg: int) -> tuple[Path, int, int] | None:
        """Where held segment `seg` of static dataset `name` lies, its length and checksum
        (None: not held here, or a read-through dataset's, whose cache checks its own)."""
        record = self.datasets.get(name)
        if record is None or seg not in record.held or record.lifetime == READTHROUGH:
            return None
        m = self.open(name).manifest
        if seg in record.disk and self.disk_root is not None:
            path = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        else:
            path = segment_path(record.path, seg)
        return path, int(m.seg_len[seg]), int(m.seg_checksum[seg])

    def verify_segment(self, name: str, seg: int) -> str:
        """Why held segment `seg` of `name` is damaged ("": sound, or not held here)."""
        where = self.segment_file(name, seg)
        if where is None:
            return ""
        try:
            return segment_fault(*where)
        except FileNotFoundError:
            return ""  # dropped or moved meanwhile: whoever did it had it sound

    def quarantine(self, name: str, seg: int, why: str) -> int:
        """Take damaged segment `seg` of `name` out of service: unlinked (a reader that has
        it open finds it damaged too, and reads elsewhere), forgotten by meta.json and the
        record, so that it can be fetched again. Returns its bytes (0: not held here)."""
        log.error("segment %d of %s %s: quarantined, to be fetched again", seg, name, why)
        return self.drop_segment(name, seg)

    def promote(self, name: str, seg: int) -> int:
        """Move disk-tier segment `seg` of `name` into memory: copied into the shm folder
        (through a mapping, as a heal is), renamed in, then counted in memory and unlinked
        from disk (a reader finds it in either place, and a map of the disk file stays
        valid). NoSpace when memory has no room for it; returns the bytes moved (0 when it
        is not on disk any more)."""
        record = self.datasets.get(name)
        if record is None or seg not in record.disk or self.disk_root is None:
            return 0
        disk_file = segment_path(self.disk_root / f"{record.name}.{record.uuid}", seg)
        length = int(disk_file.stat().st_size)
        room = self.memory_cap_room(record)
        if room is not None and length > room:
            raise NoSpace(f"segment {seg} of {name} would take it past its --max-memory")
        reservation = f"promote:{name}:{seg}:{uuid.uuid4().hex[:12]}"
        self.budgets.reserve(reservation, length, what=f"segment {seg} of {name}", evict=False)
        try:
            with open(disk_file, "rb") as src:
                expected = int(self.open(name).manifest.seg_checksum[seg])

                def fill(view: memoryview) -> None:
                    """The disk copy into memory, checked before it joins memory."""
                    done = 0
                    while done < len(view):
                        n = src.readinto(view[done:])
                        if not n:
                            raise DamagedSegment(f"segment {seg} of {name} is short", [seg])
                        done += n
                    if src.read(1):
                        raise DamagedSegment(f"segment {seg} of {name} is too long", [seg])
                    if expected and xxhash.xxh3_64_intdigest(view) != expected:
                        raise DamagedSegment(f"segment {seg} of {name} fails its checksum", [seg])

                folder = os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])
                with _closing(folder):
                    self._put_segment(folder, seg, length, fill, seal=True)
                    with self._lock:
                        if self.datasets.get(name) is not record or seg not in record.disk:
                            # Unloaded, or the segment dropped (a rebalance), meanwhile.
                            with contextlib.suppress(FileNotFoundError):
                                unlink_segment(folder, f"seg/{seg:08d}")
                            return 0
                        disk = [k for k in record.disk if k != seg]
                        self._update_meta(
                            folder, name, length, disk=disk, disk_stored=record.disk_stored - length
                        )
                        record.disk, record.disk_stored = disk, record.disk_stored - length
                        record.stored += length
                        self.budgets.drop_claim(reservation)
                        self._open.pop(name, None)
                        unlink_segment(None, str(disk_file))
        finally:
            self.budgets.release(reservation)
        return length

    def _put_segment(
        self,
        folder: int,
        seg: int,
        length: int,
        fill: Callable[[memoryview], None],
        seal: bool,
    ) -> None:
        """Write segment `seg` into dataset folder `folder`'s seg/: made beside it, filled
        by `fill`, renamed in (a reader never sees part of one; one there already, a
        leftover, is unsealed first), then sealed when `seal` (a sealed file cannot be
        renamed: a reader that opens it in between finds it unsealed, and reads it as one)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir("seg", 0o750, dir_fd=folder)
        tmp = f".seg-{seg}.{uuid.uuid4().hex[:12]}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, FILE_MODE, dir_fd=folder)
        try:
            _fill_file(fd, length, fill)
            with _closing(os.open("seg", DIR_FLAGS, dir_fd=folder)) as seg_fd:
                unseal_segment(seg_fd, f"{seg:08d}")
                os.rename(tmp, f"{seg:08d}", src_dir_fd=folder, dst_dir_fd=seg_fd)
            if seal:
                seal_segment(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(fd)

    def discard_staging(self, staging: Path) -> None:
        remove_beneath(self._fd["staging"], self._staged_name(staging))

    def instance(self, name: str, uuid: str = "") -> DatasetRecord:
        """The published dataset `name`, which must be instance `uuid` when one is given:
        NotFound when there is none (and none was asked for), StaleDataset when the instance
        asked for was unloaded or loaded again."""
        record = self.datasets.get(name)
        if record is None and not uuid:
            raise NotFound(f"no dataset named {name!r}")
        if record is None or (uuid and uuid != record.uuid):
            raise StaleDataset(
                f"dataset {name!r} was unloaded or loaded again: the instance asked for is gone"
            )
        return record

    def open(self, name: str) -> LocalDataset:
        ds = self._open.get(name)
        if ds is None:
            record = self.datasets.get(name)
            if record is None:
                raise NotFound(f"no dataset named {name!r}")
            ds = self._open[name] = open_local(record.path)
            # Damage the node's own reads find (serving a peer, decoding): told the scrubber.
            ds.on_damage = functools.partial(self._damage_found, name)
        return ds

    def _damage_found(self, name: str, segments: list[int]) -> None:
        for hook in self.on_damage_found:
            hook(name, segments)


DISK_STAGING = ".staging"  # under the disk tier's root: preloads' disk parts in progress


def disk_claim(uuid: str) -> str:
    """The store's name of a preload's claim on the disk tier (no dataset name has a colon)."""
    return f"disk:{uuid}"


def _with_caps(meta: dict[str, Any], manifest: Path) -> dict[str, Any]:
    """`meta` with the caps its manifest's header names, when it names none itself (a member
    that adopts a dataset makes its meta from the catalog, which has no caps)."""
    if "max_memory" in meta or "max_disk" in meta or not manifest.exists():
        return meta
    header = Manifest(manifest).header
    caps = {k: int(header[k]) for k in ("max_memory", "max_disk") if header.get(k)}
    return {**meta, **caps} if caps else meta


def segment_fault(path: Path, length: int, checksum: int) -> str:
    """Why the segment file at `path` is damaged: not `length` bytes long, or (when
    `checksum`) its bytes fail it; "" when sound. Read with pread (never mapped: a file cut
    short under a map would kill the node). FileNotFoundError when it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != length:
            return "has the wrong size"
        if not checksum:
            return ""
        h = xxhash.xxh3_64()
        buf = memoryview(bytearray(min(HASH_CHUNK, length)))
        for pos in range(0, length, HASH_CHUNK):
            part = buf[: min(HASH_CHUNK, length - pos)]
            if os.preadv(fd, [part], pos) != len(part):
                return "ends early"
            h.update(part)
        return "" if h.intdigest() == checksum else "fails its checksum"
    finally:
        os.close(fd)


def _seal_segments(folder: int) -> None:
    """Seal (the immutable flag, where the node can) each segment in seg/ of `folder`, and its
    manifest (readers map it too)."""
    try:
        with _closing(
            os.open(MANIFEST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        ) as fd:
            if not seal_segment(fd):
                return  # not here: no segment will be
    except FileNotFoundError:
        pass  # a disk-tier folder: segments only
    try:
        seg_fd = os.open("seg", DIR_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return
    with _closing(seg_fd):
        for entry in os.scandir(seg_fd):
            if not entry.is_file(follow_symlinks=False):
                continue
            with _closing(
                os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=seg_fd)
            ) as fd:
                if not seal_segment(fd):
                    return  # not here: none will be


def _new_staging_folder(staging_fd: int, name: str) -> str:
    """A new folder NAME.ID (with its seg/) in a staging folder; its name."""
    folder = f"{validate_name(name)}.{uuid.uuid4().hex[:12]}"
    os.mkdir(folder, 0o750, dir_fd=staging_fd)
    with _closing(os.open(folder, DIR_FLAGS, dir_fd=staging_fd)) as fd:
        os.mkdir("seg", 0o750, dir_fd=fd)
    return folder


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    """A descriptor, closed when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)


def _fill_file(fd: int, length: int, fill: Callable[[memoryview], None]) -> None:
    """Give the file `fd` its `length` bytes of tmpfs pages (ENOSPC now, not on a page fault)
    and have `fill` write them through a mapping populated up front."""
    if length == 0:
        fill(memoryview(b""))
        return
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as e:
        raise NoSpace(f"cannot allocate a segment of {format_size(length)}: {e.strerror}") from None
    mapped = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    try:
        with memoryview(mapped) as view:
            fill(view)
    finally:
        with contextlib.suppress(BufferError):  # a view kept by a traceback: unmapped with it
            mapped.close()
