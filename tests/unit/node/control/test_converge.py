"""Convergence and adoption in-process (ControlPlane.sync_once over an in-memory etcd and
in-memory members): a node drops the instances the catalog does not have, and its copies once
it was declared lost; it lists every ready dataset (its manifest adopted from a member, no
segment); stages whose claim is gone are rolled back; and a node whose lease lapsed changes
nothing until it has joined again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.control import Adopt, Adopted
from kspeedfs.format.contract.node import ManifestReq, Rebalance, Rebalanced
from kspeedfs.format.errors import NotFound
from kspeedfs.node.control import ControlPlane, EtcdCatalog, placed
from unit.controlfakes import ETCD_URL, MemoryEtcd, MemoryPeers, MemoryStore, local_dataset, run

TTL = 3.0
PREFIX = "/kspeedfs/unit/"


def settings() -> Settings:
    return Settings(etcd=[ETCD_URL], cluster="unit", member_ttl=TTL, heal_after=10.0)


class Node:
    """A ControlPlane over a MemoryStore, with the unloads it asked for."""

    def __init__(self, address: str, store: MemoryStore, peers: MemoryPeers, stager: object = None):
        self.address = address
        self.store = store
        self.unloaded: list[tuple[str, str]] = []
        peers.stores[address] = store
        self.control = ControlPlane(
            settings(),
            store,  # type: ignore[arg-type]
            peers.ask,
            self.unload,
            EtcdCatalog.of(settings(), peers.ask),
            stager=stager,  # type: ignore[arg-type]
            readers=peers,
        )

    async def unload(self, name: str, uuid: str) -> None:
        self.unloaded.append((name, uuid))
        self.store.datasets.pop(name, None)

    async def join(self) -> None:
        await self.control.membership.join(self.address)


def test_a_member_that_joined_later_lists_a_ready_dataset_holding_no_segment(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path / "ds", "ds", 4)
    etcd.put(PREFIX + "datasets/ds", ds.record(["a:1"], replicas=1))
    peers = MemoryPeers({})
    a = Node("a:1", MemoryStore(), peers)
    a.store.put(ds, [0, 1, 2, 3])
    b = Node("b:1", MemoryStore(tmp_path / "b"), peers)
    (tmp_path / "b").mkdir()

    async def main() -> None:
        await a.join()
        await b.join()
        await b.control.sync_once()
        listed = b.store.datasets["ds"]
        assert listed.uuid == ds.uuid and listed.held == []
        assert listed.path.read_bytes() == ds.manifest_path.read_bytes()
        assert [m for m, r in peers.asked if isinstance(r, ManifestReq)] == ["a:1"]
        await b.control.sync_once()  # listed already: not fetched again
        assert len([r for _m, r in peers.asked if isinstance(r, ManifestReq)]) == 1

    run(main)


def test_an_instance_the_catalog_does_not_have_is_dropped(etcd: MemoryEtcd, tmp_path: Path) -> None:
    kept = local_dataset(tmp_path / "kept", "kept", 2)
    gone = local_dataset(tmp_path / "gone", "gone", 2)
    old = local_dataset(tmp_path / "old", "old", 2)
    etcd.put(PREFIX + "datasets/kept", kept.record(["a:1"], replicas=1))
    # "old" was unloaded and loaded again while a was away: the catalog names another instance.
    etcd.put(PREFIX + "datasets/old", {**old.record(["z:1"], replicas=1), "uuid": "new"})
    a = Node("a:1", MemoryStore(), MemoryPeers({}))
    for d in (kept, gone, old):
        a.store.put(d, [0, 1])

    async def main() -> None:
        await a.join()
        await a.control.sync_once()
        assert sorted(a.unloaded) == [("gone", gone.uuid), ("old", old.uuid)]
        assert sorted(a.store.datasets) == ["kept"]

    run(main)


def test_a_member_declared_lost_drops_its_copies_when_it_comes_back(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path / "ds", "ds", 6)
    members = ["a:1", "b:1", "c:1"]
    record = ds.record(members, replicas=2, lost=["c:1"])
    etcd.put(PREFIX + "datasets/ds", record)
    where = placed("ds", CatalogEntry.from_json(record))
    peers = MemoryPeers({})
    nodes = {m: Node(m, MemoryStore(tmp_path / m), peers) for m in members}
    for m, node in nodes.items():
        (tmp_path / m).mkdir()
        node.store.put(ds, [s for s in range(6) if m in where.owners(s)])
    before = list(nodes["c:1"].store.datasets["ds"].held)
    # c held copies before it was lost (placed without the loss); they are stale now.
    nodes["c:1"].store.put(ds, list(range(3)))

    async def main() -> None:
        for node in nodes.values():
            await node.join()
        await nodes["c:1"].control.sync_once()
        assert nodes["c:1"].unloaded == [("ds", ds.uuid)]
        listed = nodes["c:1"].store.datasets["ds"]  # listed again, holding nothing
        assert listed.uuid == ds.uuid and listed.held == []
        await nodes["a:1"].control.sync_once()  # a survivor keeps its copies
        assert nodes["a:1"].unloaded == []

    assert before == []  # a lost member owns nothing by placement
    run(main)


def test_stages_whose_claim_is_gone_are_rolled_back(etcd: MemoryEtcd) -> None:
    aborted: list[tuple[str, str]] = []

    async def abort(name: str, uuid: str) -> None:
        aborted.append((name, uuid))

    stager = SimpleNamespace(
        stages={
            "orphan": SimpleNamespace(uuid="u-orphan"),  # its coordinator died
            "claimed": SimpleNamespace(uuid="u-claimed"),
            "replaced": SimpleNamespace(uuid="u-replaced"),  # the name was claimed again
        },
        abort=abort,
    )
    etcd.put(
        PREFIX + "datasets/claimed", {"name": "claimed", "uuid": "u-claimed", "state": "loading"}
    )
    etcd.put(PREFIX + "datasets/replaced", {"name": "replaced", "uuid": "u-2", "state": "loading"})
    a = Node("a:1", MemoryStore(), MemoryPeers({}), stager)

    async def main() -> None:
        await a.join()
        await a.control.sync_once()
        assert sorted(aborted) == [("orphan", "u-orphan"), ("replaced", "u-replaced")]

    run(main)


def test_a_node_whose_lease_lapsed_changes_nothing_until_it_joins_again(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path / "ds", "ds", 2)
    etcd.put(
        PREFIX + "datasets/other",
        {"name": "other", "uuid": "u", "state": "ready", "members": ["a:1", "c:1"]},
    )
    a = Node("a:1", MemoryStore(), MemoryPeers({}))
    a.store.put(ds, [0, 1])  # not in the catalog: dropped, but only by a registered node

    async def main() -> None:
        await a.join()
        await trio.sleep(2 * TTL)  # under test: a's lease lapses (nothing renews it)
        await a.control.sync_once()
        assert not a.control.registered
        assert a.unloaded == []
        assert not etcd.has(PREFIX + "down/c:1")  # c, gone, is not noted by an old view
        await a.join()
        await a.control.sync_once()
        assert a.control.registered
        assert a.unloaded == [("ds", ds.uuid)]
        assert etcd.has(PREFIX + "down/c:1")

    run(main)


def test_a_failed_preloads_claim_made_while_etcd_was_away_is_removed_once_it_answers(
    etcd: MemoryEtcd,
) -> None:
    a = Node("a:1", MemoryStore(), MemoryPeers({}))
    record = CatalogEntry("ds", "u1", "loading", members=("a:1",))

    async def main() -> None:
        await a.join()
        await a.control.claim(record)
        etcd.answering = False
        await a.control.forget_failed("ds", "u1")  # does not raise: kept for later
        assert a.control.unclaimed == {"ds": "u1"}
        etcd.answering = True
        await a.control.sync_once()
        assert not etcd.has(PREFIX + "datasets/ds")
        assert a.control.unclaimed == {}
        assert "ds" not in a.control.catalog  # the sync read the catalog after removing it

    run(main)


def test_a_later_instance_of_the_name_is_not_removed_with_the_failed_claim(
    etcd: MemoryEtcd,
) -> None:
    a = Node("a:1", MemoryStore(), MemoryPeers({}))

    async def main() -> None:
        await a.join()
        etcd.answering = False
        await a.control.forget_failed("ds", "u1")
        etcd.answering = True
        await a.control.claim(CatalogEntry("ds", "u2", "loading"))
        await a.control.sync_once()
        assert etcd.value(PREFIX + "datasets/ds")["uuid"] == "u2"
        assert a.control.unclaimed == {}

    run(main)


def test_rebalancing_a_name_the_catalog_lacks_is_refused(etcd: MemoryEtcd) -> None:
    a = Node("a:1", MemoryStore(), MemoryPeers({}))

    async def main() -> None:
        await a.join()
        with pytest.raises(NotFound):
            await a.control.op_rebalance(Rebalance(name="nothing"))
        assert await a.control.op_rebalance(Rebalance(name="")) == Rebalanced(
            datasets=[], members=["a:1"]
        )

    run(main)


def test_adopt_takes_the_catalogs_instance_dropping_another_held_here(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    ds = local_dataset(tmp_path / "new", "ds", 2)
    old = local_dataset(tmp_path / "old", "ds", 2, uuid="old-instance")
    etcd.put(PREFIX + "datasets/ds", ds.record(["a:1"], replicas=1))
    peers = MemoryPeers({})
    a = Node("a:1", MemoryStore(), peers)
    a.store.put(ds, [0, 1])
    (tmp_path / "b").mkdir()
    b = Node("b:1", MemoryStore(tmp_path / "b"), peers)
    b.store.put(old, [0, 1])  # refreshed elsewhere: b holds the instance before

    async def main() -> None:
        await a.join()
        await b.join()
        with pytest.raises(NotFound):
            await b.control.op_adopt(Adopt(name="ds", uuid="not-in-etcd"))
        assert b.unloaded == []  # a refused adopt changes nothing
        answer = await b.control.op_adopt(Adopt(name="ds", uuid=ds.uuid))
        assert answer == Adopted(name="ds", adopted=True)
        assert b.unloaded == [("ds", "old-instance")]
        assert b.store.datasets["ds"].uuid == ds.uuid and b.store.datasets["ds"].held == []

    run(main)
