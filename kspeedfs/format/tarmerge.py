"""The merged tar view's table: every shard's members in one tree, as extracting them would give.

`NAME@untar/` shows, for a dataset's `.tar` files, what extracting each of them in path order
into its own folder of one empty tree gives (`for t in $(find . -name '*.tar' | sort); do
tar -xf $t -C $(dirname $t); done`): the shards of one folder merged into that folder. A later
member of the same path replaces an earlier one, across shards as within one; folders are
implied by member paths. Each shard is parsed by the tar view's rules (kspeedfs.format.tarview:
long GNU/PAX names, links, hostile tars), so a shard that view refuses is refused here too, and
so is a shard whose paths make a file of an earlier shard's folder or a folder of its file (a
hard link to another shard's file is such a refusal: its shard's own view refuses it too).

The table holds no Python object per member: rows in the order of a depth-first walk (a
folder's children sorted by name), each a name in one byte blob and fixed-width fields, and
per folder its children's rows in one array, so a lookup is a binary search. Its size is
`nbytes`: ~60 bytes per member beside its name (docs/webdataset.md gives ImageNet's figure).
"""

from __future__ import annotations

import stat
from array import array
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from kspeedfs.format import tarscan, tarview
from kspeedfs.format.errors import DataError
from kspeedfs.format.manifest import Manifest

DIR, FILE, LINK = 0, 1, 2
_KINDS = {tarview.DIR: DIR, tarview.FILE: FILE, tarview.LINK: LINK}
NO_SHARD = -1  # a folder's row: no shard holds its bytes
_SEP = b"\0"  # sorts below every name byte: a folder's rows follow it, before its next sibling


class _Records:
    """Member rows as they are gathered, shard after shard (compact columns; keys are the
    paths with `/` as NUL, so that sorting them walks the tree depth first)."""

    def __init__(self) -> None:
        self.blob = bytearray()  # the keys, back to back
        self.ends = array("q")  # where each key ends in it
        self.shard = array("i")
        self.kind = array("B")
        self.mode = array("H")
        self.mtime = array("q")
        self.offset = array("q")
        self.size = array("q")
        self.targets: dict[int, bytes] = {}  # a link's row -> its target

    def add(
        self, key: bytes, shard: int, kind: int, mode: int, mtime: int, offset: int, size: int
    ) -> None:
        self.blob += key
        self.ends.append(len(self.blob))
        self.shard.append(shard)
        self.kind.append(kind)
        # A folder's mode is never shown (0o555, shown_mode): one value for every folder, so
        # a folder a later shard only implies (the parser's node) and one a header named (the
        # scan's) are the same row.
        self.mode.append(0o755 if kind == DIR else mode & 0o7777)
        self.mtime.append(mtime)
        self.offset.append(offset)
        self.size.append(size)

    def add_tree(self, prefix: bytes, shard: int, tree: tarview.TarTree) -> None:
        """Every node of one shard's tree, under `prefix` (its folder's key, b"" at the top)."""
        stack = [(0, prefix)]
        while stack:
            number, at = stack.pop()
            for name, child in tree.children(number):
                node = tree.nodes[child]
                key = at + _SEP + name if at else name
                if node.kind == tarview.LINK:
                    self.targets[len(self.ends)] = node.target
                self.add(
                    key, shard, _KINDS[node.kind], node.mode, node.mtime, node.offset, node.size
                )
                if node.kind == tarview.DIR:
                    stack.append((child, key))

    def add_headers(self, prefix: bytes, shard: int, headers: list[tarscan.Header]) -> None:
        """A plain shard's headers in tar order (a later one of a path replaces an earlier
        one when the rows are sorted, as in the tar view)."""
        for parts, is_dir, mode, mtime, offset, size in headers:
            if not parts:
                continue  # the tar's own folder (`./`)
            key = _SEP.join(parts)
            key = prefix + _SEP + key if prefix else key
            self.add(key, shard, DIR if is_dir else FILE, mode, mtime, offset, size)


