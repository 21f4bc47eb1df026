"""A partitioned node and a lossy link in a network namespace of the test's own (issue 29): the
fast path (2 DataLoader workers) and a mount (2 workers) read a whole tree from three nodes on
127.0.0.2-4 (replicas 2, the source moved away) through 1% loss and a 20 s partition of one
node whose process stays alive. bench/bench_faults.py runs the namespace (it makes it, shapes
its `lo` with tc u32 filters into a blackhole qdisc, and deletes it) and reports the figures;
this test checks them: 0 wrong bytes, no error, no read over the documented bound (`timeout`,
docs/cluster.md#failures), no stall of either reader over 1 s, and at most 5% of the quiet
phase's node reads read twice (hedged: the hedge delay follows each node's own latency down to
a few milliseconds, client/health.py). The 1% loss p99 against the quiet p99 (3x at most, the
issue's target) is printed, not asserted: on a loaded 2-core machine a few seconds' p99 is the
load's as much as the network's (timing belongs in bench/; tests/system/test_hedged_reads.py checks
the mechanism: the delay, the share it hedges, TCP's retransmission floor)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kspeedfs.testing.netns import namespace, netns_reason

pytestmark = pytest.mark.slow  # three nodes, a mount, DataLoader workers, 40 s of weather

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_faults.py"


def _netns_reason() -> str:
    reason = netns_reason()
    if not reason and not Path("/dev/fuse").exists():
        reason = "needs /dev/fuse"
    return reason


def test_a_partition_and_a_lossy_link_cost_no_byte_and_no_stall(tmp_path: Path) -> None:
    reason = _netns_reason()
    if reason:
        pytest.skip(f"network namespaces unusable here: {reason}")
    out = tmp_path / "faults.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quiet-s", "4", "--loss-s", "6", "--partition-s", "20",
         "--healed-s", "4", "--files", "200", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    print(done.stdout)  # the figures, in the test's output
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    bound_ms = result["timeout_s"] * 1000
    for reader, figures in result["readers"].items():
        for phase, s in figures["phases"].items():
            where = f"{reader}, {phase}"
            assert s["reads"] > 0, where
            assert s["wrong"] == 0, where
            assert s["errors"] == 0, (where, s["first_errors"])
            assert s["max_ms"] <= bound_ms, where
            assert s["stall_s"] <= 1.0, where
        quiet = figures["phases"]["quiet"]
        assert quiet["remote"] > 0, reader
        assert quiet["hedged"] <= 0.05 * quiet["remote"], (reader, quiet)  # duplicate reads


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")
def test_an_etcd_partition_loses_no_node_and_no_copy(tmp_path: Path) -> None:
    """etcd cut off from three live nodes for 8 s (4x member_ttl + heal_after: every lease
    lapses) while a reader reads: 0 wrong bytes, reads go on, and within 10 s of the heal
    every node is a member again, no down note names a live member, nobody is lost and every
    node holds exactly the segments it held (tests/netns_etcd.py)."""
    reason = _netns_reason()
    if reason:
        pytest.skip(f"network namespaces unusable here: {reason}")
    out = tmp_path / "etcd.json"
    script = Path(__file__).resolve().parents[1] / "netns_etcd.py"
    with namespace("ksetcd") as name:
        done = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, str(script), str(out), "8"],
            capture_output=True, text=True, timeout=180,
            env={**os.environ, "PYTHONPATH": str(script.parent.parent)},
        )  # fmt: skip
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["wrong"] == 0 and result["errors"] == 0
    assert result["reads_during_partition"] > 0  # the data plane never waited on etcd
    assert result["converged_s"] is not None and result["converged_s"] <= 10
    assert result["still_sound"]
    assert result["lost"] == [] and result["down_live"] == []
    assert result["held_after"] == result["held_before"]
