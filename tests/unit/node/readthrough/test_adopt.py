"""Read-through datasets adopted over etcd, in-process (an in-memory etcd, the other member
reached without a network, a real store and read-through cache here): the control plane hands
the catalog's read-through instance to the cache, which fetches its manifest through the
catalog it was built with and lists it holding no segment; registering a name that another
member has ready joins it the same way. The cache and the control plane share that catalog and
its membership, as the node's root builds them."""

from __future__ import annotations

from pathlib import Path

from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.node import ManifestReq
from kspeedfs.format.contract.readthrough import RegisterSource
from kspeedfs.node.control import ControlPlane, EtcdCatalog
from kspeedfs.node.control.membership import Membership
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.store import SegmentStore
from unit.controlfakes import (
    ETCD_URL,
    LocalDataset,
    MemoryEtcd,
    MemoryPeers,
    MemoryStore,
    local_dataset,
    run,
)

PREFIX = "/kspeedfs/unit/"


def settings(tmp: Path) -> Settings:
    return Settings(
        etcd=[ETCD_URL],
        cluster="unit",
        member_ttl=3.0,
        heal_after=10.0,
        shm_dir=tmp / "shm",
        token_file=tmp / "token",
    )


class CacheMember:
    """A node's store, read-through cache and control plane, built in the root's order: the
    catalog, the cache with it, the control plane with both."""

    def __init__(self, address: str, tmp: Path, peers: MemoryPeers):
        s = settings(tmp)
        self.address = address
        self.store = SegmentStore(s.shm_dir, s.memory_budget(), events=DatasetEvents())
        self.store.recover(False)
        catalog = EtcdCatalog.of(s, peers.ask)
        self.cache = ReadThroughCache(self.store, s, address, LoadTable(), catalog)
        self.control = ControlPlane(
            s,
            self.store,
            peers.ask,
            self.unload,
            catalog,
            readthrough=self.cache,
            readers=peers,
        )

    async def unload(self, name: str, uuid: str) -> None:
        raise AssertionError(f"{self.address} unloads nothing here ({name}, {uuid})")


def ready_elsewhere(etcd: MemoryEtcd, tmp: Path, peers: MemoryPeers) -> LocalDataset:
    """A read-through dataset ready in the catalog, listed on a:1 (live in etcd)."""
    ds = local_dataset(tmp / "a", "ds", 3)
    etcd.put(PREFIX + "datasets/ds", ds.record(["a:1"], replicas=1, lifetime=READTHROUGH))
    a = MemoryStore()
    a.put(ds, [])
    peers.stores["a:1"] = a
    return ds


def beside_a(etcd: MemoryEtcd, tmp: Path) -> tuple[MemoryPeers, LocalDataset, CacheMember]:
    """The dataset ready on a:1, and member b:1 (a cache and a control plane) beside it."""
    peers = MemoryPeers({})
    ds = ready_elsewhere(etcd, tmp, peers)
    return peers, ds, CacheMember("b:1", tmp / "b", peers)


async def both_joined(b: CacheMember, tmp: Path) -> None:
    """a:1 (where the dataset is ready) and b:1 live in etcd."""
    await Membership(settings(tmp), ClusterState.of(settings(tmp))).join("a:1")
    await b.control.membership.join("b:1")


def test_a_sync_hands_the_catalogs_read_through_instance_to_the_cache(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    peers, ds, b = beside_a(etcd, tmp_path)

    async def main() -> None:
        await both_joined(b, tmp_path)
        await b.control.sync_once()
        listed = b.store.datasets["ds"]
        assert (listed.uuid, listed.lifetime, listed.held) == (ds.uuid, READTHROUGH, [])
        assert b.cache.datasets["ds"].uuid == ds.uuid  # the cache's: its fills find it
        assert [m for m, r in peers.asked if isinstance(r, ManifestReq)] == ["a:1"]
        await b.control.sync_once()  # listed already: not fetched again
        assert len([r for _m, r in peers.asked if isinstance(r, ManifestReq)]) == 1

    run(main)


def test_registering_a_name_ready_on_another_member_joins_it(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    _peers, ds, b = beside_a(etcd, tmp_path)

    async def main() -> None:
        await both_joined(b, tmp_path)
        await b.control.members_now()  # b sees a:1 live: manifests come from live members
        registered = await b.cache.registrar.op_register_source(
            RegisterSource(name="ds", source=str(ds.source))
        )
        assert (registered.state, registered.lifetime) == ("ready", READTHROUGH)
        assert b.store.datasets["ds"].uuid == ds.uuid
        assert b.cache.datasets["ds"].uuid == ds.uuid

    run(main)
