"""The mount's dataset list, kept in step with the node by the supervisor; slots number instances.

A slot is one loaded instance of a dataset, numbered here and nowhere else, so an inode
(slot << 32 | entry + 1) means the same in every serving process; a dataset unloaded and loaded
again gets a new slot and never reuses the old inodes. Each refresh replaces the tables whole
and hands what changed to the `on_change` its caller passes (the supervisor's, which sends it
to every worker). A refresh that fails in any way logs one line and is tried again: the mount
serves on with what it knows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.contract.decoded import Decode
from kspeedfs.format.contract.node import DatasetEntry, DatasetListing, List
from kspeedfs.format.errors import KSpeedError, NodeUnreachable, NotFound
from kspeedfs.format.names import split_variant
from kspeedfs.fuse import untar, variants
from kspeedfs.net.aconnection import AsyncNodeClient
from kspeedfs.net.connection import SCAN_TIMEOUT

log = logging.getLogger(__name__)

SLOT_SHIFT = 32
INDEX_MASK = (1 << SLOT_SHIFT) - 1
BACKGROUND_REFRESH = 5.0


@dataclass
class MountedDataset:
    slot: int
    name: str
    uuid: str
    data: DatasetHandle
    info: DatasetEntry | None = None  # the node's listing entry (of `view.base`, for a view)
    # A decoded variant's files or a tar view's or a merged tar view's (in a worker).
    variant: variants.VariantFiles | variants.TarFiles | untar.UntarFiles | None = None
    view: variants.ViewOf | None = None  # a folder showing another dataset: which, and how


@dataclass
class Change:
    """What one refresh changed, in the order workers apply it."""

    dropped: list[MountedDataset]
    added: list[MountedDataset]
    node_answers: bool
    mounted_at_ns: int
    # Names under the root the kernel must forget (the dropped instances' entries): only once
    # every worker serves the change, or a lookup in between would cache the old instance.
    forget: list[bytes] = field(default_factory=list)


# Told what a refresh changed (the supervisor sends it to every worker).
OnChange = Callable[[Change], None]


def _unheard(change: Change) -> None:
    """The first refresh's change: no worker serves yet (each is told every dataset first)."""


