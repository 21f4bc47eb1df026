"""KSpeedWebDataset: WebDataset tar shards as a map-style dataset, any sample in any order.

WebDataset reads a shard from start to end, so a shuffle is a buffer over a stream. The cache
indexes each shard once (kspeedfs.format.tarindex: at preload, or on the first job that asks)
into the byte ranges of every sample's members, so sample i is one read of known ranges:
a view of shared memory where the shard is on this machine, one vectored read per node for a
batch otherwise, fetched ahead of use when the sampler's order is known (ClairvoyantSampler,
MiniEpochSampler, PrioritySampler), as for the other fast-path datasets.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from kspeedfs.format import metaindex
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tarindex import TarIndex

from .folder import CachedPath, PathLike
from .metaindexes import ask_to_index, open_kind

Sample = dict[str, Any]
Part = tuple[int, int, int]  # (manifest entry of the shard, data offset, size)

# decode= names: webdataset's image specs, and "tensor" as the other datasets mean it (uint8 CHW).
_SPEC_ALIASES = {"tensor": "torchrgb8"}


def _decoder(decode: str | Callable[[Sample], Sample]) -> Callable[[Sample], Sample]:
    """webdataset's own Decoder for an image spec (its `.decode(spec)`), or the callable given."""
    if callable(decode):
        return decode
    from webdataset import autodecode

    spec = _SPEC_ALIASES.get(decode, decode)
    if spec not in autodecode.imagespecs:
        names = ", ".join(sorted({*autodecode.imagespecs, *_SPEC_ALIASES}))
        raise InvalidArgument(f"decode must be one of {names} or a callable, not {decode!r}")
    decoder: Callable[[Sample], Sample] = autodecode.Decoder([autodecode.ImageHandler(spec)])
    return decoder


def _shards_below(m: Manifest, top: int) -> list[int]:
    """Entries of the `.tar` files under folder `top`, by their path (WebDataset's brace
    lists and sorted globs give shards in name order)."""
    found: list[tuple[bytes, int]] = []
    folders = [top]
    suffix = metaindex.TAR_SUFFIX.encode()
    while folders:
        for i in m.children(folders.pop()):
            if m.is_dir(i):
                folders.append(i)
            elif m.is_file(i) and m.name(i).endswith(suffix):
                found.append((m.path(i), i))
    return [i for _path, i in sorted(found)]


