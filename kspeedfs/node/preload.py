"""Distributed preload: the coordinator plans and drives it, every member stages its part.

1. The coordinator (the node a client asked) scans the source, plans the layout and places
   each segment on `replicas` live members (rendezvous hashing).
2. Every member scans the same source itself (checked by a digest of the tree), reserves
   budget for its segments and loads them straight from the source, in parallel.
3. The coordinator gathers the checksums, writes the one manifest, sends it to every member.
4. Commit: each member publishes with one rename. Any failure before that aborts everywhere;
   a member whose coordinator vanishes drops its staged part after STAGE_IDLE_TIMEOUT.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import trio
import xxhash

from kspeedfs.format import placement
from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    InvalidArgument,
    KSpeedError,
    NotFound,
    SourceModified,
    SourceNotVisible,
    error_from_wire,
)
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import MANIFEST_FILE, segment_path
from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.format.names import validate_name
from kspeedfs.format.tree import Tree
from kspeedfs.format.units import format_size
from kspeedfs.node import meta as metafiles
from kspeedfs.node import sourceio
from kspeedfs.node.ops import ADMIN, OpRegistry, int_field, str_field
from kspeedfs.node.peers import Call
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.loader import (
    Progress,
    load_segments,
    manifest_size_estimate,
    segment_checksums,
)
from kspeedfs.sources.source import Source, is_url, open_source

log = logging.getLogger(__name__)

STAGE_IDLE_TIMEOUT = 300.0
# A source file of another version than listed, at or after its copy: the preload is scanned,
# planned and loaded again, this many attempts in all, before it fails with that line.
LOAD_ATTEMPTS = 3
POLL_INTERVAL = 0.1
PUSH_CHUNK = 4 * 1024 * 1024
MANIFEST_CHUNK = 4 * 1024 * 1024
MAX_MANIFEST_BYTES = 1 << 34


def tree_digest(tree: Tree) -> str:
    """Identifies a scan: every member must see the same files with the same sizes."""
    h = xxhash.xxh3_128()
    for name, parent, mode, size, mtime in zip(
        tree.names, tree.parent, tree.mode, tree.size, tree.mtime_ns, strict=True
    ):
        h.update(b"%d\0%d\0%d\0%d\0" % (parent, mode, size, mtime) + name + b"\0")
    return h.hexdigest()


def source_modified(e: BaseException) -> bool:
    """Whether a load failed because a source file changed its version (alone, or among a
    group). One gone or turned into a FIFO or a folder fails the load as it is."""
    if isinstance(e, BaseExceptionGroup):
        return any(source_modified(x) for x in e.exceptions)
    return isinstance(e, SourceModified)


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(arr.tobytes()).decode()


def _unb64(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)


@dataclasses.dataclass
class Stage:
    name: str
    uuid: str
    source: str
    held: list[int]
    progress: Progress
    staging: Path | None = None
    checksums: dict[int, int] = dataclasses.field(default_factory=dict)
    seg_checksums: dict[int, int] = dataclasses.field(default_factory=dict)
    stored: int = 0
    last_contact: float = dataclasses.field(default_factory=time.monotonic)

    def written(self) -> int:
        """Bytes of its reservation on the filesystem already (at least: a segment is
        allocated before it is filled)."""
        return self.progress.bytes_done


class Stager:
    """A member's side: stage its segments, then take the manifest, then commit or abort."""

    def __init__(self, store: SegmentStore, address: str):
        self.store = store
        self.address = address
        self.stages: dict[str, Stage] = {}
        # Trees this node scanned as a coordinator, by preload uuid: its own stage reuses them.
        self._planned: dict[str, Tree] = {}
        self._nursery: trio.Nursery | None = None
        self.loaded = {"segments": 0, "bytes": 0}  # what this node loaded from sources
        # Admission: preload uuid -> when its part was claimed here (its stage takes it over).
        self.claims: dict[str, float] = {}
        self.metafiles = metafiles.MetaIndexes(store, self._get)

    def register_ops(self, ops: OpRegistry) -> None:
        """The member's side of a preload: only a coordinator (an admin) drives it."""
        for name, handler in (
            ("stage_claim", self.op_stage_claim),
            ("stage", self.op_stage),
            ("stage_status", self.op_stage_status),
            ("stage_result", self.op_stage_result),
            ("stage_manifest", self.op_stage_manifest),
            ("stage_put", self.op_stage_put),
            ("stage_done", self.op_stage_done),
            ("commit", self.op_commit),
            ("abort", self.op_abort),
        ):
            ops.add(name, handler, ADMIN)
        self.metafiles.register_ops(ops)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hosts the loads staged here, and drops the parts whose coordinator went away."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.expire_idle)
            task_status.started()

    @contextlib.contextmanager
    def scanned(self, uuid: str, tree: Tree) -> Iterator[None]:
        """While a coordinator starts the stages: this node's own stage reuses its scan."""
        self._planned[uuid] = tree
        try:
            yield
        finally:
            self._planned.pop(uuid, None)

    def _get(self, msg: dict[str, Any]) -> Stage:
        name = validate_name(msg.get("name", ""))
        stage = self.stages.get(name)
        if stage is None or stage.uuid != msg.get("uuid"):
            raise NotFound(f"no staged preload of {name!r} on {self.address}")
        stage.last_contact = time.monotonic()
        return stage

    def _check_absent(self, name: str) -> None:
        if name in self.store.datasets:
            raise AlreadyExists(f"dataset {name!r} is already loaded on {self.address}")
        current = self.stages.get(name)
        if current is not None and current.progress.state != "failed":
            raise AlreadyExists(f"dataset {name!r} is already loading on {self.address}")

    async def op_stage_claim(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Admission: claim this member's part of a preload (NoSpace when it cannot fit)
        before any member loads; its stage takes the claim over, an abort gives it back."""
        name = validate_name(msg.get("name", ""))
        uuid = str_field(msg, "uuid")
        self._check_absent(name)
        if uuid not in self.claims:
            self.store.reserve(_claim(uuid), int_field(msg, "bytes", 0))
        self.claims[uuid] = time.monotonic()
        return {"node": self.address}

    def _drop_claim(self, uuid: str) -> None:
        if self.claims.pop(uuid, None) is not None:
            self.store.release(_claim(uuid))

    async def op_stage(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        source = str(msg.get("source", ""))
        self._check_absent(name)
        if msg.get("push"):
            return await self._stage_for_push(name, msg)
        segment_size = int(msg["segment_size"])
        try:
            src = open_source(source, str(msg.get("endpoint") or ""))
            await sourceio.run_sync(src.check)
        except KSpeedError as e:
            raise SourceNotVisible(f"node {self.address} cannot read the source: {e}") from None
        progress = Progress(state="scanning", source=source)
        stage = Stage(name, str(msg["uuid"]), source, [int(k) for k in msg["segments"]], progress)
        self.stages[name] = stage
        try:
            tree = self._planned.pop(stage.uuid, None)
            if tree is None:
                tree = await sourceio.run_sync(src.scan)
            if tree_digest(tree) != msg.get("digest"):
                raise SourceNotVisible(
                    f"node {self.address} sees a different source tree at {source}"
                )
            offsets, seg_len = plan_layout(tree, segment_size)
            if any(not 0 <= k < len(seg_len) for k in stage.held):
                raise InvalidArgument("segment number out of range")
            held_bytes = sum(seg_len[k] for k in stage.held)
            stage.stored = held_bytes + manifest_size_estimate(tree) + int(msg.get("meta_bytes", 0))
            self._take_claim(stage)
        except BaseException:
            self.stages.pop(name, None)
            raise
        try:
            stage.staging = await trio.to_thread.run_sync(self.store.new_staging, name)
        except BaseException as e:
            await self._fail(stage, e)
            self.stages.pop(name, None)
            raise
        progress.state = "loading"
        assert self._nursery is not None
        self._nursery.start_soon(self._load, stage, src, tree, offsets, seg_len, segment_size)
        return {"node": self.address, "segments": len(stage.held), "bytes": held_bytes}

    async def _stage_for_push(self, name: str, msg: dict[str, Any]) -> dict[str, Any]:
        """Allocate the held segments; the coordinator then writes them with stage_put."""
        if not isinstance(msg.get("seg_len"), dict):
            raise InvalidArgument("seg_len must be an object of segment -> length")
        seg_len = {int(k): int(v) for k, v in msg["seg_len"].items()}
        if any(k < 0 or v < 0 for k, v in seg_len.items()):
            raise InvalidArgument("negative segment number or length")
        progress = Progress(state="receiving", source=str(msg.get("source", "")))
        progress.bytes_total = sum(seg_len.values())
        stage = Stage(name, str(msg["uuid"]), progress.source, sorted(seg_len), progress)
        stage.stored = progress.bytes_total + int(msg.get("manifest_estimate", 0))
        stage.stored += int(msg.get("meta_bytes", 0))
        self._take_claim(stage)
        self.stages[name] = stage
        try:
            stage.staging = await trio.to_thread.run_sync(self.store.new_staging, name)
            await trio.to_thread.run_sync(_allocate, stage.staging, seg_len)
        except BaseException as e:
            await self._fail(stage, e)
            self.stages.pop(name, None)
            if isinstance(e, OSError):
                raise DataError(f"cannot allocate staging on {self.address}: {e}") from None
            raise
        return {"node": self.address, "segments": len(seg_len), "bytes": progress.bytes_total}

    def _take_claim(self, stage: Stage) -> None:
        """Reserve the stage's bytes in place of its preload's admission claim (none when the
        coordinator made none): they were claimed already, so this fits."""
        self.store.reserve(
            stage.name, stage.stored, written=stage.written, instead_of=_claim(stage.uuid)
        )
        self.claims.pop(stage.uuid, None)

    async def op_stage_put(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self._get(msg)
        seg, offset = int(msg["segment"]), int(msg["offset"])
        assert stage.staging is not None
        if seg not in stage.held or stage.progress.state != "receiving":
            raise InvalidArgument(f"segment {seg} is not expected here")
        written = await trio.to_thread.run_sync(
            _write_piece, segment_path(stage.staging, seg), offset, str(msg["data"])
        )
        stage.progress.bytes_done += written
        return {"node": self.address}

    async def op_stage_done(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self._get(msg)
        assert stage.staging is not None
        stage.seg_checksums = await trio.to_thread.run_sync(
            segment_checksums, stage.staging, stage.held
        )
        stage.progress.state = "staged"
        self.loaded["segments"] += len(stage.held)
        self.loaded["bytes"] += stage.progress.bytes_done
        return {"node": self.address}

    async def _load(
        self,
        stage: Stage,
        src: Source,
        tree: Tree,
        offsets: list[int],
        seg_len: list[int],
        segment_size: int,
    ) -> None:
        assert stage.staging is not None
        try:
            seg_sums: dict[int, int] = {}
            stage.checksums = await sourceio.run_sync(
                load_segments,
                src,
                tree,
                Layout.of_tree(tree, offsets, seg_len, segment_size),
                stage.held,
                stage.staging,
                stage.progress,
                seg_sums,
            )
            stage.seg_checksums = seg_sums  # every source hashes segments as it fills them
            if stage.progress.cancel.is_set():
                raise KSpeedError("aborted by the coordinator")
            stage.progress.state = "staged"
            self.loaded["segments"] += len(stage.held)
            self.loaded["bytes"] += stage.progress.bytes_done
        except BaseException as e:
            await self._fail(stage, e)
            if not isinstance(e, Exception):
                raise

    async def _fail(self, stage: Stage, e: BaseException) -> None:
        if stage.staging is not None:
            with trio.CancelScope(shield=True):  # also when the failure is a cancellation
                await trio.to_thread.run_sync(self.store.discard_staging, stage.staging)
        self.store.release(stage.name)
        stage.progress.state = "failed"
        stage.progress.error = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
        stage.progress.error_kind = type(e).__name__ if isinstance(e, KSpeedError) else ""
        log.error("staging %s failed: %s", stage.name, stage.progress.error)

    async def op_stage_status(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._get(msg).progress.to_wire()

    async def op_stage_result(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self._get(msg)
        if stage.progress.state != "staged":
            raise InvalidArgument(f"{stage.name} is {stage.progress.state}, not staged")
        idx = np.array(sorted(stage.checksums), dtype="<u4")
        sums = np.array([stage.checksums[int(i)] for i in idx], dtype="<u8")
        return {
            "files": _b64(idx),
            "sums": _b64(sums),
            "segments": {str(k): v for k, v in stage.seg_checksums.items()},
        }

    async def op_stage_manifest(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self._get(msg)
        assert stage.staging is not None
        offset, total = int(msg["offset"]), int(msg["total"])
        received = await trio.to_thread.run_sync(
            _write_manifest_piece, stage, offset, total, str(msg["data"])
        )
        if received < total:
            return {"node": self.address, "received": received}
        return {"node": self.address}

    async def op_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        stage = self._get(msg)
        staging = stage.staging
        assert staging is not None
        meta = dict(msg["meta"], held=stage.held)

        def publish() -> None:
            if not (staging / MANIFEST_FILE).exists():
                raise InvalidArgument(f"{stage.name}: commit before the manifest")
            meta["stored"] = (
                sum((staging / "seg" / f).stat().st_size for f in os.listdir(staging / "seg"))
                + (staging / MANIFEST_FILE).stat().st_size
                + metafiles.stored_bytes(staging)
            )
            self.store.publish(staging, meta)

        await trio.to_thread.run_sync(publish)
        self.stages.pop(stage.name, None)
        log.info("published %s: %d segments held here", stage.name, len(stage.held))
        return {"node": self.address}

    async def op_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        self._drop_claim(str(msg.get("uuid")))
        stage = self.stages.get(name)
        if stage is not None and stage.uuid == msg.get("uuid"):
            # A loading thread sees the cancel and cleans up after itself; otherwise we do.
            stage.progress.cancel.set()
            if stage.progress.state in ("staged", "receiving"):
                await self._fail(stage, KSpeedError("aborted by the coordinator"))
            self.stages.pop(name, None)
        return {"node": self.address}

    async def expire_idle(self) -> None:
        """Drop staged parts whose coordinator stopped calling (it died mid-preload)."""
        while True:
            await trio.sleep(STAGE_IDLE_TIMEOUT / 10)
            now = time.monotonic()
            for uuid, claimed in list(self.claims.items()):
                if now - claimed > STAGE_IDLE_TIMEOUT:
                    log.warning("giving back the claim of preload %s: it never started", uuid)
                    self._drop_claim(uuid)
            for stage in list(self.stages.values()):
                if now - stage.last_contact > STAGE_IDLE_TIMEOUT:
                    log.warning("dropping %s: its coordinator stopped calling", stage.name)
                    await self.op_abort({"name": stage.name, "uuid": stage.uuid})


def _claim(uuid: str) -> str:
    """The store's name of a preload's admission claim (no dataset name has a colon)."""
    return f"claim:{uuid}"


def _allocate(staging: Path, seg_len: dict[int, int]) -> None:
    """Create the segments a coordinator will push, their memory claimed now (ENOSPC now)."""
    for k, length in seg_len.items():
        with open(segment_path(staging, k), "wb") as f:
            if length:
                os.posix_fallocate(f.fileno(), 0, length)


def _write_piece(path: Path, offset: int, data_b64: str) -> int:
    """Write one pushed piece of a segment; returns its length."""
    data = base64.b64decode(data_b64)
    fd = os.open(path, os.O_WRONLY)
    try:
        if offset < 0 or offset + len(data) > os.fstat(fd).st_size:
            raise InvalidArgument("write past the end of the segment")
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    return len(data)


def _write_manifest_piece(stage: Stage, offset: int, total: int, data_b64: str) -> int:
    """Write one piece of the manifest; the last one is checked and put in place. Returns the
    bytes received so far."""
    assert stage.staging is not None
    data = base64.b64decode(data_b64)
    if offset < 0 or offset + len(data) > total or total > MAX_MANIFEST_BYTES:
        raise InvalidArgument("manifest piece out of range")
    path = stage.staging / MANIFEST_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)
    if offset + len(data) < total:
        return offset + len(data)
    if tmp.stat().st_size != total:
        raise DataError("manifest arrived incomplete")
    m = Manifest(tmp)
    if m.uuid != stage.uuid:
        raise DataError("manifest belongs to another preload")
    for k in stage.held:
        if int(m.seg_checksum[k]) != stage.seg_checksums[k]:
            raise DataError(f"segment {k} checksum disagrees with the manifest")
    os.replace(tmp, path)
    return total


@dataclasses.dataclass
class Plan:
    name: str
    uuid: str
    source: str
    lifetime: str
    replicas: int
    segment_size: int
    tree: Tree
    digest: str
    members: list[str]
    assignment: dict[str, list[int]]
    endpoint: str = ""  # object store endpoint of a URL source
    metas: list[str] = dataclasses.field(default_factory=list)  # meta files to index


async def plan_preload(msg: dict[str, Any], segment_size: int, live_members: list[str]) -> Plan:
    name = validate_name(msg.get("name", ""))
    source = msg.get("source")
    lifetime = msg.get("lifetime", "offline")
    replicas = int(msg.get("replicas", 1))
    if lifetime not in ("offline", "leased"):
        raise InvalidArgument(f"bad lifetime {lifetime!r}: offline or leased")
    if not isinstance(source, str) or not (os.path.isabs(source) or is_url(source)):
        raise InvalidArgument("source must be an absolute path or a URL")
    if not 1 <= replicas <= len(live_members):
        raise InvalidArgument(
            f"replicas must be between 1 and the {len(live_members)} live nodes, not {replicas}"
        )
    src = open_source(source, str(msg.get("endpoint") or ""))
    tree = await sourceio.run_sync(src.scan)
    _offsets, seg_len = plan_layout(tree, segment_size)
    return Plan(
        name=name,
        uuid=secrets.token_hex(16),
        source=source,
        lifetime=lifetime,
        replicas=replicas,
        segment_size=segment_size,
        tree=tree,
        digest=tree_digest(tree),
        members=list(live_members),
        assignment=placement.Placement(name, len(seg_len), live_members, replicas).assignment(),
        endpoint=str(msg.get("endpoint") or ""),
        metas=metafiles.requested(msg, tree),
    )


async def start_stages(plan: Plan, call: Call) -> set[str]:
    """Ask every member to stage its part. Each checks the source and reserves its budget
    before answering, so a preload that cannot fit is refused before anything loads.
    Returns the members that cannot read the source (their segments get pushed)."""
    _offsets, seg_len = plan_layout(plan.tree, plan.segment_size)
    ident = {"name": plan.name, "uuid": plan.uuid}
    pushed: set[str] = set()
    errors: list[KSpeedError] = []
    meta_bytes = metafiles.reserve_estimate(plan.tree, plan.metas)

    async def start(member: str) -> None:
        held = plan.assignment[member]
        try:
            try:
                await call(
                    member,
                    "stage",
                    {
                        **ident,
                        "source": plan.source,
                        "segment_size": plan.segment_size,
                        "segments": held,
                        "digest": plan.digest,
                        "endpoint": plan.endpoint,
                        "meta_bytes": meta_bytes,
                    },
                )
            except SourceNotVisible as e:
                log.info("%s; pushing its %d segments to it", e, len(held))
                await call(
                    member,
                    "stage",
                    {
                        **ident,
                        "push": True,
                        "source": plan.source,
                        "seg_len": {str(k): seg_len[k] for k in held},
                        "manifest_estimate": manifest_size_estimate(plan.tree),
                        "meta_bytes": meta_bytes,
                    },
                )
                pushed.add(member)
        except KSpeedError as e:
            errors.append(e)

    # Admission: each member's part claimed one member at a time, in the one order every
    # coordinator uses. Claimed all at once, two preloads that do not both fit could each get
    # one member and lose the other (both refused); in one order, the first to claim a member
    # is ahead of the other on every member after it.
    try:
        for member in sorted(plan.members):
            held = sum(seg_len[k] for k in plan.assignment[member])
            part = held + manifest_size_estimate(plan.tree) + meta_bytes
            await call(member, "stage_claim", {**ident, "bytes": part})
    except KSpeedError:
        await rollback(plan, call)
        raise
    async with trio.open_nursery() as nursery:
        for member in plan.members:
            nursery.start_soon(start, member)
    if errors:
        await rollback(plan, call)
        raise errors[0]
    return pushed


async def rollback(plan: Plan, call: Call) -> None:
    """Abort the staged parts and unload any committed one, on every member."""
    with trio.CancelScope(shield=True):
        for member in plan.members:
            for op in ("abort", "unload_local"):
                try:
                    await call(member, op, {"name": plan.name, "uuid": plan.uuid})
                except KSpeedError as e:
                    log.warning("rollback of %s on %s: %s", plan.name, member, e)


async def coordinate(
    plan: Plan, call: Call, progress: Progress, scratch: Path, pushed: set[str]
) -> None:
    """Load on every member, build and send the manifest, commit; roll back on error."""
    tree = plan.tree
    offsets, seg_len = plan_layout(tree, plan.segment_size)
    layout = Layout.of_tree(tree, offsets, seg_len, plan.segment_size)
    source = open_source(plan.source, plan.endpoint)
    member_progress: dict[str, tuple[int, int]] = {}
    results: dict[str, dict[str, Any]] = {}
    ident = {"name": plan.name, "uuid": plan.uuid}
    indexes: list[tuple[str, Path]] = []

    async def stage_member(member: str) -> None:
        if member in pushed:
            for k in plan.assignment[member]:
                await push_segment(member, k)
            await call(member, "stage_done", ident)
        while True:
            p = await call(member, "stage_status", ident)
            member_progress[member] = (p["bytes_done"], p["bytes_total"])
            done = sum(d for d, _ in member_progress.values())
            total = sum(t for _, t in member_progress.values()) or 1
            progress.bytes_done = int(progress.bytes_total * done / total)
            progress.files_done = int(progress.files_total * done / total)
            if p["state"] == "staged":
                break
            if p["state"] == "failed":
                kind = p.get("error_kind") or "DataError"
                raise error_from_wire(kind, f"node {member}: {p['error']}")
            await trio.sleep(POLL_INTERVAL)
        results[member] = await call(member, "stage_result", ident)

    async def push_segment(member: str, seg: int) -> None:
        data = await sourceio.run_sync(source.read_segment, tree, layout, seg)
        for pos in range(0, len(data), PUSH_CHUNK):
            chunk = base64.b64encode(data[pos : pos + PUSH_CHUNK]).decode()
            await call(member, "stage_put", {**ident, "segment": seg, "offset": pos, "data": chunk})

    try:
        async with trio.open_nursery() as nursery:
            for member in plan.members:
                nursery.start_soon(stage_member, member)
        checksums = [0] * len(tree)
        seg_checksums = [0] * len(seg_len)
        for res in results.values():
            for i, s in zip(_unb64(res["files"], "<u4"), _unb64(res["sums"], "<u8"), strict=True):
                checksums[int(i)] = int(s)
            for k, s in res["segments"].items():
                seg_checksums[int(k)] = int(s)
        covered = {int(i) for res in results.values() for i in _unb64(res["files"], "<u4")}
        for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
            if size and i not in covered and (mode & 0o170000) == 0o100000:
                # Its segments sit on different nodes: checksum it from the source.
                checksums[i] = await sourceio.run_sync(source.checksum, tree, i)
        header = {
            "name": plan.name,
            "uuid": plan.uuid,
            "source": plan.source,
            "segment_size": plan.segment_size,
            "created": time.time(),
            "members": plan.members,
            "replicas": plan.replicas,
            "endpoint": plan.endpoint,
            "digest": plan.digest,
        }
        path = scratch / f"{plan.name}.{plan.uuid}.manifest"
        await trio.to_thread.run_sync(
            write_manifest, path, tree, offsets, checksums, seg_len, seg_checksums, header
        )
        try:
            indexes = await metafiles.build(
                plan.metas, path, source, scratch, ident, skip_bad_shards=True
            )
            blob = path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
        meta = {
            **header,
            "lifetime": plan.lifetime,
            "files": tree.file_count,
            "bytes": tree.data_bytes,
            "segments": len(seg_len),
        }

        async def send_manifest(member: str) -> None:
            # In pieces: an ImageNet manifest (~100 MB) is far over one control frame.
            for pos in range(0, len(blob), MANIFEST_CHUNK):
                chunk = base64.b64encode(blob[pos : pos + MANIFEST_CHUNK]).decode()
                args = {**ident, "offset": pos, "total": len(blob), "data": chunk}
                await call(member, "stage_manifest", args)

        async with trio.open_nursery() as nursery:
            for member in plan.members:
                nursery.start_soon(send_manifest, member)
        await metafiles.send(plan.members, ident, indexes, call)
        # Commit is the one step that cannot be undone atomically: a member that fails here
        # is rolled back by unloading the dataset everywhere.
        async with trio.open_nursery() as nursery:
            for member in plan.members:
                nursery.start_soon(call, member, "commit", {**ident, "meta": meta})
        log.info(
            "preload of %s committed on %d nodes: %s",
            plan.name,
            len(plan.members),
            format_size(tree.data_bytes),
        )
    except BaseException:
        await rollback(plan, call)
        raise
    finally:
        metafiles.discard(indexes)
