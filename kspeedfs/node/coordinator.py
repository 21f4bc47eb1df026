"""The preload coordinator: the node a client asked plans a preload over the live members,
drives it to its commit (or its rollback) and answers its progress.

A job's preload is held to `source_roots` and to a leased lifetime; with a control plane the
name is claimed in the catalog first, so one of two racing preloads wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import Ping
from kspeedfs.format.contract.preload import (
    LoadProgress,
    Preload,
    PreloadStarted,
    Progressing,
    Published,
    state_version,
)
from kspeedfs.format.errors import AlreadyExists, AuthError, KSpeedError
from kspeedfs.format.units import format_size
from kspeedfs.node.control import ClusterControl
from kspeedfs.node.loads import LoadTable, answer_on_change, failure_reason, progressing
from kspeedfs.node.ops import ADMIN, JOB, READ, OpRegistry, caller_role, refusal
from kspeedfs.node.peers import Ask
from kspeedfs.node.preload import (
    LOAD_ATTEMPTS,
    Plan,
    Stager,
    coordinate,
    plan_preload,
    source_modified,
    start_stages,
)
from kspeedfs.node.store import SegmentStore
from kspeedfs.node.tasks import Tasks
from kspeedfs.sources.loader import Progress

log = logging.getLogger(__name__)

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
    ):
        self.settings = settings
        self.store = store
        self.loads = loads
        self.stager = stager  # this node's own part of the preloads it coordinates
        self.control = control  # the members; claims and publishes in the catalog (etcd)
        self.ask = ask
        self.after_preload = after_preload
        self.tasks = Tasks()  # the preloads under way

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
        progress.state = "loading"
        progress.files_total, progress.bytes_total = plan.tree.file_count, plan.tree.data_bytes
        self.tasks.start_soon(self._coordinate, plan, progress, pushed, request)
        log.info(
            "preloading %s from %s over %d nodes: %d files, %s",
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

    async def _start_preload(self, request: Preload) -> tuple[Plan, set[str]]:
        """Scan and plan a preload, claim its name, start every member's stage."""
        claimed = ""  # control plane: the instance this preload claimed the name for
        try:
            live = await self.live_members()
            plan = await plan_preload(request, self.settings.segment_size, live)
            await self.control.claim_preload(plan, self.stager.address)  # etcd: one wins
            claimed = plan.uuid
            pushed = await start_stages(plan, self.ask, self.stager)
        except BaseException:
            if claimed:
                with trio.CancelScope(shield=True):
                    await self._forget_claim(plan.name, claimed)
            raise
        return plan, pushed

    async def _coordinate(
        self, plan: Plan, progress: Progress, pushed: set[str], request: Preload
    ) -> None:
        try:
            for attempt in range(1, LOAD_ATTEMPTS + 1):
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
