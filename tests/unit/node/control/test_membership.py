"""Membership in-process, over an in-memory etcd on trio's MockClock: the lease kept alive or
lapsing after its TTL, leaving, joining late or again, and the catalog writes made under the
lease (claims that die with it, writes fenced once it lapsed)."""

from __future__ import annotations

import pytest
import trio

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import AlreadyExists, Fenced, NodeUnreachable
from kspeedfs.node.control import ControlPlane, EtcdCatalog
from kspeedfs.node.control.membership import Membership
from unit.controlfakes import ETCD_URL, MemoryEtcd, MemoryPeers, MemoryStore, run

TTL = 3.0
PREFIX = "/kspeedfs/unit/"


def settings() -> Settings:
    return Settings(etcd=[ETCD_URL], cluster="unit", member_ttl=TTL, heal_after=10.0)


def member() -> Membership:
    return Membership(settings(), ClusterState.of(settings()))


def live(state: ClusterState) -> list[str]:
    return sorted(state.live_members())


def loading(name: str, uuid: str = "u1") -> CatalogEntry:
    return CatalogEntry(name, uuid, "loading", members=("a:1",))


def listed(uuid: str, segments: int) -> ListedInstance:
    """A read-through instance `uuid` of `segments` segments, listed over a:1."""
    return ListedInstance(uuid, ("a:1",), segments, 0, 0, 4096, 0.0)


def test_a_member_that_stops_renewing_is_gone_after_its_ttl(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a, b = member(), member()
        await a.join("a:1")
        await b.join("b:1")  # b never renews: it crashed right after joining
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.keep_alive)
            await trio.sleep(TTL - 0.5)  # under test: the TTL running
            assert live(a.state) == ["a:1", "b:1"]
            await trio.sleep(1.0)  # under test: past b's TTL, within a's renewals
            assert live(a.state) == ["a:1"]
            assert await a.members_now() == ["a:1"]
            await trio.sleep(10 * TTL)  # under test: a keeps its lease for as long as it runs
            assert live(a.state) == ["a:1"]
            nursery.cancel_scope.cancel()

    run(main)


def test_a_member_that_leaves_is_gone_at_once(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a, b = member(), member()
        await a.join("a:1")
        await b.join("b:1")
        start = trio.current_time()
        await b.leave()
        assert live(a.state) == ["a:1"]
        assert trio.current_time() == start  # no TTL waited for

    run(main)


def test_a_node_that_starts_with_etcd_away_serves_and_joins_once_it_answers(
    etcd: MemoryEtcd,
) -> None:
    async def main() -> None:
        a = member()
        etcd.answering = False
        await a.join("a:1")  # does not raise: the data plane goes on without etcd
        assert a.registration is None and a.lease_id == 0
        assert a.members() == ["a:1"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.keep_alive)
            await trio.sleep(3 * TTL)  # under test: keep_alive trying while etcd is away
            assert a.registration is None
            etcd.answering = True
            await trio.sleep(TTL)  # under test: the next keep_alive round
            assert a.registration is not None
            assert live(a.state) == ["a:1"]
            nursery.cancel_scope.cancel()

    run(main)


def test_a_lease_that_lapsed_while_etcd_was_away_is_joined_again(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a = member()
        await a.join("a:1")
        first = a.registration
        assert first is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.keep_alive)
            etcd.answering = False
            await trio.sleep(2 * TTL)  # under test: past the TTL by etcd's clock
            etcd.answering = True
            assert live(a.state) == []  # the lease expired
            await trio.sleep(TTL)  # under test: the next keep_alive round
            now = a.registration
            assert now is not None and now.lease != first.lease
            assert now.revision > first.revision  # a new fencing token
            assert live(a.state) == ["a:1"]
            nursery.cancel_scope.cancel()

    run(main)


def test_members_now_falls_back_to_the_last_view_when_etcd_is_away(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a, b = member(), member()
        await a.join("a:1")
        await b.join("b:1")
        assert await a.members_now() == ["a:1", "b:1"]
        await b.leave()
        etcd.answering = False
        assert await a.members_now() == ["a:1", "b:1"]  # not an error: the last view
        etcd.answering = True
        assert await a.members_now() == ["a:1"]

    run(main)


def test_a_claim_dies_with_its_coordinators_lease_and_a_published_record_does_not(
    etcd: MemoryEtcd,
) -> None:
    async def main() -> None:
        a = member()
        await a.join("a:1")
        await a.claim(loading("died"))
        await a.claim(loading("done", "u2"))
        await a.publish("done", "u2", listed("u2", 4))
        with pytest.raises(AlreadyExists):
            await a.claim(loading("done", "u3"))  # of two preloads of one name, one wins
        await trio.sleep(2 * TTL)  # under test: a stops renewing (it died)
        names = a.state.datasets()
        assert sorted(names) == ["done"]
        record = names["done"][0]
        assert record.state == "ready" and record.segments == 4

    run(main)


def test_catalog_writes_are_fenced_once_the_lease_lapsed(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a = member()
        await a.join("a:1")
        await a.claim(loading("ds"))
        await a.publish("ds", "u1")
        assert await a.replace("ds", "u1", listed("u1", 1))
        await trio.sleep(2 * TTL)  # under test: a's lease lapses (no keep_alive)
        with pytest.raises(Fenced):
            await a.replace("ds", "u1", listed("u1", 2))
        entry = await a.entry_now("ds")
        assert entry is not None and entry.segments == 1  # unchanged
        await a.join("a:1")  # joined again: a new registration writes again
        assert await a.replace("ds", "u1", listed("u1", 3))
        assert etcd.value(PREFIX + "datasets/ds")["segments"] == 3

    run(main)


def test_publishing_a_claim_that_died_with_the_lease_fails(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        a = member()
        await a.join("a:1")
        await a.claim(loading("ds"))
        await trio.sleep(2 * TTL)  # under test: the lease, and the claim on it, lapse
        await a.join("a:1")
        with pytest.raises(NodeUnreachable, match="claim on ds is gone"):
            await a.publish("ds", "u1")
        assert a.state.datasets() == {}  # not made ready out of nothing

    run(main)


def test_a_control_plane_that_stops_leaves_at_once(etcd: MemoryEtcd) -> None:
    async def main() -> None:
        peers = MemoryPeers({})

        async def unload(name: str, uuid: str) -> None:
            """Nothing is held here to unload."""

        control = ControlPlane(
            settings(),
            MemoryStore(),
            peers.ask,
            unload,
            EtcdCatalog.of(settings(), peers.ask),
            readers=peers,
        )  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(control.run, "a:1")
            assert live(control.state) == ["a:1"]
            nursery.cancel_scope.cancel()
        stopped = trio.current_time()
        assert live(control.state) == []
        assert trio.current_time() == stopped  # gone without waiting for its TTL

    run(main)
