"""The preload coordinator: the node a client asked plans a preload over the live members,
drives it to its commit (or its rollback) and answers its progress.

1. The coordinator scans the source, plans the layout and places each segment on `replicas`
   live members (rendezvous hashing: node/preload.py's Plan).
2. Every member claims its part (admission), then scans the same source itself (checked by a
   digest of the tree) and loads its segments straight from the source, in parallel; one
   that cannot read the source gets them pushed (node/stager.py).
3. The coordinator gathers the checksums, writes the one manifest, sends it to every member.
4. Commit: each member publishes with one rename. Any failure before that aborts everywhere.

A job's preload is held to `source_roots` and to a leased lifetime; with a control plane the
name is claimed in the catalog first, so one of two racing preloads wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import Ping, UnloadLocal
from kspeedfs.format.contract.pieces import pieces_of
from kspeedfs.format.contract.preload import (
    Abort,
    Checksummed,
    Commit,
    LoadProgress,
    Preload,
    PreloadStarted,
    Progressing,
    Published,
    StageClaim,
    StageDone,
    StageManifest,
    StagePush,
    StagePut,
    StageReq,
    StageResult,
    StageStatus,
    state_version,
)
from kspeedfs.format.errors import (
    AlreadyExists,
    AuthError,
    KSpeedError,
    NoSpace,
    SourceModified,
    SourceNotVisible,
    error_from_wire,
)
from kspeedfs.format.manifest import write_manifest
from kspeedfs.format.units import format_size
from kspeedfs.node import metaindexes, sourceio
from kspeedfs.node.control import ClusterControl
from kspeedfs.node.loads import LoadTable, answer_on_change, failure_reason, progressing
from kspeedfs.node.ops import ADMIN, JOB, READ, OpRegistry, answering, caller_role, refusal
from kspeedfs.node.peers import Ask
from kspeedfs.node.preload import Plan, plan_preload
from kspeedfs.node.preload_queue import PreloadQueue, Waiting
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import SegmentStore
from kspeedfs.node.tasks import Tasks
from kspeedfs.sources import version
from kspeedfs.sources.loader import Progress, manifest_size_estimate
from kspeedfs.sources.source import Source, open_source

log = logging.getLogger(__name__)

# A source file of another version than listed, at or after its copy: the preload is scanned,
# planned and loaded again, this many attempts in all, before it fails with that line.
LOAD_ATTEMPTS = 3
# The longest a coordinator's stage_status waits for a member's state to change: its answer
# also carries the member's counts for the preload's progress.
STATUS_WAIT_S = 0.5

# What a preload does once published, with the `decoded` size asked for (decoded variants).
AfterPreload = Callable[[str, str, int], Awaitable[None]]


class PreloadCoordinator:
    def __init__(
        self,
        settings: Settings,
        store: SegmentStore,
        loads: LoadTable,
        stager: Stager,
        control: ClusterControl,
        ask: Ask,
        after_preload: AfterPreload,
        queue: PreloadQueue,
    ):
        self.settings = settings
        self.store = store
        self.loads = loads
        self.stager = stager  # this node's own part of the preloads it coordinates
        self.control = control  # the members; claims and publishes in the catalog (etcd)
        self.ask = ask
        self.after_preload = after_preload
        self.tasks = Tasks()  # the preloads under way
        self.queue = queue  # the preloads waiting for room (--queue)

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(Preload, self.op_preload, JOB)  # a job's: under source_roots, leased
        ops.add(LoadProgress, self.op_progress, READ)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.tasks.run(task_status)

    async def op_preload(self, request: Preload) -> PreloadStarted:
        """Coordinate a preload over the live members (this node included)."""
        if caller_role.get() != ADMIN:
            request = self._job_preload(request)
        name = request.name
        if name in self.store.datasets:
            raise AlreadyExists(f"dataset {name!r} is already loaded")
        progress = self.loads.start(name, request.source)
        try:
            plan, pushed = await self._start_preload(request)
        except BaseException:
            self.loads.finish(name)
            raise
        progress.state = "loading" if pushed is not None else "queued"
        progress.files_total, progress.bytes_total = plan.tree.file_count, plan.tree.data_bytes
        self.tasks.start_soon(self._coordinate, plan, progress, pushed, request)
        log.info(
            "%s %s from %s over %d nodes: %d files, %s",
            "preloading" if pushed is not None else "queued for room: preload of",
            name,
            plan.source,
            len(plan.members),
            plan.tree.file_count,
            format_size(plan.tree.data_bytes),
        )
        return PreloadStarted(
            name=name,
            files_total=plan.tree.file_count,
            bytes_total=plan.tree.data_bytes,
            nodes=plan.members,
            queued=0 if pushed is not None else len(self.queue.waiting) + 1,
        )

    async def op_progress(self, request: LoadProgress) -> Progressing | Published:
        """A load's progress (or its dataset's record once published), long-polled: answered
        when its state changes from the version the client saw, or after wait_s."""

        def read() -> Progressing | Published:
            progress = self.loads.get(request.name)
            if progress is not None:
                return progressing(progress)
            record = self.store.instance(request.name).to_wire()
            return Published(**record, version=state_version("ready"))

        return await answer_on_change(read, request.wait_for_change_after, request.wait_s)

    def _job_preload(self, request: Preload) -> Preload:
        """A job's preload: its source must lie under one of `source_roots` (after resolving
        links, so a link out of a root does not count) and it lives only while leased."""
        source = request.source
        if request.lifetime not in ("", "leased"):
            raise AuthError("a job token preloads only with a lease (lifetime leased)")
        roots = [os.path.realpath(r) for r in self.settings.source_roots]
        if not roots:
            raise AuthError("this node allows no job preloads: `source_roots` is not set")
        real = os.path.realpath(source) if os.path.isabs(source) else ""
        if not real or not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            raise AuthError(f"a job token may preload only under {', '.join(roots)}, not {source}")
        return dataclasses.replace(request, source=real, lifetime="leased")

    async def live_members(self) -> list[str]:
        live = []
        members = await self.control.members_now()
        for member in members:
            try:
                await self.ask(member, Ping())
                live.append(member)
            except KSpeedError as e:
                log.warning("node %s is down, placing data on the others: %s", member, e)
        return live

    async def _start_preload(self, request: Preload) -> tuple[Plan, set[str] | None]:
        """Scan and plan a preload, claim its name, start every member's stage. With
        `request.queue`, a preload that does not fit is planned and claimed but not started
        (None: `_coordinate` waits in the queue for its admission)."""
        claimed = ""  # control plane: the instance this preload claimed the name for
        try:
            live = await self.live_members()
            plan = await plan_preload(request, self.settings.segment_size, live)
            await self.control.claim_preload(plan, self.stager.address)  # etcd: one wins
            claimed = plan.uuid
            try:
                pushed: set[str] | None = await start_stages(plan, self.ask, self.stager)
            except NoSpace:
                if not request.queue:
                    raise
                pushed = None
        except BaseException:
            if claimed:
                with trio.CancelScope(shield=True):
                    await self._forget_claim(plan.name, claimed)
            raise
        return plan, pushed

    async def _admitted(self, plan: Plan, progress: Progress) -> set[str]:
        """A queued preload's admission, once it is at the head of the queue and fits."""
        here = plan.assignment.get(self.stager.address, [])
        entry = Waiting(
            plan.name,
            plan.source,
            sum(int(plan.laid.seg_len[k]) for k in here) or plan.tree.data_bytes,
            progress,
        )
        pushed = await self.queue.admit(entry, lambda: start_stages(plan, self.ask, self.stager))
        progress.state = "loading"
        log.info("preload of %s admitted after %d tries in the queue", plan.name, entry.tries)
        return pushed

    async def _coordinate(
        self, plan: Plan, progress: Progress, pushed: set[str] | None, request: Preload
    ) -> None:
        try:
            for attempt in range(1, LOAD_ATTEMPTS + 1):
                if pushed is None:
                    pushed = await self._admitted(plan, progress)
                try:
                    scratch = self.store.staging_dir
                    await coordinate(plan, self.ask, progress, scratch, pushed)
                    break
                except Exception as e:
                    if attempt == LOAD_ATTEMPTS or not source_modified(e):
                        raise
                    log.warning(
                        "preload of %s, attempt %d of %d: %s; loading it again",
                        plan.name,
                        attempt,
                        LOAD_ATTEMPTS,
                        failure_reason(e),
                    )
                await self._forget_claim(plan.name, plan.uuid)
                plan, pushed = await self._start_preload(request)
                progress.files_total = plan.tree.file_count
                progress.bytes_total = plan.tree.data_bytes
            await self.control.publish(plan.name, plan.uuid)  # etcd: seen by every node
            progress.state = "ready"
            self.loads.finish(plan.name)
            elapsed = time.monotonic() - progress.started
            log.info(
                "dataset %s ready: %s in %.1fs (%.0f MB/s)",
                plan.name,
                format_size(plan.tree.data_bytes),
                elapsed,
                plan.tree.data_bytes / 1e6 / max(elapsed, 1e-9),
            )
            if request.decoded is not None:  # preload --decoded N: every member decodes
                await self.after_preload(plan.name, plan.uuid, request.decoded)
        except BaseException as e:
            unplanned = isinstance(e, Exception) and refusal(e) is None  # a bug: its traceback
            reason = self.loads.fail(plan.name, e)
            log.error("preload of %s failed: %s", plan.name, reason, exc_info=unplanned)
            with trio.CancelScope(shield=True):
                await self._forget_claim(plan.name, plan.uuid)
            if not isinstance(e, Exception):
                raise

    async def _forget_claim(self, name: str, uuid: str) -> None:
        """Drop a failed preload's catalog record (its lease would, later)."""
        try:
            await self.control.forget_failed(name, uuid)
        except KSpeedError as e:
            log.warning("could not remove %s from the catalog: %s", name, e)


