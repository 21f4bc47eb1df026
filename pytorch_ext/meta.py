"""KSpeedMetaDataset: samples named by a meta file, one per line, read through the node's mapped
meta index instead of a list parsed in every rank and worker.

The node parses the meta file once (at preload, `--meta`, or on the first job that asks for a
meta file the preload did not index) into an index that every process on the node maps: per
line the manifest entry, the target and the raw line's byte range. A dataset object holds only
config; a worker's memory does not grow with the number of lines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torchvision.datasets import VisionDataset
from torchvision.datasets.folder import default_loader

from kspeedfs.format import metaindex
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.metaindex import MetaIndex

from .folder import PathLike
from .image_folder import CachedImages
from .metaindexes import add_index, open_index

log = logging.getLogger(__name__)

Parse = Callable[[bytes], tuple[Any, Any]]


class MetaSamples:
    """Sample number -> line of the meta file -> (manifest entry, target), from the mapped index.

    Picklable config (the owner, the meta name, the rows served when not every line is); the
    index is mapped in each process on first use. With `parse`, each line asked for is parsed
    then (and only then) and its path looked up in the manifest.
    """

    def __init__(self, owner: KSpeedMetaDataset, rows: np.ndarray | None, total: int):
        self._owner = owner
        self._rows = rows  # line numbers of the samples; None: sample i is line i
        self._total = total
        self._last: tuple[int, tuple[int, Any]] | None = None
        self._idx: MetaIndex | None = None  # this process's map (a forked child keeps it)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_last"] = state["_idx"] = None
        return state

    @property
    def index(self) -> MetaIndex:
        idx = self._idx
        if idx is None:
            idx = self._idx = open_index(self._owner._reader, self._owner.meta)
        return idx

    def __len__(self) -> int:
        return self._total

    def row(self, i: int) -> int:
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(f"sample index {i} out of range for {self._total} samples")
        return i if self._rows is None else int(self._rows[i])

    def rows_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + self._total, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._total):
            raise IndexError(f"sample index out of range for {self._total} samples")
        return idx if self._rows is None else self._rows[idx].astype(np.int64)

    def line(self, i: int) -> bytes:
        """The raw line of sample i (without its newline)."""
        return self.index.line(self.row(i))

    def parsed(self, row: int) -> tuple[int, Any]:
        """(entry, target) of a line by the dataset's `parse`, with its line number on error."""
        if self._last is not None and self._last[0] == row:
            return self._last[1]
        owner = self._owner
        assert owner.parse is not None
        where = f"{owner.meta} line {row + 1}"
        try:
            rel, target = owner.parse(self.index.line(row))
        except Exception as e:
            raise InvalidArgument(f"{where}: parse failed: {e}") from e
        try:
            entry = owner._entry_of(os.fsdecode(rel))
        except (NotFound, InvalidArgument):
            raise NotFound(f"{where}: no file {os.fsdecode(rel)} in {owner.root}") from None
        self._last = (row, (entry, target))
        return entry, target

    def entry(self, i: int) -> int:
        row = self.row(i)
        if self._owner.parse is not None:
            return self.parsed(row)[0]
        return int(self.index.entry[row])

    def target(self, i: int) -> Any:
        row = self.row(i)
        if self._owner.parse is not None:
            return self.parsed(row)[1]
        return self.index.target_of(row)

    def entries_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        rows = self.rows_of(indices)
        if self._owner.parse is not None:
            return np.array([self.parsed(int(r))[0] for r in rows], dtype=np.int64)
        return self.index.entry[rows].astype(np.int64)

    def all_targets(self) -> np.ndarray:
        rows = self.rows_of(np.arange(self._total))
        if self._owner.parse is not None:
            out = np.empty(len(rows), dtype=object)
            out[:] = [self.parsed(int(r))[1] for r in rows]
            return out
        idx = self.index
        t = idx.target[rows]
        if idx.target_kind == "str":
            return np.array(idx.strings(), dtype=object)[t]
        return t.astype(np.int64)

    def all_entries(self) -> np.ndarray:
        return self.entries_of(np.arange(self._total))


