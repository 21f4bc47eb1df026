"""The job a process belongs to, from its environment and its cgroup."""

import os

from kspeedfs.client import job_identity

V1 = """12:memory:/process_api/ce6544296c3a42ed968f006cde5a008b
3:cpuset:/
0::/
"""
KUBE = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c.slice/cri-containerd-77ab.scope\n"


def test_the_variables_in_their_order():
    assert job_identity.from_environ({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "t"}) == "42"
    assert job_identity.from_environ({"KSPEEDFS_JOB": "resnet", "SLURM_JOB_ID": "42"}) == "resnet"
    assert job_identity.from_environ({"TORCHELASTIC_RUN_ID": "run 1"}) == "run_1"
    assert job_identity.from_environ({"KSPEEDFS_JOB": "  "}) == ""
    assert len(job_identity.from_environ({"KSPEEDFS_JOB": "x" * 200})) == job_identity.MAX_JOB


def test_cgroups():
    assert job_identity.from_cgroup("0::/user.slice/session-3.scope\n") == "session-3.scope"
    assert job_identity.from_cgroup(V1) == "ce6544296c3a42ed968f006cde5a008b"
    assert job_identity.from_cgroup(KUBE) == "kubepods-burstable-pod1b2c.slice"
    assert job_identity.from_cgroup("0::/\n") == ""
    assert job_identity.from_cgroup("") == ""


def test_a_process_by_its_pid(monkeypatch):
    monkeypatch.setenv("KSPEEDFS_JOB", "mine")
    # /proc/PID/environ is the environment the process started with, not os.environ now.
    assert job_identity.this_job() == "mine"
    assert job_identity.of_process(os.getpid()) == job_identity.of_process(os.getpid())
    assert job_identity.of_process(2**22 + 7) == job_identity.UNKNOWN


def test_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert job_identity.this_rank() == 3
    monkeypatch.setenv("RANK", "1")
    assert job_identity.this_rank() == 1
