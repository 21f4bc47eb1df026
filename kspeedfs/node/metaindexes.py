"""Meta-file indexes, a variant of a dataset instance: the preload's coordinator builds each one
once, sends it to every member beside the manifest; it lives in the dataset folder (so it is
unloaded with it and counted in its bytes) and every process on the node maps it. An index the
preload did not build is added to the published instance later (`meta_add`) the same way."""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import trio

from kspeedfs.format import metaindex
from kspeedfs.format.contract import READTHROUGH, Request
from kspeedfs.format.contract.metaindexes import (
    FetchMetaIndex,
    IndexAddAborted,
    IndexAdded,
    IndexCommitted,
    IndexPiecePut,
    IndexPieceStaged,
    IndexReserved,
    MetaAbort,
    MetaAdd,
    MetaAdded,
    MetaCommit,
    MetaIndexPiece,
    MetaPut,
    MetaReserve,
    StageMeta,
)
from kspeedfs.format.contract.pieces import BlobPiece, read_piece
from kspeedfs.format.errors import DataError, InvalidArgument, KSpeedError, NotFound, StaleDataset
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tree import Tree
from kspeedfs.format.units import format_size
from kspeedfs.node import sourceio, tarindexes
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.ops import ADMIN, JOB, READ, OpRegistry, caller_role
from kspeedfs.node.peers import Ask, ask_all
from kspeedfs.node.records import DatasetRecord
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import Source, open_source

log = logging.getLogger(__name__)

# The request that carries one piece of the index of a meta file to a member.
PieceRequest = Callable[[str, BlobPiece], Request]


class Staged(Protocol):
    """The part of a member's stage an index lands in."""

    uuid: str
    staging: Path | None


def requested(names: Sequence[str], tree: Tree) -> list[str]:
    """The meta files a preload asks to index, checked against the scanned source: each must be
    a regular file in it (a one-line error before anything loads)."""
    out: list[str] = []
    for raw in names:
        name = metaindex.meta_name(raw)
        i = _tree_lookup(tree, name)
        if i is None or not stat.S_ISREG(tree.mode[i]):
            raise InvalidArgument(f"meta file {name} is not a file in the source")
        if name not in out:
            out.append(name)
    return out + [s for s in tarindexes.shards(tree) if s not in out]


def reserve_estimate(tree: Tree, names: Sequence[str]) -> int:
    """Bytes each member reserves for the indexes before loading."""
    total = 0
    for name in names:
        i = _tree_lookup(tree, name)
        total += tarindexes.index_size_estimate(name, tree.size[i] if i is not None else 0)
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
    raw = source.read_verified(m, i, 0, size, int(m.checksum[i]))
    named = {**ident, "meta": meta, "meta_entry": i, "meta_size": size}
    if metaindex.is_tar_shard(meta):
        return tarindexes.build_shard(raw, out, named)
    header = metaindex.build_index(raw, m, out, named)
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
    skip_bad_shards: bool = False,
) -> list[tuple[str, Path]]:
    """Index each meta file from the source's verified bytes; (meta, index file) in scratch.
    With `skip_bad_shards` (a preload), a tar that cannot be indexed is left out, logged."""
    if not names:
        return []
    m = await trio.to_thread.run_sync(Manifest, manifest_path)
    built: list[tuple[str, Path]] = []
    try:
        for meta in names:
            digest = metaindex.index_file(meta).rsplit("/", 1)[-1]
            out = scratch / f"{ident['name']}.{ident['uuid']}.{digest}"
            try:
                await sourceio.run_sync(_build_one, source, m, meta, out, ident)
            except DataError as e:
                if not (skip_bad_shards and metaindex.is_tar_shard(meta)):
                    raise
                log.warning("not indexing a shard of %s: %s", ident["name"], e)
                tarindexes.discard_failed(out)
                continue
            built.append((meta, out))
    except BaseException:
        discard(built)
        raise
    return built


