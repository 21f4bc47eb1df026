"""Unloading a member's part of a dataset (node/unload.py) over a real SegmentStore, in process:
an unload of one instance leaves another alone, and an unload that finds the dataset gone
(another caller got there first: the converger, the read-through watch, an op) says "absent"
rather than raising. A CI run once logged a traceback from the converger for that race."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from kspeedfs.format.errors import NotFound
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.leases import LeaseTable
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.readthrough.build import InstanceBuilder
from kspeedfs.node.readthrough.catalog import LocalCatalog
from kspeedfs.node.store import DatasetRecord, SegmentStore
from kspeedfs.node.unload import Unloader
from kspeedfs.sources.source import open_source

SEG = 4096
ADDRESS = "127.0.0.1:1"


class FirstToUnload(SegmentStore):
    """A store on which another caller unloads each dataset just before this one does: the
    moment between Unloader's look at the store and its unload, made to happen every time."""

    def unload(self, name: str, uuid: str = "") -> DatasetRecord:
        super().unload(name)
        return super().unload(name, uuid)


async def _no_peers(member: str, request: Any) -> dict[str, Any]:
    raise AssertionError("a one-node unload asks no member")


def _store(root: Path, kind: type[SegmentStore] = SegmentStore) -> SegmentStore:
    store = kind(root / "shm", 1 << 30, events=DatasetEvents())
    store.recover(verify=False)
    return store


def _publish(store: SegmentStore, work: Path, name: str = "ds") -> str:
    src_dir = work / f"src-{name}"
    src_dir.mkdir()
    (src_dir / "a").write_bytes(b"x" * (SEG + 100))
    src = open_source(str(src_dir))
    staging, meta, _ = InstanceBuilder(store, SEG, ADDRESS).build(name, src, src.scan(), None)
    store.publish(staging, {**meta, "held": [0, 1], "lifetime": "offline", "readthrough": False})
    return store.datasets[name].uuid


def _unloader(store: SegmentStore) -> Unloader:
    return Unloader(
        store, LoadTable(), LeaseTable(60.0), lambda: ADDRESS, _no_peers, LocalCatalog(ADDRESS)
    )


def test_the_store_unloads_only_the_instance_named(tmp_path: Path) -> None:
    store = _store(tmp_path)
    uuid = _publish(store, tmp_path)
    with pytest.raises(NotFound, match="instance 00000000"):
        store.unload("ds", "0" * 32)
    assert store.datasets["ds"].uuid == uuid
    assert store.unload("ds", uuid).uuid == uuid
    with pytest.raises(NotFound):
        store.unload("ds")


def test_an_unload_that_finds_the_dataset_gone_says_absent(tmp_path: Path) -> None:
    store = _store(tmp_path, FirstToUnload)
    uuid = _publish(store, tmp_path)
    unloaded = trio.run(_unloader(store).unload_local, "ds", uuid)
    assert unloaded is False and "ds" not in store.datasets


def test_two_unloads_at_once_unload_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    uuids = [_publish(store, tmp_path, f"ds{i}") for i in range(20)]
    unloader = _unloader(store)
    results: list[bool] = []

    async def both() -> None:
        async def one(name: str, uuid: str) -> None:
            results.append(await unloader.unload_local(name, uuid))

        async with trio.open_nursery() as nursery:
            for i, uuid in enumerate(uuids):
                for _ in range(2):
                    nursery.start_soon(one, f"ds{i}", uuid)

    trio.run(both)
    assert sorted(results) == [False] * 20 + [True] * 20 and not store.datasets
