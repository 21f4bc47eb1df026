"""The composition root's wiring, in-process (nothing listens, etcd is never reached): the
read-through cache is built with its catalog and the control plane with the same one, so no
part is told of another after it is built; the store and the followers of its datasets are
given one events object; without etcd a read-through dataset is this node's alone
(LocalCatalog), registered, listed and refreshed as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from rdmafakes import FakeDevice, FakeRegistrar

from kspeedfs.format.config import Settings
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.contract.readthrough import Refresh, RegisterSource
from kspeedfs.node.control import ControlPlane, EtcdCatalog
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.readthrough import LocalCatalog
from kspeedfs.node.root import Node
from kspeedfs.node.store import SegmentStore
from kspeedfs.rdma.server import RdmaService


def node(tmp_path: Path, **settings: Any) -> Node:
    tmp = {"shm_dir": tmp_path / "shm", "token_file": tmp_path / "token"}
    return Node(Settings(**tmp, transport="tcp", **settings))


def test_with_etcd_the_cache_and_the_control_plane_share_one_catalog(tmp_path: Path) -> None:
    n = node(tmp_path, etcd=["http://127.0.0.1:9"])
    catalog = n.cache.registrar.catalog
    assert isinstance(catalog, EtcdCatalog)
    assert n.cache.watch.catalog is catalog
    assert isinstance(n.control, ControlPlane)
    # The membership the control plane joins is the one the cache's claims are made under.
    assert n.control.membership is catalog.membership
    assert n.control.adoption.catalog is catalog
    assert n.control.adoption.readthrough is n.cache


def test_the_store_tells_the_events_its_followers_subscribed_to(tmp_path: Path) -> None:
    n = node(tmp_path)
    events = n.store.events
    # (transport tcp: RDMA is off and follows nothing)
    assert events._followers == [n.decoded, n.meta_indexes]
    assert events._damage == [n.scrubber._found_by_node]


def test_with_a_device_rdma_follows_the_stores_events(tmp_path: Path) -> None:
    made: list[RdmaService] = []

    def rdma(store: SegmentStore, events: DatasetEvents) -> RdmaService:
        service = RdmaService(store, events, device=FakeDevice(FakeRegistrar()))  # type: ignore[arg-type]
        made.append(service)
        return service

    tmp = {"shm_dir": tmp_path / "shm", "token_file": tmp_path / "token"}
    n = Node(Settings(**tmp, transport="tcp"), rdma=rdma)
    assert made == [n.rdma]
    # Subscribed first, as it is built first.
    assert n.store.events._followers == [n.rdma, n.decoded, n.meta_indexes]


def test_without_etcd_a_read_through_dataset_is_this_nodes_alone(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for i in range(3):
        (source / f"f{i}").write_bytes(bytes([i]) * 1000)
    n = node(tmp_path)
    catalog = n.cache.registrar.catalog
    assert isinstance(catalog, LocalCatalog)
    assert n.cache.watch.catalog is catalog
    n.store.recover(False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(n.cache.run)
            request = RegisterSource(name="ds", source=str(source))
            registered = await n.cache.registrar.op_register_source(request)
            assert registered.state == "scanning"
            with trio.fail_after(30):
                # Its load ends after the publish, in the same step as the listing.
                while "ds" not in n.store.datasets or n.loads.get("ds") is not None:
                    progress = n.loads.get("ds")
                    assert progress is None or progress.state != "failed", progress.error
                    await trio.sleep(0.01)
            first = n.store.datasets["ds"]
            assert (first.lifetime, first.members, first.held) == (READTHROUGH, [n.address], [])
            assert not n.cache.busy  # the listing is over
            again = await n.cache.registrar.op_register_source(request)
            assert (again.state, again.lifetime) == ("ready", READTHROUGH)

            (source / "f1").write_bytes(b"changed" * 100)
            refreshed = await n.cache.watch.op_refresh(Refresh(name="ds"))
            assert (refreshed.state, refreshed.changed) == ("refreshed", 1)
            second = n.store.datasets["ds"]
            assert second.uuid != first.uuid and second.members == [n.address]
            assert n.cache.datasets["ds"].uuid == second.uuid
            nursery.cancel_scope.cancel()

    trio.run(main)