def source_modified(e: BaseException) -> bool:
    """Whether a load failed because a source file changed its version (alone, or among a
    group). One gone or turned into a FIFO or a folder fails the load as it is."""
    if isinstance(e, BaseExceptionGroup):
        return any(source_modified(x) for x in e.exceptions)
    return isinstance(e, SourceModified)


@dataclasses.dataclass(frozen=True)
class PartSizes:
    """What each member's part of a preload reserves besides its segments."""

    meta_bytes: int  # the meta-file indexes, estimated
    manifest_estimate: int

    @classmethod
    def of(cls, plan: Plan) -> PartSizes:
        return cls(
            metaindexes.reserve_estimate(plan.tree, plan.metas),
            manifest_size_estimate(plan.tree),
        )


async def start_stages(plan: Plan, ask: Ask, own: Stager) -> set[str]:
    """Ask every member to stage its part (this node's own stager from the plan itself). Each
    checks the source and reserves its budget before answering, so a preload that cannot fit
    is refused before anything loads. Returns the members that cannot read the source (their
    segments get pushed)."""
    sizes = PartSizes.of(plan)
    await claim_parts(plan, ask, sizes)
    pushed: set[str] = set()
    errors: list[KSpeedError] = []

    async def start(member: str) -> None:
        try:
            if await start_member(plan, ask, own, sizes, member):
                pushed.add(member)
        except KSpeedError as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for member in plan.members:
            nursery.start_soon(start, member)
    if errors:
        await rollback(plan, ask)
        raise errors[0]
    return pushed


