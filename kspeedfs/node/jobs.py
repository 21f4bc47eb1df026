"""The node's table of jobs: their training loops' reports and what it knows of their datasets.

Each watched loop (pytorch_ext.watch) reports its running totals once a second; the table keeps
the last report of each (job, rank, pid) and, per job, a bounded ring of per-second samples
(blocked, busy, samples, its datasets' hits and misses) for `kspeedfs jobs`, `top`, `report`
and /metrics. At most MAX_JOBS jobs: a job with no report for IDLE_S is aged out, and a new job
beyond the limit takes the place of the one idle longest. The clock is injected (tests run it
by hand); the datasets' counters are read through `counters`, given at construction.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from kspeedfs.format import stall
from kspeedfs.format.contract.jobs import (
    JobDataset,
    JobEntry,
    JobsAnswer,
    JobSecond,
    JobsReq,
    LoopReport,
    LoopReported,
)
from kspeedfs.format.errors import NotFound
from kspeedfs.node.ops import READ, OpRegistry

MAX_JOBS = 64
IDLE_S = 300.0  # a job with no report this long is gone
HISTORY_S = 3600  # per-second samples kept per job
RATE_WINDOW = 10  # seconds of history the rates and the recent stall are taken over


@dataclasses.dataclass(frozen=True)
class DatasetCounters:
    """What the node counts of a dataset: segment hits and misses, bytes read from its source
    (read-through datasets; a preload's are 0) and the memory it holds here."""

    hits: int = 0
    misses: int = 0
    source_bytes: int = 0
    resident_bytes: int = 0


Counters = Callable[[str], DatasetCounters | None]  # None: not on this node


@dataclasses.dataclass
class _Second:
    t: int
    blocked: float = 0.0
    busy: float = 0.0
    samples: int = 0
    hits: int = 0
    misses: int = 0
    fetch: float = 0.0  # the workers' fetches, and of them the reads by path
    read_local: float = 0.0
    read_remote: float = 0.0
    read_source: float = 0.0


@dataclasses.dataclass
class _Job:
    first: float
    last: float
    reports: dict[tuple[int, int], LoopReport] = dataclasses.field(default_factory=dict)
    datasets: dict[str, DatasetCounters] = dataclasses.field(default_factory=dict)  # at join
    seen: dict[str, DatasetCounters] = dataclasses.field(default_factory=dict)  # last read
    history: collections.deque[_Second] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_S)
    )

    def total(self, field: str) -> float:
        return sum(getattr(r, field) for r in self.reports.values())


class JobTable:
    """The jobs reporting to this node."""

    def __init__(self, clock: Callable[[], float], counters: Counters):
        self._clock = clock
        self._counters = counters
        self._jobs: dict[str, _Job] = {}

    def register_ops(self, ops: OpRegistry) -> None:
        """Any client may report its loop and read the table (a job reads its own figures)."""
        ops.add(LoopReport, self.op_loop_report, READ)
        ops.add(JobsReq, self.op_jobs, READ)

    async def op_loop_report(self, request: LoopReport) -> LoopReported:
        self.report(request)
        return LoopReported(jobs=len(self._jobs))

    async def op_jobs(self, request: JobsReq) -> JobsAnswer:
        return self.answer(request.job, request.history)

    def report(self, report: LoopReport) -> None:
        """A loop's running totals: what they add since its last report goes to this second."""
        now = self._clock()
        self._age_out(now)
        job = self._jobs.get(report.job)
        if job is None:
            if len(self._jobs) >= MAX_JOBS:
                del self._jobs[min(self._jobs, key=lambda j: self._jobs[j].last)]
            job = self._jobs[report.job] = _Job(first=now, last=now)
        job.last = now
        key = (report.rank, report.pid)
        before = job.reports.get(key)
        job.reports[key] = report
        second = self._second(job, now)
        if before is not None:  # a first report's totals are from before the job was seen here
            second.blocked += max(0.0, report.blocked - before.blocked)
            second.busy += max(0.0, report.busy - before.busy)
            second.samples += max(0, report.samples - before.samples)
            second.fetch += max(0.0, report.fetch - before.fetch)
            for path, spent in report.reads.items():
                field = f"read_{path}"
                was = before.reads.get(path, 0.0)
                setattr(second, field, getattr(second, field) + max(0.0, spent - was))
        for name in report.datasets:
            counters = self._counters(name)
            if counters is None:
                continue
            if name not in job.datasets:
                job.datasets[name] = job.seen[name] = counters
            last = job.seen[name]
            second.hits += max(0, counters.hits - last.hits)
            second.misses += max(0, counters.misses - last.misses)
            job.seen[name] = counters

    def _second(self, job: _Job, now: float) -> _Second:
        t = int(now - job.first)
        if not job.history or job.history[-1].t != t:
            job.history.append(_Second(t))
        return job.history[-1]

    def _age_out(self, now: float) -> None:
        for name in [n for n, j in self._jobs.items() if now - j.last > IDLE_S]:
            del self._jobs[name]

    def answer(self, name: str = "", history: bool = False) -> JobsAnswer:
        """The jobs (or job `name`: NotFound when it is not here), busiest first."""
        now = self._clock()
        self._age_out(now)
        if name and name not in self._jobs:
            raise NotFound(f"no job {name!r} reports to this node")
        names = [name] if name else list(self._jobs)
        entries = [self._entry(n, self._jobs[n], now, history) for n in names]
        return JobsAnswer(jobs=sorted(entries, key=lambda e: -e.samples_per_s))

    def _entry(self, name: str, job: _Job, now: float, history: bool) -> JobEntry:
        blocked, busy = job.total("blocked"), job.total("busy")
        recent = [s for s in job.history if s.t >= int(now - job.first) - RATE_WINDOW]
        window = min(float(RATE_WINDOW), max(now - job.first, 1.0))
        datasets = []
        for ds, start in sorted(job.datasets.items()):
            current = self._counters(ds) or job.seen[ds]
            datasets.append(
                JobDataset(
                    name=ds,
                    hits=max(0, current.hits - start.hits),
                    misses=max(0, current.misses - start.misses),
                    source_bytes=max(0, current.source_bytes - start.source_bytes),
                    resident_bytes=current.resident_bytes,
                )
            )
        seconds = [JobSecond(**dataclasses.asdict(s)) for s in job.history] if history else []
        reads: dict[str, float] = {}
        for report in job.reports.values():
            for path, spent in report.reads.items():
                reads[path] = reads.get(path, 0.0) + spent
        return JobEntry(
            job=name,
            ranks=sum(1 for r in job.reports.values() if not r.worker),
            blocked=blocked,
            busy=busy,
            batches=int(job.total("batches")),
            samples=int(job.total("samples")),
            samples_per_s=sum(s.samples for s in recent) / window,
            stall=stall.stall(blocked, busy),
            recent_stall=stall.stall(sum(s.blocked for s in recent), sum(s.busy for s in recent)),
            idle_s=now - job.last,
            datasets=datasets,
            history=seconds,
            fetch_seconds=job.total("fetch"),
            read_seconds=reads,
        )