async def send(
    members: Sequence[str],
    ident: dict[str, str],
    built: list[tuple[str, Path]],
    ask: Ask,
    carry: PieceRequest | None = None,
) -> None:
    """Every member gets every index, in pieces (an index is far over one control frame): into
    the stage of preload `ident` (StageMeta), or as `carry` makes the request of each piece
    (MetaPut, into a published instance)."""

    def staged(meta: str, piece: BlobPiece) -> Request:
        return StageMeta(name=ident["name"], uuid=ident["uuid"], meta=meta, piece=piece)

    request = carry or staged

    async def send_to(member: str) -> None:
        for meta, path in built:
            offset = 0
            while True:
                piece = await trio.to_thread.run_sync(read_piece, path, offset)
                await ask(member, request(meta, piece))
                end = piece.end  # decodes the piece's base64: once
                if end >= piece.total or end == offset:
                    break
                offset = end

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

    def __init__(self, store: SegmentStore, stage_of: Callable[[str, str], Staged]):
        self.store = store
        self.stage_of = stage_of  # the stage of preload (name, uuid), or NotFound

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(StageMeta, self.op_stage_meta, ADMIN)
        ops.add(FetchMetaIndex, self.op_meta_index, READ)

    async def op_stage_meta(self, request: StageMeta) -> IndexPieceStaged:
        stage = self.stage_of(request.name, request.uuid)
        if stage.staging is None:
            raise InvalidArgument("no staging folder for this preload")
        path = stage.staging / metaindex.index_file(request.meta)
        received = await trio.to_thread.run_sync(
            _write_piece, path, request.piece, stage.uuid, request.meta
        )
        return IndexPieceStaged(received=received)

    async def op_meta_index(self, request: FetchMetaIndex) -> MetaIndexPiece:
        """A piece of a published index's bytes (the client maps the whole file)."""
        name, meta = request.name, request.meta
        record = self.store.instance(name, request.uuid)
        path = record.path / metaindex.index_file(meta)
        try:
            piece = await trio.to_thread.run_sync(read_piece, path, request.offset)
        except FileNotFoundError:
            raise NotFound(
                f"dataset {name} has no index of {meta}: add it with "
                f"`kspeedfs meta add {name} {meta}`"
            ) from None
        return MetaIndexPiece(name=name, uuid=record.uuid, meta=meta, piece=piece)


def _write_piece(path: Path, piece: BlobPiece, uuid: str, meta: str) -> int:
    """Write one piece of an index; the last one is checked and put in place. Returns the bytes
    received so far."""
    data = piece.raw
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "r+b" if piece.offset else "wb") as f:
        f.seek(piece.offset)
        f.write(data)
    if piece.offset + len(data) < piece.total:
        return piece.offset + len(data)
    _check_index(tmp, tmp.stat().st_size, piece.total, uuid, meta)
    os.replace(tmp, path)
    return piece.total


def _check_index(path: Path, size: int, total: int, uuid: str, meta: str) -> None:
    """A received index is whole and is the one of `meta` built for instance `uuid`."""
    if size != total:
        raise DataError(f"meta index of {meta} arrived incomplete")
    idx = tarindexes.open_index(path, meta)
    if idx.uuid != uuid or idx.meta != meta:
        raise DataError(f"meta index of {meta} belongs to another instance of the dataset")
    del idx


def in_dataset(m: Manifest, raw: str, dataset: str) -> str:
    """A meta file named for a published dataset: it must be a regular file of its manifest."""
    meta = metaindex.meta_name(raw)
    try:
        i: int | None = m.resolve(meta)
    except NotFound:
        i = None
    if i is None or not m.is_file(i):
        raise InvalidArgument(f"meta file {meta} is not a file in dataset {dataset}")
    return meta


def _final(meta: str) -> str:
    """The index's file name inside the instance's INDEX_DIR."""
    return metaindex.index_file(meta).rsplit("/", 1)[-1]


def _tmp(meta: str, add: str) -> str:
    """Where one add writes it before the rename (a leftover is removed at the next start)."""
    return f"{_final(meta)}.{add}.tmp"


def _reservation(name: str, meta: str, add: str) -> str:
    return f"{name}#{_final(meta)}#{add}"