async def claim_parts(plan: Plan, ask: Ask, sizes: PartSizes) -> None:
    """Admission: each member's part claimed one member at a time, in the one order every
    coordinator uses; rolled back everywhere when one is refused. Claimed all at once, two
    preloads that do not both fit could each get one member and lose the other (both
    refused); in one order, the first to claim a member is ahead of the other on every member
    after it."""
    seg_len = plan.laid.seg_len
    try:
        for member in sorted(plan.members):
            held = plan.assignment[member]
            lengths = [seg_len[k] for k in held]
            claim = StageClaim(
                name=plan.name,
                uuid=plan.uuid,
                bytes=sum(lengths) + sizes.manifest_estimate + sizes.meta_bytes,
                tier=plan.tier,
                segments=held,
                lengths=lengths,
                max_memory=plan.max_memory,
                max_disk=plan.max_disk,
            )
            await ask(member, claim)
    except KSpeedError:
        await rollback(plan, ask)
        raise


async def start_member(plan: Plan, ask: Ask, own: Stager, sizes: PartSizes, member: str) -> bool:
    """Start `member`'s stage; True when it cannot read the source and its segments are to be
    pushed to it instead."""
    held = plan.assignment[member]
    if member == own.address:
        with answering(f"op {StageReq.OP}"):  # refused as the op would be
            await own.stage_planned(plan, sizes.meta_bytes)
        return False
    try:
        stage = StageReq(
            name=plan.name,
            uuid=plan.uuid,
            source=plan.source,
            segment_size=plan.segment_size,
            segments=held,
            digest=plan.digest,
            endpoint=plan.endpoint,
            meta_bytes=sizes.meta_bytes,
        )
        await ask(member, stage)
        return False
    except SourceNotVisible as e:
        log.info("%s; pushing its %d segments to it", e, len(held))
    push = StagePush(
        name=plan.name,
        uuid=plan.uuid,
        source=plan.source,
        segments=held,
        lengths=[plan.laid.seg_len[k] for k in held],
        manifest_estimate=sizes.manifest_estimate,
        meta_bytes=sizes.meta_bytes,
    )
    await ask(member, push)
    return True