class _SortedRecords:
    """The rows' records in key order (stable: for one path, later shards last), and their
    keys. Sorted as one fixed-width numpy array (`SORT_BYTES` at most, freed after), not as
    a Python object per key; wider keys (long names) fall back to a sort of Python bytes."""

    def __init__(self, rows: _Records):
        self.blob = rows.blob
        self.ends = np.frombuffer(rows.ends, dtype=np.int64)
        self.starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)
        n = len(self.ends)
        lens = self.ends - self.starts
        width = int(lens.max()) if n else 1
        if n * width <= SORT_BYTES:
            grid = np.zeros((n, width), dtype=np.uint8)
            data = np.frombuffer(self.blob, dtype=np.uint8)
            for j in range(width):  # column j of every key that long
                at = np.flatnonzero(lens > j)
                grid[at, j] = data[self.starts[at] + j]
            self.order = np.argsort(grid.view(f"S{width}").ravel(), kind="stable")
            del grid
        else:
            keys = [self.key_of(r) for r in range(n)]
            self.order = np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
        self._chunk_no = -1
        self._chunk: list[bytes] = []

    def key_of(self, record: int) -> bytes:
        return bytes(self.blob[int(self.starts[record]) : int(self.ends[record])])

    def __len__(self) -> int:
        return len(self.order)

    def record(self, k: int) -> int:
        return int(self.order[k])

    def key(self, k: int) -> bytes:
        """The k-th key in order (read a chunk at a time: the walks go forward)."""
        chunk = k >> _CHUNK_BITS
        if chunk != self._chunk_no:
            records = self.order[chunk << _CHUNK_BITS : (chunk + 1) << _CHUNK_BITS]
            starts, ends, blob = (
                self.starts[records].tolist(),
                self.ends[records].tolist(),
                self.blob,
            )
            self._chunk = [bytes(blob[a:b]) for a, b in zip(starts, ends, strict=True)]
            self._chunk_no = chunk
        return self._chunk[k & ((1 << _CHUNK_BITS) - 1)]

    def drop_shard(self, shard: np.ndarray, refused: int) -> None:
        self.order = self.order[shard[self.order] != refused]
        self._chunk_no = -1


SORT_BYTES = 256 << 20
_CHUNK_BITS = 16  # keys materialised 65,536 at a time


def _first_conflict(rows: _Records, order: _SortedRecords) -> int | None:
    """The shard to refuse first, or None: the lowest shard that makes a file (or link) of a
    path an earlier shard made a folder, or the reverse. Refusing it and looking again gives
    what extracting in order and refusing each shard that clashes with those kept would."""
    shard, kind = rows.shard, rows.kind
    worst: int | None = None
    k, n = 0, len(order)
    while k < n:
        key = order.key(k)
        end = k
        first_dir = first_other = None
        while end < n and order.key(end) == key:
            s = shard[order.record(end)]
            if kind[order.record(end)] == DIR:
                first_dir = s if first_dir is None else min(first_dir, s)
            else:
                first_other = s if first_other is None else min(first_other, s)
            end += 1
        if first_other is not None:
            below = key + _SEP
            j = end
            while j < n and order.key(j).startswith(below):
                s = shard[order.record(j)]
                first_dir = s if first_dir is None else min(first_dir, s)
                j += 1
            if first_dir is not None:
                clash = max(first_dir, first_other)
                worst = clash if worst is None else min(worst, clash)
        k = end
    return worst