class AddedIndexes:
    """Meta indexes added to a published instance (`kspeedfs meta add`, or a job's first use of
    a meta file its preload did not index). The dataset's first member coordinates, so two
    requests through different nodes end in one build: it builds the index from the source's
    checksummed bytes as a preload does; every member reserves its bytes first, receives it
    into the instance's meta/ folder under a temporary name, checks it, and publishes it with
    one rename that also counts it in the instance's stored bytes."""

    def __init__(self, store: SegmentStore, events: DatasetEvents, address: str, ask: Ask):
        self.store = store
        self.address = address
        self._ask = ask  # a request on a member (this node's own answered in process)
        self._locks: dict[tuple[str, str, str], trio.Lock] = {}
        self._reserved: dict[str, set[str]] = {}  # dataset -> reservations of adds in flight
        events.follow(self)

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(MetaAdd, self.op_meta_add, JOB)
        ops.add(MetaReserve, self.op_meta_reserve, ADMIN)
        ops.add(MetaPut, self.op_meta_put, ADMIN)
        ops.add(MetaCommit, self.op_meta_commit, ADMIN)
        ops.add(MetaAbort, self.op_meta_abort, ADMIN)

    # -- the coordinator --

    async def op_meta_add(self, request: MetaAdd) -> MetaAdded:
        """Index meta files of a published dataset on every member; one already there is left as
        it is. Every name is checked before anything is built."""
        name, raw = request.name, request.meta
        record = self.store.instance(name, request.uuid)
        if record.lifetime == READTHROUGH:
            raise InvalidArgument(
                f"dataset {name} is read-through: meta files are indexed for preloaded datasets"
            )
        members = record.members or [self.address]
        via = request.via if caller_role.get() == ADMIN else ""
        if via and via not in members:
            members = [*members, via]  # it holds the instance too (joined it later)
        if members[0] != self.address and not via:
            # Forwarded by the node asked, which gets the index too (admin: a peer).
            forward = MetaAdd(name=name, uuid=record.uuid, meta=raw, via=self.address)
            return await self._ask(members[0], forward)
        m = self.store.open(name).manifest
        if m.uuid != record.uuid:
            raise StaleDataset(f"dataset {name!r} was loaded again: the instance asked for is gone")
        metas: list[str] = []
        for r in raw:
            meta = in_dataset(m, r, name)
            if meta not in metas:
                metas.append(meta)
        try:
            indexes = [await self._add(record, m, meta, members) for meta in metas]
        except OSError as e:  # the scratch folder, the source: one line, the node stays up
            raise DataError(f"indexing meta files of {name} failed: {e}") from None
        return MetaAdded(name=name, uuid=record.uuid, indexes=indexes)

    async def _add(
        self, record: DatasetRecord, m: Manifest, meta: str, members: list[str]
    ) -> IndexAdded:
        """One index; a second request for it waits for the first, then finds it there."""
        key = (record.name, record.uuid, meta)
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                return await self._add_locked(record, m, meta, members)
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._locks.pop(key, None)

    async def _add_locked(
        self, record: DatasetRecord, m: Manifest, meta: str, members: list[str]
    ) -> IndexAdded:
        name, uuid = record.name, record.uuid
        self.store.instance(name, uuid)  # it may have gone while this waited
        add = secrets.token_hex(8)
        ident = {"name": name, "uuid": uuid, "meta": meta, "add": add}
        size = int(m.size[m.resolve(meta)])
        built: list[tuple[str, Path]] = []
        committed: list[str] = []

        def put(meta: str, piece: BlobPiece) -> Request:
            return MetaPut(**ident, piece=piece)

        try:
            estimate = tarindexes.index_size_estimate(meta, size)
            reserved = await self._reserve_on(members, MetaReserve(**ident, bytes=estimate))
            need = [member for member in members if not reserved[member].present]
            if not need:
                idx = tarindexes.open_index(record.path / metaindex.index_file(meta), meta)
                return _described(meta, "present", idx.header, idx.nbytes, 0)
            source = open_source(record.source, str(m.header.get("endpoint") or ""))
            built = await build(
                [meta],
                record.path / MANIFEST_FILE,
                source,
                self.store.staging_dir,
                {"name": name, "uuid": uuid},  # the header a preload's index has
            )
            path = built[0][1]
            header = await trio.to_thread.run_sync(_header, path, meta)
            nbytes = path.stat().st_size
            # The exact size replaces the estimate (short lines make an index outgrow it).
            await self._reserve_on(need, MetaReserve(**ident, bytes=nbytes))
            await send(need, ident, built, self._ask, put)
            added = await self._commit_on(need, MetaCommit(**ident), committed)
            return _described(meta, "added", header, nbytes, added)
        except BaseException:
            with trio.CancelScope(shield=True):
                for member in members:
                    abort = MetaAbort(**ident, drop=member in committed)
                    try:
                        await self._ask(member, abort)
                    except KSpeedError as e:
                        log.warning("dropping the index of %s on %s: %s", meta, member, e)
            raise
        finally:
            discard(built)

    async def _reserve_on(
        self, members: Sequence[str], request: MetaReserve
    ) -> dict[str, IndexReserved]:
        """`request` on every member at once; the first refusal is raised once all have
        answered."""
        answers, errors = await ask_all(self._ask, members, request)
        if errors:
            raise errors[0]
        return {member: a for member, a in answers.items()}

    async def _commit_on(self, members: Sequence[str], request: MetaCommit, done: list[str]) -> int:
        """`request` on every member at once; `done` collects the members whose index went
        in place (before the first refusal is raised, once all have answered). Returns how
        many they are."""
        answers, errors = await ask_all(self._ask, members, request)
        put = [member for member, a in answers.items() if a.added]
        done.extend(put)
        if errors:
            raise errors[0]
        return len(put)

    # -- every member --

    async def op_meta_reserve(self, request: MetaReserve) -> IndexReserved:
        """Reserve an index's bytes here (NoSpace in one line), unless it is here already."""
        name, uuid, meta, add = request.name, request.uuid, request.meta, request.add
        nbytes = request.bytes
        key = _reservation(name, meta, add)

        def reserve() -> bool:
            if _final(meta) in self.store.files_in(name, uuid, metaindex.INDEX_DIR):
                return True
            self.store.budgets.release(key)  # a reservation of this add again: the exact size
            self.store.budgets.reserve(key, nbytes, what=f"the index of {meta}")
            return False

        present = await trio.to_thread.run_sync(reserve)
        if not present:
            self._reserved.setdefault(name, set()).add(key)
        return IndexReserved(node=self.address, present=present)

    async def op_meta_put(self, request: MetaPut) -> IndexPiecePut:
        """A piece of the index, written under the add's temporary name; the last is checked."""
        name, uuid, meta, add = request.name, request.uuid, request.meta, request.add
        offset, total, data = request.piece.offset, request.piece.total, request.piece.raw
        folder = self.store.instance(name, uuid).path / metaindex.INDEX_DIR
        if _reservation(name, meta, add) not in self._reserved.get(name, ()):
            raise InvalidArgument(f"no reservation here for this index of {meta}")
        tmp = _tmp(meta, add)
        try:
            size = await trio.to_thread.run_sync(
                self.store.write_into, name, uuid, metaindex.INDEX_DIR, tmp, offset, data
            )
            if offset + len(data) < total:
                return IndexPiecePut(node=self.address, received=offset + len(data))
            await trio.to_thread.run_sync(_check_index, folder / tmp, size, total, uuid, meta)
        except OSError as e:
            raise DataError(f"index of {meta} on {self.address}: {e}") from None
        return IndexPiecePut(node=self.address, received=total)

    async def op_meta_commit(self, request: MetaCommit) -> IndexCommitted:
        """Put the received index in place (one rename) and count it instead of its reservation."""
        name, uuid, meta, add = request.name, request.uuid, request.meta, request.add
        key = _reservation(name, meta, add)
        try:
            added = await trio.to_thread.run_sync(
                self.store.add_file,
                name,
                uuid,
                metaindex.INDEX_DIR,
                _tmp(meta, add),
                _final(meta),
                key,
            )
        except OSError as e:
            raise DataError(f"index of {meta} on {self.address}: {e}") from None
        self._reserved.get(name, set()).discard(key)
        if added:
            log.info("added the index of %s to %s: %s", meta, name, format_size(added))
        return IndexCommitted(node=self.address, added=added > 0, bytes=added)

    async def op_meta_abort(self, request: MetaAbort) -> IndexAddAborted:
        """Undo an add here: its temporary file and reservation; with `drop`, the index it put
        in place too (another member failed to)."""
        name, uuid, meta, add = request.name, request.uuid, request.meta, request.add
        key = _reservation(name, meta, add)
        self.store.budgets.release(key)
        self._reserved.get(name, set()).discard(key)

        def undo() -> None:
            index = metaindex.INDEX_DIR
            self.store.remove_file(name, uuid, index, _tmp(meta, add), counted=False)
            if request.drop:
                self.store.remove_file(name, uuid, index, _final(meta), counted=True)

        try:
            await trio.to_thread.run_sync(undo)
        except StaleDataset:
            pass  # the instance went, and its files with it
        return IndexAddAborted(node=self.address)

    def unloading(self, name: str) -> None:
        """Before the dataset's files go: the reservations of its adds in flight end."""
        for key in list(self._reserved.pop(name, ())):
            self.store.budgets.release(key)

    def published(self, name: str) -> None:
        """A dataset became visible (published, or found at start): an add the node stopped in
        the middle of left its temporary file; it goes (it was never counted)."""
        record = self.store.datasets.get(name)
        if record is None:
            return
        try:
            for f in self.store.files_in(name, record.uuid, metaindex.INDEX_DIR):
                if f.endswith(".tmp"):
                    log.info("removing an unfinished meta index %s of %s", f, name)
                    self.store.remove_file(name, record.uuid, metaindex.INDEX_DIR, f, counted=False)
        except (KSpeedError, OSError) as e:
            log.warning("cannot check the meta indexes of %s: %s", name, e)


def _header(path: Path, meta: str) -> dict[str, Any]:
    return tarindexes.open_index(path, meta).header


def _described(
    meta: str, state: Literal["added", "present"], header: dict[str, Any], nbytes: int, nodes: int
) -> IndexAdded:
    """One index in a meta_add reply."""
    return IndexAdded(
        meta=meta,
        state=state,
        rows=int(header["rows"]),
        samples=int(header["samples"]),
        bad=int(header["bad"]),
        missing=int(header["missing"]),
        bytes=nbytes,
        nodes=nodes,
    )
