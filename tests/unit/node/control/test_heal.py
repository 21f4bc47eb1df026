"""Healing and rebalancing in-process: real ControlPlanes over an in-memory etcd, members whose
stores and segment reads are in memory, on trio's MockClock. A member gone past its TTL is
noted down, declared lost only after heal_after, and its copies are made again by their new
owners, from the members that hold them, else the source; a rebalance drops the segments that
moved only once their new owner holds them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import trio
from hypothesis import assume, given
from hypothesis import settings as settings_for_examples
from hypothesis import strategies as st

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.node.control import ControlPlane, EtcdCatalog, placed
from kspeedfs.node.control.membership import Membership
from unit.controlfakes import (
    ETCD_URL,
    LocalDataset,
    MemoryEtcd,
    MemoryPeers,
    MemoryStore,
    local_dataset,
    memory_etcd,
    run,
)

TTL = 3.0
HEAL_AFTER = 10.0
PREFIX = "/kspeedfs/unit/"
RECORD = PREFIX + "datasets/ds"
SEGMENTS = 12


def settings() -> Settings:
    return Settings(etcd=[ETCD_URL], cluster="unit", member_ttl=TTL, heal_after=HEAL_AFTER)


def plane(store: MemoryStore, peers: MemoryPeers) -> ControlPlane:
    async def unload(name: str, uuid: str) -> None:
        store.datasets.pop(name, None)

    return ControlPlane(
        settings(), store, peers.ask, unload, EtcdCatalog.of(settings(), peers.ask), readers=peers
    )  # type: ignore[arg-type]


def placed_over(
    etcd: MemoryEtcd, ds: LocalDataset, members: list[str], replicas: int
) -> dict[str, MemoryStore]:
    """The ready record of `ds` over `members` in etcd, and each member's store holding the
    segments placement gives it (as a finished preload leaves them)."""
    record = ds.record(members, replicas)
    etcd.put(RECORD, record)
    where = placed("ds", CatalogEntry.from_json(record))
    stores = {m: MemoryStore() for m in members}
    for m, store in stores.items():
        store.put(ds, [s for s in range(len(ds.segments)) if m in where.owners(s)])
    return stores


def held(stores: dict[str, MemoryStore]) -> dict[str, list[int]]:
    return {m: list(s.datasets["ds"].held) for m, s in stores.items() if "ds" in s.datasets}


def assert_placed(etcd: MemoryEtcd, stores: dict[str, MemoryStore], ds: LocalDataset) -> None:
    """Every owner of every segment, by the record in etcd now, holds it, with its bytes."""
    where = placed("ds", etcd.entry(RECORD))
    for seg in range(len(ds.segments)):
        for owner in where.owners(seg):
            assert seg in stores[owner].datasets["ds"].held, (seg, owner)
            assert stores[owner].data["ds", seg] == ds.segments[seg]


async def crashed_member(address: str) -> None:
    """`address` joins and never renews its lease (it crashed right after)."""
    await Membership(settings(), ClusterState.of(settings())).join(address)


async def heal_without(
    gone: str, stores: dict[str, MemoryStore], peers: MemoryPeers
) -> list[ControlPlane]:
    """`gone` crashes at once; the others run their control planes until it is lost and
    healed. Their control planes."""
    peers.down.add(gone)
    await crashed_member(gone)
    planes = {m: plane(s, peers) for m, s in stores.items() if m != gone}
    async with trio.open_nursery() as nursery:
        for address, p in planes.items():
            await nursery.start(p.run, address)
        await trio.sleep(TTL + HEAL_AFTER + 3)  # under test: past the TTL, then heal_after
        nursery.cancel_scope.cancel()
    return list(planes.values())


@settings_for_examples(max_examples=12)
@given(
    members=st.integers(2, 5),
    replicas=st.integers(1, 3),
    segments=st.integers(1, 12),
    which=st.integers(0, 4),
)
def test_any_lost_member_is_healed_onto_exactly_its_new_owners(
    members: int, replicas: int, segments: int, which: int
) -> None:
    assume(replicas < members)
    addresses = [f"n{i}:1" for i in range(members)]
    gone = addresses[which % members]
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        etcd = memory_etcd(mp)
        ds = local_dataset(Path(tmp), "ds", segments)
        stores = placed_over(etcd, ds, addresses, replicas)
        on_gone = len(held(stores)[gone])
        peers = MemoryPeers(stores)
        planes = run(lambda: heal_without(gone, stores, peers))
        assert etcd.value(RECORD)["lost"] == [gone]
        del stores[gone]
        assert_placed(etcd, stores, ds)
        from_source = sum(p.healer.stats["from_source"] for p in planes)
        # A copy comes from the source only when the lost member held the only one.
        assert from_source == (on_gone if replicas == 1 else 0)
        assert sum(peers.reads.values()) == (0 if replicas == 1 else on_gone)


def test_a_lost_members_copies_are_made_again_from_the_members_holding_them_after_heal_after(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path, "ds", SEGMENTS)
    stores = placed_over(etcd, ds, ["a:1", "b:1", "c:1"], replicas=2)
    peers = MemoryPeers(stores)
    peers.down.add("c:1")
    before = held(stores)
    lost_segments = len(before["c:1"])
    assert lost_segments > 0

    async def main() -> None:
        await crashed_member("c:1")
        planes = [plane(stores[m], peers) for m in ("a:1", "b:1")]
        async with trio.open_nursery() as nursery:
            for p, address in zip(planes, ("a:1", "b:1"), strict=True):
                await nursery.start(p.run, address)
            await trio.sleep(TTL - 0.5)  # under test: c's lease still runs
            assert not etcd.has(PREFIX + "down/c:1")
            await trio.sleep(1.5)  # under test: c's lease lapses; a survivor notes it down
            assert etcd.has(PREFIX + "down/c:1") and etcd.has(PREFIX + "grace/c:1")
            await trio.sleep(HEAL_AFTER - 2)  # under test: still within heal_after
            assert etcd.value(RECORD).get("lost", []) == []
            assert held(stores) == before  # nothing copied yet: c may come back
            assert all(p.status().under_replicated == {"ds": lost_segments} for p in planes)
            await trio.sleep(3)  # under test: past heal_after
            assert etcd.value(RECORD)["lost"] == ["c:1"]
            nursery.cancel_scope.cancel()
        assert_placed(etcd, stores, ds)
        assert all(p.status().under_replicated == {"ds": 0} for p in planes)
        assert sum(peers.reads.values()) == lost_segments  # each copy read once, from a peer
        assert "c:1" not in peers.reads
        assert all(p.healer.stats["from_source"] == 0 for p in planes)
        assert sum(p.healer.stats["segments"] for p in planes) == lost_segments

    run(main)


def test_a_copy_no_live_member_holds_is_read_from_the_source(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path, "ds", SEGMENTS)
    stores = placed_over(etcd, ds, ["a:1", "b:1", "c:1"], replicas=1)
    peers = MemoryPeers(stores)
    only_on_c = len(held(stores)["c:1"])
    assert only_on_c > 0
    planes = run(lambda: heal_without("c:1", stores, peers))
    assert etcd.value(RECORD)["lost"] == ["c:1"]
    assert_placed(etcd, stores, ds)
    assert sum(p.healer.stats["from_source"] for p in planes) == only_on_c
    assert peers.reads == {}  # no member had a copy to give


def test_a_peers_copy_that_fails_its_checksum_is_not_kept(etcd: MemoryEtcd, tmp_path: Path) -> None:
    ds = local_dataset(tmp_path, "ds", SEGMENTS)
    stores = placed_over(etcd, ds, ["a:1", "b:1", "c:1"], replicas=2)
    peers = MemoryPeers(stores)
    where = placed("ds", etcd.entry(RECORD))
    on_c = held(stores)["c:1"]
    # Every survivor copy of c's segments is damaged: none may be kept, the source's are.
    for seg in on_c:
        for owner in where.owners(seg):
            if owner != "c:1":
                stores[owner].data["ds", seg] = b"\xff" * len(ds.segments[seg])
    planes = run(lambda: heal_without("c:1", stores, peers))
    healed = placed("ds", etcd.entry(RECORD))
    copied = 0
    for seg in on_c:
        for owner in set(healed.owners(seg)) - set(where.owners(seg)):  # c's heir
            copied += 1
            assert stores[owner].data["ds", seg] == ds.segments[seg]
    assert copied == len(on_c) == sum(p.healer.stats["from_source"] for p in planes)


def test_a_rebalance_drops_moved_segments_only_once_their_new_owner_holds_them(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path, "ds", SEGMENTS)
    stores = placed_over(etcd, ds, ["a:1", "b:1"], replicas=1)
    stores["c:1"] = MemoryStore()
    stores["c:1"].put(ds, [])  # c lists the dataset, holding no segment (adopted)
    peers = MemoryPeers(stores)

    def every_segment_has_a_copy() -> bool:
        return set().union(*held(stores).values()) == set(range(SEGMENTS))

    async def main() -> None:
        planes = {m: plane(stores[m], peers) for m in ("a:1", "b:1")}
        newcomer = plane(stores["c:1"], peers)
        async with trio.open_nursery() as nursery:
            for address, p in planes.items():
                await nursery.start(p.run, address)
            # c is up (its lease kept) but has not synced: it holds nothing yet.
            await newcomer.membership.join("c:1")
            nursery.start_soon(newcomer.membership.keep_alive)
            assert await planes["a:1"].rebalance(None) == ["ds"]
            assert etcd.value(RECORD)["members"] == ["a:1", "b:1", "c:1"]
            gained = [
                s for s in range(SEGMENTS) if "c:1" in placed("ds", etcd.entry(RECORD)).owners(s)
            ]
            assert gained
            await trio.sleep(5)  # under test: a and b sync while c lacks its share
            assert stores["a:1"].dropped == [] and stores["b:1"].dropped == []
            assert every_segment_has_a_copy()
            await newcomer.sync_once()  # c copies its share
            assert set(gained) <= set(stores["c:1"].datasets["ds"].held)
            await trio.sleep(2)  # under test: a and b sync again
            nursery.cancel_scope.cancel()
        dropped = [seg for _name, seg in stores["a:1"].dropped + stores["b:1"].dropped]
        assert sorted(dropped) == sorted(gained)
        assert every_segment_has_a_copy()
        assert_placed(etcd, stores, ds)
        where = placed("ds", etcd.entry(RECORD))
        for m, segs in held(stores).items():  # nothing left that a member does not own
            assert all(m in where.owners(s) for s in segs), m

    run(main)
