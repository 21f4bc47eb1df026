"""Meta-file indexes, a variant of a dataset instance: the preload's coordinator builds each one
once, sends it to every member beside the manifest; it lives in the dataset folder (so it is
unloaded with it and counted in its bytes) and every process on the node maps it."""

from __future__ import annotations

import base64
import bisect
import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from kspeedfs.format import metaindex
from kspeedfs.format.errors import DataError, InvalidArgument, NotFound, StaleDataset
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.names import validate_name
from kspeedfs.format.tree import Tree
from kspeedfs.node.ops import ADMIN, READ, OpRegistry
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import Source

log = logging.getLogger(__name__)

PIECE = 4 * 1024 * 1024  # bytes of an index per control frame (before base64)
MAX_INDEX_BYTES = 1 << 38

Call = Callable[[str, str, dict[str, Any]], Any]


class Staged(Protocol):
    """The part of a member's stage an index lands in."""

    uuid: str
    staging: Path | None


def requested(msg: dict[str, Any], tree: Tree) -> list[str]:
    """The meta files a preload asks to index, checked against the scanned source: each must be
    a regular file in it (a one-line error before anything loads)."""
    names = msg.get("meta") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidArgument("meta must be a list of paths inside the source")
    out: list[str] = []
    for raw in names:
        name = metaindex.meta_name(raw)
        i = _tree_lookup(tree, name)
        if i is None or not stat.S_ISREG(tree.mode[i]):
            raise InvalidArgument(f"meta file {name} is not a file in the source")
        if name not in out:
            out.append(name)
    return out


def reserve_estimate(tree: Tree, names: Sequence[str]) -> int:
    """Bytes each member reserves for the indexes before loading."""
    total = 0
    for name in names:
        i = _tree_lookup(tree, name)
        total += metaindex.index_size_estimate(tree.size[i] if i is not None else 0)
    return total


def _tree_lookup(tree: Tree, rel: str) -> int | None:
    i = 0
    for part in os.fsencode(rel).split(b"/"):
        first, count = tree.first_child[i], tree.child_count[i]
        if not stat.S_ISDIR(tree.mode[i]) or not count:
            return None
        names = tree.names[first : first + count]
        k = bisect.bisect_left(names, part)
        if k == count or names[k] != part:
            return None
        i = first + k
    return i


def _build_one(
    source: Source, m: Manifest, meta: str, out: Path, ident: dict[str, str]
) -> dict[str, Any]:
    i = m.resolve(meta)
    size = int(m.size[i])
    raw = source.read_verified(m.path(i), 0, size, size, int(m.mtime_ns[i]), int(m.checksum[i]))
    header = metaindex.build_index(
        raw, m, out, {**ident, "meta": meta, "meta_entry": i, "meta_size": size}
    )
    log.info(
        "indexed %s of %s: %d lines, %d samples, %d bad, %d missing",
        meta,
        ident["name"],
        header["rows"],
        header["samples"],
        header["bad"],
        header["missing"],
    )
    return header


async def build(
    names: Sequence[str],
    manifest_path: Path,
    source: Source,
    scratch: Path,
    ident: dict[str, str],
) -> list[tuple[str, Path]]:
    """Index each meta file from the source's verified bytes; (meta, index file) in scratch."""
    if not names:
        return []
    m = await trio.to_thread.run_sync(Manifest, manifest_path)
    built: list[tuple[str, Path]] = []
    try:
        for meta in names:
            digest = metaindex.index_file(meta).rsplit("/", 1)[-1]
            out = scratch / f"{ident['name']}.{ident['uuid']}.{digest}"
            built.append((meta, out))
            await trio.to_thread.run_sync(_build_one, source, m, meta, out, ident)
    except BaseException:
        discard(built)
        raise
    return built