class MergedTree:
    """The merged view's rows; row 0 is its top folder. `shards[s]` is what the caller named
    shard s (a manifest entry)."""

    def __init__(self, arrays: dict[str, np.ndarray], refused: dict[int, str]):
        self.arrays = arrays
        self.refused = refused  # shard -> why (one line each)
        self.names = arrays["names"].tobytes()
        self.name_off = arrays["name_off"]
        self.parent = arrays["parent"]
        self.kind = arrays["kind"]
        self.mode = arrays["mode"]
        self.mtime = arrays["mtime"]
        self.shard = arrays["shard"]
        self.offset = arrays["offset"]
        self.size = arrays["size"]
        self.kids = arrays["kids"]
        self.kid_start = arrays["kid_start"]
        self.targets = arrays["targets"].tobytes()

    @property
    def rows(self) -> int:
        return len(self.kind)

    @property
    def nbytes(self) -> int:
        """What the table holds in memory."""
        return sum(a.nbytes for a in self.arrays.values()) + len(self.names) + len(self.targets)

    @property
    def members(self) -> int:
        return int(np.count_nonzero(self.kind != DIR))

    def name(self, row: int) -> bytes:
        return self.names[int(self.name_off[row]) : int(self.name_off[row + 1])]

    def is_dir(self, row: int) -> bool:
        return int(self.kind[row]) == DIR

    def children(self, row: int) -> Iterator[tuple[bytes, int]]:
        """A folder's (name, row), sorted by name bytes."""
        for c in self.kids[int(self.kid_start[row]) : int(self.kid_start[row + 1])].tolist():
            yield self.name(c), c

    def lookup(self, row: int, name: bytes) -> int | None:
        lo, hi = int(self.kid_start[row]), int(self.kid_start[row + 1])
        while lo < hi:
            mid = (lo + hi) // 2
            if self.name(int(self.kids[mid])) < name:
                lo = mid + 1
            else:
                hi = mid
        if lo < int(self.kid_start[row + 1]) and self.name(int(self.kids[lo])) == name:
            return int(self.kids[lo])
        return None

    def resolve(self, path: bytes) -> int | None:
        """The row at `path` (no links followed), or None."""
        row: int | None = 0
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if row is None or not self.is_dir(row):
                return None
            row = self.lookup(row, part)
        return row

    def path(self, row: int) -> bytes:
        parts = []
        while row:
            parts.append(self.name(row))
            row = int(self.parent[row])
        return b"/".join(reversed(parts))

    def target(self, row: int) -> bytes:
        """A link's target."""
        a = int(self.offset[row])
        return self.targets[a : a + int(self.size[row])]

    def member(self, row: int) -> tuple[int, int, int]:
        """A file's (shard, data offset in its tar, size)."""
        return int(self.shard[row]), int(self.offset[row]), int(self.size[row])

    def shown_mode(self, row: int) -> int:
        """Readable by everyone, executable files kept executable, never writable (as the
        tar view shows a member)."""
        kind = int(self.kind[row])
        if kind == LINK:
            return stat.S_IFLNK | 0o777
        if kind == DIR:
            return stat.S_IFDIR | 0o555
        return stat.S_IFREG | (0o555 if int(self.mode[row]) & 0o111 else 0o444)

    def shown_size(self, row: int) -> int:
        return 0 if self.is_dir(row) else int(self.size[row])


Read = Callable[[int, int, int], tarview.Reader]  # (tar entry, offset, size) -> bytes
Shard = tuple[bytes, Callable[[int, int], tarview.Reader], int]  # (folder, read, size)


def tars_below(m: Manifest, top: int) -> list[int]:
    """Entries of the `.tar` files under folder `top`, in path order."""
    found: list[tuple[bytes, int]] = []
    folders = [top]
    while folders:
        for i in m.children(folders.pop()):
            if m.is_dir(i):
                folders.append(i)
            elif m.is_file(i) and tarview.is_tar_name(m.name(i)):
                found.append((m.path(i), i))
    return [i for _path, i in sorted(found)]


def merge_folder(m: Manifest, top: int, read: Read) -> tuple[MergedTree, list[int]]:
    """The merged view of the tars under folder `top` of a dataset, and the tar entries its
    shard numbers stand for; `read(entry, offset, size)` reads a tar's bytes."""
    tars = tars_below(m, top)
    base = len(m.path(top))

    def shard(t: int) -> Shard:
        return m.path(int(m.parent[t]))[base:], lambda off, n: read(t, off, n), int(m.size[t])

    return merge(shard(t) for t in tars), tars


def merge(shards: Iterable[Shard]) -> MergedTree:
    """The merged tree of `shards`, given in path order as (folder of the shard relative to
    the view's top, b"" for the top; `read(offset, size)` of its bytes; its size). A shard
    that is refused is in `refused` with its one-line reason, and none of its members is
    shown. Plain shards are read by tarscan, the others by the tar view's parser."""
    rows = _Records()
    refused: dict[int, str] = {}
    for s, (folder, read, size) in enumerate(shards):
        prefix = folder.strip(b"/").replace(b"/", _SEP)
        if prefix:  # the shard's folder is there even if it is refused or empty
            rows.add(prefix, NO_SHARD, DIR, 0o755, 0, 0, 0)
        headers = tarscan.scan(read, size)
        if headers is not None:
            rows.add_headers(prefix, s, headers)
            continue
        try:
            tree = tarview.parse(read, size)
        except DataError as e:
            refused[s] = str(e)
            continue
        rows.add_tree(prefix, s, tree)
    order = _SortedRecords(rows)
    shards = np.frombuffer(rows.shard, dtype=np.int32)
    while (clash := _first_conflict(rows, order)) is not None:
        refused[clash] = "its paths make a file of an earlier shard's folder, or the reverse"
        order.drop_shard(shards, clash)
    return _table(rows, order, refused)


