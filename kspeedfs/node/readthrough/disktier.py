"""Read-through segments on the node's disk tier, the one on-disk store of the cache: a miss
that memory does not keep (the `stable` and `plan` policies' answer once a dataset's share is
full, or memory held by pinned data) lands there when the tier has room, instead of being read
from the source every epoch; and a segment evicted from memory is spilled there, a copy that a
later fill copies back (what `lru` reads again).

An instance's disk folder, DISK_ROOT/NAME.UUID, is made when the store publishes the instance
and named in meta.json ("disk_dir"); it goes with the instance (unloaded, refreshed), so a
refreshed or reloaded dataset never picks up another instance's bytes. Its segments lie in
seg/NNNNNNNN, where every reader (the mount, the fast path) finds a segment after memory, as
it finds a preload's; its spilled copies in spill/NNNNNNNN, where no reader looks. Both are
written under a dot-name beside them and renamed in, so a crash leaves no partial segment
under a real name, and both are claims on the store's disk budget (reservations of tier
"disk", recorded with the segment's place by the instance's `InstancePlaces`): preloads'
admission sees them. A restarted node claims again the sound ones it finds, and a refresh
carries the unchanged ones to the new instance (hard links).

Room: a preload's disk claim takes spilled copies first (oldest first: the spill keeps what
the tier leaves), then the disk segments of the uncapped dataset with the most there
(`reclaim`); a read-through miss onto the tier takes spilled copies, never another dataset's
segments; a spill takes older spilled copies. A dataset's `max_disk` caps its segments and
spilled copies there together, and no preload takes them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import trio

from kspeedfs.format.localdata import SEGMENT_DIR, read_meta, segment_path
from kspeedfs.format.units import format_size
from kspeedfs.node import nodefolders
from kspeedfs.node.readthrough.dataset import CachedDataset, Instances, file_checksum
from kspeedfs.node.safedir import FILE_MODE, link_segment, remove_beneath, unlink_file
from kspeedfs.node.store import SegmentStore

log = logging.getLogger(__name__)

SPILL_DIR = "spill"  # beside seg/ in an instance's disk folder: copies of evicted segments


class DiskTier:
    """The read-through part of the disk tier: segments and spilled copies; their claims are
    the store's reservations, kept by each instance's places."""

    def __init__(self, store: SegmentStore, instances: Instances):
        self.store = store
        self.instances = instances
        store.budgets.add_reclaimer(self.reclaim, tier="disk")

    @property
    def enabled(self) -> bool:
        return self.store.disk_root is not None

    @property
    def root(self) -> Path | None:
        """The spill folder (`spill_dir`): the disk tier's folder is in it."""
        return self.store.disk_root.parent if self.store.disk_root is not None else None

    def folder(self, ds: CachedDataset) -> Path:
        """The instance's disk folder (its segments in seg/, spilled copies in spill/, fills
        and copies in progress beside them)."""
        assert self.store.disk_root is not None
        return self.store.disk_root / f"{ds.name}.{ds.uuid}"

    def spill_path(self, ds: CachedDataset, seg: int) -> Path:
        return self.folder(ds) / SPILL_DIR / f"{seg:08d}"

    def held(self, ds: CachedDataset) -> int:
        """Bytes `ds` takes on disk: its segments, spilled copies and fills there (what
        `max_disk` caps)."""
        return ds.places.claimed_bytes()

    def spilled_bytes(self) -> int:
        """Bytes of the spilled copies of every instance."""
        return sum(ds.places.spilled_bytes() for ds in self.instances.by_name.values())

    def spill_room(self) -> int:
        """What the spilled copies may take: the disk budget less the rest of the tier."""
        budgets = self.store.budgets
        return max(0, budgets.disk - (budgets.disk_used() - self.spilled_bytes()))

    def claim(self, ds: CachedDataset, seg: int, take_spilled: bool = True) -> bool:
        """Claim the disk tier's room for segment `seg` of `ds`, spilled copies giving way
        (oldest first) unless not `take_spilled` (recovery, which may run in a worker thread,
        changes no other instance); False when the tier, its filesystem or the dataset's cap
        has none (or the node has no disk tier)."""
        if not self.enabled or ds.places.claimed(seg):
            return False
        if not (self.folder(ds) / SEGMENT_DIR).is_dir():
            return False  # published without one (by an older node): memory or the source
        if ds.max_disk and self.held(ds) + ds.seg_len(seg) > ds.max_disk:
            return False
        what = f"segment {seg} of {ds.name}"
        while not ds.places.claim_disk(seg, what):
            if not take_spilled or not self._drop_oldest_spilled():
                return False
        return True

    def there(self, ds: CachedDataset, seg: int) -> bool:
        """Whether disk segment `seg` of `ds` still has its file, of its size (blocking)."""
        try:
            return segment_path(self.folder(ds), seg).stat().st_size == ds.seg_len(seg)
        except OSError:
            return False

    def reclaim(self, nbytes: int) -> int:
        """Free at least nbytes of the disk tier for a preload's claim (the store calls this
        under its lock, in the event loop): spilled copies first, oldest first; then segments
        of the uncapped dataset with the most on disk (a `max_disk` cap is a share nobody
        takes), unlinked (a reader's map keeps its pages; readers drop their maps when the
        eviction counter moves)."""
        freed = 0
        while freed < nbytes:
            oldest = self._oldest_spilled()
            if oldest is None:
                break
            ds, seg = oldest
            unlink_file(self.spill_path(ds, seg))
            freed += ds.places.reclaimed_spill(seg)  # under the budgets' lock
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

    # Spilled copies.

    async def spill(self, ds: CachedDataset, seg: int) -> bool:
        """Copy memory segment `seg` of `ds`, about to be evicted, to its spill folder, older
        copies (its own only, past its `max_disk`) giving way; whether a copy was written now
        (False: none kept, or one there already)."""
        places = ds.places
        if not self.enabled or places.spill_claimed(seg):
            return False
        length = ds.seg_len(seg)
        if length > self.spill_room() or (ds.max_disk and length > ds.max_disk):
            return False
        while ds.max_disk and self.held(ds) + length > ds.max_disk:
            if not self._drop_oldest_spilled(ds):
                return False  # its disk segments take its cap
        what = f"spilled segment {seg} of {ds.name}"
        while not places.claim_spill(seg, what):
            if not self._drop_oldest_spilled():
                return False
        src = segment_path(ds.record.path, seg)
        copy = functools.partial(_copy_in, src, self.folder(ds), seg)
        try:
            done = await trio.to_thread.run_sync(copy)
        except OSError as e:
            log.warning("cannot spill segment %d of %s: %s", seg, ds.name, e)
            done = False
        if done and self.instances.current(ds) and places.spill_claimed(seg):
            places.placed_spilled(seg, time.time())
            return True
        places.release_spill(seg)  # failed, or its instance went meanwhile
        return False

    def copy_out(self, ds: CachedDataset, seg: int, dest: Path) -> None:
        """Copy the spilled copy of segment `seg` of `ds` to `dest` (OSError when it is gone
        or unreadable). Blocking; its caller tells the places it was used."""
        shutil.copyfile(self.spill_path(ds, seg), dest)

    def drop_spilled(self, ds: CachedDataset, seg: int) -> None:
        """Remove the spilled copy of segment `seg` of `ds` (unusable, or giving way)."""
        unlink_file(self.spill_path(ds, seg))
        ds.places.release_spill(seg)

    def _oldest_spilled(
        self, only: CachedDataset | None = None
    ) -> tuple[CachedDataset, int] | None:
        """The least recently used spilled copy (of `only`, when given): each instance's
        oldest, compared."""
        best: tuple[float, CachedDataset, int] | None = None
        for ds in [only] if only is not None else self.instances.by_name.values():
            oldest = ds.places.oldest_spilled()
            if oldest is not None and (best is None or oldest[0] < best[0]):
                best = (oldest[0], ds, oldest[1])
        return None if best is None else (best[1], best[2])

    def _drop_oldest_spilled(self, only: CachedDataset | None = None) -> bool:
        """Drop the least recently used spilled copy (of `only`); False when there is none."""
        oldest = self._oldest_spilled(only)
        if oldest is None:
            return False
        self.drop_spilled(*oldest)
        return True

    # A refresh and a restart.

    def remove_old_spill(self) -> None:
        """A restarted node: remove what the spill folder holds beside the disk tier's folder
        (spilled copies of the layout before they were the tier's, SPILL_DIR/NAME.UUID)."""
        if self.store.disk_root is None:
            return
        tier = self.store.disk_root
        for entry in sorted(tier.parent.iterdir()):
            if entry.name not in (tier.name, nodefolders.MARKER):
                log.info("removing spilled data of the old layout: %s", entry.name)
                remove_beneath(None, os.fspath(entry))

    def carry(self, old: CachedDataset, carried: dict[int, int]) -> Path | None:
        """A refresh: a disk staging folder with hard links of the disk segments and spilled
        copies of `old` that it carries (old segment -> new), for the store to publish with
        the new instance (`recover` then claims them). None without a disk tier. Blocking."""
        if not self.enabled:
            return None
        staging = self.store.new_disk_staging(old.name)
        for o, n in carried.items():
            links = []
            if o in old.on_disk:
                links.append((segment_path(self.folder(old), o), segment_path(staging, n)))
            if o in old.places.spilled:
                (staging / SPILL_DIR).mkdir(mode=0o750, exist_ok=True)
                links.append((self.spill_path(old, o), staging / SPILL_DIR / f"{n:08d}"))
            for src, dest in links:
                try:
                    link_segment(src, dest)
                except OSError as e:  # gone meanwhile: filled again when read
                    log.info("segment %d of %s not carried from disk: %s", o, old.name, e)
        return staging

    def recover(self, ds: CachedDataset, verify: bool) -> None:
        """A restarted node (or a refresh's new instance): claim the sound disk segments and
        spilled copies of `ds` again, the copies least recently used first by their file
        times; remove the rest (unfinished fills and copies, wrong sizes, never-checksummed
        ones, segments in memory already, those over the budget). A folder meta.json does not
        name is not read: it is emptied."""
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
            if entry.name not in (SEGMENT_DIR, SPILL_DIR) or not named:
                remove_beneath(None, os.fspath(entry))  # an unfinished fill (sealed ones too)
        if not named:
            return
        for fname in sorted(os.listdir(folder / SEGMENT_DIR)):
            path = folder / SEGMENT_DIR / fname
            sound = self._sound(ds, fname, path, verify)
            if not sound or not self.claim(ds, int(fname), take_spilled=False):
                log.warning("dropping disk-tier segment %s of %s", fname, ds.name)
                unlink_file(path)
                continue
            ds.places.placed_on_disk(int(fname))
        self._recover_spilled(ds, folder / SPILL_DIR, verify)

    def _recover_spilled(self, ds: CachedDataset, spill: Path, verify: bool) -> None:
        if spill.is_symlink() or not spill.is_dir():
            with contextlib.suppress(FileNotFoundError):
                remove_beneath(None, os.fspath(spill))
            return
        found = []
        for fname in os.listdir(spill):
            path = spill / fname
            if not self._sound(ds, fname, path, verify, in_memory_ok=True):
                log.info("dropping spilled segment %s of %s", fname, ds.name)
                remove_beneath(None, os.fspath(path))
                continue
            found.append((path.stat().st_mtime, int(fname)))
        for when, seg in sorted(found):
            if not ds.places.claim_spill(seg, f"spilled segment {seg} of {ds.name}"):
                unlink_file(spill / f"{seg:08d}")  # over the budget: the newest go
                continue
            ds.places.placed_spilled(seg, when)

    def _sound(
        self, ds: CachedDataset, fname: str, path: Path, verify: bool, in_memory_ok: bool = False
    ) -> bool:
        if not fname.isdigit() or fname != f"{int(fname):08d}" or path.is_symlink():
            return False  # readers look for NNNNNNNN only
        seg = int(fname)
        if not 0 <= seg < ds.manifest.segments or not int(ds.sums[seg]):
            return False
        if seg in ds.resident and not in_memory_ok:
            return False  # a copy of memory's: readers would find two
        try:
            if path.stat().st_size != ds.seg_len(seg):
                return False
            return not verify or file_checksum(path) == int(ds.sums[seg])
        except OSError:
            return False


def _copy_in(src: Path, folder: Path, seg: int) -> bool:
    """Copy segment file `src` to `folder`/spill/NNNNNNNN: written under a dot-name beside it
    and renamed in (a crash leaves no partial copy under a real name). False when `folder` is
    gone (its instance with it). Blocking."""
    if not folder.is_dir():
        return False
    (folder / SPILL_DIR).mkdir(mode=0o750, exist_ok=True)
    tmp = folder / f".spill.{seg:08d}.{uuid.uuid4().hex[:8]}"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(src, "rb") as f, open(os.open(tmp, flags, FILE_MODE), "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
        os.rename(tmp, folder / SPILL_DIR / f"{seg:08d}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return True
