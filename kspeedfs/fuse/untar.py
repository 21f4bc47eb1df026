"""The merged tar view on the mount: `NAME@untar/` shows a dataset's tars as one extracted tree.

What extracting every `.tar` of the dataset, in path order, into its own folder of one empty
tree would give (kspeedfs.format.tarmerge): the shards of a folder merged into that folder.
The table is built at the view's first use in each serving process, from the tars' headers
only (no member's bytes are read), and kept while the instance lives; a member's bytes are a
range of its tar, read as the tar view reads them. Indices are the table's rows (0: the view's
top), the same in every process since every process builds the same table from the same bytes.
A refused shard is one log line per process, and none of its members is shown.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import tarmerge
from kspeedfs.format.errors import DataError
from kspeedfs.fuse.kernel import Buffer, FuseError, ReadResult
from kspeedfs.fuse.variants import tar_bytes
from kspeedfs.system.memory import trim_heap

log = logging.getLogger(__name__)

UNTAR_SUFFIX = "@untar"


def untar_folder_name(name: str) -> str:
    return f"{name}{UNTAR_SUFFIX}"


class UntarFiles:
    """`NAME@untar/` as a serving process shows it."""

    def __init__(self, reader: ClusterReader, data: DatasetHandle):
        self.reader = reader
        self.data = data
        self.manifest = data.manifest
        self._merged: tuple[tarmerge.MergedTree, list[int]] | None = None
        self._lock = threading.Lock()
        _, _, self._uid, self._gid, self._top_mtime = self.manifest.stat_fields(0)
        # The folder listed last: a listing comes in several replies, each from an offset.
        self._listed: tuple[int, list[tuple[bytes, int]]] = (-1, [])

    def close(self) -> None:
        with self._lock:
            self._merged = None

    def _raw(self, tar: int, offset: int, size: int) -> Buffer:
        return tar_bytes(self.reader, self.data, tar, offset, size)

    def _built(self) -> tuple[tarmerge.MergedTree, list[int]]:
        """The merged table and the tar entries of its shards, built at the first call (one
        builder; the others wait for it)."""
        merged = self._merged
        if merged is None:
            with self._lock:
                merged = self._merged
                if merged is None:
                    started = time.monotonic()
                    merged = tarmerge.merge_folder(self.manifest, 0, self._raw)
                    trim_heap()
                    self._merged = merged
                    self._log_built(merged, time.monotonic() - started)
        return merged

    @property
    def tree(self) -> tarmerge.MergedTree:
        return self._built()[0]

    def _log_built(self, merged: tuple[tarmerge.MergedTree, list[int]], seconds: float) -> None:
        tree, tars = merged
        name = untar_folder_name(self.data.name)
        for shard, why in tree.refused.items():
            path = os.fsdecode(self.manifest.path(tars[shard]))
            log.error("%s: the shard %s is left out: %s", name, path, why)
        log.info(
            "%s: %d members of %d shards in %d rows (%d bytes), built in %.1fs",
            name,
            tree.members,
            len(tars) - len(tree.refused),
            tree.rows,
            tree.nbytes,
            seconds,
        )

    def _row(self, idx: int) -> int:
        if not 0 <= idx < self.tree.rows:
            raise FuseError(errno.ENOENT)
        return idx

    def stat_fields(self, idx: int) -> tuple[int, int, int, int, int]:
        """(mode, size, uid, gid, mtime_ns); owners are the dataset's top folder's, as a tar
        view's members take their tar's. The top's need no table: a stat of the mount's root
        names (the mount's own check that it answers) does not build it."""
        if idx == 0:
            return stat.S_IFDIR | 0o555, 0, self._uid, self._gid, self._top_mtime
        row, tree = self._row(idx), self.tree
        mtime = int(tree.mtime[row]) * 1_000_000_000
        return tree.shown_mode(row), tree.shown_size(row), self._uid, self._gid, mtime

    def path(self, idx: int) -> bytes:
        """Where `idx` is inside the view."""
        return self.tree.path(self._row(idx))

    def is_dir(self, idx: int) -> bool:
        return idx == 0 or self.tree.is_dir(self._row(idx))

    def parent(self, idx: int) -> int:
        return 0 if idx == 0 else int(self.tree.parent[self._row(idx)])

    def lookup(self, parent: int, name: bytes) -> int | None:
        row, tree = self._row(parent), self.tree
        return tree.lookup(row, name) if tree.is_dir(row) else None

    def children(self, idx: int) -> list[tuple[bytes, int]]:
        listed = self._listed
        if listed[0] == idx:
            return listed[1]
        row, tree = self._row(idx), self.tree
        kids = list(tree.children(row)) if tree.is_dir(row) else []
        self._listed = (idx, kids)
        return kids

    def readlink(self, idx: int) -> bytes | None:
        row, tree = self._row(idx), self.tree
        if int(tree.kind[row]) != tarmerge.LINK:
            raise FuseError(errno.EINVAL)
        return tree.target(row)

    def shows_own_bytes(self, idx: int) -> bool:
        """No row is a dataset file shown as it is (no checksum to give)."""
        return False

    def read(self, idx: int, offset: int, size: int) -> ReadResult:
        row = self._row(idx)
        tree, tars = self._built()
        kind = int(tree.kind[row])
        if kind != tarmerge.FILE:
            raise FuseError(errno.EISDIR if kind == tarmerge.DIR else errno.EINVAL)
        shard, start, length = tree.member(row)
        tar = tars[shard]
        n = max(0, min(size, length - offset))
        if n == 0:
            return b""
        local = self.data.local
        if local is not None:
            try:
                return local.read_view(tar, start + offset, n)  # inline: no thread hop
            except DataError:
                pass
        return lambda: self._raw(tar, start + offset, n)
