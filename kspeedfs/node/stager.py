"""A member's side of a distributed preload: stage its segments, take the manifest, commit.

Every member scans the source itself (checked against the coordinator's digest), reserves
budget for its segments and loads them straight from the source; one that cannot read the
source gets them pushed. It commits with one rename once the manifest is here, and drops its
staged part when its coordinator stops calling for STAGE_IDLE_TIMEOUT.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import trio

from kspeedfs.format.contract.pieces import Assembly, BlobPiece
from kspeedfs.format.contract.preload import (
    Abort,
    Aborted,
    Checksummed,
    Commit,
    Committed,
    ManifestPieceTaken,
    ManifestPlaced,
    Progressing,
    PushStaged,
    SegmentPiecePut,
    StageClaim,
    StageClaimed,
    StageDone,
    StageManifest,
    StagePush,
    StagePut,
    StageReq,
    StageResult,
    StageStarted,
    StageStatus,
)
from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
    SourceNotVisible,
)
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import MANIFEST_FILE, segment_path
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tree import Tree
from kspeedfs.format.units import format_size
from kspeedfs.node import metaindexes, sourceio
from kspeedfs.node.loads import answer_on_change, progressing
from kspeedfs.node.ops import ADMIN, OpRegistry
from kspeedfs.node.preload import MAX_MANIFEST_BYTES, LaidOut, Plan, lay_out, tree_digest
from kspeedfs.node.store import SegmentStore, disk_claim
from kspeedfs.node.tasks import Tasks
from kspeedfs.sources.loader import (
    Progress,
    load_segments,
    manifest_size_estimate,
    segment_checksums,
)
from kspeedfs.sources.source import Source, open_source

log = logging.getLogger(__name__)

STAGE_IDLE_TIMEOUT = 300.0


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
    manifest: Assembly | None = None  # the manifest's pieces, as they come
    disk: set[int] = dataclasses.field(default_factory=set)  # held ones on the disk tier
    disk_staging: Path | None = None

    def seg_path(self, seg: int) -> Path:
        """Where held segment `seg` is staged (its tier's staging folder)."""
        staging = self.disk_staging if seg in self.disk else self.staging
        assert staging is not None
        return segment_path(staging, seg)

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
        self.tasks = Tasks()  # the loads staged here
        self.loaded = {"segments": 0, "bytes": 0}  # what this node loaded from sources
        # Admission: preload uuid -> when its part was claimed here (its stage takes it over).
        self.claims: dict[str, float] = {}
        self.claimed_disk: dict[str, set[int]] = {}  # preload uuid -> its disk-tier segments
        self.metaindexes = metaindexes.MetaIndexes(store, self._get)

    def register_ops(self, ops: OpRegistry) -> None:
        """The member's side of a preload: only a coordinator (an admin) drives it."""
        for request, handler in (
            (StageClaim, self.op_stage_claim),
            (StageReq, self.op_stage),
            (StagePush, self.op_stage_push),
            (StageStatus, self.op_stage_status),
            (StageResult, self.op_stage_result),
            (StageManifest, self.op_stage_manifest),
            (StagePut, self.op_stage_put),
            (StageDone, self.op_stage_done),
            (Commit, self.op_commit),
            (Abort, self.op_abort),
        ):
            ops.add(request, handler, ADMIN)
        self.metaindexes.register_ops(ops)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hosts the loads staged here, and drops the parts whose coordinator went away."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.tasks.run)
            nursery.start_soon(self.expire_idle)
            task_status.started()

    def _get(self, name: str, uuid: str) -> Stage:
        stage = self.stages.get(name)
        if stage is None or stage.uuid != uuid:
            raise NotFound(f"no staged preload of {name!r} on {self.address}")
        stage.last_contact = time.monotonic()
        return stage

    def _check_absent(self, name: str) -> None:
        if name in self.store.datasets:
            raise AlreadyExists(f"dataset {name!r} is already loaded on {self.address}")
        current = self.stages.get(name)
        if current is not None and current.progress.state != "failed":
            raise AlreadyExists(f"dataset {name!r} is already loading on {self.address}")

    async def op_stage_claim(self, request: StageClaim) -> StageClaimed:
        """Admission: claim this member's part of a preload (NoSpace when it cannot fit)
        before any member loads; its stage takes the claim over, an abort gives it back."""
        self._check_absent(request.name)
        _check_parts(request)
        if request.uuid not in self.claims:
            self._claim_tiers(request)
        self.claims[request.uuid] = time.monotonic()
        disk = self.claimed_disk.get(request.uuid, set())
        lengths = dict(zip(request.segments, request.lengths, strict=True))
        disk_bytes = sum(lengths[k] for k in disk)
        return StageClaimed(node=self.address, memory=request.bytes - disk_bytes, disk=disk_bytes)

    def _claim_tiers(self, request: StageClaim) -> None:
        """Claim the part on the tiers `request.tier` asks for: with "auto", the held segments
        that fit the free memory and the memory cap (in order) go there and the rest to the
        disk tier, within its cap; a node without a disk tier holds it all in memory, as
        before tiers. NoSpace, before anything is claimed, when it cannot fit or a cap is
        larger than this node has free."""
        tier = request.tier
        if tier == "auto" and self.store.disk_root is None:
            tier = "memory"
        self._check_caps(request, tier)
        lengths = dict(zip(request.segments, request.lengths, strict=True))
        overhead = request.bytes - sum(request.lengths)  # the manifest and meta: memory
        cap = request.max_memory or request.bytes  # of the segments in memory
        if tier == "memory" or not request.segments:
            if tier == "memory" and sum(request.lengths) > cap:
                why = "--tier memory" if request.tier == "memory" else "and no disk tier here"
                raise NoSpace(
                    f"{request.name} holds {format_size(sum(request.lengths))} on "
                    f"{self.address}, more than its --max-memory {format_size(cap)} ({why})"
                )
            self.store.budgets.reserve(_claim(request.uuid), request.bytes)
            return
        room = min(self.store.budgets.memory_free() - overhead, cap) if tier == "auto" else 0
        disk: set[int] = set()
        for seg, length in sorted(lengths.items()):
            if length <= room and not disk:
                room -= length
            else:
                disk.add(seg)
        disk_bytes = sum(lengths[k] for k in disk)
        if request.max_disk and disk_bytes > request.max_disk:
            raise NoSpace(
                f"{request.name} needs {format_size(disk_bytes)} of the disk tier on "
                f"{self.address}, more than its --max-disk {format_size(request.max_disk)}"
            )
        what = f"the disk part of {request.name}"
        if disk:
            self.store.budgets.reserve(disk_claim(request.uuid), disk_bytes, what=what, tier="disk")
        try:
            self.store.budgets.reserve(_claim(request.uuid), request.bytes - disk_bytes)
        except BaseException:
            self.store.budgets.release(disk_claim(request.uuid))
            raise
        if disk:
            self.claimed_disk[request.uuid] = disk

    def _check_caps(self, request: StageClaim, tier: str) -> None:
        """Refuse (one line) caps this node cannot give: one larger than its free memory or
        disk tier now (NoSpace), a disk cap without a disk tier or with --tier memory."""
        if request.max_disk and self.store.disk_root is None:
            raise InvalidArgument(f"--max-disk needs a disk tier (spill_dir) on {self.address}")
        if request.max_disk and tier == "memory":
            raise InvalidArgument("--max-disk goes with --tier auto or disk, not memory")
        for cap, free, flag, where in (
            (request.max_memory, self.store.budgets.memory_free(), "--max-memory", "memory"),
            (request.max_disk, self.store.budgets.disk_free(), "--max-disk", "disk tier"),
        ):
            if cap > free:
                raise NoSpace(
                    f"{flag} {format_size(cap)} for {request.name!r} is more than the "
                    f"{format_size(free)} of {where} {self.address} has free"
                )

    def _drop_claim(self, uuid: str) -> None:
        if self.claims.pop(uuid, None) is not None:
            self.store.budgets.release(_claim(uuid))
        self.claimed_disk.pop(uuid, None)
        self.store.budgets.release(disk_claim(uuid))

    async def op_stage(self, request: StageReq) -> StageStarted:
        """Stage the held segments of a preload another node coordinates: this member scans
        the source itself, and must see the tree the coordinator saw."""
        self._check_absent(request.name)
        try:
            src = open_source(request.source, request.endpoint)
            await sourceio.run_sync(src.check)
        except KSpeedError as e:
            raise SourceNotVisible(f"node {self.address} cannot read the source: {e}") from None
        progress = Progress(state="scanning", source=request.source)
        stage = Stage(request.name, request.uuid, request.source, list(request.segments), progress)
        self.stages[stage.name] = stage
        try:
            tree = await sourceio.run_sync(src.scan)
            if tree_digest(tree) != request.digest:
                raise SourceNotVisible(
                    f"node {self.address} sees a different source tree at {request.source}"
                )
            laid = lay_out(tree, request.segment_size)
        except BaseException:
            self.stages.pop(stage.name, None)
            raise
        return await self._start_load(stage, src, tree, laid, request.meta_bytes)

    async def stage_planned(self, plan: Plan, meta_bytes: int) -> StageStarted:
        """Stage this node's part of a preload it coordinates: from the plan's own scan and
        layout, nothing scanned or laid out again."""
        self._check_absent(plan.name)
        progress = Progress(state="scanning", source=plan.source)
        stage = Stage(plan.name, plan.uuid, plan.source, plan.assignment[self.address], progress)
        self.stages[stage.name] = stage
        src = open_source(plan.source, plan.endpoint)
        return await self._start_load(stage, src, plan.tree, plan.laid, meta_bytes)

    async def _start_load(
        self, stage: Stage, src: Source, tree: Tree, laid: LaidOut, meta_bytes: int
    ) -> StageStarted:
        """Reserve the stage's bytes, make its staging folder, start its load."""
        try:
            seg_len = laid.seg_len
            if any(not 0 <= k < len(seg_len) for k in stage.held):
                raise InvalidArgument("segment number out of range")
            held_bytes = sum(seg_len[k] for k in stage.held)
            stage.stored = held_bytes + manifest_size_estimate(tree) + meta_bytes
            self._take_claim(stage, {k: seg_len[k] for k in stage.held})
        except BaseException:
            self.stages.pop(stage.name, None)
            raise
        try:
            stage.staging = await trio.to_thread.run_sync(self.store.new_staging, stage.name)
            if stage.disk:
                stage.disk_staging = await trio.to_thread.run_sync(
                    self.store.new_disk_staging, stage.name
                )
        except BaseException as e:
            await self._fail(stage, e)
            self.stages.pop(stage.name, None)
            raise
        stage.progress.state = "loading"
        self.tasks.start_soon(self._load, stage, src, tree, laid.layout)
        return StageStarted(node=self.address, segments=len(stage.held), bytes=held_bytes)

    async def op_stage_push(self, request: StagePush) -> StageStarted:
        """Allocate the held segments; the coordinator then writes them with stage_put."""
        self._check_absent(request.name)
        if len(request.segments) != len(request.lengths):
            raise InvalidArgument("segments and lengths must be lists of one length")
        seg_len = dict(zip(request.segments, request.lengths, strict=True))
        progress = Progress(state="receiving", source=request.source)
        progress.bytes_total = sum(seg_len.values())
        stage = Stage(request.name, request.uuid, request.source, sorted(seg_len), progress)
        stage.stored = progress.bytes_total + request.manifest_estimate + request.meta_bytes
        self._take_claim(stage, seg_len)
        self.stages[stage.name] = stage
        try:
            stage.staging = await trio.to_thread.run_sync(self.store.new_staging, stage.name)
            if stage.disk:
                stage.disk_staging = await trio.to_thread.run_sync(
                    self.store.new_disk_staging, stage.name
                )
            await trio.to_thread.run_sync(_allocate, stage, seg_len)
        except BaseException as e:
            await self._fail(stage, e)
            self.stages.pop(stage.name, None)
            if isinstance(e, OSError):
                raise DataError(f"cannot allocate staging on {self.address}: {e}") from None
            raise
        return StageStarted(node=self.address, segments=len(seg_len), bytes=progress.bytes_total)

    def _take_claim(self, stage: Stage, seg_len: dict[int, int]) -> None:
        """Reserve the stage's memory bytes in place of its preload's admission claim (none
        when the coordinator made none): they were claimed already, so this fits. Its disk
        part stays claimed as it was until the publish (or a failure) gives it back."""
        stage.disk = self.claimed_disk.pop(stage.uuid, set()) & set(seg_len)
        memory = stage.stored - sum(seg_len[k] for k in stage.disk)
        self.store.budgets.reserve(
            stage.name, memory, written=stage.written, instead_of=_claim(stage.uuid)
        )
        self.claims.pop(stage.uuid, None)

    async def op_stage_put(self, request: StagePut) -> SegmentPiecePut:
        stage = self._get(request.name, request.uuid)
        seg = request.segment
        if stage.staging is None or seg not in stage.held or stage.progress.state != "receiving":
            raise InvalidArgument(f"segment {seg} is not expected here")
        written = await trio.to_thread.run_sync(_write_piece, stage.seg_path(seg), request.piece)
        stage.progress.bytes_done += written
        return SegmentPiecePut(node=self.address)

    async def op_stage_done(self, request: StageDone) -> PushStaged:
        stage = self._get(request.name, request.uuid)
        if stage.staging is None or stage.progress.state != "receiving":
            raise InvalidArgument(f"{stage.name} is {stage.progress.state}, not receiving")
        stage.seg_checksums = await trio.to_thread.run_sync(_staged_checksums, stage)
        stage.progress.state = "staged"
        self.loaded["segments"] += len(stage.held)
        self.loaded["bytes"] += stage.progress.bytes_done
        return PushStaged(node=self.address)

    async def _load(self, stage: Stage, src: Source, tree: Tree, layout: Layout) -> None:
        assert stage.staging is not None
        try:
            seg_sums: dict[int, int] = {}
            stage.checksums = await sourceio.run_sync(
                load_segments,
                src,
                tree,
                layout,
                stage.held,
                stage.staging,
                stage.progress,
                seg_sums,
                (stage.disk_staging, stage.disk) if stage.disk_staging is not None else None,
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
        with trio.CancelScope(shield=True):  # also when the failure is a cancellation
            if stage.staging is not None:
                await trio.to_thread.run_sync(self.store.discard_staging, stage.staging)
            if stage.disk_staging is not None:
                await trio.to_thread.run_sync(self.store.discard_disk_staging, stage.disk_staging)
        self.store.budgets.release(stage.name)
        self.store.budgets.release(disk_claim(stage.uuid))
        stage.progress.state = "failed"
        stage.progress.error = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
        stage.progress.error_kind = type(e).__name__ if isinstance(e, KSpeedError) else ""
        log.error("staging %s failed: %s", stage.name, stage.progress.error)

    async def op_stage_status(self, request: StageStatus) -> Progressing:
        """The stage's progress, long-polled: answered when its state changes from the
        version the coordinator saw, or after wait_s."""
        stage = self._get(request.name, request.uuid)
        return await answer_on_change(
            lambda: progressing(stage.progress), request.wait_for_change_after, request.wait_s
        )

    async def op_stage_result(self, request: StageResult) -> Checksummed:
        stage = self._get(request.name, request.uuid)
        if stage.progress.state != "staged":
            raise InvalidArgument(f"{stage.name} is {stage.progress.state}, not staged")
        return Checksummed.of(stage.checksums, stage.seg_checksums)

    async def op_stage_manifest(
        self, request: StageManifest
    ) -> ManifestPieceTaken | ManifestPlaced:
        stage = self._get(request.name, request.uuid)
        if stage.staging is None or stage.progress.state != "staged":
            raise InvalidArgument(f"{stage.name} is {stage.progress.state}, not staged")
        if stage.manifest is None or request.piece.offset == 0:
            stage.manifest = Assembly(MAX_MANIFEST_BYTES)
        received = stage.manifest.add(request.piece)
        if not stage.manifest.done:
            return ManifestPieceTaken(node=self.address, received=received)
        blob, stage.manifest = bytes(stage.manifest.buf), None
        await trio.to_thread.run_sync(_put_manifest, stage, blob)
        return ManifestPlaced(node=self.address)

    async def op_commit(self, request: Commit) -> Committed:
        stage = self._get(request.name, request.uuid)
        staging = stage.staging
        if staging is None:
            raise InvalidArgument(f"{stage.name}: nothing staged to commit")
        meta = dict(request.meta, held=stage.held, disk=sorted(stage.disk))

        def publish() -> None:
            if not (staging / MANIFEST_FILE).exists():
                raise InvalidArgument(f"{stage.name}: commit before the manifest")
            meta["stored"] = (
                sum((staging / "seg" / f).stat().st_size for f in os.listdir(staging / "seg"))
                + (staging / MANIFEST_FILE).stat().st_size
                + metaindexes.stored_bytes(staging)
            )
            meta["disk_stored"] = sum(stage.seg_path(k).stat().st_size for k in stage.disk)
            self.store.publish(staging, meta, stage.disk_staging)

        await trio.to_thread.run_sync(publish)
        self.stages.pop(stage.name, None)
        log.info("published %s: %d segments held here", stage.name, len(stage.held))
        return Committed(node=self.address)

    async def op_abort(self, request: Abort) -> Aborted:
        await self.abort(request.name, request.uuid)
        return Aborted(node=self.address)

    async def abort(self, name: str, uuid: str) -> None:
        """Drop preload `uuid`'s claim and its staged part of `name` here, if any."""
        self._drop_claim(uuid)
        stage = self.stages.get(name)
        if stage is not None and stage.uuid == uuid:
            # A loading thread sees the cancel and cleans up after itself; otherwise we do.
            stage.progress.cancel.set()
            if stage.progress.state in ("staged", "receiving"):
                await self._fail(stage, KSpeedError("aborted by the coordinator"))
            self.stages.pop(name, None)

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
                    await self.abort(stage.name, stage.uuid)


def _check_parts(request: StageClaim) -> None:
    """The held segments of a claim: distinct, one length each, none negative, within `bytes`."""
    segments, lengths = request.segments, request.lengths
    if len(segments) != len(lengths) or len(set(segments)) != len(segments):
        raise InvalidArgument("segments and lengths must be lists of one length, no repeats")
    if min(segments + lengths, default=0) < 0 or sum(lengths) > request.bytes:
        raise InvalidArgument("segments and lengths must be at least 0, in all within bytes")


def _claim(uuid: str) -> str:
    """The store's name of a preload's admission claim (no dataset name has a colon)."""
    return f"claim:{uuid}"


def _staged_checksums(stage: Stage) -> dict[int, int]:
    """The checksums of a stage's segments, on either tier."""
    assert stage.staging is not None
    sums = segment_checksums(stage.staging, [k for k in stage.held if k not in stage.disk])
    if stage.disk_staging is not None:
        sums.update(segment_checksums(stage.disk_staging, sorted(stage.disk)))
    return sums


def _allocate(stage: Stage, seg_len: dict[int, int]) -> None:
    """Create the segments a coordinator will push, their space claimed now (ENOSPC now)."""
    for k, length in seg_len.items():
        with open(stage.seg_path(k), "wb") as f:
            if length:
                os.posix_fallocate(f.fileno(), 0, length)


def _write_piece(path: Path, piece: BlobPiece) -> int:
    """Write one pushed piece of a segment (its total: the segment's length); returns its
    length."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if piece.total != os.fstat(fd).st_size:
            raise InvalidArgument(f"a piece of a {piece.total}-byte segment, not of this one")
        data = piece.raw
        os.pwrite(fd, data, piece.offset)
    finally:
        os.close(fd)
    return len(data)


def _put_manifest(stage: Stage, blob: bytes) -> None:
    """The whole manifest received: checked against the stage and put in place."""
    assert stage.staging is not None
    path = stage.staging / MANIFEST_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    m = Manifest(tmp)
    if m.uuid != stage.uuid:
        raise DataError("manifest belongs to another preload")
    for k in stage.held:
        if int(m.seg_checksum[k]) != stage.seg_checksums[k]:
            raise DataError(f"segment {k} checksum disagrees with the manifest")
    os.replace(tmp, path)