class DatasetList:
    """The ready datasets of the node, each opened once here (so that a dataset a worker is
    told about is one that opens) and numbered with its slot."""

    def __init__(
        self, clients: list[AsyncNodeClient], reader: ClusterReader, single: str | None = None
    ):
        self.clients = clients  # the local node first: the list comes from one of them
        self.reader = reader
        self.single = single  # serve this dataset at the root instead of one folder each
        # NAME@N: the decoded variant of NAME served at the root (NAME is opened too)
        self.single_base, self.single_size = split_variant(single) if single else ("", None)
        self._variant_started = ""  # the instance whose variant this mount asked for
        self.by_slot: dict[int, MountedDataset] = {}
        self.by_name: dict[str, MountedDataset] = {}
        self.mounted_at_ns = time.time_ns()
        self.node_answers = True
        self._next_slot = 1
        # A taken-over connection's slots (takeover.py): the kernel holds their inodes.
        self._kept_slots: dict[tuple[str, str], int] = {}
        self._has_tars: dict[tuple[str, str], bool] = {}  # by (dataset, instance)
        self._last_error = ""  # of the last failed refresh: logged once, not every second
        self._lock = trio.Lock()

    def reuse_slots(self, slots: dict[tuple[str, str], int], next_slot: int) -> None:
        """Number the instances as the mount process before us did: the kernel still holds
        the inodes it gave out on the connection taken over."""
        self._kept_slots = dict(slots)
        self._next_slot = max(self._next_slot, next_slot, *[s + 1 for s in slots.values()])

    def slots(self) -> dict[tuple[str, str], int]:
        """(name, instance uuid) -> slot of every instance served now."""
        return {(m.name, m.uuid): m.slot for m in self.by_slot.values()}

    @property
    def next_slot(self) -> int:
        return self._next_slot

    def _new_slot(self, name: str, uuid: str) -> int:
        slot = self._kept_slots.pop((name, uuid), None)
        if slot is None:
            slot = self._next_slot
            self._next_slot += 1
        return slot

    async def refresh(self, on_change: OnChange = _unheard, strict: bool = False) -> None:
        """Sync with the node. Errors are logged and the known datasets kept; `strict` (the
        first refresh, before any worker) raises them. Always ends with an on_change (workers
        wait for it), in the order of the refreshes."""
        async with self._lock:  # two interleaved refreshes would each open a dataset
            change = Change([], [], self.node_answers, self.mounted_at_ns)
            try:
                change = await self._refresh()
            except Exception as e:
                if strict:
                    raise
                self.node_answers = change.node_answers = False
                why = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
                if why != self._last_error:
                    log.error("cannot refresh the dataset list (serving what is known): %s", why)
                self._last_error = why
            else:
                if self._last_error:
                    log.info("the dataset list is refreshed again")
                    self._last_error = ""
            on_change(change)

    async def refresh_unless_running(self, on_change: OnChange) -> None:
        """A worker asks: a refresh under way answers it too (its on_change reaches all)."""
        if not self._lock.locked():
            await self.refresh(on_change)

    async def keep_refreshed(self, on_change: OnChange) -> None:
        """Notice unloads even when nobody looks at the root: their memory is freed only once
        the mount's processes let go of their maps."""
        while True:
            await trio.sleep(BACKGROUND_REFRESH)
            await self.refresh(on_change)

    async def _refresh(self) -> Change:
        listing = None
        error: KSpeedError | None = None
        for client in self.clients:
            try:
                listing = await client.call(List())
                if self.single_size is not None and await self._start_variant(client, listing):
                    listing = await client.call(List())
                break
            except NodeUnreachable as e:
                error = e
        if listing is None:
            if self.node_answers:
                log.warning("no node answers, serving the datasets already known: %s", error)
            self.node_answers = False
            return Change([], [], False, self.mounted_at_ns)
        self.node_answers = True
        ready = listing.ready()
        # Decoded variants (NAME@N) are instances too: listed with their dataset's uuid.
        offered = {} if self.single else variants.offered(ready)
        if self.single and self.single_size is not None and self.single_base in ready:
            # Served from the variant's local pixels where listed, else decoded on demand.
            offered = {self.single: (self.single_base, self.single_size)}
        listed = {n: d.uuid for n, d in ready.items()}
        listed.update((v, ready[base].uuid) for v, (base, _size) in offered.items())
        for name, mounted in self.by_name.items():  # tar views: kept while their dataset is
            view = mounted.view
            if view is not None and view.size is None and view.base in ready:
                listed[name] = ready[view.base].uuid
        by_name = dict(self.by_name)
        by_slot = dict(self.by_slot)
        gone = [m for n, m in by_name.items() if listed.get(n) != m.uuid]
        forget: list[bytes] = []
        for mounted in gone:
            del by_name[mounted.name]
            del by_slot[mounted.slot]
            forget.extend(self._drop(mounted))
        added = []
        for name, d in ready.items():
            if name in by_name or (self.single and name != self.single_base):
                continue
            try:
                data = await trio.to_thread.run_sync(self.reader.open_dataset, name, d)
            except KSpeedError as e:
                log.error("cannot open dataset %s: %s", name, e)
                continue
            mounted = MountedDataset(self._new_slot(name, d.uuid), name, d.uuid, data, d)
            by_slot[mounted.slot] = mounted
            by_name[name] = mounted
            added.append(mounted)
        tar_views = {} if self.single else self._tar_views(ready, by_name)
        views: dict[str, tuple[str, int | None]] = {**offered, **tar_views}
        for name, (base, size) in views.items():  # after their datasets: workers open them so
            if name in by_name or base not in by_name:
                continue
            of = by_name[base]
            view = variants.ViewOf(base, size, name.endswith(untar.UNTAR_SUFFIX))
            slot = self._new_slot(name, of.uuid)
            mounted = MountedDataset(slot, name, of.uuid, of.data, ready[base], view=view)
            by_slot[mounted.slot] = mounted
            by_name[name] = mounted
            added.append(mounted)
        if by_name.keys() != self.by_name.keys() or gone:
            self.mounted_at_ns = time.time_ns()  # the root's mtime: its listing changed
        self.by_slot, self.by_name = by_slot, by_name
        return Change(gone, added, True, self.mounted_at_ns, forget)

    def _tar_views(
        self, ready: dict[str, DatasetEntry], by_name: dict[str, MountedDataset]
    ) -> dict[str, tuple[str, None]]:
        """`NAME@tar` and `NAME@untar` for each open dataset that holds a `.tar` file:
        {name: (NAME, None)}."""
        out: dict[str, tuple[str, None]] = {}
        for name in ready:
            mounted = by_name.get(name)
            if mounted is None or mounted.view is not None:
                continue
            key = (name, mounted.uuid)
            if key not in self._has_tars:
                self._has_tars[key] = bool(variants.tar_entries(mounted.data.manifest).size)
            if self._has_tars[key]:
                out[variants.tar_folder_name(name)] = (name, None)
                out[untar.untar_folder_name(name)] = (name, None)
        return out

    async def _start_variant(self, client: AsyncNodeClient, listing: DatasetListing) -> bool:
        """A mount of NAME@N: start the variant where the node has NAME ready but no such
        variant (as the fast path does), once per instance; True when it was asked for."""
        size = self.single_size
        assert size is not None
        d = listing.ready().get(self.single_base)
        if d is None or d.uuid == self._variant_started:
            return False
        self._variant_started = d.uuid
        v = d.decoded.get(str(size))
        if v is not None and v.state in variants.SHOWN_STATES:
            return False
        log.info("starting the decoded variant %s of instance %s", self.single, d.uuid[:8])
        await client.call(
            Decode(name=self.single_base, size=size, uuid=d.uuid), answer_within=SCAN_TIMEOUT
        )
        return True

    def _drop(self, mounted: MountedDataset) -> list[bytes]:
        """Let go of an instance; returns the names under the root the kernel must forget."""
        log.info("dataset %s (instance %s) is gone from the node", mounted.name, mounted.uuid[:8])
        if mounted.data.local is not None and mounted.view is None:
            mounted.data.local.release()  # its memory returns to the node's machine
        if not self.single:
            return [mounted.name.encode()]
        # Served at the root: the kernel would keep its entries (a day) for the old instance,
        # e.g. after a refresh; forget them so lookups reach the new one.
        if mounted.name != self.single:
            return []  # the dataset under a variant served at the root: not shown
        return sorted(self._top_names(mounted))

    def _top_names(self, mounted: MountedDataset) -> set[bytes]:
        m = mounted.data.manifest
        if mounted.view is not None:
            return variants.top_names(m)
        return {m.name(child) for child in m.children(0)}

    def root_names(self) -> set[bytes]:
        """What the mount's root lists now: a folder per dataset (and variant), or the top
        level of the one dataset served at the root. Safe from a thread: a refresh replaces
        the tables whole."""
        if not self.single:
            return {name.encode() for name in self.by_name}
        mounted = self.by_name.get(self.single)
        if mounted is None:
            return set()
        return self._top_names(mounted)

    def require(self, name: str) -> None:
        if name not in self.by_name:
            raise NotFound(f"no dataset named {name!r} on the node")
