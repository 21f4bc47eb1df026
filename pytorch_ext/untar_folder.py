"""KSpeedUntarFolder: every cached tar under a folder as one extracted tree, an ImageFolder.

The fast path's side of the merged tar view (`NAME@untar/` on the mount,
`kspeedfs://NAME@untar/`): `KSpeedUntarFolder("/data/shards")` is what `DatasetFolder` gives
over the folder every `.tar` under `/data/shards` was extracted into, in path order, each into
its own folder (kspeedfs.format.tarmerge: a later member of a path replaces an earlier one, a
refused shard is one warning and its members absent). `folder` picks a folder inside that tree
(`folder="train"` for shards whose members are `train/<class>/...`). Samples are byte ranges of
the cached tars, read as KSpeedTarFolder reads them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from kspeedfs.client import on_mount
from kspeedfs.format import tarmerge
from kspeedfs.format.errors import InvalidArgument

from .folder import PathLike
from .tar_folder import IMG_EXTENSIONS, MemberFolder

log = logging.getLogger(__name__)


class KSpeedUntarFolder(MemberFolder):
    """DatasetFolder over the merged members of the cached tars under `root`: a folder of a
    cached dataset (by its source path or its path on a mount), or a folder of the merged
    view on a mount (`/mnt/kspeedfs/NAME@untar/train`: what ImageFolder over it gives); see
    MemberFolder."""

    def __init__(
        self,
        root: PathLike,
        loader: Callable[[memoryview], Any] | None = None,
        extensions: Sequence[str] | None = IMG_EXTENSIONS,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        *,
        folder: str = "",
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
    ):
        self._configure(root, loader, transform, target_transform)
        on = on_mount.behind(self.root)
        if on is not None and on.untar is not None:  # a folder of NAME@untar on a mount
            folder = os.path.join(on.untar, folder) if folder else on.untar
            m = self._attach(on.source, objname or on.dataset, nodes, token, local)
        else:
            m = self._attach(self.root, objname, nodes, token, local)
        if not m.is_dir(self._top):
            raise InvalidArgument(f"{self.root} is not a folder of a cached dataset")
        tree, tars = tarmerge.merge_folder(m, self._top, self._reader.range_bytes)
        for shard, why in tree.refused.items():
            log.warning(
                "%s: the shard %s is left out: %s", self.root, os.fsdecode(m.path(tars[shard])), why
            )
        top = tree.resolve(os.fsencode(folder))
        if top is None or not tree.is_dir(top):
            raise InvalidArgument(
                f"no folder {folder!r} among the members of the tars in {self.root}"
            )
        if on is None or on.untar is None:
            self.root = os.path.join(self.root, folder) if folder else self.root
        self.shards = [os.fsdecode(m.path(t)) for t in tars]  # shard numbers -> paths
        self.refused = dict(tree.refused)

        def children(row: int) -> list[tuple[bytes, int]]:
            return list(tree.children(top if row == 0 else row))

        def span(row: int) -> tuple[int, int, int] | None:
            if int(tree.kind[row]) != tarmerge.FILE:
                return None
            shard, offset, size = tree.member(row)
            return tars[shard], offset, size

        self._collect(children, lambda row: tree.is_dir(row), span, extensions, is_valid_file)
