"""The node's shared-memory folder: published datasets, staging, publishing, recovery.

Layout under shm_dir:
    datasets/NAME/   published datasets (meta.json, manifest.ksm, seg/NNNNNNNN, damage: the
                     damage news every reader maps, system/damage.py)
    staging/NAME.ID/ preloads in progress; renamed into datasets/ when complete (atomic publish)
    trash/           unloaded or broken datasets, removed right away (mapped pages live on)
    .kspeedfs-node   the marker of a node's folder, locked while the node runs (nodefolders)

The disk tier (a node with `spill_dir`): segments of preloaded datasets that did not fit the
memory budget, under DISK_ROOT/NAME.UUID/seg/NNNNNNNN (staged under DISK_ROOT/.staging/), named
in the dataset's meta.json ("disk", "disk_dir"). They count in the disk budget, not the memory
one, and move to memory when memory frees up (segments.py places segments). DISK_ROOT is
SPILL_DIR/tier; the spill folder and the tier are checked and owned as the shm folder is
(safedir), so that readers in the group read disk-tier segments (by pread: system/disk_copies)
as they map memory ones.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
    StaleDataset,
)
from kspeedfs.format.localdata import MANIFEST_FILE, META_FILE, segment_path
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.names import validate_name
from kspeedfs.format.units import format_size
from kspeedfs.node import nodefolders
from kspeedfs.node.budget import Budgets
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.records import DatasetRecord, load_meta, rewrite_meta
from kspeedfs.node.safedir import (
    DIR_FLAGS,
    FILE_MODE,
    claim_dir,
    closing_fd,
    open_owned_dir,
    open_owned_subdir,
    open_subdir,
    remove_beneath,
    resolve_group,
    restrict_files,
    seal_segment,
)
from kspeedfs.node.segments import SegmentPlaces, open_disk_instance, segment_fault
from kspeedfs.system import damage
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.system.readthrough_view import open_local

log = logging.getLogger(__name__)


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
        *,
        events: DatasetEvents,
    ):
        self.root = root
        self.group = group
        # None: no disk tier. Its parent is the spill folder (spill_dir); the read-through
        # cache's spilled copies are the tier's too (readthrough/disktier.py).
        self.disk_root = disk_root
        # "datasets", "staging", "trash" (of the shm folder), "tier" and "tier_staging" (of the
        # disk tier) -> open folder
        self._fd: dict[str, int] = {}
        self._gid = -1  # the readers' group, once recover() resolved it
        self._markers: list[BinaryIO] = []  # the folders' markers, locked (node/nodefolders.py)
        self.datasets_dir = root / "datasets"
        self.staging_dir = root / "staging"
        self.trash_dir = root / "trash"
        self.datasets: dict[str, DatasetRecord] = {}
        # The memory and disk budgets: they count these datasets, and their lock is the
        # store's (a claim becomes a dataset's bytes under it).
        self.budgets = Budgets(root, budget, self.datasets, disk_root, disk_budget)
        self._lock = self.budgets.lock
        self._open: dict[str, LocalDataset] = {}
        # Which segments each dataset holds, and where: their one owner.
        self.segments = SegmentPlaces(
            self.datasets, self.budgets, self._fd, self.open, self._reopen, disk_root
        )
        # Told a dataset's name once it is visible (also each one found at start) and before
        # its files are unlinked, and (from any thread) the segments the node's own reads
        # found damaged; its followers subscribed when they were built (node/events.py).
        self.events = events
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
                self.segments.drop_segment(name, seg)
                self.damaged_at_start.append((name, seg))
                damage.announce(path, [seg])  # readers that outlived the last node: news now
            if record.lifetime != READTHROUGH:  # (one a node before sealing left: sealed now)
                with closing_fd(os.open(name, DIR_FLAGS, dir_fd=datasets_fd)) as fd:
                    _seal_segments(fd)
                    # (one an older node published has no damage news yet)
                    segments = Manifest(path / MANIFEST_FILE).segments
                    damage.create_table(fd, segments, FILE_MODE, os.fstat(fd).st_gid)
            log.info(
                "found dataset %s: %d files, %s",
                record.name,
                record.files,
                format_size(record.bytes),
            )
        self._recover_disk()
        for name in sorted(self.datasets):
            self.events.published(name)

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
            # Held while this node runs: `kspeedfs clean-node` refuses these folders meanwhile.
            self._markers = [nodefolders.hold(owned[0], self.root, "shm folder")]
            if self.disk_root is not None:
                spill = self.disk_root.parent
                self._markers.append(nodefolders.hold(owned[1], spill, "spill folder"))
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
            with closing_fd(open_disk_instance(self._fd["tier"], name)) as fd:
                claim_dir(fd, self._gid)
                restrict_files(fd, self._gid)
                if name not in readthrough:
                    _seal_segments(fd)
        for leftover in sorted(os.listdir(self._fd["tier_staging"])):
            remove_beneath(self._fd["tier_staging"], leftover)

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
            os.close(open_disk_instance(self._fd["tier"], self._disk_dir(meta).name))
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
        with closing_fd(os.open(name, DIR_FLAGS, dir_fd=self._fd["datasets"])) as folder:
            return load_meta(folder)

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
            with closing_fd(os.open(staged, DIR_FLAGS, dir_fd=self._fd["tier_staging"])) as fd:
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
            if seal:  # (a read-through one's segments come and go: its readers follow `epoch`)
                segments = Manifest(staging / MANIFEST_FILE).segments
                damage.create_table(staging_fd, segments, FILE_MODE)
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
        self.events.published(name)
        return record

    def unload(self, name: str, uuid: str = "") -> DatasetRecord:
        """Unload `name` (only instance `uuid`, when given): NotFound when it is not here, as
        when another caller unloaded it first."""
        with self._lock:
            record = self.datasets.get(name)
            if record is None or (uuid and record.uuid != uuid):
                instance = f" (instance {uuid[:8]})" if uuid else ""
                raise NotFound(f"no dataset named {name!r}{instance}")
            del self.datasets[name]
            self._open.pop(name, None)
        self.events.unloading(name)
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
        with closing_fd(folder):
            try:
                os.mkdir(sub, 0o750, dir_fd=folder)
            except FileExistsError:
                pass
            with closing_fd(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                flags |= os.O_TRUNC if offset == 0 else 0
                with closing_fd(os.open(filename, flags, FILE_MODE, dir_fd=sub_fd)) as fd:
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
            with closing_fd(folder), closing_fd(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                size = os.stat(tmp, dir_fd=sub_fd, follow_symlinks=False).st_size
                if _exists(final, sub_fd):
                    os.unlink(tmp, dir_fd=sub_fd)
                    size = 0
                else:
                    # Counted before the rename: a crash between leaves the budget
                    # over-counted (safe), never a file it does not count.
                    rewrite_meta(folder, size)
                    os.rename(tmp, final, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            SegmentPlaces.files_counted(self.datasets[name], size)
            self.budgets.drop_claim(reservation)
        return size

    def remove_file(self, name: str, instance: str, sub: str, filename: str, counted: bool) -> int:
        """Remove file `sub/filename` of an instance (unlinked: a reader's map stays valid); a
        `counted` one leaves its stored bytes too. Returns its size (0 when it is absent)."""
        with self._lock:
            folder = self._instance_dir(name, instance)
            with closing_fd(folder):
                try:
                    with closing_fd(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                        size = os.stat(filename, dir_fd=sub_fd, follow_symlinks=False).st_size
                        os.unlink(filename, dir_fd=sub_fd)
                except FileNotFoundError:
                    return 0  # no such folder, or no such file in it
                if counted:
                    rewrite_meta(folder, -size)
                    SegmentPlaces.files_counted(self.datasets[name], -size)
        if counted and size:
            self.budgets.memory_freed()
        return size

    def files_in(self, name: str, instance: str, sub: str) -> list[str]:
        """The names in folder `sub` of an instance ([] when it has none)."""
        with self._lock:
            folder = self._instance_dir(name, instance)
        with closing_fd(folder):
            try:
                with closing_fd(os.open(sub, DIR_FLAGS, dir_fd=folder)) as sub_fd:
                    return sorted(os.listdir(sub_fd))
            except FileNotFoundError:
                return []

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
            # Damage the node's own reads find (serving a peer, decoding): told the events (the
            # scrubber follows it).
            damage = functools.partial(self.events.damage_found, name)
            ds = self._open[name] = open_local(record.path, on_damage=damage)
        return ds

    def _reopen(self, name: str) -> None:
        """Forget the map of `name`: its segments changed, the next open() maps them."""
        self._open.pop(name, None)


TIER_DIR = "tier"  # the disk tier's folder in the spill folder (spill_dir)
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


def _seal_segments(folder: int) -> None:
    """Seal (the immutable flag, where the node can) each segment in seg/ of `folder`, and its
    manifest (readers map it too)."""
    try:
        with closing_fd(
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
    with closing_fd(seg_fd):
        for entry in os.scandir(seg_fd):
            if not entry.is_file(follow_symlinks=False):
                continue
            with closing_fd(
                os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=seg_fd)
            ) as fd:
                if not seal_segment(fd):
                    return  # not here: none will be


def _new_staging_folder(staging_fd: int, name: str) -> str:
    """A new folder NAME.ID (with its seg/) in a staging folder; its name."""
    folder = f"{validate_name(name)}.{uuid.uuid4().hex[:12]}"
    os.mkdir(folder, 0o750, dir_fd=staging_fd)
    with closing_fd(os.open(folder, DIR_FLAGS, dir_fd=staging_fd)) as fd:
        os.mkdir("seg", 0o750, dir_fd=fd)
    return folder


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
