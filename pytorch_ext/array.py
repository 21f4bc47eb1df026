"""KSpeedDataset: rows of a cached .npy array; a list of indices is one batch, one read per node."""

from __future__ import annotations

import ast
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset

from kspeedfs.format.errors import DataError, InvalidArgument

from .folder import CachedPath, PathLike
from .prefetch import ClairvoyantSampler

_MAGIC = b"\x93NUMPY"


def parse_npy_header(head: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, data offset) from the first bytes of a .npy file."""
    if len(head) < 10 or not head.startswith(_MAGIC):
        raise DataError("not a .npy file (bad magic)")
    major = head[6]
    if major == 1:
        (hlen,), start = struct.unpack_from("<H", head, 8), 10
    elif major in (2, 3):
        if len(head) < 12:
            raise DataError("truncated .npy header")
        (hlen,), start = struct.unpack_from("<I", head, 8), 12
    else:
        raise DataError(f"unsupported .npy format version {major}")
    if len(head) < start + hlen:
        raise DataError("truncated .npy header")
    text = head[start : start + hlen].decode("utf-8" if major == 3 else "latin1")
    try:
        d = ast.literal_eval(text)
        dtype = np.lib.format.descr_to_dtype(d["descr"])
        shape = tuple(int(x) for x in d["shape"])
        fortran = bool(d["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise DataError(f"bad .npy header: {e}") from None
    return dtype, shape, fortran, start + hlen


class KSpeedDataset(CachedPath, Dataset[Any]):
    """One row of a cached .npy array per sample.

    `ds[i]` is a row (a read-only view of shared memory when local and within one segment);
    `ds[[i, j, ...]]` (or a slice, array or tensor of indices) is one new array, gathered with
    one read per node. `batch_size` is the batch you will ask for: `batch_sampler()` then gives
    the matching sampler, which also prefetches remote rows ahead (see ClairvoyantSampler).
    A path that is not cached is actively loaded with its folder.
    """

    def __init__(
        self,
        path: PathLike,
        batch_size: int | None = None,
        *,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
        user: str | None = None,
        password: str | None = None,
    ):
        if batch_size is not None and batch_size < 1:
            raise InvalidArgument(f"batch_size must be at least 1, not {batch_size}")
        self.root = os.path.expanduser(path) if isinstance(path, str) else path
        self.batch_size = batch_size
        m = self._attach(
            self.root,
            objname,
            nodes,
            token,
            local,
            preload=os.path.dirname(os.fspath(self.root)),
            user=user,
            password=password,
        )
        if not m.is_file(self._top):
            raise InvalidArgument(f"{self.root} is not a regular file")
        self._entry = self._top
        size = int(m.size[self._entry])
        head = self._range(0, min(size, 65536 + 12), copy=True)
        try:
            dtype, shape, fortran, offset = parse_npy_header(bytes(head))
        except DataError as e:
            raise DataError(f"{self.root}: {e}") from None
        if fortran and len(shape) > 1:
            raise InvalidArgument(f"{self.root}: Fortran-order arrays have no contiguous rows")
        if dtype.hasobject:
            raise InvalidArgument(f"{self.root}: object arrays cannot be read without pickle")
        if not shape:
            raise InvalidArgument(f"{self.root}: a 0-d array has no rows")
        self.dtype = dtype
        self.shape = shape
        self.row_shape = shape[1:]
        self._offset = offset
        self._row_bytes = dtype.itemsize * math.prod(self.row_shape)
        if offset + self._row_bytes * shape[0] > size:
            raise DataError(f"{self.root}: file is shorter than its header says")

    def __len__(self) -> int:
        return self.shape[0]

    def _range(self, offset: int, length: int, copy: bool = False) -> memoryview:
        r = self._reader
        if not copy and r.local is not None:
            pieces = r.manifest.ranges(self._entry, offset, length)
            if len(pieces) == 1 and r.local.holds(pieces[0][0]):
                return r.local.view(*pieces[0])
        out = memoryview(bytearray(length))
        r.gather([(self._entry, offset, length)], out)
        return out

    def _row(self, i: int) -> Any:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        view = self._range(self._offset + i * self._row_bytes, self._row_bytes)
        row = np.frombuffer(view, dtype=self.dtype).reshape(self.row_shape)
        return row[()] if not self.row_shape else row

    def read_rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `indices` as one new array, with one read per node holding any of them."""
        n = len(self)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"row index out of range for {n} rows")
        idx %= max(n, 1)
        out = np.empty((len(idx), *self.row_shape), dtype=self.dtype)
        if out.nbytes:
            rb, base = self._row_bytes, self._offset
            requests = [(self._entry, base + int(i) * rb, rb) for i in idx]
            self._reader.gather(requests, out.reshape(-1).view(np.uint8).data)
        return out

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            self._counts()["rows"] += 1
            return self._row(int(index))
        if isinstance(index, slice):
            idx = np.arange(*index.indices(len(self)))
        elif isinstance(index, torch.Tensor):
            idx = index.numpy().astype(np.int64).reshape(-1)
        else:
            idx = np.asarray(index, dtype=np.int64).reshape(-1)
        return self._batch(idx)

    def _batch(self, idx: np.ndarray) -> np.ndarray:
        counts = self._counts()
        if not self._reader.all_local:
            got = self._prefetched(idx, self._weak_fetch("read_rows"))
            if got is not None:
                counts["prefetched"] += len(idx)
                return got
            counts["fetched"] += len(idx)
        else:
            counts["local"] += len(idx)
        return self.read_rows(idx)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A DataLoader batch (auto-batching): one read, then the rows for the collate."""
        return list(self._batch(np.asarray(indices, dtype=np.int64)))

    def batch_sampler(
        self,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        depth: int = 4,
    ) -> BatchSampler:
        """Batches of `batch_size` rows for `DataLoader(ds, sampler=..., batch_size=None)`."""
        if self.batch_size is None:
            raise InvalidArgument("batch_sampler() needs the dataset's batch_size")
        sampler = ClairvoyantSampler(
            self, num_replicas, rank, shuffle=shuffle, seed=seed, depth=depth
        )
        return BatchSampler(sampler, self.batch_size, drop_last=drop_last)