class KSpeedWebDataset(CachedPath, Dataset[Sample]):
    """The samples of WebDataset shards (`.tar`) under a cached folder, by index.

    `ds[i]` is the i-th sample `webdataset.WebDataset(shards)` yields: shards in name order
    (or in the order of `shards`, paths relative to `root`), samples in tar order, each a dict
    with `__key__`, `__url__` (the shard's path under `root`) and one entry per member
    extension. Values are `bytes`; `views=True` gives memoryviews instead, of the node's
    shared memory where the shard is local (no copy). `decode="pil"` (or "tensor", or any
    webdataset image spec such as "torchrgb8", or a callable on the sample) decodes as
    `WebDataset(...).decode(spec)` does, with webdataset's own decoders.

    A DataLoader batch (`__getitems__`) is one read per node; with a ClairvoyantSampler,
    MiniEpochSampler or PrioritySampler the remote samples are read ahead of use.
    """

    def __init__(
        self,
        root: PathLike,
        shards: Sequence[PathLike] | None = None,
        decode: str | Callable[[Sample], Sample] | None = None,
        *,
        views: bool = False,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
        user: str | None = None,
        password: str | None = None,
    ):
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        self.decode = decode
        self.views = views
        if decode is not None:
            _decoder(decode)  # a bad name is refused here, not in a worker
        m = self._attach(self.root, objname, nodes, token, local, user=user, password=password)
        if not m.is_dir(self._top):
            raise InvalidArgument(f"{self.root} is a file, not a folder of shards")
        if shards is None:
            entries = _shards_below(m, self._top)
        else:
            entries = [self._shard_entry(s) for s in shards]
        if not entries:
            raise NotFound(f"no .tar shards in {self.root}")
        self._shard_entries = entries
        self._shard_metas = [os.fsdecode(m.path(e)) for e in entries]
        self._shard_urls = [os.path.join(self.root, self.relpath(e)) for e in entries]
        counts = [idx.samples for idx in self._open_indexes()]
        self._starts: list[int] = np.concatenate([[0], np.cumsum(counts)]).tolist()

    def _shard_entry(self, shard: PathLike) -> int:
        path = os.fspath(shard)
        if os.path.isabs(path):
            path = os.path.relpath(path, os.fspath(self.root))
        if not path.endswith(metaindex.TAR_SUFFIX):
            raise InvalidArgument(f"shard {path} is not a .tar file")
        try:
            return self._entry_of(path)
        except NotFound:
            raise NotFound(f"no shard {path} in {self.root}") from None

    def _open_indexes(self) -> list[TarIndex]:
        """Every shard's index, asking the cache (once, for all) for those it does not have
        yet: a dataset cached before tar indexes existed, or a shard its preload left out."""
        reader = self._reader
        found: dict[str, TarIndex] = {}
        missing: list[str] = []
        for meta in self._shard_metas:
            try:
                found[meta] = open_kind(reader, meta, TarIndex)
            except NotFound:
                missing.append(meta)
        if missing:
            try:
                ask_to_index(reader, missing)
            except KSpeedError as e:
                raise type(e)(f"indexing the shards of {self.root}: {e}") from None
            for meta in missing:
                found[meta] = open_kind(reader, meta, TarIndex)
        return [found[meta] for meta in self._shard_metas]

    @property
    def shards(self) -> list[str]:
        """The shards' paths (`__url__`), in the dataset's order."""
        return list(self._shard_urls)

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard_index(self, shard: int) -> TarIndex:
        indexes: list[TarIndex | None] | None = self.__dict__.get("_shard_maps")
        if indexes is None:
            indexes = [None] * len(self._shard_entries)
            self._shard_maps = indexes
        idx = indexes[shard]
        if idx is None:
            idx = indexes[shard] = open_kind(self._reader, self._shard_metas[shard], TarIndex)
        return idx

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i %= n
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def _parts(self, i: int) -> tuple[int, int, list[tuple[str, int, int]]]:
        shard, j = self._locate(i)
        return shard, j, self._shard_index(shard).parts(j)

    def _is_local(self, entry: int, offset: int, size: int) -> bool:
        r = self._reader
        if r.all_local:
            return True
        if r.local is None:
            return False
        return all(r.local.holds(seg) for seg, _o, _n in r.manifest.ranges(entry, offset, size))

    def _local_view(self, entry: int, offset: int, size: int) -> memoryview | None:
        """Bytes of the shard in shared memory (no copy), or None when not in one local piece."""
        r = self._reader
        if r.local is None:
            return None
        pieces = r.manifest.ranges(entry, offset, size)
        if len(pieces) == 1 and r.local.holds(pieces[0][0]):
            return r.local.view(*pieces[0])
        return None

    def _gather(self, parts: list[Part]) -> list[memoryview]:
        """The ranges, read with one request per node, each a view of one new buffer."""
        buf = memoryview(bytearray(sum(n for _e, _o, n in parts)))
        self._reader.gather(parts, buf)
        out, pos = [], 0
        for _e, _o, n in parts:
            out.append(buf[pos : pos + n])
            pos += n
        return out

    def _fetch_samples(self, indices: Sequence[int] | np.ndarray) -> dict[int, list[memoryview]]:
        """The members' bytes of the samples among `indices` that are not all local."""
        wanted: list[int] = []
        parts: list[Part] = []
        for i in dict.fromkeys(int(k) for k in indices):
            shard, _j, members = self._parts(i)
            entry = self._shard_entries[shard]
            mine = [(entry, off, n) for _ext, off, n in members]
            if not all(self._is_local(*p) for p in mine):
                wanted.append(i)
                parts.extend(mine)
        if not parts:
            return {}
        views = iter(self._gather(parts))
        return {i: [next(views) for _ in self._parts(i)[2]] for i in wanted}

    _ready: dict[int, Any] = {}

    def __getitem__(self, index: int) -> Sample:
        i = int(index)
        shard, j, members = self._parts(i)
        entry = self._shard_entries[shard]
        data = self._ready.get(i % max(len(self), 1)) if self._ready else None
        counts = self._counts()
        if data is None:
            local = [self._local_view(entry, off, n) for _ext, off, n in members]
            if all(v is not None for v in local):
                counts["local"] += 1
                data = local
            else:
                counts["fetched"] += 1
                data = self._gather([(entry, off, n) for _ext, off, n in members])
        idx = self._shard_index(shard)
        sample: Sample = {"__key__": idx.key(j), "__url__": self._shard_urls[shard]}
        for (ext, _off, _n), value in zip(members, data, strict=True):
            sample[ext] = value if self.views and self.decode is None else bytes(value)
        if self.decode is None:
            return sample
        decoder = self.__dict__.get("_decoder")
        if decoder is None:
            decoder = self._decoder = _decoder(self.decode)
        return decoder(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """A DataLoader batch: its remote samples read in one request per node (or read ahead
        by the prefetcher) before they are assembled."""
        idx = np.asarray(indices, dtype=np.int64)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"sample index out of range for {n} samples")
        idx %= max(n, 1)
        if not self._reader.all_local:
            got = self._prefetched(idx, self._weak_fetch("_fetch_samples"))
            ready: dict[int, Any] = dict(got) if got else {}
            self._counts()["prefetched"] += len(ready)
            rest = [int(i) for i in idx if int(i) not in ready]
            fetched = self._fetch_samples(rest) if rest else {}
            self._counts()["fetched"] += len(fetched)
            ready.update(fetched)
            self._ready = ready
        try:
            return [self[int(i)] for i in idx]
        finally:
            self._ready = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_shard_maps", None)
        state.pop("_decoder", None)
        return state
