"""`kspeedfs jobs`: a job with ranks on two nodes is one row, its figures summed."""

import pytest

from kspeedfs.cli import jobs
from kspeedfs.format.contract.jobs import JobDataset, JobEntry, JobSecond


def entry(blocked: float, busy: float, hits: int, misses: int) -> JobEntry:
    return JobEntry(
        job="j",
        ranks=1,
        blocked=blocked,
        busy=busy,
        samples=100,
        samples_per_s=10.0,
        recent_stall=blocked / (blocked + busy),
        datasets=[JobDataset(name="d", hits=hits, misses=misses, source_bytes=5, resident_bytes=7)],
        history=[JobSecond(t=1, blocked=blocked, busy=busy, hits=hits)],
    )


def test_two_nodes_one_job():
    merged = jobs.merge([entry(1, 3, 8, 2), entry(3, 1, 2, 8)])
    assert merged.ranks == 2 and merged.samples == 200 and merged.samples_per_s == 20.0
    assert merged.stall == pytest.approx(0.5)
    (d,) = merged.datasets
    assert (d.name, d.hits, d.misses, d.source_bytes, d.resident_bytes) == ("d", 10, 10, 10, 14)
    assert merged.hit_rate == pytest.approx(0.5)
    (s,) = merged.history
    assert (s.t, s.blocked, s.busy, s.hits) == (1, 4, 4, 10)
    row = jobs.job_row(merged)
    assert row[0] == "j" and row[4] == "50.0% high" and row[5] == "50% below"
