"""A dataset's meta-file and tar-shard indexes in this process: the node's copy mapped when it
is on this machine, else fetched once from a node; indexing asked of the cache when missing.
Apart from KSpeedMetaDataset, so that a WebDataset reader needs no torchvision."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TypeVar

from kspeedfs.client.blobs import fetch_blob
from kspeedfs.format import metaindex
from kspeedfs.format.contract.metaindexes import FetchMetaIndex, MetaAdd
from kspeedfs.format.errors import AuthError, DataError, NotFound
from kspeedfs.format.metaindex import MetaIndex
from kspeedfs.format.tarindex import TarIndex
from kspeedfs.net.connection import SCAN_TIMEOUT

from . import cache

log = logging.getLogger(__name__)

Index = TypeVar("Index", MetaIndex, TarIndex)

_indexes: dict[tuple[str, str, str, bool | None], MetaIndex | TarIndex] = {}
_indexes_lock = threading.Lock()


def open_index(reader: cache.Reader, meta: str) -> MetaIndex:
    """This process's map of a dataset's index of `meta`: the node's copy when it is on this
    machine, else fetched once from a node (a forked worker inherits the map either way)."""
    return open_kind(reader, meta, MetaIndex)


def open_kind(reader: cache.Reader, meta: str, kind: type[Index]) -> Index:
    """`open_index` for an index of either kind (a meta file's, a tar shard's)."""
    ref = reader.ref
    key = (ref.name, ref.uuid, meta, ref.local)
    idx = _indexes.get(key)
    if isinstance(idx, kind):
        return idx
    with _indexes_lock:
        idx = _indexes.get(key)
        if not isinstance(idx, kind):
            idx = None
            if reader.local is not None:
                try:
                    idx = kind(reader.local.path / metaindex.index_file(meta))
                except NotFound:
                    pass  # not on this node's copy: ask a node (which says why not)
            if idx is None:
                idx = _fetch(reader, meta, kind)
            if idx.uuid != ref.uuid or idx.meta != meta:
                raise DataError(f"dataset {ref.name} was reloaded since this job attached to it")
            _indexes[key] = idx
    return idx


def add_index(reader: cache.Reader, meta: str) -> MetaIndex:
    """First use of a meta file the dataset was cached without: the node indexes it on every
    member (as `kspeedfs meta add` does; a job token may), then this process maps it."""
    ask_to_index(reader, [meta])
    return open_index(reader, meta)


def ask_to_index(reader: cache.Reader, metas: Sequence[str]) -> None:
    """Have the cache index meta files (or tar shards) on every member, in one request."""
    ref = reader.ref
    log.info("asking the cache to index %d files of %s (%s)", len(metas), ref.name, metas[0])
    try:
        reader.cluster.pool.live_call(
            MetaAdd(name=ref.name, uuid=ref.uuid, meta=list(metas)), answer_within=SCAN_TIMEOUT
        )
    except AuthError as e:
        raise AuthError(
            f"dataset {ref.name} has no index of {metas[0]} and indexing it needs a job token: {e}"
        ) from None


def _fetch(reader: cache.Reader, meta: str, kind: type[Index]) -> Index:
    """The index of `meta` (or a tar shard) from the first node that answers, in pieces, into
    a temporary file this process maps."""
    ref = reader.ref
    cluster = reader.cluster
    return fetch_blob(
        cluster.pool,
        lambda offset: FetchMetaIndex(name=ref.name, uuid=ref.uuid, meta=meta, offset=offset),
        f"kspeedfs-{ref.name}-",
        ".kmi",
        kind,
    )
