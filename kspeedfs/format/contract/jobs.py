"""The jobs' ops (kspeedfs.node.jobs): a training loop's report of its waiting, and the node's
table of jobs with what it knows of their datasets."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, at_least, checked
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.names import validate_name

MAX_JOB = 64  # characters of a job's name (kspeedfs.client.job_identity.MAX_JOB)
MAX_DATASETS = 32  # datasets one report names


def _job(job: str) -> str:
    if not 0 < len(job) <= MAX_JOB or not job.isprintable() or any(c.isspace() for c in job):
        raise InvalidArgument(f"must be 1 to {MAX_JOB} printable characters without spaces")
    return job


def _datasets(names: list[str]) -> list[str]:
    if len(names) > MAX_DATASETS:
        raise InvalidArgument(f"must name at most {MAX_DATASETS} datasets, not {len(names)}")
    for name in names:
        validate_name(name)
    return names


READ_PATHS = ("local", "remote", "source")  # kspeedfs.client.read_times.PATHS


def _reads(reads: dict[str, float]) -> dict[str, float]:
    for path, seconds in reads.items():
        if path not in READ_PATHS:
            raise InvalidArgument(f"unknown read path {path!r}: one of {', '.join(READ_PATHS)}")
        if seconds < 0:
            raise InvalidArgument(f"seconds of {path} must be at least 0, not {seconds}")
    return reads


@dataclasses.dataclass(frozen=True)
class LoopReport(Request["LoopReported"]):
    """One process's training loop so far (running totals: a lost report loses nothing):
    seconds blocked in next(loader) and busy between calls, batches and samples drawn."""

    OP = "loop_report"
    job: str = checked(_job)
    rank: int = at_least(0)
    pid: int = at_least(0)
    blocked: float = at_least(0)
    busy: float = at_least(0)
    batches: int = at_least(0)
    samples: int = at_least(0)
    datasets: list[str] = checked(_datasets, factory=list)
    # A DataLoader worker's (or a loop without workers'): seconds fetching batches, and of them
    # seconds in kspeedfs reads by path (kspeedfs.client.read_times).
    worker: bool = False  # a worker: not a rank of the job
    fetch: float = at_least(0, default=0.0)
    reads: dict[str, float] = checked(_reads, factory=dict)


@dataclasses.dataclass(frozen=True)
class LoopReported(Wire):
    jobs: int  # jobs the node's table holds now


@dataclasses.dataclass(frozen=True)
class JobsReq(Request["JobsAnswer"]):
    """The node's jobs (or the one named), with their per-second history when asked."""

    OP = "jobs"
    job: str = ""
    history: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobDataset(Wire):
    """A dataset a job reads: its counters while the job read it (shared with any other job
    reading it at the same time) and the memory it holds here now."""

    name: str
    hits: int = at_least(0)
    misses: int = at_least(0)
    source_bytes: int = at_least(0)
    resident_bytes: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSecond(Wire):
    """One second of a job's loop: seconds blocked and busy (summed over its ranks), samples,
    and its datasets' hits and misses."""

    t: float  # seconds since the job's first report
    blocked: float = at_least(0, default=0)
    busy: float = at_least(0, default=0)
    samples: int = at_least(0, default=0)
    hits: int = at_least(0, default=0)
    misses: int = at_least(0, default=0)
    # The workers' seconds fetching batches, and of them in kspeedfs reads by path.
    fetch: float = at_least(0, default=0)
    read_local: float = at_least(0, default=0)
    read_remote: float = at_least(0, default=0)
    read_source: float = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobEntry(Wire):
    job: str
    tenant: str = ""  # empty until tenants exist
    ranks: int = at_least(0, default=0)
    blocked: float = at_least(0, default=0)
    busy: float = at_least(0, default=0)
    batches: int = at_least(0, default=0)
    samples: int = at_least(0, default=0)
    samples_per_s: float = at_least(0, default=0)  # over the last RATE_WINDOW seconds
    stall: float = at_least(0, default=0)  # over the whole run
    recent_stall: float = at_least(0, default=0)  # over the last RATE_WINDOW seconds
    idle_s: float = at_least(0, default=0)  # since its last report
    # Its workers' seconds fetching batches, and of them in kspeedfs reads by path.
    fetch_seconds: float = at_least(0, default=0)
    read_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    datasets: list[JobDataset] = dataclasses.field(default_factory=list)
    history: list[JobSecond] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        hits = sum(d.hits for d in self.datasets)
        total = hits + sum(d.misses for d in self.datasets)
        return hits / total if total else None


@dataclasses.dataclass(frozen=True)
class JobsAnswer(Wire):
    jobs: list[JobEntry]
