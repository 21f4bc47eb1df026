"""KSpeedCallable: a DALI-style external source over a cached image folder (no DALI needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kspeedfs.format.errors import InvalidArgument

from .folder import CachedPath, PathLike
from .image_folder import KSpeedImageFolder


class SampleInfo(NamedTuple):
    """The fields of DALI's `types.SampleInfo` that a per-sample source reads."""

    idx_in_epoch: int
    idx_in_batch: int
    iteration: int
    epoch_idx: int


class BatchInfo(NamedTuple):
    """The fields of DALI's `types.BatchInfo` that a batch source reads."""

    iteration: int
    epoch_idx: int


def file_batch(folder: CachedPath, indices: np.ndarray) -> list[memoryview]:
    """The files of samples `indices` of `folder`: the remote ones prefetched or read in one
    request per node, the local ones viewed in place (no copy)."""
    entries = folder._entries(indices)
    reader = folder._reader
    if reader.all_local:  # the hot path: views of the node's memory, counted once a batch
        folder._counts()["local"] += len(entries)
        return [reader.local_view(e) for e in entries.tolist()]
    folder._prepare_batch(entries, indices)
    try:
        return [folder._bytes(int(e)) for e in entries]
    finally:
        folder._ready = {}


class KSpeedCallable:
    """A DALI external source over a cached image folder, per sample or per batch.

    Per batch, DALI's fastest way to feed it (no worker processes, no shared-memory hop: see
    docs/dali.md)::

        jpegs, labels = fn.external_source(
            source=KSpeedCallable(root, batch_size).batch, num_outputs=2, batch=True,
            batch_info=True)

    `batch(batch_info)` gives (list of encoded files as np.uint8, labels as np.int32 of shape
    (batch_size, 1)); the remote files of a batch come in one request per node. Per sample,
    as NVIDIA's ResNet-50 recipe uses it::

        fn.external_source(source=KSpeedCallable(root, batch_size), num_outputs=2,
            batch=False, parallel=True)

    `source(sample_info)` gives (encoded bytes as np.uint8, label as np.int32[1]). Both walk
    the same order: every shard its own slice of a per-epoch permutation (the same seed on all
    shards, so the slices are disjoint), and an epoch ends with StopIteration after the
    shard's full batches. The bytes are a zero-copy view of the cache where local. Picklable
    (only config) for DALI's worker processes.
    """

    # DALI's external_source asks iter() before callable(): this is a callable, never iterated.
    __iter__ = None

    def __init__(
        self,
        root: PathLike,
        batch_size: int,
        shard_id: int = 0,
        num_shards: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 42,
        is_valid_file: Callable[[str], bool] | None = None,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
    ):
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be at least 1, not {batch_size}")
        if not 0 <= shard_id < num_shards:
            raise InvalidArgument(f"shard_id {shard_id} is not in [0, {num_shards})")
        self.folder = KSpeedImageFolder(
            root,
            is_valid_file=is_valid_file,
            objname=objname,
            nodes=nodes,
            token=token,
            local=local,
        )
        self.batch_size = batch_size
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.shuffle = shuffle
        self.seed = seed
        self.shard_size = len(self.folder) // num_shards
        self.shard_offset = self.shard_size * shard_id
        self.full_iterations = self.shard_size // batch_size
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1
        self._labels: np.ndarray | None = None

    @property
    def classes(self) -> list[str]:
        return self.folder.classes

    def __len__(self) -> int:
        """Samples this shard yields per epoch."""
        return self.full_iterations * self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm_epoch != epoch:
            n = len(self.folder)
            dtype = np.int32 if n < 2**31 else np.int64
            if self.shuffle:
                self._perm = np.random.default_rng(self.seed + epoch).permutation(n).astype(dtype)
            else:
                self._perm = np.arange(n, dtype=dtype)
            self._perm_epoch = epoch
        return self._perm

    def _label_column(self) -> np.ndarray:
        """Every sample's label as an int32 column, made once per process: a sample's label
        is a row of it (a view), a batch's labels one fancy index."""
        if self._labels is None:
            targets = np.asarray(self.folder.targets, dtype=np.int32)
            self._labels = targets.reshape(-1, 1)
        return self._labels

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        if sample_info.iteration >= self.full_iterations:
            raise StopIteration
        order = self._order(int(sample_info.epoch_idx))
        index = int(order[self.shard_offset + int(sample_info.idx_in_epoch)])
        entry, _label = self.folder._sample(index)
        data = np.frombuffer(self.folder._bytes(entry), dtype=np.uint8)
        return data, self._label_column()[index]

    def batch(self, batch_info: Any) -> tuple[list[np.ndarray], np.ndarray]:
        """Batch `batch_info.iteration` of epoch `batch_info.epoch_idx` (DALI's BatchInfo, or
        this module's): the same samples, in the same order, as the per-sample calls."""
        if not hasattr(batch_info, "epoch_idx"):
            # DALI passes a bare iteration number without batch_info=True: no epoch, no order.
            raise InvalidArgument(
                f"KSpeedCallable.batch needs DALI's BatchInfo, not {batch_info!r}: pass "
                "batch_info=True to fn.external_source"
            )
        iteration = int(batch_info.iteration)
        if iteration >= self.full_iterations:
            raise StopIteration
        start = self.shard_offset + iteration * self.batch_size
        indices = self._order(int(batch_info.epoch_idx))[start : start + self.batch_size]
        indices = indices.astype(np.int64)
        files = file_batch(self.folder, indices)
        data = [np.frombuffer(f, dtype=np.uint8) for f in files]
        return data, self._label_column()[indices]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perm"], state["_perm_epoch"], state["_labels"] = None, -1, None
        return state
