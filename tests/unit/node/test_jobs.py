"""The node's job table on a fake clock: deltas per second, rates, aging, the 64-job limit."""

import pytest

from kspeedfs.format.contract.jobs import LoopReport
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.node import jobs
from kspeedfs.node.jobs import DatasetCounters, JobTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(job="train", rank=0, blocked=0.0, busy=0.0, samples=0, datasets=()):
    return LoopReport(
        job=job,
        rank=rank,
        pid=100 + rank,
        blocked=blocked,
        busy=busy,
        batches=samples // 4,
        samples=samples,
        datasets=list(datasets),
    )


def test_ranks_add_up_and_the_stall_is_theirs():
    clock = Clock()
    table = JobTable(clock, lambda name: None)
    for t in range(1, 11):
        clock.now = 1000.0 + t
        table.report(report(rank=0, blocked=0.2 * t, busy=0.8 * t, samples=40 * t))
        table.report(report(rank=1, blocked=0.4 * t, busy=0.6 * t, samples=40 * t))
    (entry,) = table.answer(history=True).jobs
    assert entry.ranks == 2
    assert entry.stall == pytest.approx(0.3)
    assert entry.recent_stall == pytest.approx(0.3)
    assert entry.samples == 800
    assert entry.samples_per_s == pytest.approx(80.0)
    # The first report's totals are from before the table saw the job: not in any second.
    assert sum(s.samples for s in entry.history) == 720
    assert [s.t for s in entry.history] == list(range(10))


def test_datasets_counted_from_when_the_job_came():
    clock = Clock()
    counts = {"coco": DatasetCounters(hits=100, misses=50, source_bytes=5000, resident_bytes=7)}
    table = JobTable(clock, counts.get)
    table.report(report(datasets=["coco", "gone"]))
    counts["coco"] = DatasetCounters(hits=130, misses=60, source_bytes=6000, resident_bytes=9)
    clock.now += 1
    table.report(report(blocked=0.5, busy=0.5, samples=8, datasets=["coco"]))
    (entry,) = table.answer(history=True).jobs
    (coco,) = entry.datasets
    assert (coco.hits, coco.misses, coco.source_bytes, coco.resident_bytes) == (30, 10, 1000, 9)
    assert entry.hit_rate == pytest.approx(0.75)
    assert (entry.history[-1].hits, entry.history[-1].misses) == (30, 10)


def test_idle_jobs_age_out_and_the_table_is_bounded():
    clock = Clock()
    table = JobTable(clock, lambda name: None)
    table.report(report(job="old"))
    clock.now += jobs.IDLE_S + 1
    table.report(report(job="new"))
    assert [e.job for e in table.answer().jobs] == ["new"]
    with pytest.raises(NotFound):
        table.answer("old")
    for n in range(jobs.MAX_JOBS + 5):
        clock.now += 0.01
        table.report(report(job=f"j{n}"))
    names = {e.job for e in table.answer().jobs}
    assert len(names) == jobs.MAX_JOBS
    assert "new" not in names and f"j{jobs.MAX_JOBS + 4}" in names


def test_a_bad_report_is_refused_off_the_wire():
    wire = report().to_wire()
    for field, value in (("job", "a b"), ("job", ""), ("blocked", -1.0), ("datasets", ["../x"])):
        with pytest.raises(InvalidArgument):
            LoopReport.from_wire({**wire, field: value})


def test_workers_add_their_fetches_not_ranks():
    clock = Clock()
    table = JobTable(clock, lambda name: None)
    table.report(report(blocked=1.0, busy=1.0, samples=8))
    for pid in (7, 8):
        worker = LoopReport(
            job="train",
            rank=0,
            pid=pid,
            blocked=0.0,
            busy=0.0,
            batches=0,
            samples=0,
            worker=True,
            fetch=2.0,
            reads={"remote": 0.5},
        )
        table.report(worker)
    (entry,) = table.answer().jobs
    assert entry.ranks == 1
    assert entry.fetch_seconds == 4.0 and entry.read_seconds == {"remote": 1.0}
    with pytest.raises(InvalidArgument):
        LoopReport.from_wire({**report().to_wire(), "reads": {"tape": 1.0}})
