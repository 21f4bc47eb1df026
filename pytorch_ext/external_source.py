"""KSpeedCallable: a DALI-style external source over a cached image folder (no DALI needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kspeedfs.format.errors import InvalidArgument

from .folder import PathLike
from .image_folder import KSpeedImageFolder


class SampleInfo(NamedTuple):
    """The fields of DALI's `types.SampleInfo` that a per-sample source reads."""

    idx_in_epoch: int
    idx_in_batch: int
    iteration: int
    epoch_idx: int


class KSpeedCallable:
    """`source(sample_info) -> (encoded bytes as np.uint8, label as np.int32[1])`.

    For `fn.external_source(source=KSpeedCallable(...), num_outputs=2, batch=False,
    parallel=True)`: every shard walks its own slice of a per-epoch permutation (the same seed
    on all shards, so the slices are disjoint), and an epoch ends with StopIteration after the
    shard's full batches. The bytes are a zero-copy view of the cache where local. Picklable
    (only config) for DALI's worker processes.
    """

    # DALI's external_source asks iter() before callable(): this is a per-sample callable only.
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

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        if sample_info.iteration >= self.full_iterations:
            raise StopIteration
        order = self._order(int(sample_info.epoch_idx))
        index = int(order[self.shard_offset + int(sample_info.idx_in_epoch)])
        entry, label = self.folder._sample(index)
        data = np.frombuffer(self.folder._bytes(entry), dtype=np.uint8)
        return data, np.array([label], dtype=np.int32)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perm"], state["_perm_epoch"] = None, -1
        return state
