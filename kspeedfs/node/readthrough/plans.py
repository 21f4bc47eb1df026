"""The readers' plans: the upcoming segment order of a dataset, sent by its readers in chunks
(the `plan` op), handed whole to the eviction policy."""

from __future__ import annotations

import dataclasses

import numpy as np

from kspeedfs.format.contract.readthrough import Plan, Planned
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.node.readthrough.dataset import Instances

MAX_PLAN_USES = 1 << 26  # a plan longer than this many segment uses is refused


@dataclasses.dataclass
class _Partial:
    plan: str
    uuid: str
    segments: np.ndarray  # int64, -1 where no chunk landed yet
    missing: int


class PlanTable:
    """Gathers each dataset's newest plan. Every reader of one sampler sends the same plan
    (same `plan` name): the first whole copy goes to the policy, repeats are ignored."""

    def __init__(self, instances: Instances, uses_plans: bool):
        self.instances = instances
        self.uses_plans = uses_plans
        self._partial: dict[str, _Partial] = {}
        self._taken: dict[str, tuple[str, str]] = {}  # name -> (uuid, plan) handed over

    async def op_plan(self, request: Plan) -> Planned:
        ds = self.instances.find(request.name, request.uuid)
        if not self.uses_plans:
            return Planned(False)
        if self._taken.get(ds.name) == (ds.uuid, request.plan):
            return Planned(True, complete=True)
        total, start, segs = request.total, request.start, request.segments
        if total > MAX_PLAN_USES or start + len(segs) > total:
            raise InvalidArgument(f"plan: {len(segs)} uses at {start} do not fit {total}")
        if any(s >= ds.manifest.segments for s in segs):
            raise InvalidArgument(f"plan: a segment out of range for {ds.name}")
        part = self._partial.get(ds.name)
        if part is None or (part.plan, part.uuid) != (request.plan, ds.uuid):
            empty = np.full(total, -1, dtype=np.int64)
            part = self._partial[ds.name] = _Partial(request.plan, ds.uuid, empty, total)
        if len(part.segments) != total:
            raise InvalidArgument(f"plan {request.plan!r}: total {total} changed")
        window = part.segments[start : start + len(segs)]
        part.missing -= int(np.count_nonzero(window < 0))
        window[:] = segs
        if part.missing > 0:
            return Planned(True)
        del self._partial[ds.name]
        self._taken[ds.name] = (ds.uuid, request.plan)
        # Admitting reads a whole segment, not keeping a miss one file: a swap must win more
        # hits than that costs, and the readers' position is known only roughly (bench_tiers
        # with one file a segment and no margin: 0.57-0.59 of a shuffle from the source
        # against stable's 0.51; a margin of one segment's files keeps it at stable's).
        files_per_segment = max(1, round(ds.record.files / max(1, ds.manifest.segments)))
        self.instances.policy.planned(ds.name, part.segments, request.horizon, files_per_segment)
        return Planned(True, complete=True)
