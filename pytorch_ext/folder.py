"""KSpeedFolder: the base of the fast-path datasets over a cached folder (zero-copy `read`)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.manifest import Manifest

from . import cache, lease
from .index import (
    IndexBuilder,
    LazyFiles,
    SampleIndex,
    SampleList,
    build_folder_index,
    extension_check,
)
from .prefetch import EpochPlan, PrefetchMixin

PathLike = str | os.PathLike[str]


class CachedPath(PrefetchMixin):
    """A path inside a cached dataset: attaching, leasing, per-process readers, pickling."""

    root: Any
    _ref: cache.CacheRef
    _top: int
    _prefix: bytes
    _index: SampleList  # set by datasets over a folder or a meta file; KSpeedDataset has none
    # The name an active load of a source gets when no objname is given.
    _name_for_load: Callable[[str], str] = staticmethod(cache.derived_name)

    def _attach(
        self,
        path: PathLike,
        objname: str | None,
        nodes: str | Sequence[str] | None,
        token: PathLike | None,
        local: bool | None,
        preload: PathLike | None = None,
        meta: Sequence[str] = (),
        user: str | None = None,
        password: str | None = None,
    ) -> Manifest:
        """Find (or actively load) the dataset holding `path`; errors surface here, in the
        process that builds the dataset, never in a worker."""
        settings = cache.client_settings(nodes, token, user, password)
        ref, rel, key = cache.attach(
            os.fspath(path),
            objname=objname,
            name_rule=type(self)._name_for_load,
            settings=settings,
            local=local,
            source_for_preload=os.fspath(preload) if preload is not None else None,
            meta=meta,
        )
        self._ref = ref
        if key is not None:
            # Ends with the last dataset object of this process, or at exit.
            self._lease = weakref.finalize(self, lease.unhold, key, os.getpid())
        m = self._reader.manifest
        self._top = m.resolve(rel)
        self._prefix = m.path(self._top)
        return m

    @property
    def dataset_name(self) -> str:
        """The name of the cached dataset this reads from."""
        return self._ref.name

    @property
    def _reader(self) -> cache.Reader:
        held = self.__dict__.get("_held_reader")
        if held is not None and held[0] == cache.generation:
            return held[1]
        r = cache.reader(self._ref)
        self._held_reader = (cache.generation, r)
        return r

    def relpath(self, entry: int) -> str:
        full = self._reader.manifest.path(entry)
        return os.fsdecode(full[len(self._prefix) + 1 :] if self._prefix else full)

    def source_path(self, entry: int) -> str:
        return os.path.join(self.root, self.relpath(entry))

    def _entry_of(self, relpath: PathLike) -> int:
        m = self._reader.manifest
        rel = os.fsencode(relpath).strip(b"/")
        i = m.resolve(self._prefix + b"/" + rel if self._prefix else rel)
        if not m.is_file(i):
            raise InvalidArgument(f"not a regular file in {self._ref.name}: {os.fsdecode(rel)}")
        return i

    _ready: dict[int, memoryview] = {}

    def _bytes(self, entry: int, scratch: bool = False) -> memoryview:
        if self._ready:
            data = self._ready.get(entry)
            if data is not None:
                return data
        r = self._reader
        counts = self._counts()
        if r.all_local:
            counts["local"] += 1
            return r.local_view(entry)
        if r.is_local(entry):
            counts["local"] += 1
        else:
            counts["fetched"] += 1
        return r.scratch_view(entry) if scratch else r.view(entry)

    def _fetch_remote(self, entries: np.ndarray) -> dict[int, memoryview]:
        r = self._reader
        remote = [int(e) for e in entries if not r.is_local(int(e))]
        return r.fetch(remote) if remote else {}

    def _prepare_batch(self, entries: np.ndarray, indices: np.ndarray) -> None:
        """Before serving a batch: its remote files in memory, prefetched or in one read per node."""
        r = self._reader
        if r.all_local:
            self._ready = {}
            return
        got = self._prefetched(indices, self._weak_fetch("_fetch_entries"))
        counts = self._counts()
        ready: dict[int, memoryview] = dict(got) if got else {}
        counts["prefetched"] += len(ready)
        missing = [int(e) for e in entries if int(e) not in ready and not r.is_local(int(e))]
        if missing:
            ready.update(r.fetch(missing))
            counts["fetched"] += len(missing)
        self._ready = ready

    def _fetch_entries(self, indices: np.ndarray) -> dict[int, memoryview]:
        return self._fetch_remote(self._entries(indices))

    def _entries(self, indices: np.ndarray) -> np.ndarray:
        """Manifest entries of dataset indices (a subclass with its own sample list overrides)."""
        return self._index.entries_of(indices)

    def _plan_announcer(self) -> Callable[[EpochPlan], None] | None:
        """A read-through dataset's node evicts by the plan (eviction = "plan"): this epoch's
        order and the next one's, as manifest entries."""
        ref = weakref.ref(self)

        def announce(plan: EpochPlan) -> None:
            me = ref()
            if me is None or not me._reader.handle.readthrough:
                return
            orders = (plan.remaining(), plan.next_epoch().remaining())  # a resumed one: from start
            entries = [me._entries(np.asarray(o, dtype=np.int64)) for o in orders]
            me._reader.announce_plan(entries, plan_reader(plan))

        return announce

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A DataLoader batch: its remote files are read in one request per node (or were
        prefetched) before the per-sample `__getitem__` calls."""
        idx = np.asarray(indices, dtype=np.int64)
        self._prepare_batch(self._entries(idx), idx)
        try:
            return [self[int(i)] for i in idx]  # type: ignore[index]  # each dataset has one
        finally:
            self._ready = {}

    def __getstate__(self) -> dict[str, Any]:
        # Only config crosses to workers: no lease, no threads, no buffers.
        state = self.__dict__.copy()
        state.pop("_lease", None)
        state.pop("_ready", None)
        state.pop("_held_reader", None)
        return self._drop_prefetch_state(state)


class KSpeedFolder(CachedPath, Dataset[Any]):
    """Files under a cached folder. Subclass it and override `__getitem__`.

    `files` lists paths relative to root (in sorted walk order); `read(relpath)` returns the
    file's bytes as a memoryview of the node's shared memory when the data is local (no copy),
    else of a buffer filled over the network. Arguments: `objname` picks the cached dataset by
    name, `nodes`/`token` override the config, `local=False` forces network reads, and
    `extensions` keeps only files with those (lowercase) endings.
    """

    def __init__(
        self,
        root: PathLike,
        *,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
        extensions: tuple[str, ...] | None = None,
        user: str | None = None,
        password: str | None = None,
    ):
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        m = self._attach(self.root, objname, nodes, token, local, user=user, password=password)
        if not m.is_dir(self._top):
            raise InvalidArgument(f"{self.root} is a file, not a folder")
        builder = IndexBuilder()
        valid = extension_check(m, extensions) if extensions else (lambda i, p: True)
        build_folder_index(m, self._top, 0, builder, valid)
        self._index: SampleIndex = builder.build()

    @property
    def files(self) -> LazyFiles:
        return LazyFiles(self)

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[Any]:
        # DALI's external_source asks iter() before callable(), and __getitem__ alone would make
        # this iterable: a subclass with a per-sample __call__ (KSpeed's recipe) must not be.
        if callable(self):
            raise TypeError(f"{type(self).__name__} object is not iterable: it is a callable")
        return (self[i] for i in range(len(self)))

    def read(self, relpath: PathLike) -> memoryview:
        """The bytes of a file under root; zero-copy where local (a read-only view)."""
        return self._bytes(self._entry_of(relpath))

    def read_index(self, index: int) -> memoryview:
        """The bytes of file number `index` (of `files`)."""
        return self._bytes(self._index.entry(index))

    def size(self, relpath: PathLike) -> int:
        return int(self._reader.manifest.size[self._entry_of(relpath)])

    def __getitem__(self, index: int) -> Any:
        """File `index` as a read-only uint8 array over the cached bytes; override this."""
        return np.frombuffer(self.read_index(index), dtype=np.uint8)


def plan_reader(plan: EpochPlan) -> str:
    """Which share of the epoch `plan` is, as the node keeps the plans of a dataset apart:
    "rank/replicas". A sampler over the whole dataset in each process of a job (replicas 1)
    is told apart by the process's rank: each may order the epoch its own way."""
    rank = plan.rank if plan.num_replicas > 1 else cache.process_rank()
    return f"{rank}/{plan.num_replicas}"
