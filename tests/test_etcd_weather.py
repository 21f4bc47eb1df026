"""Membership that an etcd outage or a skewed clock cannot turn into data loss (issue 29), with
a real etcd: down notes only for absent members, "lost" by etcd's clock, fencing, an etcd
frozen under readers, and nodes an hour ahead of and behind the others."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import make_tree, wait_for
from etcdutil import EtcdCluster, copies

from kspeedfs.client.clusterstate import ClusterState, resolve_nodes
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.errors import Fenced
from kspeedfs.testing.etcd import EtcdProcess
from kspeedfs.testing.netns import read_until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")

A, B = "10.0.0.1:7420", "10.0.0.2:7420"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def test_a_down_note_never_lands_on_a_member_that_registered(etcd: EtcdProcess) -> None:
    state = ClusterState([etcd.endpoint], "weather1")
    me = state.register(A, 10, 1)
    before = state.snapshot()
    assert B not in before.members  # the view a note would be decided on...
    b = state.register(B, 10, 2)  # ...and B registers before the note is written
    assert not state.note_down(B, me, 20)
    assert B not in state.snapshot().down
    state.revoke(b.lease)  # now it is really gone: the note lands, with its grace
    assert state.note_down(B, me, 20)
    assert not state.note_down(B, me, 20)  # one note: the first survivor's
    snap = state.snapshot()
    assert B in snap.down and B in snap.grace and not snap.lost(B, me)
    state.register(B, 10, 3)  # its registration clears the note and the grace in one step
    snap = state.snapshot()
    assert B not in snap.down and B not in snap.grace
    assert not snap.lost(B, me)


def test_lost_is_decided_by_etcds_clock_and_a_stale_note_never_counts(
    etcd: EtcdProcess,
) -> None:
    state = ClusterState([etcd.endpoint], "weather2")
    me = state.register(A, 10, 1)
    assert state.note_down(B, me, 2)
    assert not state.snapshot().lost(B, me)
    wait_for(lambda: state.snapshot().lost(B, me), timeout=10, what="etcd to expire the grace")
    # The observer registers again (its lease lapsed, as when etcd was away): the note was
    # written before, so it is stale for the new registration and counts no more.
    me2 = state.register(A, 10, 1)
    snap = state.snapshot()
    assert snap.stale_note(B, me2) and not snap.lost(B, me2)
    # The old registration is fenced: its catalog writes are refused.
    state.claim({"name": "ds", "uuid": "u1"}, me2)
    with pytest.raises(Fenced):
        state.update("ds", "u1", lambda r: {**r, "state": "ready"}, fence=me)
    with pytest.raises(Fenced):
        state.claim({"name": "other", "uuid": "u2"}, me)
    assert not state.note_down(B, me, 2, stale=snap.down[B].mod)
    assert state.note_down(B, me2, 2, stale=snap.down[B].mod)  # written again, fresh grace
    assert not state.snapshot().lost(B, me2)


def _no_loss(cluster: EtcdCluster, name: str, held: dict[str, list[int]]) -> bool:
    record = cluster.record(name)
    down = cluster.state().snapshot().down
    live = {n.address for n in cluster.nodes}
    now = {n.address: sorted(_held(n, name)) for n in cluster.nodes}
    return (
        not record.get("lost")
        and not (down.keys() & live)
        and set(cluster.members().values()) == {"up"}
        and now == held
    )


def _held(node: object, name: str) -> list[int]:
    from clusterutil import held_on_disk

    try:
        return held_on_disk(node, name)  # type: ignore[arg-type]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_an_etcd_frozen_under_readers_costs_no_copy(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    cluster = etcd_cluster
    for _ in range(3):
        cluster.add()
    src = make_tree(tmp_path / "src", 64 * 1024)
    cluster.preload(src, "frozen", replicas=2)
    held = {n.address: sorted(_held(n, "frozen")) for n in cluster.nodes}
    assert all(held.values())
    stop, counts = threading.Event(), {"reads": 0, "wrong": 0, "errors": 0}
    client = ClusterReader(resolve_nodes(cluster.settings()))  # the nodes, from etcd, now
    ds = client.open_dataset("frozen")

    def want(rel: str) -> bytes:
        return (src / rel).read_bytes()

    reader = threading.Thread(target=read_until, args=(client, ds, want, stop, counts))
    reader.start()
    wait_for(lambda: counts["reads"] > 0, what="the first reads")
    try:
        assert cluster.etcd.proc is not None
        # Frozen far longer than member_ttl + heal_after (2 + 2 s): every lease lapses at once
        # when it wakes up, while every node stayed alive.
        cluster.etcd.proc.send_signal(signal.SIGSTOP)
        # under test: etcd frozen past member_ttl + heal_after
        time.sleep(8)
        reads_during = counts["reads"]
        cluster.etcd.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: _no_loss(cluster, "frozen", held), timeout=10, what="convergence, no loss")
        time.sleep(4)  # under test: past heal_after again, nobody lost later either
        assert _no_loss(cluster, "frozen", held)
    finally:
        stop.set()
        reader.join()
        client.close()
        if cluster.etcd.proc is not None:
            cluster.etcd.proc.send_signal(signal.SIGCONT)
    assert counts["wrong"] == 0 and counts["errors"] == 0
    assert reads_during > 0  # the data plane never waited on etcd
    assert sum(copies("frozen", cluster.nodes).values()) == sum(len(h) for h in held.values())


@pytest.mark.slow
@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime not installed (faketime)")
def test_clocks_an_hour_off_declare_nobody_lost_before_heal_after(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    cluster = etcd_cluster
    heal = {"KSPEEDFS_HEAL_AFTER": "15"}
    skew = {"LD_PRELOAD": str(LIBFAKETIME), "DONT_FAKE_MONOTONIC": "1", **heal}
    cluster.add(**skew, FAKETIME="+1h")
    cluster.add(**skew, FAKETIME="-1h")
    cluster.add(**heal)
    victim = cluster.add(**heal)
    src = make_tree(tmp_path / "src", 64 * 1024)
    cluster.preload(src, "skew", replicas=2)
    held = {n.address: sorted(_held(n, "skew")) for n in cluster.nodes}
    assert victim.proc is not None
    # Two 5 s outages (its lease, 2 s, lapses each time). Whichever survivor notes it down
    # first, a node ahead of the note's writer would have counted an hour gone, at once.
    for _ in range(2):
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(5)
        victim.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: cluster.members().get(victim.address) == "up", timeout=10)
        time.sleep(2)  # a few syncs of every node after it is back
        assert not cluster.record("skew").get("lost")
    assert {n.address: sorted(_held(n, "skew")) for n in cluster.nodes} == held
    # And a real loss is still seen, by etcd's clock, after heal_after.
    victim.kill9()
    wait_for(lambda: victim.address in cluster.record("skew").get("lost", []), timeout=40)