async def rollback(plan: Plan, ask: Ask) -> None:
    """Abort the staged parts and unload any committed one, on every member."""
    with trio.CancelScope(shield=True):
        for member in plan.members:
            for request in (
                Abort(name=plan.name, uuid=plan.uuid),
                UnloadLocal(plan.name, plan.uuid),
            ):
                try:
                    await ask(member, request)
                except KSpeedError as e:
                    log.warning("rollback of %s on %s: %s", plan.name, member, e)


async def coordinate(
    plan: Plan, ask: Ask, progress: Progress, scratch: Path, pushed: set[str]
) -> None:
    """Load on every member, build and send the manifest, commit; roll back on error."""
    source = open_source(plan.source, plan.endpoint)
    indexes: list[tuple[str, Path]] = []
    try:
        results = await StagedParts(plan, ask, progress, source, pushed).gather()
        checksums, seg_checksums = await gather_checksums(plan, results, source)
        header = manifest_header(plan)
        path = scratch / f"{plan.name}.{plan.uuid}.manifest"
        ident = {"name": plan.name, "uuid": plan.uuid}
        try:
            await trio.to_thread.run_sync(
                write_manifest,
                path,
                plan.tree,
                plan.laid.offsets,
                checksums,
                plan.laid.seg_len,
                seg_checksums,
                header,
            )
            indexes = await metaindexes.build(
                plan.metas, path, source, scratch, ident, skip_bad_shards=True
            )
            blob = path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
        await send_manifest(plan, ask, blob)
        await metaindexes.send(plan.members, ident, indexes, ask)
        await commit(plan, ask, header)
    except BaseException:
        await rollback(plan, ask)
        raise
    finally:
        metaindexes.discard(indexes)


