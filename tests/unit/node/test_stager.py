"""A preload in-process: a coordinator and two members' stagers, each over a real SegmentStore
in a temporary folder, their ops called directly (the `ask` between them is OpRegistry.call,
no socket). Each member publishes exactly the segments placement gave it, as the source has
them; a member that refuses its part leaves nothing staged or reserved anywhere."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import Ping, Pong
from kspeedfs.format.contract.preload import Preload
from kspeedfs.format.errors import NoSpace
from kspeedfs.node.control.static import StaticControl
from kspeedfs.node.coordinator import PreloadCoordinator
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import READ, OpRegistry
from kspeedfs.node.preload import Stager
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import LocalSource
from unit.controlfakes import inline_threads, run

MEMBERS = ["a:1", "b:1"]
SEGMENT = 64 * 1024


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder in /dev/shm (the stores' filesystem), removed afterwards."""
    root = Path("/dev/shm") / f"kspeedfs-unit-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Member:
    """A member's store, stager and ops."""

    def __init__(self, address: str, root: Path, budget: int):
        self.store = SegmentStore(root / address.replace(":", "_"), budget, events=DatasetEvents())
        self.store.recover(verify=False)
        self.stager = Stager(self.store, address)
        self.ops = OpRegistry()
        self.stager.register_ops(self.ops)
        self.ops.add(Ping, self.pong, READ)
        self.address = address

    async def pong(self, request: Ping) -> Pong:
        return Pong(self.address, 1)


def source(tmp_path: Path, files: int) -> Path:
    folder = tmp_path / "source"
    folder.mkdir()
    for i in range(files):
        (folder / f"f{i:02d}").write_bytes(bytes([i + 1]) * (SEGMENT // 2 + 100 * i))
    return folder


def coordinator_over(members: dict[str, Member]) -> PreloadCoordinator:
    settings = Settings(segment_size=SEGMENT)

    async def ask(member: str, request: Request[Answer]) -> Answer:
        return await members[member].ops.call(request)

    async def after_preload(name: str, uuid: str, decoded: int) -> None:
        raise AssertionError("no decoded preload here")

    a = members["a:1"]
    return PreloadCoordinator(
        settings,
        a.store,
        LoadTable(),
        a.stager,
        StaticControl(settings, MEMBERS),
        ask,
        after_preload,
    )


async def preload(coordinator: PreloadCoordinator, request: Preload) -> str:
    """The preload's final state (ready, or failed)."""
    await coordinator.op_preload(request)
    while (progress := coordinator.loads.get(request.name)) is not None:
        if progress.state == "failed":
            return "failed"
        await trio.sleep(0.05)  # polling the load table
    return "ready"


def test_each_member_publishes_the_segments_placed_on_it(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline_threads(monkeypatch)
    folder = source(tmp_path, 12)
    members = {m: Member(m, shm, 1 << 30) for m in MEMBERS}
    coordinator = coordinator_over(members)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for m in members.values():
                await nursery.start(m.stager.run)
            await nursery.start(coordinator.run)
            request = Preload(name="ds", source=str(folder), replicas=1)
            assert await preload(coordinator, request) == "ready"
            nursery.cancel_scope.cancel()

    run(main)
    records = {m: member.store.datasets["ds"] for m, member in members.items()}
    assert len({r.uuid for r in records.values()}) == 1  # one instance everywhere
    segments = records["a:1"].segments
    assert segments > 2
    assert sorted(s for r in records.values() for s in r.held) == list(range(segments))
    src = LocalSource(str(folder))
    for m, member in members.items():
        ds = member.store.open("ds")
        for seg in records[m].held:
            want = bytes(src.read_segment(ds.manifest, ds.manifest.layout, seg))
            assert bytes(ds.segment(seg)) == want, (m, seg)
        assert member.stager.stages == {}


def test_a_member_that_refuses_its_part_leaves_nothing_anywhere(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline_threads(monkeypatch)
    folder = source(tmp_path, 12)
    members = {"a:1": Member("a:1", shm, 1 << 30), "b:1": Member("b:1", shm, 4096)}
    coordinator = coordinator_over(members)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for m in members.values():
                await nursery.start(m.stager.run)
            await nursery.start(coordinator.run)
            with pytest.raises(NoSpace):
                await coordinator.op_preload(Preload(name="ds", source=str(folder)))
            nursery.cancel_scope.cancel()

    run(main)
    for m, member in members.items():
        assert member.store.datasets == {}, m
        assert member.store.budgets.reserved == {}, m  # every claim given back
        assert member.stager.stages == {} and member.stager.claims == {}, m