def _table(rows: _Records, order: _SortedRecords, refused: dict[int, str]) -> MergedTree:
    """Rows in depth-first order, each path once (the last record of it), with the folders
    that paths imply."""
    names = bytearray()
    name_off = array("q", [0, 0])  # the top has no name
    parent = array("i", [0])
    picked = array("q", [-1])  # the record a row shows; -1 an implied folder (and the top)
    chain: list[tuple[bytes, int]] = []  # (key, row) of the folders above the walk
    k, n = 0, len(order)
    while k < n:
        key = order.key(k)
        while k + 1 < n and order.key(k + 1) == key:
            k += 1
        record = order.record(k)
        k += 1
        parts = key.split(_SEP)
        while chain and not key.startswith(chain[-1][0] + _SEP):
            chain.pop()
        for depth in range(len(chain), len(parts) - 1):  # folders no record names
            folder_key = _SEP.join(parts[: depth + 1])
            chain.append(
                (folder_key, _add_row(names, name_off, parent, picked, parts[depth], chain, -1))
            )
        row = _add_row(names, name_off, parent, picked, parts[-1], chain, record)
        if rows.kind[record] == DIR:
            chain.append((key, row))
    sel = np.frombuffer(picked, dtype=np.int64)
    real = sel >= 0
    at = np.where(real, sel, 0)

    def column(values: array, dtype: str, default: int) -> np.ndarray:
        given = np.frombuffer(values, dtype=values.typecode).astype(dtype)
        full = given[at] if given.size else np.zeros(len(at), dtype)  # no member at all
        full[~real] = default
        return full

    kind = column(rows.kind, "u1", DIR)
    offset = column(rows.offset, "<i8", 0)
    size = column(rows.size, "<i8", 0)
    targets = bytearray()
    for row in np.flatnonzero(kind == LINK).tolist():
        target = rows.targets[int(sel[row])]
        offset[row], size[row] = len(targets), len(target)
        targets += target
    parents = np.frombuffer(parent, dtype=np.int32).copy()
    kids = np.argsort(parents[1:], kind="stable").astype("<i4") + 1  # depth-first: names sorted
    kid_start = np.searchsorted(parents[kids], np.arange(len(parents) + 1)).astype("<i8")
    arrays: dict[str, np.ndarray] = {
        "names": np.frombuffer(bytes(names), dtype=np.uint8),
        "name_off": _narrow(np.frombuffer(name_off, dtype=np.int64)),
        "parent": parents,
        "kind": kind,
        "mode": column(rows.mode, "<u2", 0o755),
        "mtime": _narrow(column(rows.mtime, "<i8", 0)),
        "shard": column(rows.shard, "<i4", NO_SHARD),
        "offset": _narrow(offset),
        "size": _narrow(size),
        "kids": kids,
        "kid_start": _narrow(kid_start),
        "targets": np.frombuffer(bytes(targets), dtype=np.uint8),
    }
    return MergedTree(arrays, dict(sorted(refused.items())))


def _narrow(values: np.ndarray) -> np.ndarray:
    """`values` in 4 bytes each where they fit (offsets in tars under 4 GiB, sizes, times),
    else in 8: half the table at ImageNet's shape."""
    if not values.size or (int(values.min()) >= 0 and int(values.max()) < 1 << 32):
        return values.astype("<u4")
    if int(values.min()) >= -(1 << 31) and int(values.max()) < 1 << 31:
        return values.astype("<i4")
    return values.astype("<i8")


def _add_row(
    names: bytearray,
    name_off: array,
    parent: array,
    picked: array,
    name: bytes,
    chain: list[tuple[bytes, int]],
    record: int,
) -> int:
    names += name
    name_off.append(len(names))
    parent.append(chain[-1][1] if chain else 0)
    picked.append(record)
    return len(picked) - 1
