"""Tar-shard indexes, a kind of meta index: a preload indexes every `.tar` file of its source
(kspeedfs.format.tarindex), and they travel, land and go with the instance exactly as the meta
indexes of kspeedfs.node.metaindexes do. A shard the preload cannot index (damaged, not a tar) is
left out with a warning rather than failing the dataset; a job's first use of it asks for it
again (`meta_add`), which refuses it in one line."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

from kspeedfs.format import metaindex, tarindex
from kspeedfs.format.errors import DataError
from kspeedfs.format.tree import Tree

log = logging.getLogger(__name__)


def shards(tree: Tree) -> list[str]:
    """The `.tar` files of a scanned source, as paths inside it (names that are not UTF-8 are
    left out: an index is named on the wire)."""
    out: list[str] = []
    for i, (name, mode) in enumerate(zip(tree.names, tree.mode, strict=True)):
        if stat.S_ISREG(mode) and name.endswith(metaindex.TAR_SUFFIX.encode()):
            try:
                out.append(tree.path(i).decode())
            except UnicodeDecodeError:
                log.warning("not indexing the tar %r: its name is not UTF-8", tree.path(i))
    return out


def index_size_estimate(meta: str, size: int) -> int:
    """Bytes to reserve for the index of a meta file or a shard of `size` bytes."""
    if metaindex.is_tar_shard(meta):
        return tarindex.index_size_estimate(size)
    return metaindex.index_size_estimate(size)


def open_index(path: Path, meta: str) -> metaindex.MetaIndex | tarindex.TarIndex:
    """The index file of `meta`, by its kind."""
    if metaindex.is_tar_shard(meta):
        return tarindex.TarIndex(path)
    return metaindex.MetaIndex(path)


def build_shard(raw: bytes, out: Path, header: dict[str, Any]) -> dict[str, Any]:
    try:
        built = tarindex.build_index(raw, out, header)
    except DataError as e:
        raise DataError(f"shard {header['meta']}: {e}") from None
    log.info(
        "indexed the shard %s of %s: %d samples in %d members",
        header["meta"],
        header["name"],
        built["samples"],
        built["rows"],
    )
    return built


def discard_failed(out: Path) -> None:
    """A shard whose index failed leaves nothing behind."""
    out.unlink(missing_ok=True)
    Path(os.fspath(out) + ".tmp").unlink(missing_ok=True)
