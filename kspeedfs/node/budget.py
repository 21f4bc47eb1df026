"""The node's two budgets, memory and the disk tier: what the published datasets take, the
claims of work in progress (reservations), and the refusal of a claim that does not fit.

One owner, built and held by the store (`SegmentStore.budgets`), which shares with it its
table of published datasets and its lock: a claim turns into a dataset's bytes under that lock
(`drop_claim`), so no count ever sees both or neither.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from kspeedfs.format.errors import AlreadyExists, NoSpace
from kspeedfs.format.units import format_size


class Counted(Protocol):
    """What the budgets read of a published dataset: its bytes in memory and on the tier."""

    @property
    def stored(self) -> int: ...

    @property
    def disk_stored(self) -> int: ...


@dataclasses.dataclass
class Reservation:
    """Budget claimed by work in progress (a load, a fill, a variant, an index), before it
    writes: counted in the budget at once, and against the free space of the shm filesystem
    for the part it has not written yet, so that two claims never count on the same bytes."""

    nbytes: int
    written: Callable[[], int] | None = None  # how much of it is on the filesystem already
    tier: str = "memory"  # or "disk": counted in the disk tier's budget
    # A copy kept only while nothing else needs the room (a read-through segment spilled to the
    # disk tier): any other disk claim may count its bytes as free, and its owner drops it.
    gives_way: bool = False

    def unwritten(self) -> int:
        return max(0, self.nbytes - (self.written() if self.written is not None else 0))


class Budgets:
    """The memory budget (`memory` bytes of the shm folder `shm_root`) and the disk tier's
    (`disk` bytes of `disk_root`; None: no disk tier). Thread-safe: claims come from the event
    loop and from worker threads."""

    def __init__(
        self,
        shm_root: Path,
        memory: int,
        datasets: Mapping[str, Counted],
        disk_root: Path | None = None,
        disk: int = 0,
    ):
        self.shm_root = shm_root
        self.memory = memory
        self.disk_root = disk_root
        self.disk = disk
        self._datasets = datasets  # the store's: published datasets, by name
        self._reserved: dict[str, Reservation] = {}  # by name: work that has not published
        # Running sums of the claims (read-through segments on the tier hold one claim each:
        # a sum over all of them on every claim would cost a miss O(segments)).
        self._claimed = {"memory": 0, "disk": 0}
        self._giving = 0  # of the disk claims, those that give way to any other (spilled copies)
        self._memory_claims: dict[str, Reservation] = {}  # the memory budget's, for _fs_room
        # Held by whoever changes what the budgets count: the claims here, the store's records.
        self.lock = threading.Lock()
        self._reclaimers: list[Callable[[int], int]] = []
        self._disk_reclaimers: list[Callable[[int], int]] = []
        self._memory_freed: list[Callable[[], None]] = []  # when_memory_freed's callbacks

    def when_memory_freed(self, callback: Callable[[], None]) -> None:
        """`callback()` is called from any thread (maybe under the lock: it must not take it)
        when memory may have freed up: an unload, a segment dropped or evicted, a reservation
        given back. Promotion waits on it."""
        self._memory_freed.append(callback)

    def memory_freed(self) -> None:
        """Tell the followers that memory may have freed up."""
        for callback in self._memory_freed:
            callback()

    def add_reclaimer(self, reclaim: Callable[[int], int], tier: str = "memory") -> None:
        """Someone holding evictable (read-through) memory, or disk-tier bytes with `tier`
        "disk": when a reservation does not fit, `reclaim(nbytes)` is asked to free that much
        (called under the lock) and returns the bytes it freed."""
        (self._disk_reclaimers if tier == "disk" else self._reclaimers).append(reclaim)

    @property
    def reserved(self) -> Mapping[str, Reservation]:
        """The claims, by name (a read-only view: `reserve`, `release` and `drop_claim` change
        them)."""
        return types.MappingProxyType(self._reserved)

    def _claim(self, name: str, claim: Reservation) -> None:
        self._reserved[name] = claim
        if claim.tier == "memory":
            self._memory_claims[name] = claim
        self._claimed[claim.tier] += claim.nbytes
        if claim.gives_way:
            self._giving += claim.nbytes

    def _unclaim(self, name: str) -> Reservation | None:
        claim = self._reserved.pop(name, None)
        self._memory_claims.pop(name, None)
        if claim is not None:
            self._claimed[claim.tier] -= claim.nbytes
            if claim.gives_way:
                self._giving -= claim.nbytes
        return claim

    def used(self) -> int:
        """Bytes of the memory budget taken (datasets and claims)."""
        return sum(r.stored for r in self._datasets.values()) + self._claimed["memory"]

    def disk_used(self) -> int:
        """Bytes of the disk budget the tier takes: its datasets' segments and claims."""
        return sum(r.disk_stored for r in self._datasets.values()) + self._claimed["disk"]

    def memory_free(self) -> int:
        """What a claim on the memory budget could take now, without evicting anything."""
        with self.lock:
            fs_free, promised = self._fs_room()
            return max(0, min(self.memory - self.used(), fs_free - promised))

    def disk_free(self) -> int:
        """What a claim on the disk tier could take now (0 without a disk tier)."""
        if self.disk_root is None:
            return 0
        with self.lock:
            giving = self._giving
            st = os.statvfs(self.disk_root)
            fs_free = st.f_bavail * st.f_frsize - self._disk_promised(False)
            return max(0, min(self.disk - self.disk_used() + giving, fs_free + giving))

    def _disk_promised(self, all_claims: bool) -> int:
        """Bytes of disk claims a new claim must leave room for on the filesystem: all of them,
        or all but those that give way (they are written: their room is counted back)."""
        return self._claimed["disk"] - (0 if all_claims else self._giving)

    def reserve(
        self,
        name: str,
        nbytes: int,
        what: str = "dataset",
        written: Callable[[], int] | None = None,
        instead_of: str = "",
        evict: bool = True,
        tier: str = "memory",
        gives_way: bool = False,
        over_giving: bool = False,
    ) -> None:
        """Claim budget for work before it starts; refuse what cannot fit (`what` names it in
        the refusal). One check and claim under the lock: of two claims that do not both fit,
        the second is refused. `written` says how much of the claim is on the filesystem
        already (default: nothing until it is published or released). `instead_of` names an
        earlier claim for the same work (a preload's admission) that this one replaces: its
        bytes count as free here, and it stays when this one is refused. `evict` lets the
        reclaimers (read-through eviction, which lives on the event loop) make room. `tier`
        "disk" claims the disk tier's budget instead (NoSpace when the node has none).
        `gives_way`: a copy kept only while nothing else needs its room (a spilled read-through
        segment). `over_giving`: a disk claim that may take the room of those (a heal's segment,
        claimed from a worker thread, which cannot make them go: their owner drops them at its
        next spill, as the spill folder gave way to the tier before it was folded in)."""
        with self.lock:
            if name in self._datasets or name in self._reserved:
                raise AlreadyExists(f"dataset {name!r} is already loaded or loading")
            earlier = self._unclaim(instead_of)
            try:
                if tier == "disk":
                    reclaimers = self._disk_reclaimers if evict else []
                    self._check_disk_fits(nbytes, what, reclaimers, over_giving)
                else:
                    self._check_fits(nbytes, what, self._reclaimers if evict else [])
            except BaseException:
                if earlier is not None:
                    self._claim(instead_of, earlier)
                raise
            self._claim(name, Reservation(nbytes, written, tier, gives_way))

    def release(self, name: str) -> None:
        """Give claim `name` back (none: nothing happens); memory given back is told."""
        with self.lock:
            given_back = self._unclaim(name)
        if given_back is not None and given_back.tier == "memory":
            self.memory_freed()

    def drop_claim(self, name: str) -> None:
        """Drop claim `name` in place, telling no one: its bytes are counted in a dataset's
        record now, or freed by a reclaimer. Called under the lock."""
        self._unclaim(name)

    def _check_disk_fits(
        self,
        nbytes: int,
        what: str,
        reclaimers: list[Callable[[int], int]],
        over_giving: bool = False,
    ) -> None:
        """Refuse (NoSpace) a claim the disk tier's budget or filesystem cannot hold, once
        `reclaimers` freed what they could; `over_giving`: counting the claims that give way
        as free. Called under the lock."""
        if self.disk_root is None:
            raise NoSpace(f"{what} needs a disk tier, and this node has none (spill_dir)")
        for reclaim in reclaimers:
            if self.disk - self.disk_used() >= nbytes:
                break
            reclaim(nbytes - (self.disk - self.disk_used()))
        giving = self._giving if over_giving else 0
        free = self.disk - self.disk_used() + giving
        if free < nbytes:
            raise NoSpace(
                f"{what} needs {format_size(nbytes)} of disk on this node but only "
                f"{format_size(max(free, 0))} of its {format_size(self.disk)} disk tier"
                " is free"
            )
        st = os.statvfs(self.disk_root)
        promised = self._disk_promised(not over_giving)
        if nbytes > st.f_bavail * st.f_frsize - promised + giving:
            raise NoSpace(
                f"{what} needs {format_size(nbytes)} but {self.disk_root} has only "
                f"{format_size(st.f_bavail * st.f_frsize)} free"
            )

    def _holders(self, most: int = 3) -> str:
        """Who holds the memory, largest first: the `most` largest datasets and the claims of
        work in progress (what a refused claim's one line names)."""
        held = sorted(self._datasets.items(), key=lambda item: -item[1].stored)
        parts = [f"{name} {format_size(r.stored)}" for name, r in held[:most] if r.stored]
        if len(held) > most:
            rest = sum(r.stored for _, r in held[most:])
            parts.append(f"{len(held) - most} more {format_size(rest)}")
        if self._claimed["memory"]:
            parts.append(f"loads and fills in progress {format_size(self._claimed['memory'])}")
        return ", ".join(parts) or "nothing"

    def _check_fits(self, nbytes: int, what: str, reclaimers: list[Callable[[int], int]]) -> None:
        """Refuse (NoSpace) a claim of nbytes that the budget or the filesystem cannot hold
        beside the claims made, once `reclaimers` freed what they could. Called under the
        lock."""
        for reclaim in reclaimers:
            if self.memory - self.used() >= nbytes:
                break
            reclaim(nbytes - (self.memory - self.used()))
        if self.memory - self.used() < nbytes:
            free = self.memory - self.used()
            raise NoSpace(
                f"{what} needs {format_size(nbytes)} on this node but only "
                f"{format_size(max(free, 0))} of its {format_size(self.memory)} budget is free"
                f" (held by {self._holders()})"
            )
        # The filesystem may hold less than the budget (other users of /dev/shm, a small
        # tmpfs): its free space, less what earlier claims are still to write; evictable
        # memory gives way to it as it does to the budget.
        fs_free, promised = self._fs_room()
        for reclaim in reclaimers:
            if nbytes <= fs_free - promised:
                break
            reclaim(nbytes - (fs_free - promised))
            fs_free, promised = self._fs_room()
        if nbytes > fs_free - promised:
            also = f", {format_size(promised)} of it promised to work in progress"
            raise NoSpace(
                f"{what} needs {format_size(nbytes)} but {self.shm_root} has only "
                f"{format_size(fs_free)} free{also if promised else ''}"
            )

    def _fs_room(self) -> tuple[int, int]:
        """The shm filesystem's free bytes, and how many of them claims have yet to write."""
        st = os.statvfs(self.shm_root)
        promised = sum(r.unwritten() for r in self._memory_claims.values())
        return st.f_bavail * st.f_frsize, promised