async def send(
    members: Sequence[str], ident: dict[str, str], built: list[tuple[str, Path]], call: Call
) -> None:
    """Every member gets every index, in pieces (an index is far over one control frame)."""

    async def send_to(member: str) -> None:
        for meta, path in built:
            total = path.stat().st_size
            with open(path, "rb") as f:
                pos = 0
                while True:
                    data = await trio.to_thread.run_sync(f.read, PIECE)
                    args = {
                        **ident,
                        "meta": meta,
                        "offset": pos,
                        "total": total,
                        "data": base64.b64encode(data).decode(),
                    }
                    await call(member, "stage_meta", args)
                    pos += len(data)
                    if pos >= total or not data:
                        break

    async with trio.open_nursery() as nursery:
        for member in members:
            nursery.start_soon(send_to, member)


def discard(built: list[tuple[str, Path]]) -> None:
    for _meta, path in built:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)


def stored_bytes(dataset_dir: Path) -> int:
    """Bytes of the indexes in a dataset (or staging) folder."""
    folder = dataset_dir / metaindex.INDEX_DIR
    if not folder.is_dir():
        return 0
    return sum((folder / f).stat().st_size for f in os.listdir(folder))


class MetaIndexes:
    """A member's side: receive a preload's indexes into its stage, and serve published ones to
    clients that cannot map them (a machine that holds no part of the dataset)."""

    def __init__(self, store: SegmentStore, stage_of: Callable[[dict[str, Any]], Staged]):
        self.store = store
        self.stage_of = stage_of

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add("stage_meta", self.op_stage_meta, ADMIN)
        ops.add("meta_index", self.op_meta_index, READ)

    async def op_stage_meta(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self.stage_of(msg)
        if stage.staging is None:
            raise InvalidArgument("no staging folder for this preload")
        meta = metaindex.meta_name(str(msg["meta"]))
        offset, total = int(msg["offset"]), int(msg["total"])
        data = base64.b64decode(str(msg["data"]))
        path = stage.staging / metaindex.index_file(meta)
        received = await trio.to_thread.run_sync(
            _write_piece, path, offset, total, data, stage.uuid, meta
        )
        return {"received": received}

    async def op_meta_index(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A piece of a published index's bytes (the client maps the whole file)."""
        name = validate_name(msg.get("name", ""))
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if msg.get("uuid") and msg["uuid"] != record.uuid:
            raise StaleDataset(f"dataset {name!r} was loaded again: the instance asked for is gone")
        meta = metaindex.meta_name(str(msg.get("meta", "")))
        path = record.path / metaindex.index_file(meta)
        offset = int(msg.get("offset", 0))

        def read_piece() -> tuple[int, bytes]:
            try:
                with open(path, "rb") as f:
                    total = os.fstat(f.fileno()).st_size
                    f.seek(offset)
                    return total, f.read(max(0, min(PIECE, total - offset)))
            except FileNotFoundError:
                raise NotFound(
                    f"dataset {name} has no index of {meta}: preload it with --meta {meta}"
                ) from None

        total, data = await trio.to_thread.run_sync(read_piece)
        return {
            "name": name,
            "uuid": record.uuid,
            "meta": meta,
            "offset": offset,
            "total": total,
            "data": base64.b64encode(data).decode(),
        }


def _write_piece(path: Path, offset: int, total: int, data: bytes, uuid: str, meta: str) -> int:
    """Write one piece of an index; the last one is checked and put in place. Returns the bytes
    received so far."""
    if offset < 0 or offset + len(data) > total or total > MAX_INDEX_BYTES:
        raise InvalidArgument("meta index piece out of range")
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)
    if offset + len(data) < total:
        return offset + len(data)
    if tmp.stat().st_size != total:
        raise DataError(f"meta index of {meta} arrived incomplete")
    idx = metaindex.MetaIndex(tmp)
    if idx.uuid != uuid or idx.meta != meta:
        raise DataError(f"meta index of {meta} belongs to another preload")
    del idx
    os.replace(tmp, path)
    return total
