"""Read-through segments on the node's disk tier: a miss that memory does not keep (the
`stable` and `plan` policies' answer once a dataset's share is full, or memory held by pinned
data) lands there when the tier has room, instead of being read from the source every epoch.

The segments lie in the instance's disk folder, DISK_ROOT/NAME.UUID/seg/NNNNNNNN: the store
makes it when it publishes a read-through instance and names it in meta.json ("disk_dir"), so
every reader (the mount, the fast path) finds a segment there after memory, as it finds a
preload's. Each segment is a claim on the store's disk budget (a reservation of tier "disk")
from before it is written until its instance is forgotten (unloaded, refreshed): preloads'
admission and the spill folder see it. A restarted node claims again the sound segments it
finds, and a refresh carries the unchanged ones to the new instance (hard links). A
preload's disk claim takes this room as it takes read-through memory (`reclaim`); a dataset's
`max_disk` cap counts these and its spilled segments together, and no preload takes them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kspeedfs.format.localdata import SEGMENT_DIR, read_meta, segment_path
from kspeedfs.format.units import format_size
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances, file_checksum
from kspeedfs.node.safedir import link_segment, remove_beneath, unlink_file
from kspeedfs.node.spill import SpillArea
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)


class DiskTier:
    """The read-through part of the disk tier; its claims are the store's reservations."""

    def __init__(self, store: SegmentStore, instances: Instances, spill: SpillArea | None):
        self.store = store
        self.instances = instances
        self.spill = spill
        store.budgets.add_reclaimer(self.reclaim, tier="disk")

    @property
    def enabled(self) -> bool:
        return self.store.disk_root is not None

    def folder(self, ds: CachedDataset) -> Path:
        """The instance's disk folder (its segments in seg/, fills in progress beside it)."""
        assert self.store.disk_root is not None
        return self.store.disk_root / f"{ds.name}.{ds.uuid}"

    def held(self, ds: CachedDataset) -> int:
        """Bytes `ds` takes on disk: its disk-tier claims and its spilled segments (what
        `max_disk` caps)."""
        spilled = self.spill.bytes_of(ds.spill_key) if self.spill is not None else 0
        return ds.places.claimed_bytes() + spilled

    def claim(self, ds: CachedDataset, seg: int) -> bool:
        """Claim the disk tier's room for segment `seg` of `ds`; False when the tier, its
        filesystem or the dataset's cap has none (or the node has no disk tier)."""
        if not self.enabled or ds.places.claimed(seg):
            return False
        if not (self.folder(ds) / SEGMENT_DIR).is_dir():
            return False  # published without one (by an older node): memory or the source
        if ds.max_disk and self.held(ds) + ds.seg_len(seg) > ds.max_disk:
            return False
        return ds.places.claim_disk(seg, f"segment {seg} of {ds.name}")

    def there(self, ds: CachedDataset, seg: int) -> bool:
        """Whether disk segment `seg` of `ds` still has its file, of its size (blocking)."""
        try:
            return segment_path(self.folder(ds), seg).stat().st_size == ds.seg_len(seg)
        except OSError:
            return False

    def reclaim(self, nbytes: int) -> int:
        """Free at least nbytes of the disk tier for a preload's claim (the store calls this
        under its lock, in the event loop): segments of the uncapped dataset with the most
        on disk first (a `max_disk` cap is a share nobody takes), unlinked (a reader's map
        keeps its pages; readers drop their maps when the eviction counter moves)."""
        freed = 0
        while freed < nbytes:
            candidates = [
                d for d in self.instances.by_name.values() if d.on_disk and not d.max_disk
            ]
            if not candidates:
                break
            ds = max(candidates, key=lambda d: d.disk_bytes)
            seg = max(ds.on_disk)
            unlink_file(segment_path(self.folder(ds), seg))
            freed += ds.places.reclaimed_from_disk(seg)  # under the budgets' lock
            ds.epoch[0] += 1
            ds.stats["disk_evictions"] += 1
        if freed:
            log.info("evicted %s of read-through disk-tier data for a preload", format_size(freed))
        return freed

    def release(self, ds: CachedDataset, seg: int) -> None:
        """The claim of segment `seg` goes (its file was never written, or is gone)."""
        ds.places.release_disk(seg)

    def carry(self, old: CachedDataset, carried: dict[int, int]) -> Path | None:
        """A refresh: a disk staging folder with hard links of the disk segments of `old`
        that it carries (old segment -> new), for the store to publish with the new instance
        (`recover` then claims them). None without a disk tier. Blocking."""
        if not self.enabled:
            return None
        staging = self.store.new_disk_staging(old.name)
        for o, n in carried.items():
            if o in old.on_disk:
                try:
                    link_segment(segment_path(self.folder(old), o), segment_path(staging, n))
                except OSError as e:  # gone meanwhile: filled again when read
                    log.info("segment %d of %s not carried from disk: %s", o, old.name, e)
        return staging

    def recover(self, ds: CachedDataset, verify: bool) -> None:
        """A restarted node: claim the sound disk segments of `ds` again; remove the rest
        (unfinished fills, wrong sizes, never-checksummed ones, copies of memory's, those
        over the budget). A folder meta.json does not name is not read: it is emptied."""
        if not self.enabled:
            return
        folder = self.folder(ds)
        try:
            named = read_meta(ds.record.path).get("disk_dir") == str(folder)
        except (OSError, ValueError):
            named = False
        if not folder.is_dir():
            return
        for entry in folder.iterdir():
            if entry.name != SEGMENT_DIR or not named:
                remove_beneath(None, os.fspath(entry))  # an unfinished fill (sealed ones too)
        if not named:
            return
        for fname in sorted(os.listdir(folder / SEGMENT_DIR)):
            path = folder / SEGMENT_DIR / fname
            if not self._sound(ds, fname, path, verify) or not self.claim(ds, int(fname)):
                log.warning("dropping disk-tier segment %s of %s", fname, ds.name)
                unlink_file(path)
                continue
            ds.places.placed_on_disk(int(fname))

    def _sound(self, ds: CachedDataset, fname: str, path: Path, verify: bool) -> bool:
        if not fname.isdigit() or fname != f"{int(fname):08d}" or path.is_symlink():
            return False  # readers look for NNNNNNNN only
        seg = int(fname)
        if not 0 <= seg < ds.manifest.segments or seg in ds.resident or not int(ds.sums[seg]):
            return False
        try:
            if path.stat().st_size != ds.seg_len(seg):
                return False
            return not verify or file_checksum(path) == int(ds.sums[seg])
        except OSError:
            return False
