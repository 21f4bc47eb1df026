"""Leases: the table on a fake clock, and real jobs that actively load, share, exit and crash."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, preload, wait_for

from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.node.leases import LeaseTable
from kspeedfs.sample import make_sample


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_table_counts_renews_and_expires() -> None:
    clock = Clock()
    t = LeaseTable(10.0, clock)
    a = t.acquire("ds", "i1", "host:1")
    b = t.acquire("ds", "i1", "host:2")
    assert t.count("ds") == 2 and t.total() == 2
    assert t.holders("ds") == ["host:1", "host:2"]
    clock.now += 8
    t.renew(a.id)
    clock.now += 5  # b is 13 s old, a was renewed 5 s ago
    assert [lease.id for lease in t.expire()] == [b.id]
    assert t.count("ds") == 1
    with pytest.raises(NotFound):
        t.renew(b.id)
    assert t.release(a.id).name == "ds"
    assert t.count("ds") == 0 and t.total() == 0
    with pytest.raises(NotFound):
        t.release(a.id)


def test_a_lease_past_its_ttl_cannot_be_renewed_even_before_the_sweep() -> None:
    clock = Clock()
    t = LeaseTable(5.0, clock)
    lease = t.acquire("ds", "i1", "h")
    clock.now += 5.0
    with pytest.raises(NotFound):
        t.renew(lease.id)


def test_idle_gives_a_never_leased_dataset_one_ttl_of_grace() -> None:
    clock = Clock()
    t = LeaseTable(10.0, clock)
    assert t.idle(["orphan"]) == []
    clock.now += 9.9
    assert t.idle(["orphan"]) == []
    clock.now += 0.1
    assert t.idle(["orphan"]) == ["orphan"]
    lease = t.acquire("held", "i1", "h")
    for _ in range(5):  # held for five ttls by renewals
        clock.now += 9
        t.renew(lease.id)
        assert t.idle(["held"]) == []
    t.release(lease.id)
    assert t.idle(["held"]) == []  # its clock starts at the release
    clock.now += 10
    assert t.idle(["held"]) == ["held"]


def test_closing_blocks_new_leases_until_forgotten() -> None:
    t = LeaseTable(10.0, Clock())
    lease = t.acquire("ds", "i1", "h")
    assert not t.begin_close("ds")  # still held
    t.release(lease.id)
    assert t.begin_close("ds")
    assert not t.begin_close("ds")  # one task unloads it
    with pytest.raises(NotFound, match="being unloaded"):
        t.acquire("ds", "i1", "h")
    t.forget("ds")
    assert t.acquire("ds", "i1", "h").name == "ds"
    with pytest.raises(InvalidArgument):
        LeaseTable(0)


JOB = """
import sys
from pytorch_ext import KSpeedFolder

sys.stdin.readline()  # build the dataset when the test says so
ds = KSpeedFolder(sys.argv[1])
assert bytes(ds.read_index(0))
print(ds.dataset_name, flush=True)
sys.stdin.readline()  # then exit cleanly when told (or be killed)
"""


class Job:
    """A training job in a subprocess: builds a dataset on a path, holds it, exits."""

    def __init__(self, script: Path, root: Path, node: NodeProcess):
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(root)],
            env=node.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def attach(self) -> str:
        """Build the dataset; returns its cache name once it is ready."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        name = self.proc.stdout.readline().strip()
        if not name:
            self.proc.wait(30)
            raise AssertionError(
                f"job failed: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        return name

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0, self.proc.stderr.read() if self.proc.stderr else ""

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for job in made:
        job.cleanup()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "data" / "train"
    make_sample(src, classes=2, per_class=3, file_size=3000, bases=2)
    return src


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


@pytest.fixture
def short_ttl_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    config = tmp_path / "node.toml"
    config.write_text("lease_ttl = 2.0\n")
    node = NodeProcess(shm_dir, token_file, tmp_path, extra=("--config", str(config))).start()
    yield node
    node.stop()


def datasets(node: NodeProcess) -> dict[str, dict]:  # type: ignore[type-arg]
    return {d["name"]: d for d in node.request("list")["datasets"]}


@pytest.mark.slow  # job processes on a node
def test_two_jobs_share_an_active_dataset_until_both_exit(
    node: NodeProcess, source: Path, script: Path, jobs: list[Job]
) -> None:
    jobs += [Job(script, source, node), Job(script, source, node)]  # both import in parallel
    a, b = jobs
    name = a.attach()
    d = datasets(node)[name]
    assert d["lifetime"] == "leased" and d["leases"] == 1 and d["source"] == str(source)
    assert b.attach() == name
    assert datasets(node)[name]["leases"] == 2
    assert node.request("status")["leases"] == 2
    a.exit()
    assert datasets(node)[name]["leases"] == 1  # still loaded for b
    b.exit()
    assert name not in datasets(node)  # the last clean exit unloaded it
    assert "its last lease was released" in node.log()


@pytest.mark.slow  # job processes on a node
def test_a_killed_job_lets_the_dataset_go_after_the_ttl(
    short_ttl_node: NodeProcess, source: Path, script: Path, jobs: list[Job]
) -> None:
    node = short_ttl_node
    jobs.append(Job(script, source, node))
    name = jobs[0].attach()
    assert datasets(node)[name]["leases"] == 1
    jobs[0].kill9()
    wait_for(lambda: name not in datasets(node), timeout=60, what="the lease to expire")
    log = node.log()
    assert f"lease on {name} held by" in log and "expired" in log
    assert "its last lease was released" not in log


@pytest.mark.slow  # job processes on a node
def test_an_offline_dataset_survives_a_job(
    node: NodeProcess, source: Path, script: Path, jobs: list[Job]
) -> None:
    preload(node, source.parent, "offline")
    jobs.append(Job(script, source, node))
    assert jobs[0].attach() == "offline"
    jobs[0].exit()
    d = datasets(node)["offline"]
    assert d["lifetime"] == "offline" and d["state"] == "ready" and d["leases"] == 0


@pytest.mark.slow  # job processes on a node
def test_a_leased_dataset_nobody_leases_is_unloaded(
    short_ttl_node: NodeProcess, source: Path
) -> None:
    """A job that died between starting the preload and taking its lease leaves nothing."""
    from kspeedfs.client import admin
    from kspeedfs.format.config import load_settings

    node = short_ttl_node
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    admin.preload(settings, str(source), "orphan", show_progress=False, lifetime="leased")
    wait_for(lambda: "orphan" not in datasets(node), timeout=60, what="the orphan to go")
    assert "unloading orphan: no lease on it" in node.log()