class StagedParts:
    """Every member's stage of one preload watched to its end: a member that cannot read the
    source is fed its segments from it, each member's counts summed into the preload's
    progress, each one's checksums taken once it is staged."""

    def __init__(self, plan: Plan, ask: Ask, progress: Progress, source: Source, pushed: set[str]):
        self.plan, self.ask, self.progress = plan, ask, progress
        self.source, self.pushed = source, pushed
        self.counts: dict[str, tuple[int, int]] = {}  # member -> (bytes done, bytes in all)
        self.results: dict[str, Checksummed] = {}

    async def gather(self) -> list[Checksummed]:
        async with trio.open_nursery() as nursery:
            for member in self.plan.members:
                nursery.start_soon(self.stage, member)
        return list(self.results.values())

    async def stage(self, member: str) -> None:
        plan = self.plan
        if member in self.pushed:
            for k in plan.assignment[member]:
                await self.push_segment(member, k)
            await self.ask(member, StageDone(name=plan.name, uuid=plan.uuid))
        await self.wait_staged(member)
        self.results[member] = await self.ask(member, StageResult(name=plan.name, uuid=plan.uuid))

    async def push_segment(self, member: str, seg: int) -> None:
        plan = self.plan
        data = await sourceio.run_sync(self.source.read_segment, plan.tree, plan.laid.layout, seg)
        for piece in pieces_of(memoryview(data)):
            await self.ask(
                member, StagePut(name=plan.name, uuid=plan.uuid, segment=seg, piece=piece)
            )

    async def wait_staged(self, member: str) -> None:
        """Long-poll `member`'s stage until it is staged; its failure raised as its error."""
        seen = -1  # the version of the member's state last seen: answered when it changes
        while True:
            status = StageStatus(
                name=self.plan.name,
                uuid=self.plan.uuid,
                wait_for_change_after=seen,
                wait_s=STATUS_WAIT_S,
            )
            p = await self.ask(member, status)
            seen = p.version
            self.count(member, p)
            if p.state == "staged":
                return
            if p.state == "failed":
                kind = p.error_kind or "DataError"
                raise error_from_wire(kind, f"node {member}: {p.error}")

    def count(self, member: str, p: Progressing) -> None:
        """The preload's progress: its totals in the share of the members' bytes done."""
        self.counts[member] = (p.bytes_done, p.bytes_total)
        done = sum(d for d, _ in self.counts.values())
        total = sum(t for _, t in self.counts.values()) or 1
        progress = self.progress
        progress.bytes_done = int(progress.bytes_total * done / total)
        progress.files_done = int(progress.files_total * done / total)


async def gather_checksums(
    plan: Plan, results: list[Checksummed], source: Source
) -> tuple[list[int], list[int]]:
    """Every file's checksum and every segment's, from the members' results; a file whose
    segments sit on different nodes is checksummed from the source."""
    tree = plan.tree
    checksums = [0] * len(tree)
    seg_checksums = [0] * len(plan.laid.seg_len)
    for res in results:
        files, sums = res.columns
        for i, s in zip(files, sums, strict=True):
            checksums[int(i)] = int(s)
        for k, s in res.segments.items():
            seg_checksums[int(k)] = s
    covered = {int(i) for res in results for i in res.columns[0]}
    for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
        if size and i not in covered and stat.S_ISREG(mode):
            checksums[i] = await sourceio.run_sync(source.checksum, tree, i)
    return checksums, seg_checksums


def manifest_header(plan: Plan) -> dict[str, Any]:
    """The manifest's header: the preload's identity, source and members."""
    return {
        "name": plan.name,
        "uuid": plan.uuid,
        "source": plan.source,
        "segment_size": plan.segment_size,
        "created": time.time(),
        "members": plan.members,
        "replicas": plan.replicas,
        "endpoint": plan.endpoint,
        "digest": plan.digest,
        "versions": version.digest(plan.tree),  # beside the digest: what the source check reads
        # In the manifest too: a member that adopts the dataset (etcd) keeps its caps.
        **{k: v for k, v in plan.caps().items() if v},
    }


async def send_manifest(plan: Plan, ask: Ask, blob: bytes) -> None:
    """The manifest to every member, in pieces: an ImageNet manifest (~100 MB) is far over one
    control frame."""

    async def send_to(member: str) -> None:
        for piece in pieces_of(blob):
            await ask(member, StageManifest(name=plan.name, uuid=plan.uuid, piece=piece))

    async with trio.open_nursery() as nursery:
        for member in plan.members:
            nursery.start_soon(send_to, member)


async def commit(plan: Plan, ask: Ask, header: dict[str, Any]) -> None:
    """Commit on every member. The one step that cannot be undone atomically: a member that
    fails here is rolled back by unloading the dataset everywhere (the caller's rollback)."""
    tree = plan.tree
    meta = {
        **header,
        "lifetime": plan.lifetime,
        "files": tree.file_count,
        "bytes": tree.data_bytes,
        "segments": len(plan.laid.seg_len),
        **plan.caps(),
    }
    async with trio.open_nursery() as nursery:
        for member in plan.members:
            nursery.start_soon(ask, member, Commit(name=plan.name, uuid=plan.uuid, meta=meta))
    log.info(
        "preload of %s committed on %d nodes: %s",
        plan.name,
        len(plan.members),
        format_size(tree.data_bytes),
    )