class KSpeedMetaDataset(CachedImages):
    """Samples listed in a meta file (`relative/path.jpg 3`, or JSON lines), read from the cache.

    `root` is the cached dataset's root (the preloaded folder); `meta` a file in it, indexed at
    preload (`kspeedfs preload ROOT --name N --meta train.txt`), by the active load this
    dataset starts when ROOT is not cached, or, when ROOT is cached without it, by the node
    this dataset asks on first use. Paths in the meta file are relative to `root`.

    Items are `(image, target)` as with ImageFolder (`decode="pil"|"tensor"`, `loader`,
    `transform`, `target_transform`); `samples`/`targets` are lazy sequences; string targets
    come from the index's string table (`classes`, `class_to_idx`). `parse` (a function from a
    line's bytes to `(relpath, target)`) replaces the built-in parsing: it is called only for
    the lines asked for. Bad lines and missing files are refused with their line numbers;
    `strict=False` skips them (with `parse`, that takes one pass over the lines here).
    """

    def __init__(
        self,
        root: PathLike,
        meta: PathLike,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        parse: Parse | None = None,
        strict: bool = True,
        loader: Callable[..., Any] = default_loader,
        *,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        decode: str = "pil",
        local: bool | None = None,
    ):
        if decode not in ("pil", "tensor"):
            raise InvalidArgument(f"decode must be 'pil' or 'tensor', not {decode!r}")
        VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)
        meta_path = os.fspath(meta)
        if os.path.isabs(meta_path):
            meta_path = os.path.relpath(meta_path, os.fspath(self.root))
        self.meta = metaindex.meta_name(meta_path)
        self.parse = parse
        self.strict = strict
        self.loader = loader
        self.decode = decode
        m = self._attach(self.root, objname, nodes, token, local, meta=[self.meta])
        if self._prefix:
            raise InvalidArgument(
                f"{self.root} is a folder inside dataset {self._ref.name}, not its root: paths "
                "in a meta file are relative to the root of a cached dataset"
            )
        if not m.is_dir(self._top):
            raise InvalidArgument(f"{self.root} is a file, not a folder")
        try:
            try:
                idx = open_index(self._reader, self.meta)
            except NotFound:
                idx = add_index(self._reader, self.meta)  # cached without it: first use
        except NotFound as e:
            raise NotFound(f"{self.meta} of {self.root}: {e}") from None
        self.classes: list[str] = idx.strings() if idx.target_kind == "str" else []
        self.class_to_idx = {c: k for k, c in enumerate(self.classes)}
        self._samples = None
        self._targets = None
        if parse is None:
            self._index = self._builtin_samples(idx)
        elif strict:
            self._index = MetaSamples(self, idx.nonblank, idx.rows - int(idx.header["blank"]))
        else:
            self._index = self._parsed_samples(idx)

    def _builtin_samples(self, idx: MetaIndex) -> MetaSamples:
        h = idx.header
        if h["bad"] or h["missing"]:
            what = f"{self.meta} in {self.root}: {idx.describe_problems()}"
            if self.strict:
                raise InvalidArgument(f"{what}; strict=False skips them")
            log.warning("skipping lines of %s", what)
        return MetaSamples(self, idx.good, int(h["samples"]))

    def _parsed_samples(self, idx: MetaIndex) -> MetaSamples:
        """strict=False with a parser: the lines that parse and name a file, found in one pass."""
        probe = MetaSamples(self, None, idx.rows)
        good: list[int] = []
        skipped: list[str] = []
        for row in range(idx.rows) if idx.nonblank is None else idx.nonblank.tolist():
            try:
                probe.parsed(row)
                good.append(row)
            except KSpeedError as e:
                if len(skipped) < 5:
                    skipped.append(str(e))
        if skipped:
            log.warning("skipping %d lines: %s", idx.rows - len(good), "; ".join(skipped))
        return MetaSamples(self, np.array(good, dtype=np.int64), len(good))

    def line(self, index: int) -> bytes:
        """The raw meta line of sample `index`."""
        assert isinstance(self._index, MetaSamples)
        return self._index.line(index)

    def extra_repr(self) -> str:
        return f"Meta file: {self.meta}\n" + super().extra_repr()
