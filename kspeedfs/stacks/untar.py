"""`kspeedfs://NAME@untar/...`: the merged tar view (kspeedfs.format.tarmerge) through fsspec.

The same tree the mount shows as `NAME@untar/`: every `.tar` of the dataset extracted in path
order into its own folder, built from the tars' headers once per instance and process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kspeedfs.client.dataset_reader import Reader
from kspeedfs.format import tarmerge
from kspeedfs.format.errors import NoSuchPath
from kspeedfs.system.memory import trim_heap

log = logging.getLogger(__name__)

UNTAR_VIEW = "@untar"


class MergedViews:
    """The merged tables of the instances this filesystem has opened `NAME@untar` of."""

    def __init__(self) -> None:
        self._trees: dict[str, tuple[tarmerge.MergedTree, list[int]]] = {}
        self._lock = threading.Lock()

    def _tree(self, reader: Reader) -> tuple[tarmerge.MergedTree, list[int]]:
        uuid = reader.ref.uuid
        with self._lock:
            found = self._trees.get(uuid)
            if found is None:
                found = tarmerge.merge_folder(reader.manifest, 0, reader.range_bytes)
                trim_heap()
                for shard, why in found[0].refused.items():
                    path = os.fsdecode(reader.manifest.path(found[1][shard]))
                    log.warning(
                        "%s%s: the shard %s is left out: %s", reader.ref.name, UNTAR_VIEW, path, why
                    )
                self._trees = {uuid: found}  # one instance's table at a time: the newest
            return found

    def spot(self, reader: Reader, rel: str) -> tuple[tarmerge.MergedTree, int]:
        """The table and row of `rel` in the view (no links followed)."""
        tree, _ = self._tree(reader)
        row = tree.resolve(os.fsencode(rel))
        if row is None:
            raise NoSuchPath(f"no such file: kspeedfs://{reader.ref.name}{UNTAR_VIEW}/{rel}")
        return tree, row

    def describe(
        self, reader: Reader, tree: tarmerge.MergedTree, row: int, path: str
    ) -> dict[str, Any]:
        _mode, _size, uid, gid, mtime_ns = reader.manifest.stat_fields(0)
        kind = {tarmerge.DIR: "directory", tarmerge.FILE: "file", tarmerge.LINK: "link"}[
            int(tree.kind[row])
        ]
        out: dict[str, Any] = {
            "name": path,
            "size": tree.shown_size(row) if kind == "file" else 0,
            "type": kind,
            "mode": tree.shown_mode(row),
            "uid": uid,
            "gid": gid,
            "mtime": float(tree.mtime[row]) if row else mtime_ns / 1e9,
            "islink": kind == "link",
            "dataset": reader.ref.name,
            "instance": reader.ref.uuid,
        }
        if kind == "link":
            out["destination"] = os.fsdecode(tree.target(row))
        return out

    def info(self, reader: Reader, rel: str, path: str) -> dict[str, Any]:
        tree, row = self.spot(reader, rel)
        return self.describe(reader, tree, row, path)

    def ls(self, reader: Reader, rel: str, path: str) -> list[dict[str, Any]]:
        tree, row = self.spot(reader, rel)
        if not tree.is_dir(row):
            return [self.describe(reader, tree, row, path)]
        return [
            self.describe(reader, tree, child, f"{path}/{os.fsdecode(name)}")
            for name, child in tree.children(row)
        ]

    def member(self, reader: Reader, rel: str, path: str) -> tuple[int, int, int, dict[str, Any]]:
        """(tar entry, offset, size, details) of a member file."""
        tree, row = self.spot(reader, rel)
        if int(tree.kind[row]) != tarmerge.FILE:
            raise IsADirectoryError(f"kspeedfs://{path} is not a regular file")
        shard, offset, size = tree.member(row)
        return self._tree(reader)[1][shard], offset, size, self.describe(reader, tree, row, path)
