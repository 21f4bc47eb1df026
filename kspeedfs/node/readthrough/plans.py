"""The readers' plans: the upcoming segment order of a dataset, sent by each of its readers (a
rank's share of the sampler) in chunks (the `plan` op), handed whole to the eviction policy."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import numpy as np

from kspeedfs.format.contract.readthrough import Planned, PlanReq
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.node.readthrough.dataset import Instances
from kspeedfs.node.readthrough.policy import PlannedUses

MAX_PLAN_USES = PlannedUses.MAX_USES  # a plan longer than this many segment uses is refused


@dataclasses.dataclass
class _Partial:
    plan: str
    uuid: str
    segments: np.ndarray  # int64, -1 where no chunk landed yet
    missing: int


class PlanTable:
    """Gathers the newest plan of each reader of each dataset. Every DataLoader worker of one
    rank sends the same plan (same `reader`, same `plan` name): the first whole copy goes to
    the policy, repeats are ignored. Per dataset, the plans of at most MAX_READERS readers
    are kept, taken or in chunks, as the policy keeps them (the oldest goes), and those in
    chunks hold MAX_PLAN_USES uses in all (a job cannot make the node hold 64 of the
    largest)."""

    MAX_READERS = PlannedUses.MAX_READERS

    def __init__(self, instances: Instances, uses_plans: bool):
        self.instances = instances
        self.uses_plans = uses_plans
        self._partial: dict[str, OrderedDict[str, _Partial]] = {}  # name -> reader -> chunks
        # name -> reader -> (uuid, plan) handed over, oldest first, as the policy holds them
        self._taken: dict[str, OrderedDict[str, tuple[str, str]]] = {}

    async def op_plan(self, request: PlanReq) -> Planned:
        ds = self.instances.find(request.name, request.uuid)
        if not self.uses_plans:
            return Planned(False)
        reader = request.reader
        taken = self._taken.setdefault(ds.name, OrderedDict())
        if taken.get(reader) == (ds.uuid, request.plan):
            return Planned(True, complete=True)
        total, start, segs = request.total, request.start, request.segments
        if total > MAX_PLAN_USES or start + len(segs) > total:
            raise InvalidArgument(f"plan: {len(segs)} uses at {start} do not fit {total}")
        if any(s >= ds.manifest.segments for s in segs):
            raise InvalidArgument(f"plan: a segment out of range for {ds.name}")
        partial = self._partial.setdefault(ds.name, OrderedDict())
        part = partial.get(reader)
        if part is None or (part.plan, part.uuid) != (request.plan, ds.uuid):
            partial.pop(reader, None)
            held = sum(len(p.segments) for p in partial.values())
            while partial and (len(partial) >= self.MAX_READERS or held + total > MAX_PLAN_USES):
                held -= len(partial.popitem(last=False)[1].segments)  # before allocating
            empty = np.full(total, -1, dtype=np.int64)
            part = partial[reader] = _Partial(request.plan, ds.uuid, empty, total)
        if len(part.segments) != total:
            raise InvalidArgument(f"plan {request.plan!r}: total {total} changed")
        window = part.segments[start : start + len(segs)]
        part.missing -= int(np.count_nonzero(window < 0))
        window[:] = segs
        if part.missing > 0:
            return Planned(True)
        del partial[reader]
        for old in [r for r, (uuid, _) in taken.items() if uuid != ds.uuid]:
            del taken[old]  # of an instance gone: the policy dropped its plans with it
        taken.pop(reader, None)
        taken[reader] = (ds.uuid, request.plan)
        _keep_newest(taken, self.MAX_READERS)
        # Admitting reads a whole segment, not keeping a miss one file: a swap must win more
        # hits than that costs, and the readers' position is known only roughly (bench_tiers
        # with one file a segment and no margin: 0.57-0.59 of a shuffle from the source
        # against stable's 0.51; a margin of one segment's files keeps it at stable's).
        files_per_segment = max(1, round(ds.record.files / max(1, ds.manifest.segments)))
        self.instances.policy.planned(
            ds.name, part.segments, request.horizon, files_per_segment, reader
        )
        return Planned(True, complete=True)


def _keep_newest(table: OrderedDict[str, Any], most: int) -> None:
    while len(table) > most:
        table.popitem(last=False)
