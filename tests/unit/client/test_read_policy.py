"""The read policy and its hedged reads in-process, over fake nodes (fakenodes.py) and a real
local map and source: the local map first, then the segment's owners best first, then the
source; a late owner is hedged to the next one, a dead one falls to its replica."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kspeedfs.client import hedged
from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.errors import StaleDataset
from kspeedfs.format.manifest import Manifest
from kspeedfs.system.readthrough_view import open_local
from kspeedfs.testing.process import wait_until
from unit.controlfakes import LocalDataset, local_dataset

from .fakenodes import FakeCluster

NODES = ["10.0.0.1:7420", "10.0.0.2:7420", "10.0.0.3:7420"]
FILES = 3  # one 4 KiB file a segment


@pytest.fixture
def data(tmp_path: Path) -> LocalDataset:
    return local_dataset(tmp_path / "ds", "ds", FILES)


def _cluster(tmp_path: Path, data: LocalDataset, timeout: float = 5.0) -> FakeCluster:
    """Every node holds every segment (a node not an owner is never asked)."""
    held = {n: dict(enumerate(data.segments)) for n in NODES}
    return FakeCluster(tmp_path, held, timeout)


def _handle(data: LocalDataset, tmp_path: Path, local_segments: list[int]) -> DatasetHandle:
    """The dataset over NODES, two replicas, this process mapping `local_segments` (a
    folder as a node publishes it)."""
    local = None
    if local_segments:
        folder = tmp_path / "local"
        (folder / "seg").mkdir(parents=True)
        shutil.copy(data.manifest_path, folder / "manifest.ksm")
        (folder / "meta.json").write_text(json.dumps({"lifetime": "offline"}))
        for seg in local_segments:
            (folder / "seg" / f"{seg:08d}").write_bytes(data.segments[seg])
        local = open_local(folder)
    manifest = local.manifest if local else Manifest(data.manifest_path)
    return DatasetHandle(
        name=data.name,
        uuid=data.uuid,
        source=str(data.source),
        members=list(NODES),
        replicas=2,
        manifest=manifest,
        local=local,
    )


def _file(ds: DatasetHandle, k: int) -> int:
    return ds.manifest.resolve(f"f{k:03d}.bin")


@pytest.fixture
def reader_of() -> Iterator[Callable[[FakeCluster], ClusterReader]]:
    readers: list[ClusterReader] = []

    def make(cluster: FakeCluster) -> ClusterReader:
        readers.append(ClusterReader(cluster.settings, pool=cluster.pool()))
        return readers[-1]

    yield make
    for r in readers:
        r.close()


def test_local_map_then_owners_then_the_source(
    tmp_path: Path, data: LocalDataset, reader_of: Callable[[FakeCluster], ClusterReader]
) -> None:
    cluster = _cluster(tmp_path, data)
    reader = reader_of(cluster)
    ds = _handle(data, tmp_path, local_segments=[0])
    files = [_file(ds, k) for k in range(FILES)]
    out = bytearray(FILES * 4096)
    reader.gather(ds, [(i, 0, 4096) for i in files], memoryview(out))
    assert bytes(out) == b"".join(data.segments)
    assert reader.stats["local"] == 1 and reader.stats["remote"] == 2
    assert reader.stats["source"] == 0
    first_owners = {ds.owners(seg)[0] for seg in (1, 2)}
    assert sum(n.answers for n in cluster.nodes.values()) == 2
    assert all(cluster.nodes[n].answers for n in first_owners)
    for node in cluster.nodes.values():
        node.down = True
    assert reader.read(ds, files[2], 0, 4096) == data.segments[2]
    assert reader.stats["source"] == 1
    assert reader.read(ds, files[0], 0, 4096) == data.segments[0]  # the local map still
    assert reader.stats["local"] == 2


def test_a_dead_owner_falls_to_its_replica_then_the_source(
    tmp_path: Path, data: LocalDataset, reader_of: Callable[[FakeCluster], ClusterReader]
) -> None:
    cluster = _cluster(tmp_path, data)
    reader = reader_of(cluster)
    ds = _handle(data, tmp_path, local_segments=[])
    i = _file(ds, 1)
    first, second = ds.owners(1)[:2]
    cluster.nodes[first].down = True
    assert reader.read(ds, i, 0, 4096) == data.segments[1]
    assert reader.pool.is_down(first)
    assert cluster.nodes[second].answers == 1 and reader.stats["source"] == 0
    cluster.nodes[second].down = True
    assert reader.read(ds, i, 0, 4096) == data.segments[1]
    assert reader.stats["source"] == 1


def test_an_owner_serving_wrong_bytes_is_passed_over(
    tmp_path: Path, data: LocalDataset, reader_of: Callable[[FakeCluster], ClusterReader]
) -> None:
    cluster = _cluster(tmp_path, data)
    reader = reader_of(cluster)
    ds = _handle(data, tmp_path, local_segments=[])
    first, second = ds.owners(2)[:2]
    cluster.nodes[first].segments[2] = b"\0" * 4096  # fails the segment's checksum
    assert reader.read(ds, _file(ds, 2), 0, 4096) == data.segments[2]
    assert cluster.nodes[second].answers == 1
    assert not reader.pool.is_down(first)  # it answered: a refusal, not a silence


def test_a_slow_first_owner_is_answered_by_the_second_and_its_answer_drained(
    tmp_path: Path,
    data: LocalDataset,
    reader_of: Callable[[FakeCluster], ClusterReader],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hedged, "RECEIVE_STALL_S", 60.0)  # the drain waits for the thaw
    cluster = _cluster(tmp_path, data)
    reader = reader_of(cluster)
    ds = _handle(data, tmp_path, local_segments=[])
    first, second = ds.owners(1)[:2]
    cluster.nodes[first].freeze()
    assert reader.read(ds, _file(ds, 1), 0, 4096) == data.segments[1]
    assert reader.stats["hedged"] == 1 and reader.stats["hedge_won"] == 1
    assert cluster.nodes[second].answers == 1 and cluster.nodes[first].answers == 0
    assert reader.pool.health.is_suspect(first)
    cluster.nodes[first].thaw()
    wait_until(lambda: reader.stats["drained"] == 1, 10, "the late answer to be drained")
    assert cluster.nodes[first].answers == 1
    assert reader.pool.acquire(first)[0] is True  # its connection kept


def test_a_hedged_read_all_of_whose_owners_fail_is_one_clear_error(
    tmp_path: Path, data: LocalDataset, reader_of: Callable[[FakeCluster], ClusterReader]
) -> None:
    cluster = _cluster(tmp_path, data, timeout=0.3)
    reader = reader_of(cluster)
    ds = _handle(data, tmp_path, local_segments=[])
    ds.source = ""  # nowhere else to read it
    first, second = ds.owners(1)[:2]
    cluster.nodes[first].freeze()
    del cluster.nodes[second].segments[1]  # answers that it does not hold it
    with pytest.raises(StaleDataset):
        reader.read(ds, _file(ds, 1), 0, 4096)
    assert reader.pool.is_down(first)  # silent for the whole read
    assert not reader.pool.is_down(second)
    cluster.nodes[first].thaw()
