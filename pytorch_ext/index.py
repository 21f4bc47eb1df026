"""Sample lists as runs of consecutive manifest entries: a few arrays, not one object per file.

The manifest stores a folder's children contiguously and sorted, so the files of a class folder
are usually one run. Sample i is found by a binary search over the run starts; memory is
proportional to the number of runs (about one per folder), and the arrays pickle in microseconds
for spawned workers.
"""

from __future__ import annotations

import bisect
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, overload

import numpy as np

from kspeedfs.format.manifest import Manifest

_S_IFMT = 0o170000
T = TypeVar("T")


class SampleList(Protocol):
    """What the datasets and the lazy lists ask of a sample list."""

    def __len__(self) -> int: ...

    def entry(self, i: int) -> int: ...

    def target(self, i: int) -> Any: ...

    def entries_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...

    def all_targets(self) -> np.ndarray: ...

    def all_entries(self) -> np.ndarray: ...


class SampleIndex:
    """Sample number -> (manifest entry, target)."""

    def __init__(self, starts: np.ndarray, entries: np.ndarray, targets: np.ndarray, total: int):
        self.starts = starts  # sample number where each run starts
        self.entries = entries  # manifest entry of each run's first sample
        self.targets = targets  # target of each run
        self.total = total

    def __len__(self) -> int:
        return self.total

    def _run(self, i: int) -> int:
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(f"sample index {i} out of range for {self.total} samples")
        starts = self.__dict__.get("_starts_list")
        if starts is None:
            starts = self._starts_list = self.starts.tolist()  # bisect beats numpy on scalars
        return bisect.bisect_right(starts, i) - 1

    def entry(self, i: int) -> int:
        i = i + self.total if i < 0 else i
        r = self._run(i)
        return int(self.entries[r]) + i - self._starts_list[r]

    def target(self, i: int) -> int:
        return int(self.targets[self._run(i)])

    def entries_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + self.total, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self.total):
            raise IndexError(f"sample index out of range for {self.total} samples")
        runs = np.searchsorted(self.starts, idx, side="right") - 1
        return self.entries[runs] + idx - self.starts[runs]

    def all_targets(self) -> np.ndarray:
        lengths = np.diff(np.append(self.starts, self.total))
        return np.repeat(self.targets, lengths)

    def all_entries(self) -> np.ndarray:
        return self.entries_of(np.arange(self.total))


class IndexBuilder:
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: list[int] = []
        self._targets: list[int] = []
        self._next_entry = -1
        self._target = -1
        self.total = 0

    def add(self, entry: int, target: int) -> None:
        if entry != self._next_entry or target != self._target:
            self._starts.append(self.total)
            self._entries.append(entry)
            self._targets.append(target)
            self._target = target
        self._next_entry = entry + 1
        self.total += 1

    def build(self) -> SampleIndex:
        return SampleIndex(
            np.array(self._starts, dtype=np.int64),
            np.array(self._entries, dtype=np.int64),
            np.array(self._targets, dtype=np.int64),
            self.total,
        )


def _name(m: Manifest, i: int) -> str:
    return os.fsdecode(m.name(i))


def _sorted_children(m: Manifest, d: int) -> list[int]:
    """Children in the order Python sorts their names (bytes order but for non-UTF-8 names)."""
    kids = list(m.children(d))
    if all(m.name(i).isascii() for i in kids):
        return kids
    return sorted(kids, key=lambda i: _name(m, i))


def walk(m: Manifest, top: int) -> list[tuple[str, int]]:
    """Every folder under `top` (itself first) with its path relative to `top`, in the order of
    `sorted(os.walk(top))`. Symlinks are not followed: the cache serves no link targets."""
    found = [("", top)]
    queue = [("", top)]
    while queue:
        rel, d = queue.pop()
        for i in m.children(d):
            if (int(m.mode[i]) & _S_IFMT) == stat.S_IFDIR:
                sub = (rel + "/" + _name(m, i)) if rel else _name(m, i)
                found.append((sub, i))
                queue.append((sub, i))
    # os.walk yields "top", "top/a", "top/a/b", "top/a-c": sorting full paths as strings.
    found.sort(key=lambda item: item[0])
    return found


def files_in(m: Manifest, d: int) -> Iterator[int]:
    for i in _sorted_children(m, d):
        if (int(m.mode[i]) & _S_IFMT) == stat.S_IFREG:
            yield i


def class_folders(m: Manifest, root: int) -> list[tuple[str, int]]:
    """(name, entry) of each folder directly under root, sorted like `find_classes`."""
    out = [(_name(m, i), i) for i in m.children(root) if (int(m.mode[i]) & _S_IFMT) == stat.S_IFDIR]
    return sorted(out)


def build_folder_index(
    m: Manifest,
    top: int,
    target: int,
    builder: IndexBuilder,
    valid: Callable[[int, str], bool],
    path_of: Callable[[str, str], str] | None = None,
) -> int:
    """Add the valid files under folder `top` (walk order) with `target`; returns how many.

    `valid(entry, path)` gets the path from `path_of(folder rel, name)`, or "" without it.
    """
    added = 0
    for rel, d in walk(m, top):
        for i in files_in(m, d):
            if valid(i, path_of(rel, _name(m, i)) if path_of else ""):
                builder.add(i, target)
                added += 1
    return added


def extension_check(m: Manifest, extensions: tuple[str, ...]) -> Callable[[int, str], bool]:
    """`has_file_allowed_extension` on the name bytes (no path string needed)."""
    exts = tuple(e.lower().encode() for e in extensions)
    return lambda i, _path: m.name(i).lower().endswith(exts)


class _BuiltOnAccess(Sequence[T]):
    """A read-only list over the sample index whose items are made when asked for."""

    def __init__(self, index: SampleList):
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


class LazySamples(_BuiltOnAccess[tuple[str, int]]):
    """`samples` of an image folder, built on access: (source path, target)."""

    def __init__(self, owner: Any):
        super().__init__(owner._index)
        self._owner = owner

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, i: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._owner.source_path(self._index.entry(i)), self._index.target(i)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        # tolist: Python ints from an int array, and a meta file's string targets as they are
        targets = self._index.all_targets().tolist()
        for k, e in enumerate(self._index.all_entries()):
            yield self._owner.source_path(int(e)), targets[k]

    def __repr__(self) -> str:
        return f"<{len(self)} samples of {self._owner.root!r}, built on access>"


class LazyTargets(_BuiltOnAccess[int]):
    """`targets` without a list: an int per sample from the run arrays."""

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return list(self._index.all_targets()[i].tolist())
        return self._index.target(i)

    def __iter__(self) -> Iterator[int]:
        return iter(self._index.all_targets().tolist())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self._index.all_targets()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        return f"<{len(self)} targets, built on access>"


class LazyFiles(_BuiltOnAccess[str]):
    """`files` of a folder dataset: paths relative to its root."""

    def __init__(self, owner: Any):
        super().__init__(owner._index)
        self._owner = owner

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._owner.relpath(self._index.entry(i))

    def __repr__(self) -> str:
        return f"<{len(self)} files of {self._owner.root!r}>"
